"""Single-stream dispatch shared by SPO++ and SPO (SPEC 2-3): one baseline per task.

Dispatch samples idle tasks with weight u(v̂) (``spopp_jax.sampling``) and freezes v̂_q at
dispatch; A_i = R_i − v̂_i. Several in-flight requests per task (m > 1) follow the
orchestrator module docstring ("Several in-flight requests per task").
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rollout_bridge import baselines
from rollout_bridge.methods.base import Launch, LearnerOutput, MethodConfig, NextKey, PreviousResponse, Receipt
from rollout_bridge.sum_tree import SumTree
from rollout_bridge.trajectory import DispatchStamp, Trajectory
from spopp_jax import sampling, tracker

SIBLING_RULES = ("balanced", "proportional")

# Jitted once per shape (the dense reference sampler).
_sample_idle = jax.jit(sampling.sample_idle_tasks, static_argnames=("k", "floor", "form"))


def free_slot_mask(in_flight_count: np.ndarray, max_in_flight_per_task: int) -> np.ndarray:
    """Unavailable-slot mask of the [m · num_tasks] slot candidates, tier-major.

    Candidate ``j · num_tasks + x`` is the (j+1)-th concurrent request of task x; it is
    free iff ``j >= in_flight_count[x]`` (True = occupied / not dispatchable). With m = 1
    this is ``in_flight_count > 0``, SPEC 3's in-flight mask.
    """
    in_flight_count = np.asarray(in_flight_count)
    if in_flight_count.ndim != 1 or not np.issubdtype(in_flight_count.dtype, np.integer):
        raise ValueError(f"in_flight_count must be a 1-D integer array, got {in_flight_count.dtype}"
                         f"{in_flight_count.shape}")
    if max_in_flight_per_task < 1:
        raise ValueError(f"max_in_flight_per_task must be >= 1, got {max_in_flight_per_task}")
    tiers = np.arange(max_in_flight_per_task)[:, None]
    return (tiers < in_flight_count[None, :]).reshape(-1)


def sample_dispatch_tasks(
    key: jax.Array,
    v_hat: np.ndarray,
    in_flight_count: np.ndarray,
    max_in_flight_per_task: int,
    count: int,
    rule: str = "balanced",
    floor: float = 0.05,
    form: str = "inside_sqrt",
) -> np.ndarray:
    """Tasks of the next ``count`` dispatches (repeats allowed up to m − in_flight_x).

    SPEC 3 weight u(v̂) = ``sampling.uncertainty_weights``; draws without replacement via
    ``sampling.sample_idle_tasks`` (Gumbel top-k: the first ``count`` of a full draw have
    the law of ``count`` sequential draws, one compile per shape).

    rule "proportional": one draw over the slot candidates of :func:`free_slot_mask` with
      v̂ tiled per tier, so each draw picks x with probability ∝ u(v̂_x)·(m − in_flight_x).
    rule "balanced": tier by tier; the tier is the tasks with the fewest requests in flight
      (b < m); up to its size are drawn ∝ u(v̂) without replacement, their counts rise,
      repeat. The first tier uses ``key`` itself, tier t > 0 ``fold_in(key, t)``.
    At m = 1 both are exactly ``sample_idle_tasks(key, v̂, in_flight > 0)[:count]``.
    """
    if rule not in SIBLING_RULES:
        raise ValueError(f"rule must be one of {SIBLING_RULES}, got {rule!r}")
    v_hat = np.asarray(v_hat)
    in_flight_count = np.asarray(in_flight_count)
    num_tasks = v_hat.shape[0]
    if v_hat.ndim != 1 or in_flight_count.shape != v_hat.shape:
        raise ValueError(f"v_hat and in_flight_count must be [num_tasks] vectors, got {v_hat.shape}, "
                         f"{in_flight_count.shape}")
    occupied = free_slot_mask(in_flight_count, max_in_flight_per_task)
    if not 0 <= count <= int((~occupied).sum()):
        raise ValueError(f"count must be in [0, free slots = {int((~occupied).sum())}], got {count}")
    if rule == "proportional" or max_in_flight_per_task == 1:
        order = _sample_idle(key, jnp.asarray(np.tile(v_hat, max_in_flight_per_task)), jnp.asarray(occupied),
                             k=occupied.size, floor=floor, form=form)
        chosen = np.asarray(order)[:count]
        if np.any(chosen < 0) or np.any(occupied[chosen]):
            raise RuntimeError("sampler returned an occupied slot")
        return chosen % num_tasks
    counts, chosen, tier = in_flight_count.astype(np.int64).copy(), [], 0
    while len(chosen) < count:
        fewest = counts.min(where=counts < max_in_flight_per_task, initial=max_in_flight_per_task)
        members = counts == fewest
        take = min(count - len(chosen), int(members.sum()))
        tier_key = key if tier == 0 else jax.random.fold_in(key, tier)
        order = np.asarray(_sample_idle(tier_key, jnp.asarray(v_hat), jnp.asarray(~members), k=num_tasks,
                                        floor=floor, form=form))[:take]
        if np.any(order < 0) or np.any(~members[order]):
            raise RuntimeError("sampler returned a task outside its tier")
        counts[order] += 1
        chosen.extend(int(x) for x in order)
        tier += 1
    return np.asarray(chosen, dtype=np.int64)


def tracker_arrays(state: Any) -> dict[str, np.ndarray]:
    """{alpha, beta, z_ref} as float32 NumPy arrays from a ``TrackerState`` or its restored dict."""
    get = (lambda name: state[name]) if isinstance(state, Mapping) else (lambda name: getattr(state, name))
    return {name: np.array(get(name), np.float32) for name in ("alpha", "beta", "z_ref")}


def uncertainty_weight(v_hat: np.ndarray, floor: float, form: str) -> np.ndarray:
    """SPEC 3 u(v̂) on the host, float32 like ``spopp_jax.sampling.uncertainty_weights``:
    sqrt(clip(v̂(1−v̂), 0, ¼) + floor) ("inside_sqrt") or sqrt(clip(v̂(1−v̂), 0, ¼)) + floor."""
    v = np.asarray(v_hat, np.float32)
    spread = np.clip(v * (np.float32(1) - v), np.float32(0), np.float32(0.25))
    if form == "inside_sqrt":
        return np.sqrt(spread + np.float32(floor))
    return np.sqrt(spread) + np.float32(floor)


TASK_SAMPLERS = ("sum_tree", "dense")


@dataclasses.dataclass
class SingleStreamConfig(MethodConfig):
    """The recipe fields every single-stream method shares (not itself a method)."""

    def check(self, cfg) -> None:
        """m in-flight requests per task (SPEC 2: m = 1) need enough distinct tasks: on a
        task set the config decides (``env.known_num_tasks()``: generated games, drawn problems),
        ``rollout.max_in_flight`` <= m x ``env.num_games``."""
        tasks = cfg.env.known_num_tasks()
        if tasks is not None:
            slots = cfg.rollout.max_in_flight_per_task * tasks
            if cfg.rollout.max_in_flight > slots:
                raise ValueError(f"rollout.max_in_flight must be <= rollout.max_in_flight_per_task x "
                                 f"env.num_games={slots} (in-flight requests per task are bounded), "
                                 f"got {cfg.rollout.max_in_flight}")


class SingleStreamMethod:
    """Shared single-stream behaviour: per-task tracker, SPEC-3 sampling, frozen v̂.

    Host bookkeeping in NumPy, incremental: the tracker arrays (``alpha``, ``beta``,
    ``z_ref``: ``spopp_jax.tracker``'s re-referenced form), the cached v̂ of every task and,
    for ``sampler.impl="sum_tree"``, a :class:`~rollout_bridge.sum_tree.SumTree` of dispatch
    weights w_x = u(v̂_x)·(m − in_flight_x); only tasks whose evidence or in-flight count
    changed are recomputed, and a draw costs O(log #tasks). Successive draws, each ∝ w with
    the drawn task's w lowered, have exactly the law of SPEC 3's sampler
    (``sample_dispatch_tasks``'s Gumbel top-k; rule "proportional" for m > 1). The balanced
    sibling rule with m > 1 (tiers) and ``sampler.impl="dense"`` use
    :func:`sample_dispatch_tasks` over all tasks (O(#tasks) per dispatch round).

    Subclasses decide what a receipt adds to the tracker (:meth:`observe_receipt`) and
    what happens after an update (call :meth:`refresh` for tasks whose v̂ changed)."""

    def __init__(self, config, num_tasks: int, prior_alpha: np.ndarray, prior_beta: np.ndarray):
        self.config = config
        self.num_tasks = num_tasks
        self.per_task_limit = config.max_in_flight_per_task
        self._set_tracker(tracker_arrays(tracker.init(prior_alpha, prior_beta, z0=config.z0)))
        self.in_flight = np.zeros(num_tasks, np.int64)
        self.free_slots = self.per_task_limit * num_tasks
        self.use_tree = config.sampler.impl == "sum_tree" and (
            self.per_task_limit == 1 or config.sibling_rule == "proportional")
        self.rng = np.random.Generator(np.random.PCG64(config.seed))
        self._rebuild()

    @classmethod
    def check_config(cls, config) -> None:
        """Single stream accepts every orchestrator setting (m >= 1, any sibling rule)."""

    # -------------------------------------------------------------- evidence and weights
    @property
    def tracker(self) -> tracker.TrackerState:
        return tracker.TrackerState(alpha=self.alpha, beta=self.beta, z_ref=self.z_ref)

    def _set_tracker(self, arrays: Mapping[str, np.ndarray]) -> None:
        self.alpha, self.beta, self.z_ref = (np.array(arrays[k], np.float32) for k in ("alpha", "beta", "z_ref"))
        self.v_hat = self.alpha / (self.alpha + self.beta)

    def _weights(self, tasks) -> np.ndarray:
        u = uncertainty_weight(self.v_hat[tasks], self.config.sampler.floor, self.config.sampler.form)
        return u.astype(np.float64) * (self.per_task_limit - self.in_flight[tasks])

    def _weight_of(self, task_id: int) -> float:
        """w_x of one task with Python floats (the per-request path: no array overhead)."""
        v = float(self.v_hat[task_id])
        spread = min(max(v * (1.0 - v), 0.0), 0.25)
        floor = self.config.sampler.floor
        u = math.sqrt(spread + floor) if self.config.sampler.form == "inside_sqrt" else math.sqrt(spread) + floor
        return u * (self.per_task_limit - int(self.in_flight[task_id]))

    def _rebuild(self) -> None:
        self.tree = SumTree(self._weights(np.arange(self.num_tasks))) if self.use_tree else None

    def refresh(self, tasks) -> None:
        """Recompute v̂ and the dispatch weight of ``tasks`` after their evidence changed."""
        for x in ([tasks] if isinstance(tasks, int) else np.atleast_1d(np.asarray(tasks, np.int64)).tolist()):
            alpha = self.alpha[x]
            self.v_hat[x] = alpha / (alpha + self.beta[x])
            if self.tree is not None:
                self.tree.update(x, self._weight_of(x))

    def _count(self, task_id: int, delta: int, update_weight: bool = True) -> None:
        """Change a task's in-flight count; ``update_weight=False`` when the caller
        refreshes the task's weight right after (one sum-tree walk instead of two)."""
        self.in_flight[task_id] += delta
        self.free_slots -= delta
        if self.tree is not None and update_weight:
            self.tree.update(task_id, self._weight_of(task_id))

    # -------------------------------------------------------------- protocol
    def held_count(self) -> int:
        return 0

    def plan_dispatch(self, next_key: NextKey, capacity: int, in_flight: np.ndarray) -> list[Launch]:
        """Up to ``capacity`` tasks by SPEC 3, each with its v̂ frozen now; counted in flight."""
        count = int(min(capacity, self.free_slots))
        if count <= 0:
            return []
        if self.tree is None:
            chosen = sample_dispatch_tasks(next_key(), self.v_hat.copy(), self.in_flight, self.per_task_limit, count,
                                           rule=self.config.sibling_rule, floor=self.config.sampler.floor,
                                           form=self.config.sampler.form).tolist()
            for x in chosen:
                self._count(int(x), +1)
        else:
            chosen = [self._draw_and_count() for _ in range(count)]
        return [Launch(int(x), float(self.v_hat[x])) for x in chosen]

    def _draw_and_count(self) -> int:
        """One task ∝ w, then its w is lowered (the next draw is without replacement).
        Zero-weight free tasks (only with floor 0) come after all positive ones, uniformly,
        as in the Gumbel sampler."""
        if self.tree.total > 0:
            x = self.tree.draw(self.rng)
        else:
            x = int(self.rng.choice(np.flatnonzero(self.in_flight < self.per_task_limit)))
        self._count(x, +1)
        return x

    def observe_receipt(self, traj: Trajectory) -> bool:
        """Evidence a usable receipt adds at once (SPO++); none by default. Returns True
        when it refreshed the task (its sum-tree weight is then current)."""
        return False

    def receive(self, stamp: DispatchStamp, traj: Trajectory | None, spoil: str | None) -> Receipt:
        if traj is None:
            self._count(stamp.task_id, -1)
            return Receipt()
        self._count(stamp.task_id, -1, update_weight=False)
        if not self.observe_receipt(traj) and self.tree is not None:
            self.tree.update(stamp.task_id, self._weight_of(stamp.task_id))
        return Receipt(ready=(traj,))

    def advantages(self, trajectories: Sequence[Trajectory]) -> np.ndarray:
        """A_i = R_i − v̂_i with v̂_i frozen at dispatch (SPEC 2)."""
        return baselines.frozen_baseline_advantages(trajectories)

    def learner_extras(self, trajectories: Sequence[Trajectory]) -> tuple[PreviousResponse | None, ...] | None:
        return None

    def after_update(self, trajectories: Sequence[Trajectory], output: LearnerOutput) -> None:
        return None

    def state_dict(self) -> dict:
        rng = self.rng.bit_generator.state
        words = [rng["state"]["state"], rng["state"]["inc"]]
        return {"tracker": {"alpha": self.alpha.copy(), "beta": self.beta.copy(), "z_ref": self.z_ref.copy()},
                "sampler_rng": np.array([(w >> shift) & _WORD for w in words for shift in (64, 0)], np.uint64),
                "sampler_rng_extra": np.array([rng["has_uint32"], rng["uinteger"]], np.uint64)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        arrays = tracker_arrays(state["tracker"])
        if arrays["alpha"].shape != (self.num_tasks,):
            raise ValueError(f"state tracker has {arrays['alpha'].shape[0]} tasks, expected {self.num_tasks}")
        self._set_tracker(arrays)
        words = [int(w) for w in np.asarray(state["sampler_rng"], np.uint64)]
        extra = [int(w) for w in np.asarray(state["sampler_rng_extra"], np.uint64)]
        self.rng.bit_generator.state = {
            "bit_generator": "PCG64",
            "state": {"state": (words[0] << 64) | words[1], "inc": (words[2] << 64) | words[3]},
            "has_uint32": extra[0], "uinteger": extra[1]}
        self.in_flight[:] = 0  # requests in flight are not restored
        self.free_slots = self.per_task_limit * self.num_tasks
        self._rebuild()


_WORD = (1 << 64) - 1
