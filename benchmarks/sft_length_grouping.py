"""Warm-start SFT time per epoch: random batches padded to the data set's longest
demonstration (`warmstart.group_by_length false`) vs batches grouped by length, each padded
to its own longest (`true`, the default). Same examples, model, optimizer and step count.

    python benchmarks/sft_length_grouping.py --config_path configs/alfworld_tiny.yaml \
        --examples 192 [any train.py overrides]

The config decides the task set, the warm-start demonstrations (env.warmstart_games,
warmstart.loss_on, warmstart.max_length), the tiny model's shape and the batch size; the
tiny model folder (`model.tiny_dir`) is built as the job would build it. For each layout:
epoch 1 (with the compilations: one shape for the plain layout, one per width for the
grouped one) and epoch 2 (steady state) are timed; the ratio is taken in the same run.
Prints the CPU, the load average before and after, and the pad share of each layout.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._hardware import cpu_model  # noqa: E402


def epoch_seconds(cfg, folder, examples, pad_id: int, group_by_length: bool) -> tuple[list[float], float]:
    """(wall seconds of epochs 1 and 2, pad share of the padded tokens) of one layout."""
    from rollout_bridge.components import load_policy
    from rollout_bridge.warmstart import epoch_batches, length_grouped_batches, padded_width, run_sft
    from spopp_jax.learner import LearnerConfig, init_train_state, make_sft_step

    ws = cfg.warmstart
    learner_config = LearnerConfig(learning_rate=ws.learning_rate, weight_decay=ws.weight_decay)
    model_def, state = init_train_state(load_policy(folder, cfg.model), learner_config)
    step = make_sft_step(model_def, learner_config)
    times = []
    for epoch in range(2):
        start = time.perf_counter()
        state, _ = run_sft(step, state, examples, epochs=1, batch_size=ws.batch_size, pad_id=pad_id,
                           seed=epoch, group_by_length=group_by_length)
        times.append(time.perf_counter() - start)
    batches = (length_grouped_batches if group_by_length else epoch_batches)(
        examples, ws.batch_size, np.random.default_rng(0))
    data_width = padded_width(max(len(e.token_ids) for e in examples), 32)
    padded = real = 0
    for rows in batches:
        width = padded_width(max(len(e.token_ids) for e in rows), 128) if group_by_length else data_width
        padded += width * len(rows)
        real += sum(len(e.token_ids) for e in rows)
    return times, 1.0 - real / padded


def main(argv=None) -> None:
    import train
    from rollout_bridge import components as build
    from rollout_bridge.envs.kinds import build_env
    from rollout_bridge.warmstart import sft_examples

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=None, help="use the first N demonstrations (default: all)")
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
    results = {}
    for name, grouped in (("plain (data set's longest)", False), ("grouped by length", True)):
        times, pad = epoch_seconds(cfg, folder, examples, chat.tokenizer.pad_token_id, grouped)
        results[grouped] = times
        print(f"{name:28s} epoch 1 (compiles) {times[0]:7.1f} s, epoch 2 {times[1]:7.1f} s, "
              f"pad share {pad:.0%}")
    print(f"same-run ratio plain / grouped, epoch 2: {results[False][1] / results[True][1]:.2f}x; "
          f"epoch 1: {results[False][0] / results[True][0]:.2f}x")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
