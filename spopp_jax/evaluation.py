"""The paper's evaluation scores (SPEC 7), over a curve of per-step mean rewards.

A *plotted step* aggregates a fixed number of trajectories (128 in the paper's ALFWorld
runs); ``r_1 .. r_T`` are their mean rewards. All functions take a 1-D sequence of finite
floats and return Python floats; they are host-side NumPy (reports, not training).

- ``area_under_curve``: the normalised trapezoid area
  AUC = r_1 if T = 1, else (1/(T-1)) * sum_{t=1}^{T-1} (r_t + r_{t+1}) / 2.
- ``last_mean``: mean of the last k plotted steps (k = 5 in the paper).
- ``c10_score``: the ablation's screening score over the first 10 steps,
  C10 = (AUC(r_1..r_10) + mean(r_6..r_10)) / 2.
- ``paired_differences``: per-replicate a_i - b_i, their mean and sample standard
  deviation (divisor n - 1) and signs, as SPEC 7 asks for SPO++ - SPO.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

__all__ = [
    "PairedDifferences",
    "area_under_curve",
    "c10_score",
    "last_mean",
    "paired_differences",
    "plotted_steps",
]


def _curve(rewards: Sequence[float], name: str = "rewards") -> np.ndarray:
    curve = np.asarray(rewards, dtype=np.float64)
    if curve.ndim != 1:
        raise ValueError(f"`{name}` must be 1-D, got shape {curve.shape}")
    if curve.size == 0:
        raise ValueError(f"`{name}` is empty")
    if not np.all(np.isfinite(curve)):
        raise ValueError(f"`{name}` holds non-finite values: {curve[~np.isfinite(curve)][:3]}")
    return curve


def plotted_steps(per_update: Sequence[float], updates_per_step: int) -> np.ndarray:
    """Mean reward of each block of ``updates_per_step`` consecutive updates (equal-sized
    updates, so this is the mean over the block's trajectories). An incomplete last block is
    dropped, never averaged over fewer updates."""
    if updates_per_step < 1:
        raise ValueError(f"`updates_per_step` must be >= 1, got {updates_per_step}")
    values = _curve(per_update, "per_update")
    steps = values.size // updates_per_step
    if steps == 0:
        raise ValueError(f"{values.size} updates make no complete plotted step of "
                         f"{updates_per_step} updates")
    return values[: steps * updates_per_step].reshape(steps, updates_per_step).mean(axis=1)


def area_under_curve(rewards: Sequence[float]) -> float:
    """Normalised trapezoid area (SPEC 7): r_1 if T = 1, else mean of (r_t + r_{t+1})/2."""
    curve = _curve(rewards)
    if curve.size == 1:
        return float(curve[0])
    return float(np.mean((curve[:-1] + curve[1:]) / 2.0))


def last_mean(rewards: Sequence[float], k: int = 5) -> float:
    """Mean reward of the last ``k`` plotted steps (all of them when fewer exist is NOT
    allowed: a short curve raises, so scores of different lengths are never mixed)."""
    curve = _curve(rewards)
    if not 1 <= k <= curve.size:
        raise ValueError(f"`k` must be in [1, {curve.size}] for a curve of {curve.size} steps, got {k}")
    return float(np.mean(curve[-k:]))


def c10_score(rewards: Sequence[float]) -> float:
    """C10 = (AUC(r_1..r_10) + mean(r_6..r_10)) / 2 over the FIRST 10 plotted steps (the
    paper's short-run ablation score); needs at least 10 steps, later ones are ignored."""
    curve = _curve(rewards)
    if curve.size < 10:
        raise ValueError(f"C10 needs at least 10 plotted steps, got {curve.size}")
    first = curve[:10]
    return 0.5 * (area_under_curve(first) + float(np.mean(first[5:])))


class PairedDifferences(NamedTuple):
    differences: np.ndarray  # a_i - b_i per replicate
    mean: float
    std: float               # sample std (n - 1); nan for a single pair
    positive: int
    negative: int
    zero: int


def paired_differences(a: Sequence[float], b: Sequence[float]) -> PairedDifferences:
    """a_i - b_i for replicates paired by index (same seed, shared start)."""
    first, second = _curve(a, "a"), _curve(b, "b")
    if first.shape != second.shape:
        raise ValueError(f"paired scores need equal lengths, got {first.size} and {second.size}")
    diff = first - second
    std = float(np.std(diff, ddof=1)) if diff.size > 1 else float("nan")
    return PairedDifferences(diff, float(np.mean(diff)), std, int(np.sum(diff > 0)),
                             int(np.sum(diff < 0)), int(np.sum(diff == 0)))
