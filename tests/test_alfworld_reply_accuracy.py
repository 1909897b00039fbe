"""benchmarks/alfworld_reply_accuracy.py: reply spans of an action mask and where the
number starts in a "<command> = <number>" reply."""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import alfworld_reply_accuracy as bench  # noqa: E402


def test_reply_spans_are_the_runs_of_the_mask():
    mask = np.array([0, 1, 1, 0, 0, 1, 0, 1], bool)
    assert bench.reply_spans(mask) == [(1, 3), (5, 6), (7, 8)]
    assert bench.reply_spans(np.zeros(4, bool)) == []


def test_number_starts_after_the_separator(tmp_path):
    from rollout_bridge.tokenizer import build_tiny_tokenizer

    texts = ["go to drawer 1 = 2", "open drawer 1 = 10", "take cd 1 from drawer 1 = 11"] * 20
    tokenizer = build_tiny_tokenizer(texts, tmp_path, vocab_size=300)
    for text in ("open drawer 1 = 10", "take cd 1 from drawer 1 = 11"):
        ids = tokenizer.encode(text)
        start = bench.number_start(tokenizer, ids)
        assert tokenizer.decode(ids[:start]).endswith("=") and tokenizer.decode(ids[start:]).strip().isdigit()
    ids = tokenizer.encode("look")
    assert bench.number_start(tokenizer, ids) == len(ids)
