"""SPO++ (SPEC 2-3): the event-time tracker, updated at receipt.

A usable result (x, z_i, R_i) enters ``spopp_jax.tracker.observe`` as soon as it is
received, so every later dispatch sees it; v̂ is frozen at dispatch and A_i = R_i − v̂_i.
Receipt-order invariant: ``observe`` is a sum of commuting terms (SPEC 2).

The recipe (``--method spopp``): the event-time tracker with retention ``tracker.rho``
(SPEC 2), the action-token whitening measure (SPEC 4) and dual clip c = 2 (SPEC 5).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal, Optional

import numpy as np

from rollout_bridge.methods.base import MethodConfig
from rollout_bridge.methods.single_stream import SingleStreamConfig, SingleStreamMethod
from rollout_bridge.trajectory import Trajectory


class SpoPlusPlus(SingleStreamMethod):
    """SPO++: evidence visible to later dispatches at once (event-time weights)."""

    def observe_receipt(self, traj: Trajectory) -> bool:
        """``spopp_jax.tracker.observe`` for one result, on the host in float32:
        z_new = max(z_ref, z_i), alpha' = e^{−(z_new − z_ref)}·alpha + e^{−(z_new − z_i)}·R_i,
        beta' likewise with 1 − R_i (SPEC 2 "Overflow": every exponent <= 0)."""
        x = traj.task_id
        if traj.reward not in (0.0, 1.0):
            raise ValueError(f"rewards must be 0 or 1, got {traj.reward!r} (task {x})")
        z, z_ref = np.float32(traj.z), self.z_ref[x]
        one = np.float32(1)
        if z >= z_ref:  # z_new = z: e^{−(z_new − z_i)} = 1 exactly
            z_new, keep, weight = z, np.exp(z_ref - z), one
        else:
            z_new, keep, weight = z_ref, one, np.exp(z - z_ref)
        reward = np.float32(traj.reward)
        self.alpha[x] = keep * self.alpha[x] + weight * reward
        self.beta[x] = keep * self.beta[x] + weight * (one - reward)
        self.z_ref[x] = z_new
        self.refresh(x)
        return True


@MethodConfig.register_subclass("spopp")
@dataclasses.dataclass
class SpoPlusPlusConfig(SingleStreamConfig):
    """SPO++ (SPEC 2-5): event-time tracker, action-token measure, dual clip 2."""

    measure: Literal["token", "trajectory"] = "token"
    dual_clip: Optional[float] = 2.0

    method_class: ClassVar = SpoPlusPlus
