"""Advantages for a consumed batch under the three matched methods (SPEC 2, 4).

* SPO++ and SPO (single stream): A_i = R_i − v̂_i with v̂_i the baseline FROZEN at
  dispatch (SPEC 2); then whitening under the configured measure (SPEC 4).
* GRPO: A_i = R_i − mean_{j in group(i)} R_j (group-relative) over whole groups of G,
  then the same whitening.

Also the SPEC-4 batch diagnostics and SPO's divergence D (SPEC 2, "Baseline").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

import jax
import numpy as np

from rollout_bridge.trajectory import Trajectory
from spopp_jax import advantages as adv_lib

if TYPE_CHECKING:
    from rollout_bridge.methods.base import PreviousResponse


def action_lengths(trajectories: Sequence[Trajectory]) -> np.ndarray:
    """L_i of SPEC 4: number of policy-generated tokens of each trajectory."""
    return np.fromiter((np.count_nonzero(t.action_mask) for t in trajectories), np.float32, len(trajectories))


def frozen_baseline_advantages(trajectories: Sequence[Trajectory]) -> np.ndarray:
    """A_i = R_i − v̂_i, v̂_i read at dispatch (SPEC 2). float32 [n]."""
    rewards = np.array([t.reward for t in trajectories], dtype=np.float32)
    frozen = np.array([t.frozen_baseline for t in trajectories], dtype=np.float32)
    if not np.all(np.isfinite(frozen)):
        raise ValueError("trajectories must carry a finite frozen_baseline")
    return rewards - frozen


def group_relative_advantages(trajectories: Sequence[Trajectory], group_size: int | None = None) -> np.ndarray:
    """GRPO: A_i = R_i − mean of R over trajectory i's group (``stamp.group_id``). float32 [n].

    ``group_size`` (G): when given, every group of the batch must appear with exactly G
    members (a batch of whole groups); a split or shrunken group raises ValueError, since
    its mean is not the group mean GRPO defines (a one-member fragment has A = 0).
    """
    rewards = np.array([t.reward for t in trajectories], dtype=np.float64)
    groups = np.array([t.stamp.group_id for t in trajectories])
    if np.any(groups < 0):
        raise ValueError("GRPO trajectories must carry a group_id >= 0")
    if group_size is not None:
        ids, counts = np.unique(groups, return_counts=True)
        partial = {int(g): int(c) for g, c in zip(ids, counts) if c != group_size}
        if partial:
            raise ValueError(f"trajectories must hold whole groups of group_size={group_size}; "
                             f"group_id -> members in batch: {partial}")
    advantages = np.empty_like(rewards)
    for group in np.unique(groups):
        members = groups == group
        advantages[members] = rewards[members] - rewards[members].mean()
    return advantages.astype(np.float32)


# Compiled once per batch size: run eagerly, each call would dispatch ~15 small JAX ops one
# by one, on every update.
_whiten = jax.jit(adv_lib.whiten, static_argnames=("measure", "eps"))
_batch_stats = jax.jit(adv_lib.batch_stats, static_argnames=("quantiles", "eps"))


def _host_arrays(raw_advantages, lengths) -> tuple[np.ndarray, np.ndarray]:
    """float32 NumPy copies, checked on the host (the value checks are skipped under jit)."""
    raw, lengths = np.asarray(raw_advantages, np.float32), np.asarray(lengths, np.float32)
    adv_lib._check_trajectory_args(raw, lengths)
    return raw, lengths


def whiten(raw_advantages: np.ndarray, lengths: np.ndarray, measure: str, eps: float = 1e-8) -> np.ndarray:
    """Ã = (A − μ)/(σ + eps) under the "token" or "trajectory" measure (SPEC 4)."""
    adv_lib._check_measure(measure)
    raw, lengths = _host_arrays(raw_advantages, lengths)
    return np.asarray(_whiten(raw, lengths, measure=measure, eps=float(eps)), dtype=np.float32)


def batch_diagnostics(raw_advantages: np.ndarray, lengths: np.ndarray) -> dict[str, float]:
    """SPEC-4 per-batch log (``spopp_jax.advantages.batch_stats``: Cov_n(L, A), the
    loss-weighted centers after both whitenings, length quantiles) as Python floats."""
    stats = jax.device_get(_batch_stats(*_host_arrays(raw_advantages, lengths)))
    out = {name: float(value) for name, value in stats.items()}
    out["advantage_mean"] = float(np.mean(raw_advantages)) if len(raw_advantages) else 0.0
    return out


def token_mean_abs_log_ratio(action_mask, logp_then, logp_now) -> float:
    """SPO's D: mean over action tokens of |log π_then − log π_now| (0 if no actions)."""
    action_mask = np.asarray(action_mask, dtype=bool)
    logp_then = np.asarray(logp_then, dtype=np.float64)
    logp_now = np.asarray(logp_now, dtype=np.float64)
    if not (action_mask.shape == logp_then.shape == logp_now.shape):
        raise ValueError(
            f"action_mask, logp_then, logp_now must share a shape, got "
            f"{action_mask.shape}, {logp_then.shape}, {logp_now.shape}"
        )
    count = action_mask.sum()
    if count == 0:
        return 0.0
    diff = np.where(action_mask, np.abs(logp_then - logp_now), 0.0)
    return float(diff.sum() / count)


