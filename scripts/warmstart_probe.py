#!/usr/bin/env python
"""Does a warm start read? A cheap probe without rollouts: the teacher-forced negative
log-likelihood of the walkthrough replies of held-out games, split by the part of the reply.

    python scripts/warmstart_probe.py --config_path configs/textworld_agentic.yaml [--games 8]

reads `<output_dir>/warmstart_model` (made by `python train.py --stage warmstart` with the
same config) and prints, averaged over every reply of the first `--games` held-out games
(`env.heldout_games`; the training games when there are none):

    first   the reply's first token (which command: the choice a reading policy makes)
    text    the rest of the command text (copied from the list / goal with reply_format
            command_number)
    number  the number after the last "=" (command_number) or the whole reply (number):
            what the environment plays (none with free-text commands, numbered_actions
            false). A policy that does not find the command's number in the shuffled list
            is near ln(#commands shown) here (~2.1-2.4 nats).

`--renamed` first rewrites every room and thing name with fresh random words
(`rollout_bridge.envs.textworld_rename`): no model has seen those names, so a low `text`
NLL then means the model copies names from the observation.

The model is loaded with transformers (PyTorch), a reference nobody here wrote.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NUMBER_MARK = "="   # command_number replies: "<command> = <k>"
RENAME_SEED = 987_654   # --renamed: a mapping no warm start (seeded by the job's seed) reuses


def reply_spans(action_mask) -> list[np.ndarray]:
    """Target positions (index into ids[1:]) of each reply: the runs of the action mask."""
    positions = np.nonzero(np.asarray(action_mask[1:]))[0]
    return np.split(positions, np.nonzero(np.diff(positions) > 1)[0] + 1) if positions.size else []


def split_reply(tokens: list[str], numbered: bool = True) -> tuple[slice, slice, slice]:
    """(first, text, number) slices of one reply's tokens (the last one is the stop token):
    the number is what follows the last token holding "=", or the whole reply without it;
    a free-text command (`numbered` False) is its first token and the rest, no number."""
    body = len(tokens) - 1
    if not numbered:
        return slice(0, min(1, body)), slice(min(1, body), body), slice(0, 0)
    marks = [i for i, token in enumerate(tokens[:body]) if NUMBER_MARK in token]
    if not marks:
        return slice(0, 0), slice(0, 0), slice(0, body)
    return slice(0, 1), slice(1, marks[-1]), slice(marks[-1] + 1, body)


def load_warm_start(cfg):
    """(held-out task set, or the training one when there are none; chat; the warm start
    as a transformers model) of `<output_dir>/warmstart_model`."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollout_bridge import components as build
    from rollout_bridge.envs.kinds import build_env

    folder = Path(cfg.output_dir) / "warmstart_model"
    if not folder.is_dir():
        raise SystemExit(f"{folder} does not exist: run `python train.py --stage warmstart` with this config first")
    env = build_env(cfg, False, lambda _: None, False)
    tasks = env.held_out if env.held_out is not None else env.train
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return tasks, build.load_chat(folder), model


def probe(cfg, games: int, renamed: bool = False) -> dict[str, float]:
    import torch

    from rollout_bridge.warmstart import demonstration_example

    tasks, chat, model = load_warm_start(cfg)
    if renamed:   # names no model has seen: only copying them from the row predicts them
        from rollout_bridge.envs.textworld_rename import RenamedDemonstrations, textworld_names_of

        tasks = RenamedDemonstrations(tasks, textworld_names_of(tasks.game_files), 1.0, seed=RENAME_SEED)
    parts: dict[str, list[float]] = {"first": [], "text": [], "number": []}
    for task in range(min(games, tasks.num_tasks)):
        example = demonstration_example(chat, tasks.demonstration(task))
        ids = torch.tensor([example.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        nll = -logp[torch.arange(ids.shape[1] - 1), ids[0, 1:]].numpy()
        for span in reply_spans(example.action_mask):
            tokens = [chat.tokenizer.decode([int(example.token_ids[i + 1])]) for i in span]
            for name, part in zip(parts, split_reply(tokens, cfg.env.numbered_actions)):
                if part.stop > part.start:
                    parts[name].append(float(nll[span[part]].mean()))
    return {name: float(np.mean(values)) if values else float("nan") for name, values in parts.items()}


def play(cfg, episodes: int, show: int = 0) -> dict[str, float]:
    """Play every held-out game (the training games when there are none) `episodes` times
    with the warm start, sampling replies as the rollouts do (temperature
    `rollout.temperature`, at most `rollout.max_new_tokens` tokens); the success rate, its
    standard error, and the fraction of replies that played a shown command. Prints the
    first `show` episodes' replies."""
    import torch

    tasks, chat, model = load_warm_start(cfg)
    stops = list(dict.fromkeys([*chat.stop_token_ids, *(chat.turn_close_ids or [])[:1]]))
    torch.manual_seed(cfg.seed)
    wins, replies, shown_commands = [], 0, 0
    for round_ in range(episodes):
        for task in range(tasks.num_tasks):
            episode = tasks.episode(task)
            ids = chat.prompt_ids(episode.reset())
            trace = []
            while not episode.done:
                with torch.no_grad():
                    out = model.generate(torch.tensor([ids]), do_sample=True, temperature=cfg.rollout.temperature,
                                         top_k=0, max_new_tokens=cfg.rollout.max_new_tokens, eos_token_id=stops,
                                         pad_token_id=chat.tokenizer.pad_token_id)[0, len(ids):].tolist()
                reply = chat.action_text([i for i in out if i not in stops]).strip()
                listed = list(episode.admissible)
                outcome = episode.step(reply)
                played = outcome.info["command"] in listed and not outcome.info.get("not_a_number")
                replies, shown_commands = replies + 1, shown_commands + played
                trace.append(f"{'+' if played else '-'} {reply!r}")
                ids = ids + out + chat.close_ids(out) + (chat.observation_turn_ids(outcome.observation)
                                                         if not episode.done else [])
            wins.append(float(episode.won))
            episode.close()
            if round_ * tasks.num_tasks + task < show:
                print(f"game {task} ({'won' if episode.won else 'lost'}; walkthrough {episode.walkthrough}): "
                      + " | ".join(trace))
    rate = float(np.mean(wins))
    return {"success": rate, "se": float(np.sqrt(rate * (1 - rate) / len(wins))), "episodes": len(wins),
            "shown_command_rate": shown_commands / max(replies, 1)}


def main(argv=None) -> None:
    import train

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--games", type=int, default=8, help="held-out games whose walkthroughs are scored")
    parser.add_argument("--renamed", action="store_true",
                        help="rewrite the games' names with fresh random words first (textworld): "
                             "then the text part measures copying, not memory")
    parser.add_argument("--play", type=int, default=0, metavar="K",
                        help="also play every held-out game K times, sampling like the rollouts (success +- SE)")
    parser.add_argument("--show", type=int, default=0, help="with --play: print the first N episodes' replies")
    args, rest = parser.parse_known_args(argv)
    cfg = train.parse_config(rest)
    if args.play:
        result = play(cfg, args.play, args.show)
        print(f"warm start {cfg.output_dir}: success {result['success']:.3f} +- {result['se']:.3f} over "
              f"{result['episodes']} episodes; {result['shown_command_rate']:.2f} of the replies played a shown "
              f"command (load {os.getloadavg()[0]:.1f})")
    result = probe(cfg, args.games, args.renamed)
    print(f"warm start {cfg.output_dir}{' (names renamed)' if args.renamed else ''}: mean NLL per reply part (nats) " +
          ", ".join(f"{name} {value:.2f}" for name, value in result.items()) + f" (load {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
