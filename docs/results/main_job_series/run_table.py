#!/usr/bin/env python
"""Per-run table of the main-job series (docs/RESULTS.md, "The main job"): time, load, async
regime and held-out gain of each run folder given (each holds the job's summary.json and
load.txt, the 1-minute load average sampled every 10 s while the run went).

    python docs/results/main_job_series/run_table.py docs/results/main_job_series/{idle,loaded}_*

The pooled gain per held-out game over a set of runs:
    python docs/results/s46_heldout/seed_table.py docs/results/main_job_series/loaded_*"""

import json
import statistics
import sys
from pathlib import Path


def row(folder: Path) -> str:
    s = json.loads((folder / "summary.json").read_text())
    loads = [float(line.split()[1]) for line in (folder / "load.txt").read_text().splitlines()]
    gain = s["heldout_gain_over_warm_start"]
    lag = s["policy_lag_histogram"]
    before, after = s["heldout_before_rl_estimate"]["success_rate"], s["heldout_after_rl_estimate"]["success_rate"]
    return (f"| {folder.name} | {s['total_wall_s']:.0f} | {s['rl_wall_s']:.0f} | "
            f"{s['async_regime']['seconds_per_update']:.1f} | {min(loads):.1f}-{max(loads):.1f} "
            f"(mean {statistics.mean(loads):.1f}) | {before:.3f} -> {after:.3f} | {gain['gain']:+.3f} ± {gain['se']:.3f} "
            f"({gain['gain'] / gain['se']:+.2f} SE) | {100 * s['event_order']['fraction']:.1f}% | "
            f"{100 * (lag['0'] + lag['1']):.0f}% / {100 * lag['2']:.0f}% |")


def main(folders: list[str]) -> None:
    print("| run | whole job (s) | RL (s) | s/update | 1-min load | held-out success before -> after | "
          "held-out gain (paired by game) | out of event order | policy lag 0-1 / 2 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for folder in folders:
        print(row(Path(folder)))


if __name__ == "__main__":
    main(sys.argv[1:])
