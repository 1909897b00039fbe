"""Data files a loader reads: DAPO-Math parquet rows whose ground truth cannot be scored are
skipped with a count (never an answer any policy collects), and an ALFWorld game file that
is not a game is named in one error."""

from __future__ import annotations

import sys
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
