"""Per-run markdown table of the evidence campaign on the 120-update recipe.

    python docs/results/evidence_r120/run_table.py docs/results/evidence_r120

One row per finished run (<root>/<arm>/seed<k>/summary.json): held-out gain over the shared
warm start (paired by game, 2,048 episodes), the training-task gain (tasks 0-255), the share
of results received out of event order, the share of trained trajectories at policy lag 2,
and the run's wall time (RL and its evaluations).
"""

import json
import sys
from pathlib import Path

ARMS = ("spopp", "spo", "grpo", "event_traj", "receipt_token", "receipt_traj")


def row(arm: str, seed: int, summary: dict) -> str:
    held, train = summary["heldout_gain_over_warm_start"], summary["train_gain_over_warm_start"]
    order = summary["event_order"]
    lag2 = summary["policy_lag_histogram"].get("2", 0.0)
    return (f"| {arm} | {seed} | {held['gain']:+.3f} ± {held['se']:.3f} ({held['gain'] / held['se']:+.1f} SE) | "
            f"{summary['heldout_after_rl']['success_rate']:.3f} | {train['gain']:+.3f} ± {train['se']:.3f} | "
            f"{100 * order['fraction']:.1f}% ({order['out_of_event_order']:.0f} of {order['received']:.0f}) | "
            f"{100 * lag2:.0f}% | {summary['rl_wall_s']:.0f} s |")


def main(root: Path) -> None:
    print("| arm | seed | held-out gain | held-out after RL | train gain | out of event order | lag 2 | RL + evaluations |")
    print("|---|---|---|---|---|---|---|---|")
    paths = sorted(root.glob("*/seed*/summary.json"),
                   key=lambda p: (int(p.parent.name.removeprefix("seed")), ARMS.index(p.parent.parent.name)
                                  if p.parent.parent.name in ARMS else len(ARMS)))
    for path in paths:
        print(row(path.parent.parent.name, int(path.parent.name.removeprefix("seed")), json.loads(path.read_text())))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
