"""Warm-start SFT time per epoch: random batches padded to the data set's longest
demonstration (`warmstart.group_by_length false`) vs batches grouped by length, each padded
to its own longest (`true`, the default). Same examples, model, optimizer and step count.

    python benchmarks/sft_length_grouping.py --config_path configs/alfworld_tiny.yaml \
        --examples 192 [any train.py overrides]

The config decides the task set, the warm-start demonstrations (env.warmstart_games,
warmstart.loss_on, warmstart.max_length), the tiny model's shape and the batch size; the
tiny model folder (`model.tiny_dir`) is built as the job would build it. Each layout
first runs one epoch with its compilations (one shape plain, one per width grouped); then
`--rounds` interleaved rounds of one epoch each (benchmarks/_protocol.py: load average per
round, busy rounds left out, same-run ratio of medians).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _protocol  # noqa: E402
from benchmarks._hardware import cpu_model  # noqa: E402


def layout_runner(cfg, folder, examples, pad_id: int, group_by_length: bool):
    """A function running one SFT epoch of this layout from its own state (epoch r uses
    shuffle seed r) and returning its wall seconds."""
    from rollout_bridge.components import load_policy
    from rollout_bridge.warmstart import run_sft
    from spopp_jax.learner import LearnerConfig, init_train_state, make_sft_step

    ws = cfg.warmstart
    learner_config = LearnerConfig(num_micro_batches=1, length_bucket=None, num_mini_batches=1, action_logits_fraction=None,
                                   learning_rate=ws.learning_rate, weight_decay=ws.weight_decay)
    model_def, state = init_train_state(load_policy(folder, cfg.model), learner_config)
    step = make_sft_step(model_def, learner_config)
    held = {"state": state, "epoch": 0}

    def run_epoch() -> float:
        start = time.perf_counter()
        held["state"], _ = run_sft(step, held["state"], examples, epochs=1, batch_size=ws.batch_size,
                                   pad_id=pad_id, seed=held["epoch"], group_by_length=group_by_length)
        held["epoch"] += 1
        return time.perf_counter() - start

    return run_epoch


def pad_share(examples, batch_size: int, group_by_length: bool) -> float:
    """Share of pad tokens in one epoch's batches of this layout (as `run_sft` packs them)."""
    from rollout_bridge.warmstart import sft_batches

    padded = real = 0
    for arrays in sft_batches(examples, batch_size, np.random.default_rng(0), 0, group_by_length):
        padded += arrays["attention_mask"].size
        real += int(arrays["attention_mask"].sum())
    return 1.0 - real / padded


def main(argv=None) -> None:
    import train
    from rollout_bridge import components as build
    from rollout_bridge.envs.kinds import build_env
    from rollout_bridge.warmstart import sft_examples

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=None, help="use the first N demonstrations (default: all)")
    parser.add_argument("--rounds", type=int, default=3, help="timed interleaved rounds (one epoch each)")
    parser.add_argument("--max-load-excess", type=float, default=_protocol.DEFAULT_MAX_LOAD_EXCESS)
    parser.add_argument("--allow-busy", action="store_true", help="keep busy rounds (the headline says so)")
    args, rest = parser.parse_known_args(argv)
    cfg = train.parse_config(rest)
    bundle = build_env(cfg, True, print, cfg.progress)
    if bundle.warm is None:
        raise SystemExit("this config has no warm-start demonstrations (env.warmstart_games)")
    folder = build.model_folder(cfg.model, bundle.corpus, print)
    chat = build.load_chat(folder)
    examples = sft_examples(bundle.warm, chat, max_length=cfg.warmstart.max_length, loss_on=cfg.warmstart.loss_on)
    examples = examples[:args.examples]
    lengths = np.array([len(e.token_ids) for e in examples])
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores); load average before: {os.getloadavg()}")
    print(f"{len(examples)} demonstrations, tokens min/median/max {lengths.min()}/{int(np.median(lengths))}/"
          f"{lengths.max()}, batch {cfg.warmstart.batch_size}, model hidden {cfg.model.tiny_hidden_size} "
          f"x {cfg.model.tiny_num_layers} layers")
    layouts = {"plain": False, "grouped": True}
    for name, grouped in layouts.items():
        print(f"{name}: pad share {pad_share(examples, cfg.warmstart.batch_size, grouped):.0%}")
    runners = {name: layout_runner(cfg, folder, examples, chat.tokenizer.pad_token_id, grouped)
               for name, grouped in layouts.items()}
    for name, run_epoch in runners.items():   # compiles: one shape plain, one per width grouped
        print(f"{name}: first epoch (with compilations) {run_epoch():.1f} s", flush=True)
    timings = _protocol.interleaved_rounds(runners, args.rounds, max_load_excess=args.max_load_excess)
    _protocol.report(timings, len(examples), "demonstrations", args.allow_busy)
    print("headline: " + _protocol.headline(timings, "grouped", "plain", args.allow_busy))
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
