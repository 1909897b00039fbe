"""The original SPO (SPEC 2 "Baseline"): a receipt-order tracker with KL-adaptive retention.

After the actor update, in arrival order: α ← ρ_i α + R_i, β ← ρ_i β + (1 − R_i) with
ρ_i = clip(2^{−D_i/D_half}, ρ_min, ρ_max) and D_i = token-mean |log π_then − log π_now| over
y′, the task's previous consumed response. As the SPO authors wrote it, BOTH log-probs are
the learner's: π_then recorded when y′ was trained on (the learner's log-probs of its batch
at that update's starting parameters, ``LearnerOutput.trained_logp``), π_now after the
current update. The engine's rollout log-probs never enter D (an engine-vs-learner
mismatch, large with a bf16 vLLM pool, would otherwise drag ρ toward ρ_min).

With a fixed retention (``spo_rho_min == spo_rho_max``, the tracker x measure 2x2's
receipt-order cells) ρ does not depend on D, so no y′ is kept and the learner runs neither
the π_then forward nor the y′ forward: those cells then differ from the event-time ones in
the tracker only, not in learner time (which sets the async timing the 2x2 studies).

State (``state_dict``): the tracker and, per task, y′ with its π_then.

The recipe (``--method spo``, the SPO paper's): retention clip(2^{−D/d_half}, rho_min,
rho_max) with d_half 0.06, rho in [0.875, 0.96] (SPEC 2 "Baseline"), the trajectory
whitening measure (SPEC 4) and dual clip c = 10 (SPEC 5).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Literal, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rollout_bridge import baselines, state_codec
from rollout_bridge.methods.base import LearnerOutput, MethodConfig, PreviousResponse
from rollout_bridge.methods.single_stream import SingleStreamConfig, SingleStreamMethod
from rollout_bridge.trajectory import Trajectory
from spopp_jax import tracker


# Jitted once per batch size: an eager ``lax.scan`` would be traced and compiled on every
# update (seconds of CPU and a growing compile cache over a long run).
_spo_observe = jax.jit(tracker.spo_observe)
_spo_retention = jax.jit(tracker.spo_retention, static_argnames=("d_half", "rho_min", "rho_max"))


class Spo(SingleStreamMethod):
    """SPO: the tracker moves only after the update, by D from the learner."""

    def __init__(self, config, num_tasks: int, prior_alpha, prior_beta):
        super().__init__(config, num_tasks, prior_alpha, prior_beta)
        self.previous: dict[int, PreviousResponse] = {}

    @property
    def needs_divergence(self) -> bool:
        """D moves ρ only when the retention clip is an interval."""
        return self.config.spo_rho_min < self.config.spo_rho_max

    def learner_extras(self, trajectories: Sequence[Trajectory]) -> tuple[PreviousResponse | None, ...] | None:
        """y′ of each trajectory: the task's previous consumed response (an earlier row of
        this batch when the task repeats in it), None on a first visit; None for the whole
        batch when the retention is fixed (no D needed)."""
        if not self.needs_divergence:
            return None
        latest: dict[int, PreviousResponse] = dict(self.previous)
        out = []
        for row, traj in enumerate(trajectories):
            out.append(latest.get(traj.task_id))
            latest[traj.task_id] = PreviousResponse(traj.task_id, np.asarray(traj.token_ids, np.int32),
                                                    np.asarray(traj.action_mask, bool), None, batch_row=row)
        return tuple(out)

    def after_update(self, trajectories: Sequence[Trajectory], output: LearnerOutput) -> None:
        """SPO receipt-order tracker, applied after the actor update in arrival order; then
        each trajectory becomes its task's y′ with π_then = the learner's log-probs."""
        if not self.needs_divergence:  # ρ = spo_rho_min whatever D: no y′ to keep
            rho = jnp.full(len(trajectories), self.config.spo_rho_min, jnp.float32)
            self._observe(trajectories, rho)
            return
        if output.trained_logp is None:
            raise ValueError("method 'spo' needs LearnerOutput.trained_logp (the learner's log-probs of the "
                             "batch at the update's starting parameters: π_then of the next visit)")
        trained_logp = np.asarray(output.trained_logp, np.float32)
        if trained_logp.ndim != 2 or trained_logp.shape[0] != len(trajectories):
            raise ValueError(f"LearnerOutput.trained_logp must be [{len(trajectories)}, T], got {trained_logp.shape}")
        divergence = baselines.spo_divergences(len(trajectories), output.divergence)
        rho = _spo_retention(jnp.asarray(divergence), d_half=self.config.spo_d_half,
                             rho_min=self.config.spo_rho_min, rho_max=self.config.spo_rho_max)
        self._observe(trajectories, rho)
        for row, traj in enumerate(trajectories):
            n = len(traj.token_ids)
            mask = np.asarray(traj.action_mask, bool)
            self.previous[traj.task_id] = PreviousResponse(
                traj.task_id, np.asarray(traj.token_ids, np.int32), mask,
                np.where(mask, trained_logp[row, :n], 0.0).astype(np.float32))

    def _observe(self, trajectories: Sequence[Trajectory], rho) -> None:
        """The receipt-order tracker update in arrival order with retentions ``rho``."""
        tasks = np.array([t.task_id for t in trajectories])
        updated = _spo_observe(self.tracker, tasks, np.array([t.reward for t in trajectories], np.float32), rho)
        self._set_tracker({k: np.asarray(getattr(updated, k)) for k in ("alpha", "beta", "z_ref")})
        self.refresh(np.unique(tasks))

    def state_dict(self) -> dict:
        tasks = sorted(self.previous)
        responses = [self.previous[x] for x in tasks]
        return {
            **super().state_dict(),
            "previous": {
                "task_ids": state_codec.nonempty(np.asarray(tasks, np.int64)),
                "token_ids": state_codec.encode_ragged([r.token_ids for r in responses], np.int32),
                "action_mask": state_codec.encode_ragged([r.action_mask for r in responses], bool),
                "logp_then": state_codec.encode_ragged([r.logp_then for r in responses], np.float32),
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        saved = state["previous"]
        token_ids = state_codec.decode_ragged(saved["token_ids"])
        tasks = np.asarray(saved["task_ids"])[:len(token_ids)]
        masks = state_codec.decode_ragged(saved["action_mask"])
        logps = state_codec.decode_ragged(saved["logp_then"])
        self.previous = {int(x): PreviousResponse(int(x), ids, mask.astype(bool), logp)
                         for x, ids, mask, logp in zip(tasks, token_ids, masks, logps)}


@MethodConfig.register_subclass("spo")
@dataclasses.dataclass
class SpoConfig(SingleStreamConfig):
    """SPO (SPEC 2 "Baseline", SPEC 4-5): receipt-order tracker with KL-adaptive retention
    clip(2^{−D/d_half}, rho_min, rho_max), trajectory measure, dual clip 10. With
    ``rho_min == rho_max`` the retention is fixed and no divergence D is computed."""

    measure: Literal["token", "trajectory"] = "trajectory"
    dual_clip: Optional[float] = 10.0
    d_half: float = 0.06
    rho_min: float = 0.875
    rho_max: float = 0.96

    method_class: ClassVar = Spo

    def __post_init__(self):
        super().__post_init__()
        if not (math.isfinite(self.d_half) and self.d_half > 0):
            raise ValueError(f"method.d_half must be finite and > 0, got {self.d_half!r}")
        if not 0.0 < self.rho_min <= self.rho_max < 1.0:
            raise ValueError(f"method.rho_min must be in (0, method.rho_max] with rho_max < 1, got "
                             f"{self.rho_min!r} (rho_max {self.rho_max!r})")

    def orchestrator_fields(self) -> dict:
        return {**super().orchestrator_fields(), "spo_d_half": self.d_half, "spo_rho_min": self.rho_min,
                "spo_rho_max": self.rho_max}
