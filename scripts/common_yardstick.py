#!/usr/bin/env python
"""The common yardstick: every run's policy at each kept checkpoint step (and its starting
policy, step 0) evaluated on one fixed task mix with common random numbers; per run the
curve (step -> success ± SE over tasks) and its AUC over the steps, across arms the paired
differences by seed (mean, SE, 95% CI, seeds improving). `rollout_bridge/yardstick.py`
defines the mix and the scores.

    python scripts/common_yardstick.py --runs runs/m/spopp_0 runs/m/grpo_0 ... \
        --out docs/results/yardstick_x [--set train] [--tasks 32] [--rollouts 4] \
        [--eval_steps 20,40,...] [--start true] [--reference spopp] [--carry earlier/yardstick.json] \
        [any train.py flag]

The train.py flags (e.g. `--config_path configs/math_tir_tiny.yaml`) give the tasks, the
agent and the engine; each run's saved env settings and decoding must equal them (the
command names every difference). Writes `<out>/yardstick.json` (the record),
`<out>/yardstick.md` (the tables), `<out>/yardstick.png` (the curves) and one file per run
and step under `<out>/evaluations/` (reused when run again with the same settings).
`--carry` keeps the runs of an earlier record (made on the same mix and steps, with the
same env, decoding and model settings on the same task content: its `key`) that `--runs`
does not name, as they were recorded: runs added later are played alone. A record written
before records held their key is carried with a warning line; `settings.unchecked` lists the
runs not checked against `key` (carried so, or played from step files written before they
held the tasks' digest).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _bool(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() == "true"


def _steps(text: str) -> list[int]:
    try:
        steps = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated steps, got {text!r}") from None
    if not steps or steps[0] < 0:
        raise argparse.ArgumentTypeError(f"expected steps >= 0, got {text!r}")
    return steps


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", required=True, help="train.py output_dir folders (checkpoints/ inside)")
    parser.add_argument("--out", required=True, help="folder for yardstick.json / .md / .png and the evaluations")
    parser.add_argument("--set", default="train", dest="task_set",
                        help="the task set: train, or an extra set of the env kind (heldout, no_tool, ...)")
    parser.add_argument("--tasks", type=int, default=None, help="the first N tasks of the set (default: all)")
    parser.add_argument("--rollouts", type=int, default=4, help="episodes per task and policy")
    parser.add_argument("--eval_steps", type=_steps, default=None,
                        help="checkpoint steps to evaluate, e.g. 20,40,60 (default: the steps every run holds; "
                             "--steps is train.py's)")
    parser.add_argument("--start", type=_bool, default=True, help="also evaluate each run's starting policy (step 0)")
    parser.add_argument("--reference", default=None, help="the arm the others are compared with (default spopp)")
    parser.add_argument("--figure", type=_bool, default=True)
    parser.add_argument("--carry", default=None,
                        help="an earlier yardstick.json of the same mix, steps and settings: its runs that --runs "
                             "does not name are kept as recorded (not played)")
    return parser.parse_known_args(argv)


def machine_text() -> str:
    model = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")), "?")
    return f"{platform.node()}, {os.cpu_count()} CPUs ({model}), load average {os.getloadavg()[0]:.1f}"


def write_record(out: Path, record: dict) -> Path:
    """``<out>/yardstick.json``: one line (the per-task records of every run and step are long),
    written whole by `write_text_atomic` (a temporary file of its own, then renamed)."""
    from rollout_bridge.atomic_files import write_text_atomic

    return write_text_atomic(out / "yardstick.json", json.dumps(record, separators=(",", ":")) + "\n")


def main(argv=None) -> dict:
    args, rest = parse_args(argv)
    import train
    from rollout_bridge import yardstick as ys
    from rollout_bridge.envs.kinds import build_env
    from rollout_bridge.job import build_job
    from rollout_bridge.run_folder import RunPaths, enable_compilation_cache, log

    cfg = train.parse_config(rest)
    if cfg.rollout.engine.uses_servers:
        raise SystemExit(f"common_yardstick: rollout.engine={cfg.rollout.engine.name} (on servers) is not supported; "
                         "use jax or vllm")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    enable_compilation_cache(cfg.compilation_cache_dir)
    runs = [ys.read_run(folder) for folder in args.runs]
    ys.check_runs(cfg, runs)
    steps = ys.common_steps(runs, args.eval_steps, args.start)
    earlier = None if args.carry is None else ys.read_record(args.carry)
    machine = machine_text()
    log(f"yardstick: {len(runs)} runs ({', '.join(run.label for run in runs)}), steps {steps}; {machine}")
    env = build_env(cfg, False, log, cfg.progress)
    try:
        job = build_job(cfg, RunPaths(out), env)
        mix = ys.TaskMix.build(env, args.task_set, args.tasks, args.rollouts, cfg.seed)
        key = ys.settings_key(cfg, mix)
        carried = [] if earlier is None else ys.carried_runs(earlier, mix, steps, [run.label for run in runs], key)
        unchecked = [] if earlier is None else ys.unchecked_runs(earlier, carried)
        start = time.time()
        summaries = []
        for run in runs:   # one at a time: each step a fresh engine
            records = asyncio.run(ys.evaluate_run(job, run, steps, mix, out / "evaluations"))
            summaries.append(ys.run_summary(run, records))
            if ys.unchecked_steps(records):
                unchecked.append(run.label)
    finally:
        env.close()
    summaries = [*carried, *summaries]
    arms = ys.arm_order([summary["arm"] for summary in summaries], args.reference)
    settings = {"argv": list(sys.argv[1:] if argv is None else argv), "env_kind": cfg.env.kind, "seed": cfg.seed,
                "engine": cfg.rollout.engine.name, "machine": machine, "wall_s": time.time() - start,
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "unchecked": unchecked}
    if carried:
        settings["carried"] = {"from": args.carry, "runs": [summary["label"] for summary in carried],
                               "settings": earlier["settings"]}
    record = ys.yardstick_record(summaries, mix, steps, arms, settings, key)
    write_record(out, record)
    table = ys.markdown(record) + f"\n({machine} at the start; {settings['wall_s']:.0f} s"
    if carried:
        table += f"; {len(carried)} runs carried from {args.carry}, not played"
    table += ")\n"
    (out / "yardstick.md").write_text(table)
    if args.figure:
        ys.figure(record, out / "yardstick.png")
    print(table)
    return record


if __name__ == "__main__":
    from rollout_bridge.run_errors import run_cleanly

    raise SystemExit(run_cleanly(main))
