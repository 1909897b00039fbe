#!/usr/bin/env python
"""Soak: run `python train.py` for many updates of a tiny job and sample the child's RSS,
open files and threads from /proc every `--interval_s` seconds.

    python benchmarks/train_rss_soak.py --steps 1000 --workdir /tmp/soak
    python benchmarks/train_rss_soak.py --steps 100 -- --rollout.batch_size 8   # extra flags

Prints one row per sample (with the 1-minute load average: on a shared machine the
per-update time is not a property of the code) and, at the end, the least-squares RSS
slope in MiB per 100 updates over the samples of the RL loop after `--warmup_updates`
(the final evaluation rollouts excluded), with the first and last RSS. The job is tests/test_train_resume.py's tiny configuration with the warm
start and prior off, no checkpoints until the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _hardware import cpu_model  # noqa: E402
from test_train_resume import _tiny_job  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")


def sample(pid: int) -> dict | None:
    """RSS (MiB), open files and threads of process `pid`; None once it has exited."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            rss = int(f.read().split()[1]) * PAGE / 2**20
        files = len(os.listdir(f"/proc/{pid}/fd"))
        threads = len(os.listdir(f"/proc/{pid}/task"))
    except (FileNotFoundError, ProcessLookupError):
        return None
    return {"rss_mib": rss, "open_files": files, "threads": threads}


def updates_done(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    return sum(1 for line in metrics.read_text().splitlines() if line.strip().endswith("}"))


def rss_slope_per_100(rows: list[dict], warmup: int) -> float | None:
    """Least-squares slope of RSS against updates (MiB per 100 updates) after `warmup`."""
    points = [(r["updates"], r["rss_mib"]) for r in rows if r["updates"] > warmup]
    if len({u for u, _ in points}) < 2:
        return None
    updates, rss = np.array(points, dtype=np.float64).T
    return float(np.polyfit(updates, rss, 1)[0] * 100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/spopp_soak"))
    parser.add_argument("--interval_s", type=float, default=10.0)
    parser.add_argument("--warmup_updates", type=int, default=20)
    parser.add_argument("extra", nargs="*", help="more train.py flags (after --)")
    args = parser.parse_args(argv)

    job = _tiny_job(args.workdir, args.steps)
    run = args.workdir / f"run_{int(time.time())}"
    job[job.index("--output_dir") + 1] = str(run)
    job += ["--checkpoint_every", str(args.steps), "--warmstart.enabled", "false",
            "--prior.enabled", "false", *args.extra]
    print(f"cpu: {cpu_model()}, {os.cpu_count()} cores; job: {' '.join(job[1:])}", flush=True)
    args.workdir.mkdir(parents=True, exist_ok=True)
    log = open(args.workdir / "soak_train.log", "w")
    start = time.time()
    process = subprocess.Popen(job, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                               env=dict(os.environ, PYTHONUNBUFFERED="1"))
    rows = []
    while process.poll() is None:
        time.sleep(args.interval_s)
        now = sample(process.pid)
        if now is None or now["rss_mib"] == 0:   # exited (a zombie has no memory)
            break
        row = {"wall_s": round(time.time() - start, 1),
               "updates": updates_done(run / "metrics.jsonl"), **now,
               "load_1min": os.getloadavg()[0]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    process.wait()
    # the RL loop only: after the warm-up, before the final evaluation rollouts
    during = [r for r in rows if r["updates"] < args.steps]
    slope = rss_slope_per_100(during, args.warmup_updates)
    after = [r for r in during if r["updates"] > args.warmup_updates]
    summary = {
        "returncode": process.returncode, "updates": updates_done(run / "metrics.jsonl"),
        "rss_slope_mib_per_100_updates": slope,
        "rss_first_after_warmup": after[0]["rss_mib"] if after else None,
        "rss_last_in_loop": after[-1]["rss_mib"] if after else None,
        "open_files_range": [min(r["open_files"] for r in after), max(r["open_files"] for r in after)] if after else None,
        "threads_range": [min(r["threads"] for r in after), max(r["threads"] for r in after)] if after else None,
        "wall_s": round(time.time() - start, 1),
        "load_1min_mean": float(np.mean([r["load_1min"] for r in rows])) if rows else None,
    }
    print("summary " + json.dumps(summary), flush=True)
    return 0 if process.returncode == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
