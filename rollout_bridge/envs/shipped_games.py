"""Game sets that ship with the checkout: unpacked in seconds instead of generated in minutes.

Generating the main job's 1,024 training and 512 held-out games takes 6-7 minutes on 2
cores, ~70% of it Inform 7's `ni` translating each game's story. The same files, packed
once into `assets/textworld_games/<set folder>.tar.xz`, are 10 MB. When a game set's folder
(`textworld_games.game_set_folder`: its spec and exclusions) has such an archive,
`generate_game_set` unpacks it instead of generating.

Nothing unchecked is used: `shipped.json` holds each archive's sha256 and the digest of the
games it holds (`game_files_digest`: each game's Inform 7 source and description, the digest
the fixed-policy records key), and the unpacked manifest must name the spec asked for.
On any mismatch the archive is left alone (a warning says why) and the set is generated
from its seeds as before, giving the same games. The `.z8` story files carry their compile
date and nothing else differs from a fresh generation (tests/test_shipped_games.py
regenerates shipped games and compares).

Files are moved into the set's folder one by one and the manifest last, as generation
writes it, so an interrupted unpack is a folder without a manifest: the next run unpacks
(or generates) again. `pack_game_set` (scripts/pack_textworld_games.py) makes an archive
from a generated set: members in name order, manifest first, no owners or dates, xz with a
dictionary large enough to span many games (their story files share most of their bytes).
"""

from __future__ import annotations

import io
import json
import lzma
import os
import re
import shutil
import tarfile
import time
import warnings
from pathlib import Path
from typing import Callable

from rollout_bridge.envs.game_set_manifest import MANIFEST, game_files_digest, load_manifest
from rollout_bridge.atomic_files import write_text_atomic
from spopp_jax.checkpoint_integrity import file_sha256

SHIPPED_DIR = Path(__file__).resolve().parents[2] / "assets" / "textworld_games"
INDEX = "shipped.json"
_MEMBER = re.compile(r"[A-Za-z0-9_.\-]+")
_GRAMMARS_FIELD = re.compile(rb'"text_grammars_path": "(?:[^"\\]|\\.)*"')
_XZ_FILTERS = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME, "dict_size": 256 << 20}]


def archive_path(folder_name: str, shipped_dir: str | os.PathLike = SHIPPED_DIR) -> Path:
    return Path(shipped_dir) / f"{folder_name}.tar.xz"


def _read_index(shipped_dir: Path) -> dict:
    path = shipped_dir / INDEX
    if not path.exists():
        return {}
    with open(path) as f:
        return json.load(f)


def set_digest(folder: Path, manifest: dict) -> str:
    """`game_files_digest` of the set's games, named by their file names, in manifest order."""
    files = [g["file"] for g in manifest["games"]]
    return game_files_digest(files, [folder / f for f in files])


def _game_files(manifest: dict) -> list[str]:
    """The files of a set's games: each one's `.json`, `.ni` and `.z8`."""
    return [Path(g["file"]).with_suffix(suffix).name for g in manifest["games"] for suffix in (".json", ".ni", ".z8")]


