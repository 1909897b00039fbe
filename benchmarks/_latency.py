"""Latency model and simulated-time accounting for ``wallclock_async_vs_group.py``.

The workload (all times in simulated seconds, driven by ``run_virtual``):

* Trajectory ``(task x, visit v)`` generates ``L`` action tokens with
  ``ln L = mu + sigma * (sqrt(w) * xi_x + sqrt(1 - w) * eps_xv)``, ``xi, eps ~ N(0, 1)``
  (a per-task length component of share ``w`` plus a per-visit one), clipped to
  ``[min_tokens, max_tokens]``. ``mu = ln(mean_tokens) - sigma^2 / 2`` keeps the
  (unclipped) mean length fixed while ``sigma`` sets how heavy the tail is.
* The tokens are split evenly over ``turns = min(max_turns, ceil(L / tokens_per_turn))``
  turns. A turn's engine latency is ``tokens * decode_s_per_token`` (one decode stream per
  rollout slot); each environment step takes ``env_step_s``, the reset ``env_reset_s``.
* Success: ``R = 1[u_xv < sigmoid(logit0_x + eta * k)]`` with ``k`` the number of learner
  updates contained in the weights that generated the trajectory (the policy event when
  every update is published), ``logit0_x ~ N(logit0_mean, logit0_std)``, ``u_xv ~ U(0, 1)``:
  every update, once published, raises every task's success logit by ``eta``; the same
  rule for every method.
* The learner's update takes ``learner_base_s + learner_s_per_token * batch_tokens``
  (all tokens of the batch's trajectories); a publish takes ``publish_s``.

The accounting helpers below are pure functions over interval lists; the unit tests check
them on hand-computable schedules.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class LatencyModel:
    """Workload constants (see the module docstring for the formulas)."""

    sigma: float = 1.0  # tail parameter: std of ln L
    mean_tokens: float = 512.0
    task_share: float = 0.5  # w: share of ln L variance that is per task
    min_tokens: int = 16
    max_tokens: int = 8192
    tokens_per_turn: int = 256
    max_turns: int = 8
    decode_s_per_token: float = 0.02
    env_step_s: float = 0.5
    env_reset_s: float = 0.2
    learner_base_s: float = 2.0
    learner_s_per_token: float = 1.5e-4
    publish_s: float = 1.0
    logit0_mean: float = -1.5
    logit0_std: float = 1.0
    eta: float = 0.15  # success-logit gain per published update

    def __post_init__(self):
        if self.sigma < 0:
            raise ValueError(f"sigma must be >= 0, got {self.sigma}")
        if not 0.0 <= self.task_share <= 1.0:
            raise ValueError(f"task_share must be in [0, 1], got {self.task_share}")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"need 1 <= min_tokens <= max_tokens, got {self.min_tokens}, {self.max_tokens}")
        for name in ("tokens_per_turn", "max_turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class TrajectoryPlan:
    """What visit ``visit`` of task ``task_id`` will do: tokens per turn and its success draw."""

    task_id: int
    visit: int
    turn_tokens: tuple[int, ...]
    success_u: float

    @property
    def num_tokens(self) -> int:
        return sum(self.turn_tokens)


def log_mean_offset(sigma: float, mean_tokens: float) -> float:
    """mu = ln(mean) − sigma²/2, so E[exp(mu + sigma·Z)] = mean."""
    if mean_tokens <= 0:
        raise ValueError(f"mean_tokens must be > 0, got {mean_tokens}")
    return math.log(mean_tokens) - 0.5 * sigma * sigma


def split_turns(num_tokens: int, tokens_per_turn: int, max_turns: int) -> tuple[int, ...]:
    """Split ``num_tokens`` evenly (earlier turns get the remainder) over
    ``min(max_turns, ceil(num_tokens / tokens_per_turn))`` turns."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    turns = min(max_turns, -(-num_tokens // tokens_per_turn))
    base, extra = divmod(num_tokens, turns)
    return tuple(base + (i < extra) for i in range(turns))


class Workload:
    """Deterministic per-seed draws: task effects, per-visit lengths and success draws."""

    def __init__(self, model: LatencyModel, num_tasks: int, seed: int):
        if num_tasks < 1:
            raise ValueError(f"num_tasks must be >= 1, got {num_tasks}")
        self.model, self.num_tasks, self.seed = model, num_tasks, seed
        rng = np.random.default_rng([seed, 0])
        self.task_effect = rng.standard_normal(num_tasks)
        self.logit0 = model.logit0_mean + model.logit0_std * rng.standard_normal(num_tasks)
        self._plans: dict[tuple[int, int], TrajectoryPlan] = {}

    def plan(self, task_id: int, visit: int) -> TrajectoryPlan:
        key = (int(task_id), int(visit))
        if key not in self._plans:
            m = self.model
            rng = np.random.default_rng([self.seed, 1, key[0], key[1]])
            eps, u = rng.standard_normal(), rng.random()
            z = math.sqrt(m.task_share) * self.task_effect[key[0]] + math.sqrt(1 - m.task_share) * eps
            length = math.exp(log_mean_offset(m.sigma, m.mean_tokens) + m.sigma * z)
            length = int(min(max(round(length), m.min_tokens), m.max_tokens))
            self._plans[key] = TrajectoryPlan(key[0], key[1], split_turns(length, m.tokens_per_turn, m.max_turns), u)
        return self._plans[key]

    def success_probability(self, policy_event: int | np.ndarray) -> np.ndarray:
        """p_x(k) = sigmoid(logit0_x + eta·k) for every task x; [..., num_tasks]."""
        k = np.asarray(policy_event, dtype=np.float64)[..., None]
        return 1.0 / (1.0 + np.exp(-(self.logit0 + self.model.eta * k)))

    def expected_success(self, policy_event: int | np.ndarray) -> np.ndarray:
        """Mean over tasks of p_x(k): the served policy's expected reward."""
        return self.success_probability(policy_event).mean(axis=-1)

    def succeeds(self, plan: TrajectoryPlan, policy_event: int) -> bool:
        p = 1.0 / (1.0 + math.exp(-(self.logit0[plan.task_id] + self.model.eta * policy_event)))
        return plan.success_u < p

    def learner_seconds(self, batch_tokens: int) -> float:
        return self.model.learner_base_s + self.model.learner_s_per_token * batch_tokens


