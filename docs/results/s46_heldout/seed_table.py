#!/usr/bin/env python
"""Held-out gains of the main job's runs, per run and pooled per game over runs.

    python docs/results/s46_heldout/seed_table.py docs/results/s46_heldout/records/g1024_h512_seed{0,1,2}

Each argument is a run folder holding the job's summary.json. Per run: the job's own paired
gains (mean over games of after - before, SE over games), the games that went up / down,
and the gain on the first 128 held-out games (the earlier default's held-out set) and on the
other 384. Pooled: per held-out game, the mean of the runs' gains, then mean and SE over
games (the runs share the games, so they are pooled per game, not as independent runs)."""

import json
import sys
from pathlib import Path

import numpy as np


def rates(record):
    return np.asarray(record["successes"], float) / np.maximum(np.asarray(record["trials"], float), 1)


def mean_se(values):
    values = np.asarray(values, float)
    return values.mean(), values.std(ddof=1) / np.sqrt(len(values))


def main(folders):
    gains = []
    for folder in folders:
        summary = json.loads((Path(folder) / "summary.json").read_text())
        gain = rates(summary["heldout_after_rl"]) - rates(summary["heldout_before_rl"])
        gains.append(gain)
        train, held = summary["train_gain_over_warm_start"], summary["heldout_gain_over_warm_start"]
        first, rest = mean_se(gain[:128]), mean_se(gain[128:])
        print(f"{Path(folder).name}: train gain {train['gain']:+.3f} ± {train['se']:.3f} "
              f"({train['gain'] / train['se']:+.1f} SE); held-out gain {held['gain']:+.3f} ± {held['se']:.3f} "
              f"({held['gain'] / held['se']:+.1f} SE), games up / down {(gain > 0).sum()} / {(gain < 0).sum()}; "
              f"first 128 games {first[0]:+.3f} ± {first[1]:.3f}, other {len(gain) - 128} {rest[0]:+.3f} ± {rest[1]:.3f}")
    pooled = mean_se(np.mean(gains, axis=0))
    print(f"pooled per game over {len(gains)} runs: {pooled[0]:+.3f} ± {pooled[1]:.3f} ({pooled[0] / pooled[1]:+.1f} SE)")


if __name__ == "__main__":
    main(sys.argv[1:])
