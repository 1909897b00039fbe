"""Seeded, cached TextWorld game sets: the canonical task set and the warm-start set.

A *game set* is a folder of TextWorld games generated offline, exactly as

    tw-make custom --world-size W --nb-objects O --quest-length Q --seed S --output g.z8

would make them, but in one process per worker (`textworld_generate.make_and_compile`: the
same `.json`, `.ni` and `.z8` files, without reloading TextWorld's logic files per game and
without Inform 7's Index pages).
Game i of a set uses seed `base_seed + i`; `workers` processes generate games at once
(candidate seeds are accepted in seed order, so the set does not depend on `workers`). The folder is complete once its
`manifest.json` is written (last, atomically); an interrupted generation is resumed, a
complete one is reused. Each `.z8` sits next to its `.json` (TextWorld's game description,
which carries the walkthrough).

A game is part of a set only if its walkthrough wins the compiled game (a few tw-make
games are not: the parser asks which of two similarly named objects is meant); such a
seed is skipped like a duplicate.

The warm-start (SFT) set must be disjoint from the training set so that the cold start
teaches the action format and general skill, not the answers to the training tasks
(`generate_disjoint_game_set`): games whose (objective, walkthrough) coincide with a
training game are skipped and replaced by the next seed.

ALFWorld (or any other local TextWorld games) plugs in through `list_game_files`: point
it at a folder and it returns every playable game file under it (recursively):
`*.z8`/`*.z5` (Inform7 / z-machine, TextWorld's own) and `*.tw-pddl` (ALFWorld's PDDL
games, e.g. `$ALFWORLD_DATA/json_2.1.1/train/*/*/game.tw-pddl`).
`.ulx` (Glulx) is not playable with textworld >= 1.7 and is rejected with a message.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from pathlib import Path
from typing import Iterable, Sequence

from rollout_bridge.envs.game_set_manifest import MANIFEST, game_files_digest  # noqa: F401 (re-exported)
from rollout_bridge.envs.game_set_manifest import load_manifest as _load_manifest
from rollout_bridge.envs.game_set_manifest import write_manifest as _write_manifest
from rollout_bridge.envs.process_pool import worker_pool
from rollout_bridge.envs.shipped_games import SHIPPED_DIR, unpack_shipped_set
from rollout_bridge.envs.textworld_env import (PLAYABLE_SUFFIXES, list_game_files,  # noqa: F401 (re-exported)
                                               start_game, task_name_for)

MANIFEST_VERSION = 2   # 2: every game's walkthrough checked to win the compiled game


@dataclasses.dataclass(frozen=True)
class GameSetSpec:
    """What to generate: `num_games` games with seeds `base_seed .. base_seed+num_games-1`.

    world_size = number of rooms, nb_objects = objects in the world, quest_length = number
    of actions in the winning walkthrough (tw-make's `custom` options of the same names).
    """

    name: str
    num_games: int
    base_seed: int
    world_size: int = 2
    nb_objects: int = 4
    quest_length: int = 1

    def __post_init__(self):
        if not re.fullmatch(r"[A-Za-z0-9_\-]+", self.name):
            raise ValueError(f"name must be [A-Za-z0-9_-]+, got {self.name!r}")
        for field in ("num_games", "world_size", "nb_objects", "quest_length"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if self.base_seed < 0:
            raise ValueError(f"base_seed must be >= 0, got {self.base_seed}")

    @property
    def folder_name(self) -> str:
        return (f"{self.name}_w{self.world_size}_o{self.nb_objects}_q{self.quest_length}"
                f"_s{self.base_seed}_n{self.num_games}")


def _record(seed: int, game, compiled: str | os.PathLike) -> dict:
    walkthrough = list(game.metadata.get("walkthrough") or [])
    if not walkthrough:
        raise RuntimeError(f"game seed {seed} has no walkthrough")
    return {"file": os.path.basename(compiled), "seed": seed, "objective": game.objective,
            "walkthrough": walkthrough}


def walkthrough_wins(path: str | os.PathLike, walkthrough: Sequence[str]) -> bool:
    """Whether the compiled game at `path` is won by playing `walkthrough` (a few games
    are not: the z-machine parser asks "Which do you mean, the type P box or the box?").
    Only `won` is requested: TextWorld reads it from the game's own "*** The End ***" with or
    without its state tracking, which the admissible commands would need and cost."""
    from textworld import EnvInfos

    env = start_game(str(path), EnvInfos(won=True))
    try:
        env.reset()
        for command in walkthrough:
            state, _, done = env.step(command)
            if done:
                return bool(state["won"])
        return False
    finally:
        env.close()


def _cached_game(seed: int, path: Path) -> dict | None:
    """The record of a game already compiled at `path` by an interrupted generation (its
    .json and .z8 present and loadable), else None."""
    import textworld

    if not (path.exists() and path.with_suffix(".json").exists()):
        return None
    try:
        return _record(seed, textworld.Game.load(str(path.with_suffix(".json"))), path)
    except Exception:   # noqa: BLE001 - a half-written file: generate again
        return None


def generate_game(seed: int, spec: GameSetSpec, path: Path) -> dict | None:
    """Generate and compile one game to `path` (.z8) (or reuse the files an interrupted
    generation left there); return its record for the manifest, or None (files removed)
    when its walkthrough does not win the compiled game."""
    from rollout_bridge.envs.textworld_generate import make_and_compile

    record = _cached_game(seed, path)
    if record is None:
        game = make_and_compile(seed, spec.world_size, spec.nb_objects, spec.quest_length, path)
        record = _record(seed, game, path)
    try:
        playable = walkthrough_wins(path, record["walkthrough"])
    except Exception:   # noqa: BLE001 - a corrupt leftover file: generate again
        _drop_game_files(path)
        return generate_game(seed, spec, path)
    if not playable:
        _drop_game_files(path)
        return None
    return record


def game_signature(record: dict) -> str:
    """Content identity of a game: objective + walkthrough (names differ across seeds)."""
    text = record["objective"] + "\n" + "\n".join(record["walkthrough"])
    return hashlib.sha1(text.encode()).hexdigest()


def game_set_folder(spec: GameSetSpec, data_dir: str | os.PathLike,
                    exclude_signatures: Iterable[str] = ()) -> Path:
    """`data_dir/<spec.folder_name>`, plus `_x<hash>` of the excluded games if any (a set
    made disjoint from other games is a different set: it never overwrites the plain one)."""
    excluded = sorted(set(exclude_signatures))
    name = spec.folder_name
    if excluded:
        name += "_x" + hashlib.sha1("\n".join(excluded).encode()).hexdigest()[:10]
    return Path(data_dir) / name


def _seed_stream(spec: GameSetSpec, folder: Path, workers: int):
    """(seed, path, record) for seeds base_seed, base_seed+1, ... in order, `workers`
    games being generated at any time (a process pool when workers > 1)."""
    max_seed = spec.base_seed + 20 * spec.num_games + 100
    seeds = iter(range(spec.base_seed, max_seed))
    path_of = lambda seed: folder / f"game_{seed:06d}.z8"
    if workers <= 1:
        for seed in seeds:
            yield seed, path_of(seed), generate_game(seed, spec, path_of(seed))
        return
    with worker_pool(workers) as pool:
        pending = []
        try:
            for seed in seeds:
                pending.append((seed, pool.submit(generate_game, seed, spec, path_of(seed))))
                if len(pending) >= 2 * workers:
                    seed0, future = pending.pop(0)
                    yield seed0, path_of(seed0), future.result()
            for seed0, future in pending:
                yield seed0, path_of(seed0), future.result()
        finally:   # games generated beyond the last one needed are not part of the set
            for seed0, future in pending:
                future.cancel()
            for seed0, future in pending:
                if not future.cancelled():
                    future.exception()
                    _drop_game_files(path_of(seed0))


def _drop_game_files(path: Path) -> None:
    for suffix in (".z8", ".json", ".ni"):
        path.with_suffix(suffix).unlink(missing_ok=True)


def generate_game_set(spec: GameSetSpec, data_dir: str | os.PathLike,
                      exclude_signatures: Iterable[str] = (), progress=None, workers: int = 1,
                      shipped_dir: str | os.PathLike | None = SHIPPED_DIR, log=None) -> list[Path]:
    """Make (or reuse) the game set `spec` under `data_dir`; return its .z8 paths in order.
    A set that ships in `shipped_dir` is unpacked from it instead (`shipped_games`; `log`
    says so, or why it was not used).

    Games whose signature is in `exclude_signatures` (or repeats an earlier game of the
    set) are skipped and the next seed is tried, so the set always has `num_games`
    distinct games. Deterministic: same spec and exclusions -> same games, same folder
    (whatever `workers`, the number of generating processes).
    """
    excluded = set(exclude_signatures)
    folder = game_set_folder(spec, data_dir, excluded)
    manifest = _load_manifest(folder)
    if (manifest is not None and manifest.get("spec") == dataclasses.asdict(spec)
            and manifest.get("version") == MANIFEST_VERSION):
        return [folder / g["file"] for g in manifest["games"]]
    if shipped_dir is not None and unpack_shipped_set(folder, dataclasses.asdict(spec), MANIFEST_VERSION,
                                                      shipped_dir, log):
        return [folder / g["file"] for g in _load_manifest(folder)["games"]]
    folder.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []
    stream = _seed_stream(spec, folder, workers)
    try:
        for seed, path, record in stream:
            if record is None:   # its walkthrough does not win: not part of the set
                continue
            signature = game_signature(record)
            if signature not in excluded:
                excluded.add(signature)
                records.append(record)
            else:   # a duplicate: drop its files so the folder holds only the set's games
                _drop_game_files(path)
            if progress is not None:
                progress(len(records), spec.num_games)
            if len(records) == spec.num_games:
                break
    finally:
        stream.close()
    if len(records) < spec.num_games:
        raise RuntimeError(
            f"could not make {spec.num_games} distinct games for {spec.name!r}; "
            "increase world_size / nb_objects / quest_length")
    _write_manifest(folder, {"spec": dataclasses.asdict(spec), "version": MANIFEST_VERSION, "games": records})
    return [folder / g["file"] for g in records]


def game_set_signatures(spec: GameSetSpec, data_dir: str | os.PathLike) -> set[str]:
    """Signatures of a generated (not itself disjoint-made) set."""
    manifest = _load_manifest(game_set_folder(spec, data_dir))
    if manifest is None:
        raise FileNotFoundError(f"game set {spec.folder_name} not generated under {data_dir}")
    return {game_signature(g) for g in manifest["games"]}


def set_signatures(game_files: Sequence[str | os.PathLike]) -> set[str]:
    """Signatures of the games `game_files` (generated; read from their set's manifest)."""
    names = {Path(f).name for f in game_files}
    signatures = set()
    for folder in {Path(f).parent for f in game_files}:
        manifest = _load_manifest(folder)
        if manifest is None:
            raise FileNotFoundError(f"{folder / MANIFEST} is missing: not a generated game set")
        signatures |= {game_signature(g) for g in manifest["games"] if g["file"] in names}
    return signatures


def generate_disjoint_game_set(spec: GameSetSpec, data_dir: str | os.PathLike,
                               disjoint_from: Sequence[GameSetSpec], progress=None, workers: int = 1) -> list[Path]:
    """Generate `spec` with no game in common with the (already generated) `disjoint_from`."""
    excluded: set[str] = set()
    for other in disjoint_from:
        excluded |= game_set_signatures(other, data_dir)
    return generate_game_set(spec, data_dir, exclude_signatures=excluded, progress=progress, workers=workers)


