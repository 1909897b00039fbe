"""The tracker x measure 2x2 (SPEC 7 open question): which of SPO++'s two changes to SPO,
the event-time tracker (SPEC 2) or the action-token measure (SPEC 4), carries the gain.

The retention is FIXED at 0.875 in every cell (the receipt-order cells hold SPO's clip at
rho_min = rho_max = 0.875, so no divergence is computed) and the dual clip at c = 2, so the
cells differ in the tracker and the measure only. The event-time x token cell is ``spopp``.

    event_trajectory     SPO++'s event-time tracker, trajectory measure
    receipt_token        SPO's receipt-order tracker (rho 0.875), action-token measure
    receipt_trajectory   SPO's receipt-order tracker (rho 0.875), trajectory measure
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from rollout_bridge.methods.base import MethodConfig
from rollout_bridge.methods.spo import SpoConfig
from rollout_bridge.methods.spopp import SpoPlusPlusConfig

FIXED_RHO = 0.875   # tracker.rho of the event-time cells


@MethodConfig.register_subclass("event_trajectory")
@dataclasses.dataclass
class EventTrajectoryConfig(SpoPlusPlusConfig):
    """Event-time tracker x trajectory measure, dual clip 2."""

    measure: Literal["token", "trajectory"] = "trajectory"
    dual_clip: Optional[float] = 2.0


@MethodConfig.register_subclass("receipt_token")
@dataclasses.dataclass
class ReceiptTokenConfig(SpoConfig):
    """Receipt-order tracker with a fixed retention x action-token measure, dual clip 2."""

    measure: Literal["token", "trajectory"] = "token"
    dual_clip: Optional[float] = 2.0
    rho_min: float = FIXED_RHO
    rho_max: float = FIXED_RHO


@MethodConfig.register_subclass("receipt_trajectory")
@dataclasses.dataclass
class ReceiptTrajectoryConfig(SpoConfig):
    """Receipt-order tracker with a fixed retention x trajectory measure, dual clip 2."""

    measure: Literal["token", "trajectory"] = "trajectory"
    dual_clip: Optional[float] = 2.0
    rho_min: float = FIXED_RHO
    rho_max: float = FIXED_RHO
