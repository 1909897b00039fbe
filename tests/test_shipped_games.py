"""Game sets that ship with the checkout (rollout_bridge/envs/shipped_games.py): a set with an
archive is unpacked, not generated, and its files are a generation's; an archive that fails
a check is left alone and the set is generated; the archives that ship are the default
recipe's games, the very games the warm start's shipped records were measured on."""

from __future__ import annotations

import dataclasses
import io
import json
import tarfile
from pathlib import Path

import pytest

pytest.importorskip("textworld")

from rollout_bridge.config import load_config  # noqa: E402
from rollout_bridge.envs import textworld_games  # noqa: E402
from rollout_bridge.envs.shipped_games import (INDEX, SHIPPED_DIR, archive_path, pack_game_set,  # noqa: E402
                                               unpack_shipped_set)
from rollout_bridge.envs.textworld_games import (MANIFEST, GameSetSpec, game_set_folder,  # noqa: E402
                                                 game_signature, generate_game_set)
from rollout_bridge.envs.textworld_generate import make_and_compile  # noqa: E402
from spopp_jax.checkpoint_integrity import file_sha256  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SPEC = GameSetSpec("tiny", num_games=3, base_seed=0, world_size=1, nb_objects=3, quest_length=1)


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    """A generated 3-game set and the shipped folder holding its archive."""
    data_dir = tmp_path_factory.mktemp("generated")
    generate_game_set(SPEC, data_dir, shipped_dir=None)
    shipped = tmp_path_factory.mktemp("shipped")
    pack_game_set(game_set_folder(SPEC, data_dir), shipped)
    return game_set_folder(SPEC, data_dir), shipped


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _no_generation(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a shipped set was generated")
    monkeypatch.setattr(textworld_games, "generate_game", refuse)


def test_a_shipped_set_is_unpacked_with_a_generations_files(generated, tmp_path, monkeypatch):
    folder, shipped = generated
    _no_generation(monkeypatch)
    lines = []
    files = generate_game_set(SPEC, tmp_path, shipped_dir=shipped, log=lines.append)
    assert [f.name for f in files] == [g["file"] for g in json.loads((folder / MANIFEST).read_text())["games"]]
    assert _files(files[0].parent) == _files(folder)      # every .json, .ni, .z8 and the manifest, byte for byte
    assert len(lines) == 1 and lines[0].startswith("unpacked 3 games from ")
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]   # no staging folder left behind
    assert generate_game_set(SPEC, tmp_path, shipped_dir=shipped) == files   # then reused like a generated set


def test_an_interrupted_unpack_or_generation_is_completed(generated, tmp_path, monkeypatch):
    """A folder without a manifest (games moved in, or an interrupted generation) is not a
    set: it is unpacked again, the manifest last."""
    folder, shipped = generated
    _no_generation(monkeypatch)
    partial = tmp_path / folder.name
    partial.mkdir()
    first = sorted(folder.glob("*.z8"))[0]
    (partial / first.name).write_bytes(b"half a story file")
    generate_game_set(SPEC, tmp_path, shipped_dir=shipped)
    assert _files(partial) == _files(folder)


def _all_members(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive, "r:xz") as tar:
        return {member.name: tar.extractfile(member).read() for member in tar}