def pack_game_set(folder: str | os.PathLike, shipped_dir: str | os.PathLike = SHIPPED_DIR) -> dict:
    """Pack the complete generated set at `folder` into `shipped_dir/<folder name>.tar.xz`
    and record it in `shipped_dir/shipped.json`; return its index entry."""
    folder, shipped_dir = Path(folder), Path(shipped_dir)
    manifest = load_manifest(folder)
    if manifest is None:
        raise FileNotFoundError(f"{folder / MANIFEST} is missing: not a complete generated game set")
    names = [MANIFEST] + sorted(_game_files(manifest))
    shipped_dir.mkdir(parents=True, exist_ok=True)
    out = archive_path(folder.name, shipped_dir)
    partial = out.with_name(out.name + ".partial")
    with lzma.open(partial, "wb", format=lzma.FORMAT_XZ, filters=_XZ_FILTERS) as xz, \
            tarfile.open(fileobj=xz, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for name in names:
            data = (folder / name).read_bytes()
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    os.replace(partial, out)
    entry = {"sha256": file_sha256(out), "games_digest": set_digest(folder, manifest),
             "num_games": len(manifest["games"]), "spec": manifest["spec"]}
    index = _read_index(shipped_dir)
    index[folder.name] = entry
    write_text_atomic(shipped_dir / INDEX, json.dumps(index, indent=1, sort_keys=True) + "\n")
    return entry


def _local_grammars_field() -> bytes:
    """A game description's `KB.text_grammars_path` as a generation here writes it (where
    textworld is installed; only generation reads it)."""
    from textworld.generator.data import KnowledgeBase

    return b'"text_grammars_path": ' + json.dumps(KnowledgeBase.default().text_grammars_path).encode()


def _extract(archive: Path, into: Path) -> None:
    """Every member of `archive` into `into`: plain files with plain names only, each game
    description naming this machine's textworld install as a generation here would."""
    field = _local_grammars_field()
    with tarfile.open(archive, "r:xz") as tar:
        for member in tar:
            if not (member.isfile() and _MEMBER.fullmatch(member.name)):
                raise ValueError(f"unexpected member {member.name!r}")
            data = tar.extractfile(member).read()
            if member.name.endswith(".json"):
                data = _GRAMMARS_FIELD.sub(lambda _: field, data, count=1)
            (into / member.name).write_bytes(data)


def _refuse(reason: str, log: Callable[[str], None] | None) -> bool:
    message = f"shipped game set not used ({reason}); generating it instead"
    if log is None:
        warnings.warn(message, stacklevel=3)
    else:
        log(message)
    return False


def _unpacked_set_fault(staging: Path, manifest: dict | None, spec: dict, version: int,
                        games_digest: str) -> str | None:
    """What is wrong with the set unpacked at `staging`, or None when it is the set asked for."""
    if manifest is None or manifest.get("spec") != spec or manifest.get("version") != version:
        return "it holds another spec or manifest version"
    missing = [name for name in _game_files(manifest) if not (staging / name).is_file()]
    if missing:
        return f"it lacks {len(missing)} of its games' files ({missing[0]}, ...)"
    if set_digest(staging, manifest) != games_digest:
        return f"its games do not match their digest in {INDEX}"
    return None


def unpack_shipped_set(folder: str | os.PathLike, spec: dict, version: int,
                       shipped_dir: str | os.PathLike = SHIPPED_DIR,
                       log: Callable[[str], None] | None = None) -> bool:
    """Unpack the shipped archive of the set `folder` (named by its spec and exclusions) into
    it; True when done and checked, False (nothing written to `folder`) when there is no
    archive for it or it fails a check. `spec` and `version`: what its manifest must say."""
    folder, shipped_dir = Path(folder), Path(shipped_dir)
    entry = _read_index(shipped_dir).get(folder.name)
    archive = archive_path(folder.name, shipped_dir)
    if entry is None or not archive.exists():
        return False
    start = time.perf_counter()
    if file_sha256(archive) != entry["sha256"]:
        return _refuse(f"{archive} does not match its sha256 in {INDEX}", log)
    staging = folder.parent / f".{folder.name}.unpacking-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        try:
            _extract(archive, staging)
            manifest = load_manifest(staging)
            reason = _unpacked_set_fault(staging, manifest, spec, version, entry["games_digest"])
        except (OSError, EOFError, ValueError, KeyError, TypeError, tarfile.TarError, lzma.LZMAError) as error:
            reason = f"it could not be unpacked: {type(error).__name__}: {error}"
        if reason is not None:
            return _refuse(f"{archive}: {reason}", log)
        folder.mkdir(parents=True, exist_ok=True)
        for path in sorted(staging.iterdir()):
            if path.name != MANIFEST:
                os.replace(path, folder / path.name)
        os.replace(staging / MANIFEST, folder / MANIFEST)   # last: the set is complete
        if log is not None:
            log(f"unpacked {len(manifest['games'])} games from {archive} (shipped, checked against "
                f"{INDEX}) in {time.perf_counter() - start:.0f}s")
        return True
    finally:
        shutil.rmtree(staging, ignore_errors=True)
