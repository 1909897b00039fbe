"""The ``Trajectory`` record and its packing into the learner's ``TrainBatch`` arrays.

A trajectory is the full token stream of one episode (chat-templated prompt, sampled
replies, environment observations) with a per-token ``action_mask`` (1 exactly on tokens
the policy sampled) and the engine's log-probs aligned to those tokens. The dispatch
stamps (task, policy event, z, frozen v̂, SPEC 2) travel with it to the learner.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class DispatchStamp:
    """What the orchestrator fixed when it dispatched a request (SPEC 2-3).

    request_id: dispatch sequence number; policy_event: event k of the weights that will
    generate it; z: its coordinate z_k; frozen_baseline: v̂_q read at dispatch (NaN for
    GRPO, whose baseline is the group mean); group_id: GRPO group (-1 otherwise).
    """

    request_id: int
    task_id: int
    policy_event: int
    z: float
    frozen_baseline: float
    dispatch_time: float
    group_id: int = -1


def _frozen_array(values, dtype) -> np.ndarray:
    """A read-only 1-D NumPy copy of ``values`` (a trajectory never changes after it ends)."""
    array = np.array(values, dtype=dtype)
    if array.ndim != 1:
        array = array.reshape(-1)
    array.flags.writeable = False
    return array


@dataclasses.dataclass(frozen=True, eq=False)
class Trajectory:
    """One finished (or failed / aborted) episode.

    token_ids (int32), action_mask (bool), rollout_logp (float32) are read-only 1-D NumPy
    arrays of equal length (any sequence given is converted once; no per-token Python
    objects are kept: cheaper to hold, pack and checkpoint at 10k concurrent episodes);
    rollout_logp is 0 where action_mask is False. ``reward`` is the binary terminal reward
    R (0 for failures, truncations and aborts). Times are event-loop seconds;
    ``turn_latencies`` are the engine latencies of each turn and ``env_latencies`` those
    of reset + each step. ``turn_policy_events`` / ``turn_last_policy_events``: per turn,
    the policy event of its first / last sampled token (they differ only when an in-flight
    publish landed during the turn, SPEC 3 "Publishing without a drain"; empty last events
    mean "same as first"). Two trajectories are equal when every field is (the arrays
    element-wise); a trajectory is unhashable.
    """

    stamp: DispatchStamp
    token_ids: np.ndarray
    action_mask: np.ndarray
    rollout_logp: np.ndarray
    prompt_length: int
    reward: float
    finish_time: float
    turn_latencies: tuple[float, ...] = ()
    env_latencies: tuple[float, ...] = ()
    turn_policy_events: tuple[int, ...] = ()
    turn_last_policy_events: tuple[int, ...] = ()
    finish_reasons: tuple[str, ...] = ()
    truncated: bool = False
    failed: bool = False
    aborted: bool = False
    error: str | None = None

    def __post_init__(self):
        for name, dtype in (("token_ids", np.int32), ("action_mask", np.bool_), ("rollout_logp", np.float32)):
            value = getattr(self, name)
            if not (isinstance(value, np.ndarray) and value.dtype == dtype and not value.flags.writeable):
                object.__setattr__(self, name, _frozen_array(value, dtype))
        n = len(self.token_ids)
        if len(self.action_mask) != n or len(self.rollout_logp) != n:
            raise ValueError(
                f"token_ids, action_mask, rollout_logp must have equal length, got "
                f"{n}, {len(self.action_mask)}, {len(self.rollout_logp)}"
            )
        if n and self.action_mask[0]:
            raise ValueError("action_mask[0] must be False (position 0 is never an action)")

    def __eq__(self, other) -> bool:
        if not isinstance(other, Trajectory):
            return NotImplemented
        return all(
            np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
            for a, b in ((getattr(self, f.name), getattr(other, f.name)) for f in dataclasses.fields(self))
        )

    __hash__ = None

    # Convenience views of the stamp.
    @property
    def task_id(self) -> int:
        return self.stamp.task_id

    @property
    def policy_event(self) -> int:
        return self.stamp.policy_event

    @property
    def z(self) -> float:
        return self.stamp.z

    @property
    def frozen_baseline(self) -> float:
        return self.stamp.frozen_baseline

    @property
    def dispatch_time(self) -> float:
        return self.stamp.dispatch_time

    @property
    def event_span(self) -> tuple[int, int]:
        """(first, last) policy event among the trajectory's sampled tokens (SPEC 3: recorded
        per trajectory); (stamp event, stamp event) when no turn was generated."""
        if not self.turn_policy_events:
            return (self.stamp.policy_event, self.stamp.policy_event)
        last = self.turn_last_policy_events or self.turn_policy_events
        return (min(self.turn_policy_events), max(last))

    @property
    def num_action_tokens(self) -> int:
        """L_i of SPEC 4: tokens the policy generated."""
        return int(np.count_nonzero(self.action_mask))

    @property
    def num_turns(self) -> int:
        return len(self.turn_latencies)

    @property
    def usable(self) -> bool:
        """True when the trajectory is evidence for the tracker and a training sample."""
        return not (self.failed or self.aborted)


def pack_train_arrays(
    trajectories: Sequence[Trajectory],
    advantages: Sequence[float] | np.ndarray,
    pad_to_multiple: int = 1,
    pad_id: int = 0,
    max_length: int | None = None,
) -> dict[str, np.ndarray]:
    """Right-pad trajectories into the ``TrainBatch`` arrays of docs/DESIGN.md.

    Returns ``input_ids`` int32, ``attention_mask`` bool, ``action_mask`` bool,
    ``rollout_logp`` float32 (engine log-prob of token t, 0 off actions) and
    ``advantages`` float32 (trajectory i's whitened advantage on every token of row i;
    the loss only reads it under ``action_mask``), all ``[B, T]`` with
    ``T = ceil(max_len / pad_to_multiple) * pad_to_multiple`` (fewer shapes to compile).
    """
    if len(trajectories) == 0:
        raise ValueError("trajectories must be non-empty")
    advantages = np.asarray(advantages, dtype=np.float32)
    if advantages.shape != (len(trajectories),):
        raise ValueError(f"advantages must have shape ({len(trajectories)},), got {advantages.shape}")
    if not np.all(np.isfinite(advantages)):
        raise ValueError("advantages must be finite")
    if pad_to_multiple < 1:
        raise ValueError(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
    lengths = np.fromiter((len(t.token_ids) for t in trajectories), np.int64, len(trajectories))
    longest = int(lengths.max())
    if max_length is not None and longest > max_length:
        raise ValueError(f"a trajectory has {longest} tokens > max_length={max_length}")
    width = -(-max(longest, 1) // pad_to_multiple) * pad_to_multiple
    batch = len(trajectories)
    # row-major scatter of the concatenated streams: one NumPy call per array, no row loop
    attention_mask = np.arange(width)[None, :] < lengths[:, None]
    input_ids = np.full((batch, width), pad_id, dtype=np.int32)
    input_ids[attention_mask] = np.concatenate([t.token_ids for t in trajectories])
    action_mask = np.zeros((batch, width), dtype=bool)
    action_mask[attention_mask] = np.concatenate([t.action_mask for t in trajectories])
    rollout_logp = np.zeros((batch, width), dtype=np.float32)
    rollout_logp[attention_mask] = np.concatenate([t.rollout_logp for t in trajectories])
    rollout_logp[~action_mask] = 0.0  # the contract: 0 off actions, whatever a caller stored
    advantage_rows = np.broadcast_to(advantages[:, None], (batch, width)).astype(np.float32)
    return dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        action_mask=action_mask,
        rollout_logp=rollout_logp,
        advantages=np.where(attention_mask, advantage_rows, 0.0).astype(np.float32),
    )


def pack_train_batch(trajectories: Sequence[Trajectory], advantages, **kwargs):
    """:func:`pack_train_arrays` wrapped in ``spopp_jax.learner.TrainBatch``."""
    from spopp_jax.learner import TrainBatch  # the learner's contract type

    return TrainBatch(**pack_train_arrays(trajectories, advantages, **kwargs))