def _damage(kind: str, shipped: Path, folder_name: str) -> None:
    index_path, archive = shipped / INDEX, archive_path(folder_name, shipped)
    index = json.loads(index_path.read_text())
    if kind == "archive bytes":
        data = bytearray(archive.read_bytes())
        data[len(data) // 2] ^= 0xFF
        archive.write_bytes(bytes(data))
    elif kind == "games digest":
        index[folder_name]["games_digest"] = "0" * 40
    else:
        members = {"../escaped.txt": b"hi"} if kind == "member outside the folder" else {
            name: data for name, data in _all_members(archive).items() if name != "game_000000.z8"}
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:xz") as tar:
            for name, data in members.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        archive.write_bytes(buffer.getvalue())
        index[folder_name]["sha256"] = file_sha256(archive)
    index_path.write_text(json.dumps(index))


@pytest.mark.parametrize("kind, reason", [("archive bytes", "does not match its sha256"),
                                          ("games digest", "do not match their digest"),
                                          ("member outside the folder", "unexpected member '../escaped.txt'"),
                                          ("a game's story file missing", "lacks 1 of its games' files (game_000000.z8")])
def test_an_archive_that_fails_a_check_is_left_alone_and_the_set_generated(generated, tmp_path, kind, reason):
    folder, shipped = generated
    damaged = tmp_path / "shipped"
    damaged.mkdir()
    for name in (INDEX, archive_path(folder.name).name):
        (damaged / name).write_bytes((shipped / name).read_bytes())
    _damage(kind, damaged, folder.name)
    data_dir = tmp_path / "data"
    lines = []
    files = generate_game_set(SPEC, data_dir, shipped_dir=damaged, log=lines.append)
    assert len(lines) == 1 and lines[0].startswith("shipped game set not used (") and "generating it" in lines[0]
    assert reason in lines[0]
    assert [p.name for p in data_dir.iterdir()] == [folder.name]
    assert not (tmp_path / "escaped.txt").exists() and not (data_dir / "escaped.txt").exists()
    generated_files = _files(files[0].parent)   # the same games, compiled here
    assert {n: b for n, b in generated_files.items() if not n.endswith(".z8")} == \
        {n: b for n, b in _files(folder).items() if not n.endswith(".z8")}


def test_a_set_with_no_archive_or_another_spec_is_generated(generated, tmp_path):
    folder, shipped = generated
    other = GameSetSpec("tiny", num_games=2, base_seed=0, world_size=1, nb_objects=3, quest_length=1)
    assert not unpack_shipped_set(game_set_folder(other, tmp_path), {}, 2, shipped)
    # an archive under another set's name (its manifest names SPEC) is refused by its manifest
    lines = []
    assert not unpack_shipped_set(tmp_path / folder.name, {**dataclasses.asdict(SPEC), "num_games": 2},
                                  textworld_games.MANIFEST_VERSION, shipped, lines.append)
    assert "another spec" in lines[0] and not (tmp_path / folder.name).exists()


def _default_sets() -> tuple[str, str]:
    """The folder names of the default recipe's training and held-out sets (the held-out
    name holds the training games' signatures, read from the shipped training manifest)."""
    env = load_config([]).env
    shape = dict(world_size=env.world_size, nb_objects=env.nb_objects, quest_length=env.quest_length)
    train = game_set_folder(GameSetSpec("train", env.num_games, env.game_seed, **shape), "")
    with tarfile.open(archive_path(train.name), "r:xz") as tar:
        first = tar.next()
        assert first.name == MANIFEST
        manifest = json.load(tar.extractfile(first))
    signatures = {game_signature(g) for g in manifest["games"]}
    held = game_set_folder(GameSetSpec("heldout", env.heldout_games, env.heldout_seed, **shape), "", signatures)
    return train.name, held.name


def _first_members(archive: Path, count: int) -> dict[str, bytes]:
    with tarfile.open(archive, "r:xz") as tar:
        members = {}
        for member in tar:
            if member.name != MANIFEST:
                members[member.name] = tar.extractfile(member).read()
            if len(members) == 3 * count:
                return members


def _without_install_path(description: bytes) -> dict:
    game = json.loads(description)
    game["KB"].pop("text_grammars_path")
    return game


def test_the_shipped_archives_are_the_default_recipes_games(tmp_path):
    """Each set the default recipe plays ships, checked by sha256; its games digest is the
    one the warm start's shipped prior (training games) and held-out evaluation (held-out
    games) are keyed on; and its first game is what the generator makes from its seed."""
    index = json.loads((SHIPPED_DIR / INDEX).read_text())
    train, held = _default_sets()
    assert sorted(index) == sorted([train, held])
    for name in (train, held):
        assert file_sha256(archive_path(name)) == index[name]["sha256"]
    records = {p.name.split("-")[0]: json.loads(p.read_text())
               for p in (ROOT / "assets" / "textworld_text_warmstart" / "evaluations").glob("*.json")}
    assert records["prior"]["key"]["tasks"] == index[train]["games_digest"]
    assert records["evaluation"]["key"]["tasks"] == {"heldout": index[held]["games_digest"]}
    for name in (train, held):
        spec = index[name]["spec"]
        shipped = _first_members(archive_path(name), 1)
        seed = int(min(shipped).split(".")[0].removeprefix("game_"))
        made = make_and_compile(seed, spec["world_size"], spec["nb_objects"], spec["quest_length"],
                                tmp_path / f"game_{seed:06d}.z8")
        assert made is not None
        assert shipped[f"game_{seed:06d}.ni"] == (tmp_path / f"game_{seed:06d}.ni").read_bytes()
        assert _without_install_path(shipped[f"game_{seed:06d}.json"]) == \
            _without_install_path((tmp_path / f"game_{seed:06d}.json").read_bytes())
        assert len(shipped[f"game_{seed:06d}.z8"]) == (tmp_path / f"game_{seed:06d}.z8").stat().st_size
