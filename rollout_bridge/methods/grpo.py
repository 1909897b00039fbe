"""GRPO (SPEC 4 baselines): G rollouts of one task per group and a group barrier.

A group joins the ready buffer only when all G members are back, and whole: a group with
an aborted member (or a failed one when ``train_on_failed`` is False) is dropped whole,
since a shrunken group's mean is not the group mean (a one-member fragment has A = 0).
A_i = R_i − mean_{j in group(i)} R_j. See the orchestrator module docstring.

The recipe (``--method grpo``): groups of G = 8, then the same action-token whitening
(SPEC 4) and dual clip c = 2 (SPEC 5) as SPO++, so the two differ in the baseline only.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal, Mapping, Optional, Sequence

import jax
import numpy as np

from rollout_bridge import baselines
from rollout_bridge.methods.base import DroppedGroup, Launch, LearnerOutput, MethodConfig, NextKey, Receipt
from rollout_bridge.trajectory import DispatchStamp, Trajectory


@dataclasses.dataclass
class _Group:
    """A group in flight: ``resolved`` members came back (any outcome) of ``size``;
    ``members`` are the trainable ones; ``spoiled`` names why the group will be dropped."""

    task_id: int
    size: int
    members: list
    resolved: int = 0
    spoiled: str | None = None


class GroupMethod:
    """Groups of G rollouts of one task with a barrier; advantages from the group."""

    tracker = None  # no per-task evidence: tasks are drawn uniformly among idle ones

    def __init__(self, config, num_tasks: int, prior_alpha=None, prior_beta=None):
        self.config = config
        self.num_tasks = num_tasks
        self.group_size = config.group_size
        self.per_task_limit = config.group_size  # one group of G members per task
        self.groups: dict[int, _Group] = {}
        self.next_group = 0

    @classmethod
    def check_config(cls, config) -> None:
        if config.batch_size % config.group_size:
            raise ValueError(f"batch_size ({config.batch_size}) must be a multiple of group_size "
                             f"({config.group_size})")
        if config.max_in_flight < config.group_size:
            raise ValueError(f"max_in_flight must be >= group_size for {config.method.upper()}")
        if config.max_in_flight_per_task != 1:
            raise ValueError(f"max_in_flight_per_task must be 1 for {config.method.upper()} "
                             "(a group is its multi-request unit)")

    def held_count(self) -> int:
        return sum(len(g.members) for g in self.groups.values())

    def plan_dispatch(self, next_key: NextKey, capacity: int, in_flight: np.ndarray) -> list[Launch]:
        """Whole groups on idle tasks drawn uniformly without replacement."""
        idle = in_flight == 0
        count = int(min(capacity // self.group_size, idle.sum()))
        if count <= 0:
            return []
        chosen = np.asarray(jax.random.choice(next_key(), np.flatnonzero(idle), (count,), replace=False))
        launches = []
        for task_id in chosen:
            group_id, self.next_group = self.next_group, self.next_group + 1
            self.groups[group_id] = _Group(task_id=int(task_id), size=self.group_size, members=[])
            launches += [Launch(int(task_id), float("nan"), group_id)] * self.group_size
        return launches

    def receive(self, stamp: DispatchStamp, traj: Trajectory | None, spoil: str | None) -> Receipt:
        """Barrier: count one member as back (``traj`` trainable, or None with ``spoil``
        naming why not). When all G are back the group is ready whole, or dropped whole."""
        group = self.groups[stamp.group_id]
        group.resolved += 1
        if traj is not None:
            group.members.append(traj)
        if spoil is not None and group.spoiled is None:
            group.spoiled = spoil
        if group.resolved < group.size:
            return Receipt()
        del self.groups[stamp.group_id]
        if group.spoiled is None:
            return Receipt(ready=tuple(group.members))
        return Receipt(dropped=DroppedGroup(stamp.group_id, group.task_id, group.spoiled, tuple(group.members)))

    def advantages(self, trajectories: Sequence[Trajectory]) -> np.ndarray:
        """A_i = R_i − mean of R over i's group; whole groups by construction (checked)."""
        return baselines.group_relative_advantages(trajectories, self.group_size)

    def learner_extras(self, trajectories: Sequence[Trajectory]) -> None:
        return None

    def after_update(self, trajectories: Sequence[Trajectory], output: LearnerOutput) -> None:
        return None

    def state_dict(self) -> dict:
        """Groups still in flight are not saved: a checkpoint is taken after a drain."""
        return {"next_group": np.asarray(self.next_group, np.int64)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.next_group = int(state["next_group"])


@MethodConfig.register_subclass("grpo")
@dataclasses.dataclass
class GrpoConfig(MethodConfig):
    """GRPO (SPEC 4 baselines): groups of ``group_size`` G rollouts of one task, A = R − the
    group mean, action-token measure, dual clip 2."""

    measure: Literal["token", "trajectory"] = "token"
    dual_clip: Optional[float] = 2.0
    group_size: int = 8

    method_class: ClassVar = GroupMethod

    def __post_init__(self):
        super().__post_init__()
        if self.group_size < 1:
            raise ValueError(f"method.group_size must be >= 1, got {self.group_size!r}")

    def orchestrator_fields(self) -> dict:
        return {**super().orchestrator_fields(), "group_size": self.group_size}

    def check(self, cfg) -> None:
        """A batch is whole groups, a group is dispatched whole, and one group per task."""
        r, g = cfg.rollout, self.group_size
        if r.batch_size % g:
            raise ValueError(f"rollout.batch_size must be a multiple of method.group_size={g} for {self.name}, "
                             f"got {r.batch_size}")
        if r.max_in_flight < g:
            raise ValueError(f"rollout.max_in_flight must be >= method.group_size={g} for {self.name} (a group "
                             f"is dispatched whole), got {r.max_in_flight}")
        if r.max_in_flight_per_task != 1:
            raise ValueError(f"rollout.max_in_flight_per_task must be 1 for {self.name} (a group is its "
                             f"multi-request unit), got {r.max_in_flight_per_task}")
