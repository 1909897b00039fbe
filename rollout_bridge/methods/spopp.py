"""SPO++ (SPEC 2-3): the event-time tracker, updated at receipt.

A usable result (x, z_i, R_i) enters ``spopp_jax.tracker.observe`` as soon as it is
received, so every later dispatch sees it; v̂ is frozen at dispatch and A_i = R_i − v̂_i.
Receipt-order invariant: ``observe`` is a sum of commuting terms (SPEC 2).
"""

from __future__ import annotations

import jax
import numpy as np

from rollout_bridge.methods.single_stream import SingleStreamMethod
from rollout_bridge.trajectory import Trajectory
from spopp_jax import tracker

_observe = jax.jit(tracker.observe)


class SpoPlusPlus(SingleStreamMethod):
    """SPO++: evidence visible to later dispatches at once (event-time weights)."""

    def observe_receipt(self, traj: Trajectory) -> None:
        self.tracker = _observe(self.tracker, np.array([traj.task_id], np.int32),
                                np.array([traj.z], np.float32), np.array([traj.reward], np.float32))