def spo_divergences(num_trajectories: int, divergence: Sequence[float | None] | None) -> np.ndarray:
    """D_i for each consumed trajectory in arrival order; None (first visit) gives 0."""
    if divergence is None:
        return np.zeros(num_trajectories, dtype=np.float32)
    if isinstance(divergence, Mapping):
        raise TypeError("divergence must be a sequence aligned with the batch (one D per trajectory, "
                        "None for a first visit), not a mapping by task")
    if len(divergence) != num_trajectories:
        raise ValueError(f"divergence must have {num_trajectories} entries, got {len(divergence)}")
    values = np.array([0.0 if d is None else float(d) for d in divergence], dtype=np.float32)
    if not np.all(np.isfinite(values) & (values >= 0)):
        raise ValueError("divergence must be finite and >= 0")
    return values


def pack_previous_responses(
    previous: Sequence[PreviousResponse | None], logp_batch: np.ndarray | None = None, pad_to_multiple: int = 1,
    num_rows: int | None = None,
) -> tuple[dict[str, np.ndarray] | None, np.ndarray]:
    """SPO learner helper: pack the y′ that exist into arrays for scoring under π_now.

    Returns ``(arrays, rows)``: ``rows[i]`` is the row of ``previous[i]`` in ``arrays`` or
    -1 where it is None; ``arrays`` (None when no trajectory has a y′) holds
    ``input_ids`` int32, ``attention_mask``, ``action_mask`` bool and ``logp_then`` float32,
    all [R, T]: π_then is ``y′.logp_then`` (recorded by the learner when y′ was trained),
    or ``logp_batch[y′.batch_row]`` (the learner's log-probs of this batch at the update's
    starting parameters) when y′ is an earlier row of the same batch. ``num_rows`` pads R
    with empty rows (one compiled shape per batch size).
    """
    present = [p for p in previous if p is not None]
    rows = np.full(len(previous), -1, dtype=np.int64)
    rows[[i for i, p in enumerate(previous) if p is not None]] = np.arange(len(present))
    if not present:
        return None, rows
    count = len(present) if num_rows is None else num_rows
    if count < len(present):
        raise ValueError(f"num_rows ({num_rows}) must be >= the number of previous responses ({len(present)})")
    longest = max(len(p.token_ids) for p in present)
    width = -(-max(longest, 1) // pad_to_multiple) * pad_to_multiple
    arrays = {
        "input_ids": np.zeros((count, width), np.int32),
        "attention_mask": np.zeros((count, width), bool),
        "action_mask": np.zeros((count, width), bool),
        "logp_then": np.zeros((count, width), np.float32),
    }
    for row, response in enumerate(present):
        n = len(response.token_ids)
        if response.batch_row >= 0:
            if logp_batch is None:
                raise ValueError("a previous response in this batch needs logp_batch (its π_then)")
            then = np.asarray(logp_batch)[response.batch_row, :n]
        else:
            then = response.logp_then
        arrays["input_ids"][row, :n] = response.token_ids
        arrays["attention_mask"][row, :n] = True
        arrays["action_mask"][row, :n] = response.action_mask
        arrays["logp_then"][row, :n] = np.where(response.action_mask, then, 0.0)
    return arrays, rows


def divergences_from_logprobs(
    rows: np.ndarray, arrays: dict[str, np.ndarray] | None, logp_now
) -> list[float | None]:
    """D_i = token-mean |π_then − π_now| over y′'s action tokens, aligned with ``rows``.

    ``logp_now``: [R, T] log-probs of ``arrays["input_ids"]`` under the updated policy
    (token t's log-prob at position t, as the learner's ``token_logprobs``); π_then is
    ``arrays["logp_then"]``. None where there was no y′ (SPO's D = 0, first visit).
    """
    if arrays is None:
        return [None] * len(rows)
    logp_now = np.asarray(logp_now)
    if logp_now.shape != arrays["action_mask"].shape:
        raise ValueError(f"logp_now must have shape {arrays['action_mask'].shape}, got {logp_now.shape}")
    return [
        None if row < 0 else token_mean_abs_log_ratio(
            arrays["action_mask"][row], arrays["logp_then"][row], logp_now[row])
        for row in rows
    ]
