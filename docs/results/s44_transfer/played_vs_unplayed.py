"""Training-game gain of RL split by whether RL played the game: a game counts as played
when the tracker's (alpha, beta) at the last checkpoint differ from the prior's (the
event-time tracker changes a task's counts only when one of its results arrives).

    python docs/results/s44_transfer/played_vs_unplayed.py runs/s44/games1024 [step]

Reads <run>/checkpoints/<step>/extra_orchestrator, <run>/prior.json, <run>/eval_after.json
(the prior and the evaluation after RL use the same common random numbers)."""

import json
import sys

import numpy as np
import orbax.checkpoint as ocp

from pathlib import Path

run = str(Path(sys.argv[1]).resolve())
step = sys.argv[2] if len(sys.argv) > 2 else "60"
state = ocp.Checkpointer(ocp.StandardCheckpointHandler()).restore(f"{run}/checkpoints/{step}/extra_orchestrator")
tracker = state["tree"]["method"]["tracker"]
alpha, beta = np.asarray(tracker["alpha"]), np.asarray(tracker["beta"])
prior = json.load(open(f"{run}/prior.json"))
after = json.load(open(f"{run}/eval_after.json"))
played = ~(np.isclose(alpha, np.float32(prior["alpha0"]), atol=1e-4)
           & np.isclose(beta, np.float32(prior["beta0"]), atol=1e-4))
before_rate = np.asarray(prior["successes"], float) / np.asarray(prior["trials"], float)
after_rate = np.asarray(after["successes"], float) / np.asarray(after["trials"], float)
for name, mask in (("played", played), ("never played", ~played)):
    gain = after_rate[mask] - before_rate[mask]
    print(f"{name}: {mask.sum()} games, before {before_rate[mask].mean():.3f} after {after_rate[mask].mean():.3f} "
          f"gain {gain.mean():+.3f} +- {gain.std(ddof=1) / np.sqrt(len(gain)):.3f}")
