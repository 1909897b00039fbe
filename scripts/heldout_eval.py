#!/usr/bin/env python
"""Evaluate policies on a job's held-out games with more episodes per game than the job's
own evaluation, and print each policy's gain over the first one, paired by game.

    python scripts/heldout_eval.py --rollouts 16 \
        --policy assets/textworld_text_warmstart --policy runs/x/hf_model \
        [--out runs/x/heldout_16.json] [any train.py flag, e.g. --env.heldout_games 128]

The job (`python train.py`) evaluates the held-out games with `evaluation.heldout_rollouts`
episodes per game (4). Its paired SE then mostly measures binomial noise inside each game
(4 episodes of a game with success p carry variance p(1 - p)/4 per side), not how much the
games differ. More episodes per game shrink that part. Everything else is the job's:
`configs/default.yaml` plus the flags given (so the same held-out games, the same agent
loop, the same engine settings and evaluation seed: `rollout_bridge.evaluation.evaluate_policy`), each policy
on a fresh engine, with the job's compilation cache (`compilation_cache_dir`): the engine's
~140 prefill programs are read back instead of compiled again (~0.5 s each on 2 CPU cores).
The first `--policy` is the reference (e.g. the warm start); the gain of each later one is
mean_g(after_g - before_g) with SE std_g / sqrt(G) over the G held-out games
(`rollout_bridge.job_report.paired_gain`, the job's formula).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", action="append", required=True,
                        help="an HF policy folder (model + tokenizer); give two or more, the first is the reference")
    parser.add_argument("--rollouts", type=int, default=16, help="episodes per held-out game and policy")
    parser.add_argument("--out", default=None, help="write every policy's per-game record here (JSON)")
    args, rest = parser.parse_known_args(argv)
    if len(args.policy) < 2:
        parser.error("give at least two --policy folders (the first is the reference)")
    if args.rollouts < 1:
        parser.error(f"--rollouts must be >= 1, got {args.rollouts}")
    for policy in args.policy:
        if not (Path(policy) / "config.json").is_file():
            parser.error(f"--policy {policy}: not an HF model folder (no config.json)")
    return args, rest


def main(argv=None) -> list[dict]:
    args, rest = parse_args(argv)
    import train
    from rollout_bridge import components as build
    from rollout_bridge.envs.kinds import build_env
    from rollout_bridge.evaluation import evaluate_policy
    from rollout_bridge.job import build_job
    from rollout_bridge.job_report import margin_text, paired_gain, success_estimate
    from rollout_bridge.run_folder import RunPaths, enable_compilation_cache, log

    cfg = train.parse_config(rest)
    enable_compilation_cache(cfg.compilation_cache_dir)
    env = build_env(cfg, False, log, cfg.progress)
    try:
        if "heldout" not in env.extra_evals:
            raise SystemExit(f"env.kind={cfg.env.kind} with these settings has no held-out games")
        job = build_job(cfg, RunPaths(Path(cfg.output_dir)), env)
        load = os.getloadavg()[0]
        records = []
        for policy in args.policy:
            start = time.time()
            chat = build.load_chat(Path(policy), env.chat_tools)   # each policy with its own tokenizer
            record = asyncio.run(evaluate_policy(job, Path(policy), chat, args.rollouts, f"of {policy}"))["heldout"]
            records.append({"policy": policy, **record, "wall_s": time.time() - start})
    finally:
        env.close()
    games = len(records[0]["successes"])
    where = env.tasks_record.get("heldout_games")   # the generated folder's name (TextWorld); ALFWorld has none
    print(f"held-out games: {games}{f' ({where})' if where else ''}, {args.rollouts} episodes per game "
          f"(load average {load:.1f} at the start)")
    reference = records[0]
    for record in records:
        estimate = success_estimate(record["successes"], record["trials"])
        line = (f"{record['policy']}: {estimate['success_rate']:.3f} ± {estimate['se']:.3f} (SE over "
                f"{estimate['games']} games, {estimate['episodes']} episodes, {record['wall_s']:.0f} s)")
        if record is not reference:
            gain = paired_gain(reference, record)
            record["gain_over_reference"] = gain
            line += f"; gain over {reference['policy']}: {gain['gain']:+.3f} ± {gain['se']:.3f} " \
                    f"(paired by game): {margin_text(gain['gain'], gain['se'])}"
        print(line)
    if args.out:
        Path(args.out).write_text(json.dumps({"rollouts": args.rollouts, "policies": records}, indent=1))
    return records


if __name__ == "__main__":
    main()
