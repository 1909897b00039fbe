"""scripts/recall_drill.py: its examples are well-formed recall problems (each queried
value is the one listed after that key, the loss is on those values only) and its
no-recall baselines are the hand-computed ones."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

_SPEC = importlib.util.spec_from_file_location(
    "recall_drill", Path(__file__).resolve().parents[1] / "scripts" / "recall_drill.py")
drill = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(drill)


def _split(ids, separated, key_tokens):
    """(listed {key: value}, [(key, value) queried]) read back from one row."""
    sep = ids.index(drill.SEP)
    body = [t for t in ids[1:sep] if t != drill.NL]
    tail = [t for t in ids[sep + 1:] if t != drill.NL]
    width = key_tokens + 1
    listed = {tuple(body[i:i + key_tokens]): body[i + key_tokens] for i in range(0, len(body), width)}
    queried = [(tuple(tail[i:i + key_tokens]), tail[i + key_tokens]) for i in range(0, len(tail), width)]
    return listed, queried


@pytest.mark.parametrize("separated", [False, True])
@pytest.mark.parametrize("all_queries", [False, True])
@pytest.mark.parametrize("key_tokens", [1, 3])
def test_rows_are_recall_problems(separated, all_queries, key_tokens):
    rng = np.random.default_rng(3)
    for pairs in (2, 5, 8):
        ids, mask = drill.recall_row(rng, pairs, all_queries, separated, key_tokens)
        ids = [int(t) for t in ids]
        assert len(ids) == len(mask)
        listed, queried = _split(ids, separated, key_tokens)
        assert len(listed) == pairs                       # distinct keys
        assert sorted(listed.values()) == list(range(20, 20 + pairs))
        assert len(queried) == (pairs if all_queries else 1)
        for key, value in queried:
            assert listed[key] == value
        if all_queries:
            assert {k for k, _ in queried} == set(listed)
        targets = [t for t, m in zip(ids, mask) if m]
        assert targets == [v for _, v in queried]          # loss on the queried values only
        assert (drill.NL in ids) == separated


def test_baselines():
    assert drill.baselines(2, False) == pytest.approx((math.log(2), math.log(2)))
    chance, elimination = drill.baselines(3, True)
    assert chance == pytest.approx(math.log(3))
    assert elimination == pytest.approx((math.log(3) + math.log(2) + 0.0) / 3)


def test_the_longest_row_fits_the_compiled_width():
    pairs, key_tokens = 8, 3
    ids, _ = drill.recall_row(np.random.default_rng(0), pairs, True, True, key_tokens)
    assert len(ids) == 4 + 2 * pairs * (key_tokens + 2)   # the width main() compiles for
    padded_ids, valid, mask = drill.padded([(ids, [False] * len(ids))], len(ids) + 2)
    assert valid.sum() == len(ids) and padded_ids[0, -1] == drill.PAD and not mask.any()


@pytest.mark.parametrize("argv", [["--pairs", "1"], ["--pairs", "40"], ["--pairs", "4", "--min-pairs", "5"],
                                  ["--hidden", "130"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        drill.main(argv)
