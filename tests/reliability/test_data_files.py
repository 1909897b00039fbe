"""Data files a loader reads: DAPO-Math parquet rows whose ground truth cannot be scored are
skipped with a count (never an answer any policy collects), and an ALFWorld game file that
is not a game is named in one error. Data files a job writes into a folder other jobs share
(a game set's manifest, Math-TIR's teacher data, the prompt-blind cache, the common
yardstick's record) are written whole by two jobs at once, and a tiny model folder two jobs
build at once is built once."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from reliability_table import Row, covers

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def write_dapo(path: Path, rows) -> None:
    """DAPO-Math-17K's schema; rows = (prompt, ground truth or None, index)."""
    pq.write_table(pa.table({
        "data_source": ["math_dapo"] * len(rows),
        "prompt": [[{"content": p, "role": "user"}] for p, _, _ in rows],
        "ability": ["MATH"] * len(rows),
        "reward_model": [{"ground_truth": g, "style": "rule-lighteval/MATH_v2"} for _, g, _ in rows],
        "extra_info": [{"index": i} for _, _, i in rows],
    }), path)


@covers(Row("game / data folder", "DAPO-Math parquet rows with a null ground truth, an empty one, the text 'None', "
            "or one math-verify cannot parse (`\\frac{`)",
            "skipped, with one line per kind counting them ('DAPO-Math data ...: skipped 3 row(s) whose ground "
            "truth cannot be scored (empty ground truth: 1, ground truth is the text 'None': 1, null ground truth: "
            "1)' and '... skipped 1 drawn prompt(s) whose ground truth math-verify cannot parse ...'); a drawn "
            "prompt that is skipped is replaced by another draw",
            "a policy answering `\\boxed{None}` earns 0 on every loaded task (a null answer loaded as the "
            "answer 'None' would match it: reward 1)"))
def test_dapo_rows_that_cannot_be_scored_are_skipped(tmp_path):
    from rollout_bridge.envs.math_tir.tasks import load_dapo_math
    from rollout_bridge.envs.math_tir.verifier import check_answer

    good = [(f"Problem {k}: what is {k} times 7?", str(7 * k), f"id-{k}") for k in range(1, 6)]
    bad = [("Problem null", None, "null"), ("Problem empty", "  ", "empty"), ("Problem None", "None", "none"),
           ("Problem broken", "\\frac{", "broken")]
    write_dapo(tmp_path / "dapo.parquet", good + bad)
    said = []
    everything = load_dapo_math(tmp_path, 0, seed=0, log=said.append)
    assert sorted(t.key for t in everything.tasks) == sorted(k for _, _, k in good)
    assert len(said) == 2 and "skipped 3 row(s)" in said[0] and "null ground truth: 1" in said[0]
    chosen = load_dapo_math(tmp_path, 5, seed=3, log=said.append)
    assert sorted(t.key for t in chosen.tasks) == sorted(k for _, _, k in good)
    for task in everything.tasks:
        assert not check_answer(task.ground_truth, "The answer is \\boxed{None}", 5, 5)
        assert check_answer(task.ground_truth, f"\\boxed{{{task.ground_truth}}}", 5, 5)
    write_dapo(tmp_path / "dapo.parquet", bad)
    with pytest.raises(ValueError, match="no row with a ground truth that can be scored"):
        load_dapo_math(tmp_path, 0, seed=0, log=said.append)


@covers(Row("game / data folder", "an ALFWorld game.tw-pddl of random bytes (not UTF-8), a folder named game.tw-pddl",
            "GameFileError naming the file: '... is not UTF-8 text (byte N); it is damaged or not a game.tw-pddl' "
            "/ '... cannot be read: Is a directory' (the episode fails as a failed trajectory, the run lives)",
            "nothing half-loaded; a raw UnicodeDecodeError / IsADirectoryError never reaches the job"))
def test_alfworld_game_file_that_is_not_text(tmp_path):
    from rollout_bridge.envs.alfworld_games import GameFileError, read_game_file

    broken = tmp_path / "broken" / "game.tw-pddl"
    broken.parent.mkdir()
    broken.write_bytes(bytes(range(128, 256)) * 8)
    with pytest.raises(GameFileError, match=r"broken/game.tw-pddl' is not UTF-8 text"):
        read_game_file(broken)
    folder = tmp_path / "dir" / "game.tw-pddl"
    folder.mkdir(parents=True)
    with pytest.raises(GameFileError, match="cannot be read"):
        read_game_file(folder)