# ---------------------------------------------------------------------------------------
# Accounting over simulated time
# ---------------------------------------------------------------------------------------


def _check_intervals(intervals: Sequence[tuple[float, float]], name: str) -> np.ndarray:
    array = np.asarray(intervals, dtype=np.float64).reshape(-1, 2)
    if np.any(array[:, 1] < array[:, 0]):
        raise ValueError(f"{name}: every interval needs end >= start")
    return array


def clipped_busy_time(intervals: Sequence[tuple[float, float]], start: float, end: float) -> float:
    """Σ_i |[s_i, e_i] ∩ [start, end]| (overlaps count once per interval: slot-seconds)."""
    array = _check_intervals(intervals, "intervals")
    if end < start:
        raise ValueError(f"end ({end}) must be >= start ({start})")
    return float(np.clip(np.minimum(array[:, 1], end) - np.maximum(array[:, 0], start), 0.0, None).sum())


def union_length(intervals: Sequence[tuple[float, float]]) -> float:
    """|∪_i [s_i, e_i]|: time covered by at least one interval."""
    array = _check_intervals(intervals, "intervals")
    total, current_start, current_end = 0.0, None, None
    for s, e in array[np.argsort(array[:, 0], kind="stable")]:
        if current_end is None or s > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = s, e
        else:
            current_end = max(current_end, e)
    if current_end is not None:
        total += current_end - current_start
    return float(total)


def slot_utilisation(episodes: Sequence[tuple[float, float]], num_slots: int, wall: float) -> float:
    """Busy slot-time / (S × wall), an episode occupying one slot from reset to close."""
    if num_slots < 1:
        raise ValueError(f"num_slots must be >= 1, got {num_slots}")
    if wall <= 0:
        raise ValueError(f"wall must be > 0, got {wall}")
    return clipped_busy_time(episodes, 0.0, wall) / (num_slots * wall)


def aborted_slot_time(episodes: Sequence[tuple[float, float]], done: Sequence[bool],
                      wall: float) -> tuple[float, float]:
    """(slot-seconds of episodes that ended before ``wall`` without being played to the
    end, all busy slot-seconds in [0, wall]). Episodes still running at ``wall`` are cut
    by the horizon, not aborted: they count as busy, not as aborted work."""
    array = _check_intervals(episodes, "episodes")
    done = np.asarray(done, dtype=bool)
    if done.shape != (array.shape[0],):
        raise ValueError(f"done must have one flag per episode ({array.shape[0]}), got {done.shape}")
    busy = np.clip(np.minimum(array[:, 1], wall) - array[:, 0], 0.0, None)
    aborted = (~done) & (array[:, 1] < wall)
    return float(busy[aborted].sum()), float(busy.sum())


def max_concurrency(intervals: Sequence[tuple[float, float]]) -> int:
    """Largest number of intervals open at once (an end at t frees before a start at t)."""
    array = _check_intervals(intervals, "intervals")
    events = sorted([(e, -1) for e in array[:, 1]] + [(s, 1) for s in array[:, 0]])
    level = peak = 0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    return peak


def learner_idle_fraction(updates: Sequence[tuple[float, float]], wall: float) -> float:
    """1 − |∪ learner busy ∩ [0, wall]| / wall: the share of time the learner waits."""
    if wall <= 0:
        raise ValueError(f"wall must be > 0, got {wall}")
    array = _check_intervals(updates, "updates")
    clipped = np.clip(array, 0.0, wall)
    return 1.0 - union_length(clipped) / wall


def step_values(change_times: Sequence[float], values: Sequence[float], initial: float,
                grid: np.ndarray) -> np.ndarray:
    """Right-continuous step function on ``grid``: ``initial`` before the first change,
    then ``values[j]`` from ``change_times[j]`` on (change_times non-decreasing)."""
    times = np.asarray(change_times, dtype=np.float64)
    vals = np.asarray(values, dtype=np.float64)
    if times.shape != vals.shape:
        raise ValueError(f"change_times {times.shape} and values {vals.shape} differ in shape")
    if np.any(np.diff(times) < 0):
        raise ValueError("change_times must be non-decreasing")
    index = np.searchsorted(times, np.asarray(grid, dtype=np.float64), side="right")
    return np.concatenate([[initial], vals])[index]


def drain_wait(update_ends: Sequence[float], publish_times: Sequence[float]) -> float:
    """Σ_p (p − the last update end at or before publish p): time from the end of the
    update whose weights are published to their reaching the rollout engine (the drain
    plus the publish latency)."""
    ends = np.sort(np.asarray(update_ends, dtype=np.float64))
    publishes = np.asarray(publish_times, dtype=np.float64)
    index = np.searchsorted(ends, publishes, side="right") - 1
    if np.any(index < 0):
        raise ValueError("every publish needs an update end at or before it")
    return float((publishes - ends[index]).sum())
