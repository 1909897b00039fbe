"""scripts/warmstart_probe.py: the reply spans of an action mask and the split of a reply
into its first token, the command text and the number (checked by hand)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

_SPEC = importlib.util.spec_from_file_location(
    "warmstart_probe", Path(__file__).resolve().parents[1] / "scripts" / "warmstart_probe.py")
probe = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(probe)


def test_reply_spans_are_the_runs_of_the_mask_shifted_to_targets():
    mask = [False, False, True, True, False, False, True, False]
    spans = probe.reply_spans(mask)
    assert [s.tolist() for s in spans] == [[1, 2], [5]]   # ids[1:] positions
    assert probe.reply_spans([False, False]) == []


def test_split_command_number_reply():
    tokens = ["take", " stick", " from", " cabinet", " =", " 8", "<|im_end|>"]
    first, text, number = probe.split_reply(tokens)
    assert tokens[first] == ["take"]
    assert tokens[text] == [" stick", " from", " cabinet"]
    assert tokens[number] == [" 8"]


def test_split_number_only_reply():
    tokens = ["1", "2", "<|im_end|>"]
    first, text, number = probe.split_reply(tokens)
    assert tokens[first] == [] and tokens[text] == [] and tokens[number] == ["1", "2"]
    assert np.arange(3)[number].tolist() == [0, 1]


def test_split_free_text_reply():
    tokens = ["take", " red", " key", "<stop>"]
    first, text, number = probe.split_reply(tokens, numbered=False)
    assert tokens[first] == ["take"] and tokens[text] == [" red", " key"] and tokens[number] == []
    first, text, number = probe.split_reply(["<stop>"], numbered=False)
    assert first.stop == first.start and text.stop == text.start and number.stop == number.start