def _writers(monkeypatch):
    """name -> (the file it writes under a folder, write(folder, n): writer n's content)."""
    from types import SimpleNamespace

    from rollout_bridge.envs import alfworld_games, textworld_blind, textworld_games
    from rollout_bridge.envs.math_tir.teacher import write_jsonl

    alfworld = alfworld_games.AlfworldSetSpec("race", num_games=1, base_seed=0)
    monkeypatch.setattr(alfworld_games, "write_game", lambda generated, folder: None)   # the manifest only

    def alfworld_set(folder: Path, n: int) -> None:
        game = SimpleNamespace(record=lambda: {"dir": "game_0", "writer": n})
        monkeypatch.setattr(alfworld_games, "_make_one", lambda args: game)
        alfworld_games.generate_game_set(alfworld, folder)

    spec = importlib.util.spec_from_file_location("common_yardstick", ROOT / "scripts" / "common_yardstick.py")
    common_yardstick = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common_yardstick)

    return {
        "TextWorld manifest": (textworld_games.MANIFEST,
                               lambda folder, n: textworld_games._write_manifest(folder, {"writer": n})),
        "ALFWorld manifest": (f"{alfworld.folder_name}/{alfworld_games.MANIFEST}", alfworld_set),
        "Math-TIR teacher data": ("teacher_train.jsonl",
                                  lambda folder, n: write_jsonl(folder / "teacher_train.jsonl", [{"writer": n}])),
        "TextWorld prompt-blind cache": (textworld_blind.CACHE_NAME,
                                         lambda folder, n: textworld_blind._write_cache(folder, {"writer": n})),
        "common yardstick record": ("yardstick.json",
                                    lambda folder, n: common_yardstick.write_record(folder, {"writer": n})),
    }


@covers(Row("game / data folder", "two jobs write one shared data file at once (a game set's manifest, Math-TIR's "
            "teacher data, the prompt-blind cache, the common yardstick's record): the second writes the whole "
            "file while the first is about to rename its own into place",
            "each writer writes a temporary file of its own (pid and random suffix), flushed, then renamed: both "
            "succeed, the last rename wins",
            "the file is one writer's whole content; no temporary file is left", kind="fault"))
@pytest.mark.parametrize("name", ["TextWorld manifest", "ALFWorld manifest",
                                  "Math-TIR teacher data", "TextWorld prompt-blind cache",
                                  "common yardstick record"])
def test_two_writers_of_one_data_file_never_share_a_temporary_file(tmp_path, monkeypatch, name):
    file_name, write = _writers(monkeypatch)[name]
    real_replace = os.replace
    raced = []

    def another_writer_first(source, target):   # writer 1's file is complete: writer 2 runs start to end now
        if not raced:
            raced.append(source)
            write(tmp_path, 2)
        real_replace(source, target)

    monkeypatch.setattr(os, "replace", another_writer_first)
    write(tmp_path, 1)
    assert raced, "the writer never renamed a temporary file into place"
    text = (tmp_path / file_name).read_text()
    assert re.search(r'"writer": ?1\b', text) and not re.search(r'"writer": ?2\b', text)   # writer 1 renamed last
    assert [str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()] == [file_name]


@covers(Row("game / data folder", "two jobs build one tiny model folder (`model.tiny_dir`) at once, e.g. two arms of "
            "a campaign started together: the second starts while the first has written its weights and not yet "
            "its marker",
            "the build runs under an flock on the folder and the marker is checked again under it: the second "
            "waits, finds the first's marker and reuses the folder (one build); the marker is written atomically",
            "both jobs get the folder a single build writes, byte for byte, and nothing rewrites it after either "
            "returned; no temporary file is left", kind="fault"))
def test_two_builders_of_one_tiny_model_folder_build_it_once(tmp_path, monkeypatch):
    import spopp_jax.models
    from rollout_bridge.tiny_model import TinyModelShape, ensure_tiny_model

    shape = TinyModelShape(vocab_size=300, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                           num_kv_heads=1, head_dim=8)
    corpus = ["go north and take the lamp", "open the door with the brass key", "you are in a kitchen"] * 3
    alone = ensure_tiny_model(tmp_path / "alone", corpus, shape)
    expected = {p.name: p.read_bytes() for p in sorted(alone.iterdir())}
    folder = tmp_path / "shared"
    real_save = spopp_jax.models.save_pretrained
    weights_written, builds = threading.Event(), []

    def save_then_pause(model, path, **kwargs):   # the second job starts between the weights and the marker
        builds.append(path)
        real_save(model, path, **kwargs)
        weights_written.set()
        time.sleep(1.0)

    monkeypatch.setattr(spopp_jax.models, "save_pretrained", save_then_pause)
    seen, errors, done = [], [], []

    def build() -> None:
        try:
            ensure_tiny_model(folder, corpus, shape)
            seen.append({p.name: p.read_bytes() for p in sorted(folder.iterdir())})   # what the job loads now
        except BaseException as error:   # noqa: BLE001 - reported by the assertion below
            errors.append(error)
        done.append(True)

    first = threading.Thread(target=build)
    first.start()
    assert weights_written.wait(120), "the first builder never wrote its weights"
    second = threading.Thread(target=build)
    second.start()
    while len(done) < 2 and (first.is_alive() or second.is_alive()):   # after a return, the folder stays whole
        if done:
            seen.append({p.name: p.read_bytes() for p in sorted(folder.iterdir())})
        time.sleep(0.02)
    first.join(120)
    second.join(120)
    assert not errors, errors
    assert len(builds) == 1, f"built {len(builds)} times"
    assert seen and all(files == expected for files in seen)
    assert {p.name: p.read_bytes() for p in sorted(folder.iterdir())} == expected   # no temporary file left
