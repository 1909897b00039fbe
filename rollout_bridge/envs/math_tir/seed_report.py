"""Success before -> after RL of several seeds of a Math-TIR job, and their curves.

    python -m rollout_bridge.envs.math_tir.seed_report runs/mt/s0 runs/mt/s1 runs/mt/s2 \\
        --figure docs/figures/math_tir_tiny.png

reads each run folder's ``summary.json`` (written by ``train.py``) and ``metrics.jsonl``
and prints, per evaluation (``train`` = the prior's rollouts and the same rollouts after
RL; ``no_tool``, ``heldout``, ``heldout_no_tool`` = the env kind's extra evaluations), the
success of every seed before and after RL and, over the seeds, the mean and the standard
error of the mean

    SE = std(x, ddof=1) / sqrt(n_seeds)

of the before, the after and the after - before values (seeds are the independent unit:
rollouts of one seed share a model, so they are not). The figure shows each seed's
per-update batch success (trailing mean) and ``turns_mean - 1`` (clipped to [0, 1]): an
episode answered without the tool has 1 turn, one tool call then the answer 2, so this is
the tool-call rate while episodes make at most one call.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from rollout_bridge.metrics import read_metrics, trailing_mean

EVALUATIONS = ("train", "no_tool", "heldout", "heldout_no_tool")
CURVE_WINDOW = 20


def success_of(summary: Mapping, evaluation: str, when: str) -> float | None:
    """Success rate of ``evaluation`` ``before``/``after`` RL in a train.py summary (None
    if the run did not evaluate it)."""
    if evaluation == "train":
        return summary.get(f"success_{when}_rl")
    entry = summary.get(f"{evaluation}_{when}_rl")
    return None if entry is None else entry["success_rate"]


def mean_and_se(values: Sequence[float]) -> tuple[float, float]:
    """(mean, std(ddof=1)/sqrt(n)); SE is nan for a single value."""
    x = np.asarray(values, dtype=np.float64)
    se = float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else math.nan
    return float(x.mean()), se


def seed_table(summaries: Mapping[str, Mapping]) -> list[dict]:
    """One row per evaluation present in every summary: per-seed before/after, and the
    mean +- SE over seeds of before, after and their difference."""
    rows = []
    for evaluation in EVALUATIONS:
        pairs = {name: (success_of(s, evaluation, "before"), success_of(s, evaluation, "after"))
                 for name, s in summaries.items()}
        if any(b is None or a is None for b, a in pairs.values()):
            continue
        before, after = (np.array([p[i] for p in pairs.values()]) for i in (0, 1))
        rows.append({"evaluation": evaluation, "per_seed": pairs, "before": mean_and_se(before),
                     "after": mean_and_se(after), "gain": mean_and_se(after - before)})
    return rows


def format_table(rows: Sequence[dict]) -> str:
    """Markdown: evaluation | per seed before -> after | mean before | mean after | gain."""
    def pm(pair):
        return f"{pair[0]:.3f} ± {pair[1]:.3f}"

    lines = ["| evaluation | per seed: before -> after | before (mean ± SE) | after (mean ± SE) | after - before |",
             "|---|---|---|---|---|"]
    for row in rows:
        seeds = ", ".join(f"{b:.3f} -> {a:.3f}" for b, a in row["per_seed"].values())
        lines.append(f"| {row['evaluation']} | {seeds} | {pm(row['before'])} | {pm(row['after'])} | "
                     f"{row['gain'][0]:+.3f} ± {row['gain'][1]:.3f} |")
    return "\n".join(lines)


def plot_seeds(runs: Mapping[str, Path], figure: Path, window: int = CURVE_WINDOW) -> Path:
    """Per seed: trailing-mean batch success per update (solid) and tool-call rate (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (name, folder), color in zip(runs.items(), plt.rcParams["axes.prop_cycle"].by_key()["color"]):
        rows = [r for r in read_metrics(folder / "metrics.jsonl") if "success_rate" in r]
        steps = np.array([r["step"] for r in rows])
        ax.plot(steps, trailing_mean(np.array([r["success_rate"] for r in rows]), window), "-", color=color,
                label=f"{name}: batch success")
        turns = [r.get("turns_mean") for r in rows]
        if all(t is not None for t in turns):
            ax.plot(steps, trailing_mean(np.clip(np.array(turns) - 1.0, 0.0, 1.0), window), "--", color=color,
                    label=f"{name}: tool-call rate (mean turns - 1)")
    ax.set_xlabel("learner update")
    ax.set_ylabel(f"trailing mean over {window} updates")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("SPO++ on the tiny Math-TIR task")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    figure.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(figure, dpi=100)
    plt.close(fig)
    return figure


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description="Success before -> after RL over seeds of a Math-TIR job.")
    parser.add_argument("runs", nargs="+", help="run folders (each with summary.json and metrics.jsonl)")
    parser.add_argument("--figure", default=None, help="write the seeds' curves here (PNG)")
    args = parser.parse_args(argv)
    runs = {Path(r).name: Path(r) for r in args.runs}
    missing = [str(f / "summary.json") for f in runs.values() if not (f / "summary.json").is_file()]
    if missing:
        raise SystemExit(f"no summary.json (run not finished?): {', '.join(missing)}")
    summaries = {name: json.loads((folder / "summary.json").read_text()) for name, folder in runs.items()}
    rows = seed_table(summaries)
    print(format_table(rows))
    if args.figure:
        print(f"figure: {plot_seeds(runs, Path(args.figure))}")
    return rows


if __name__ == "__main__":
    main()
