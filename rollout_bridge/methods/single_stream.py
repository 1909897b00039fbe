"""Single-stream dispatch shared by SPO++ and SPO (SPEC 2-3): one baseline per task.

Dispatch samples idle tasks with weight u(v̂) (``spopp_jax.sampling``) and freezes v̂_q at
dispatch; A_i = R_i − v̂_i. Several in-flight requests per task (m > 1) follow the
orchestrator module docstring ("Several in-flight requests per task").
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rollout_bridge import baselines
from rollout_bridge.methods.base import Launch, LearnerOutput, NextKey, PreviousResponse, Receipt
from rollout_bridge.trajectory import DispatchStamp, Trajectory
from spopp_jax import sampling, tracker

SIBLING_RULES = ("balanced", "proportional")

# Jitted once per shape: the per-request tracker / sampler calls stay cheap on the host.
_all_baselines = jax.jit(lambda state: tracker.baseline(state, jnp.arange(state.alpha.shape[0])))
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
    """{alpha, beta, z_ref} as NumPy arrays from a ``TrackerState`` or its restored dict."""
    get = (lambda name: state[name]) if isinstance(state, Mapping) else (lambda name: getattr(state, name))
    return {name: np.asarray(get(name)) for name in ("alpha", "beta", "z_ref")}


class SingleStreamMethod:
    """Shared single-stream behaviour: per-task tracker, SPEC-3 sampling, frozen v̂.

    Subclasses decide what a receipt adds to the tracker (:meth:`observe_receipt`) and
    what happens after an update."""

    def __init__(self, config, num_tasks: int, prior_alpha: np.ndarray, prior_beta: np.ndarray):
        self.config = config
        self.num_tasks = num_tasks
        self.per_task_limit = config.max_in_flight_per_task
        self.tracker = tracker.init(prior_alpha, prior_beta, z0=config.z0)

    @classmethod
    def check_config(cls, config) -> None:
        """Single stream accepts every orchestrator setting (m >= 1, any sibling rule)."""

    def held_count(self) -> int:
        return 0

    def baselines(self) -> np.ndarray:
        """v̂ of every task (SPEC 2), read once per dispatch round."""
        return np.asarray(_all_baselines(self.tracker))

    def plan_dispatch(self, next_key: NextKey, capacity: int, in_flight: np.ndarray) -> list[Launch]:
        m = self.per_task_limit
        count = int(min(capacity, np.maximum(m - in_flight, 0).sum()))
        if count <= 0:
            return []
        v_hat = self.baselines()  # read once: no result arrives in between
        chosen = sample_dispatch_tasks(next_key(), v_hat, in_flight, m, count, rule=self.config.sibling_rule,
                                       floor=self.config.sampler_floor, form=self.config.sampler_form)
        return [Launch(int(x), float(v_hat[int(x)])) for x in chosen]

    def observe_receipt(self, traj: Trajectory) -> None:
        """Evidence a usable receipt adds at once (SPO++); none by default."""

    def receive(self, stamp: DispatchStamp, traj: Trajectory | None, spoil: str | None) -> Receipt:
        if traj is None:
            return Receipt()
        self.observe_receipt(traj)
        return Receipt(ready=(traj,))

    def advantages(self, trajectories: Sequence[Trajectory]) -> np.ndarray:
        """A_i = R_i − v̂_i with v̂_i frozen at dispatch (SPEC 2)."""
        return baselines.frozen_baseline_advantages(trajectories)

    def learner_extras(self, trajectories: Sequence[Trajectory]) -> tuple[PreviousResponse | None, ...] | None:
        return None

    def after_update(self, trajectories: Sequence[Trajectory], output: LearnerOutput) -> None:
        return None

    def state_dict(self) -> dict:
        return {"tracker": tracker_arrays(self.tracker)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        arrays = tracker_arrays(state["tracker"])
        if arrays["alpha"].shape != (self.num_tasks,):
            raise ValueError(f"state tracker has {arrays['alpha'].shape[0]} tasks, expected {self.num_tasks}")
        self.tracker = tracker.TrackerState(**{k: jnp.asarray(v) for k, v in arrays.items()})
