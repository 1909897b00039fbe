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


class _ScriptedModel:
    """A stand-in for the transformers model: `generate` appends the next scripted reply
    (its token ids and a stop token) to the prompt, as `model.generate` returns."""

    def __init__(self, chat, replies):
        self.chat, self.replies = chat, list(replies)

    def generate(self, input_ids, **kwargs):
        import torch

        assert kwargs["do_sample"] and kwargs["eos_token_id"]
        reply = self.chat.encode(self.replies.pop(0)) + [kwargs["eos_token_id"][0]]
        return torch.tensor([input_ids[0].tolist() + reply])


def test_play_counts_wins_and_shown_commands(tmp_path, monkeypatch, capsys):
    from types import SimpleNamespace

    from rollout_bridge.agent import ChatFormat
    from rollout_bridge.envs.textworld_env import ObservationStyle, TextWorldTasks
    from rollout_bridge.envs.textworld_games import GameSetSpec, generate_game_set
    from rollout_bridge.tokenizer import build_tiny_tokenizer

    files = generate_game_set(GameSetSpec("probe", num_games=2, base_seed=3, world_size=2, nb_objects=3,
                                          quest_length=2), tmp_path / "games")
    tasks = TextWorldTasks(files, files[0].parent, max_turns=4,
                           style=ObservationStyle(max_feedback_chars=80, numbered_actions=True))
    corpus = [o + "\n" + a for t in range(tasks.num_tasks) for o, a in tasks.demonstration(t)]
    chat = ChatFormat.from_tokenizer(build_tiny_tokenizer(corpus, tmp_path / "tok", vocab_size=400))
    cfg = SimpleNamespace(seed=0, rollout=SimpleNamespace(temperature=1.0, max_new_tokens=8))
    walkthroughs = [reply for t in range(tasks.num_tasks) for _, reply in tasks.demonstration(t)]

    monkeypatch.setattr(probe, "load_warm_start", lambda _: (tasks, chat, _ScriptedModel(chat, walkthroughs)))
    result = probe.play(cfg, episodes=1, show=1)
    assert result == {"success": 1.0, "se": 0.0, "episodes": 2, "shown_command_rate": 1.0}
    assert "game 0 (won" in capsys.readouterr().out

    # a policy that never types a listed command: every turn counted, no shown command, no win
    monkeypatch.setattr(probe, "load_warm_start", lambda _: (tasks, chat, _ScriptedModel(chat, ["xyzzy"] * 16)))
    result = probe.play(cfg, episodes=2)
    assert result["success"] == 0.0 and result["episodes"] == 4 and result["shown_command_rate"] == 0.0
