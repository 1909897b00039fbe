"""RLOO (REINFORCE leave-one-out; Kool et al. 2019, Ahmadian et al. 2024): GRPO's groups
and barrier with a leave-one-out baseline, written as the proof that a method is one file.

    A_i = R_i − (1/(G−1)) Σ_{j in group(i), j≠i} R_j = G/(G−1) · (R_i − mean_group R)

then the same SPEC-4 whitening as every method. Requires G >= 2. The recipe is GRPO's
(G = 8, action-token measure, dual clip 2) with this baseline.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Sequence

import numpy as np

from rollout_bridge import baselines
from rollout_bridge.methods.base import MethodConfig
from rollout_bridge.methods.grpo import GroupMethod, GrpoConfig
from rollout_bridge.trajectory import Trajectory


def leave_one_out_advantages(trajectories: Sequence[Trajectory], group_size: int) -> np.ndarray:
    """A_i = G/(G−1)·(R_i − group mean) = R_i − mean of the OTHER members' rewards. float32 [n]."""
    centred = baselines.group_relative_advantages(trajectories, group_size).astype(np.float64)
    return (centred * group_size / (group_size - 1)).astype(np.float32)


class Rloo(GroupMethod):
    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        if config.group_size < 2:
            raise ValueError(f"group_size must be >= 2 for rloo (a leave-one-out mean), got {config.group_size}")

    def advantages(self, trajectories: Sequence[Trajectory]) -> np.ndarray:
        return leave_one_out_advantages(trajectories, self.group_size)


@MethodConfig.register_subclass("rloo")
@dataclasses.dataclass
class RlooConfig(GrpoConfig):
    """RLOO: GRPO's recipe and groups, the leave-one-out baseline (G >= 2)."""

    method_class: ClassVar = Rloo

    def __post_init__(self):
        super().__post_init__()
        if self.group_size < 2:
            raise ValueError(f"method.group_size must be >= 2 for rloo (a leave-one-out mean), got "
                             f"{self.group_size!r}")
