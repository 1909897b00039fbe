"""The learning curve of a job (``learning_curve.png``): training success per update and
its trailing mean, held-out success before and after RL, reference lines."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rollout_bridge.run_report import success_axis_limits

TRAILING_WINDOW = 5  # updates in the trailing success mean (the plot's and the progress bar's)


def plot_job_curve(rows, path: Path, title: str, held_out: dict, references: dict) -> Path:
    """learning_curve.png: training success per update (and its trailing mean), held-out
    success before and after RL with ±2 SE bars (``held_out``: name -> (update, estimate)),
    and horizontal reference lines (``references``: label -> success, e.g. the exact
    prompt-blind ceilings and the warm start's training success)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rollout_bridge.metrics import trailing_mean

    points = [(r["step"], r["success_rate"]) for r in rows if "success_rate" in r]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    shown = [*references.values(),   # every plotted value: the success axis fits them
             *(e["success_rate"] + k * 2 * e["se"] for _, e in held_out.values() for k in (-1, 1))]
    if points:
        steps, values = map(np.asarray, zip(*points))
        shown += [*values, *trailing_mean(values, TRAILING_WINDOW)]
        ax.plot(steps, values, "o-", ms=3, alpha=0.35, label="train success per update")
        ax.plot(steps, trailing_mean(values, TRAILING_WINDOW), "-", lw=2,
                label=f"train success, trailing mean ({TRAILING_WINDOW})")
    for label, (update, estimate) in held_out.items():
        ax.errorbar([update], [estimate["success_rate"]], yerr=[2 * estimate["se"]], fmt="s", ms=7, capsize=5,
                    label=f"{label}: {estimate['success_rate']:.2f} ± 2 SE")
    for (label, value), style in zip(references.items(), ("--", ":", "-.", (0, (1, 3)), (0, (5, 5)))):
        if value is not None:
            ax.axhline(value, ls=style, color="gray", label=f"{label}: {value:.2f}")
    ax.set_xlabel("learner update")
    ax.set_ylabel("success rate")
    ax.set_ylim(*success_axis_limits(shown))
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
