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
    pack_width: int | None = None,
    row_multiple: int = 1,
) -> dict[str, np.ndarray]:
    """The ``TrainBatch`` arrays of docs/DESIGN.md: one right-padded row per trajectory, or
    several trajectories per row (``pack_width`` given).

    Returns ``input_ids`` int32, ``attention_mask`` bool, ``action_mask`` bool,
    ``rollout_logp`` float32 (engine log-prob of token t, 0 off actions) and
    ``advantages`` float32 (a trajectory's whitened advantage on every one of its tokens;
    the loss only reads it under ``action_mask``), all ``[B, T]`` with
    ``T = ceil(max_len / pad_to_multiple) * pad_to_multiple`` (fewer shapes to compile).

    Packed (``pack_width``, a multiple of ``pad_to_multiple``): the layout of
    `packed_layout` ([R, W], R a multiple of ``row_multiple``, the least padded area R·W
    for any width up to ``pack_width``), plus ``segment_ids`` int32 [R, W]: trajectory i's
    tokens carry i + 1 (0 = padding), so attention, positions and log-probs stay within
    each trajectory (`spopp_jax.learner.TrainBatch`). Rows past the last trajectory are
    all padding. Every token keeps its value; only its place changes, so the token-mean
    loss over all action tokens is the same sum (`unpack_rows` reads values back per
    trajectory).
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
    if pack_width is None:
        width = -(-max(longest, 1) // pad_to_multiple) * pad_to_multiple
        rows, starts, num_rows = np.arange(len(trajectories)), np.zeros_like(lengths), len(trajectories)
    else:
        if any(t.action_mask[0] for t in trajectories if len(t.token_ids)):
            raise ValueError("a packed trajectory cannot start with an action token (its log-prob "
                             "would be read from the previous trajectory's last token)")
        rows, starts, num_rows, width = packed_layout(lengths, pack_width, pad_to_multiple, row_multiple)
    # flat index of every token in the [num_rows, width] arrays, trajectory by trajectory
    flat = np.concatenate([np.arange(n) + row * width + start
                           for n, row, start in zip(lengths, rows, starts)]).astype(np.int64)

    def scatter(values, dtype, fill=0):
        out = np.full(num_rows * width, fill, dtype=dtype)
        out[flat] = values
        return out.reshape(num_rows, width)

    attention_mask = scatter(True, bool, False)
    action_mask = scatter(np.concatenate([t.action_mask for t in trajectories]), bool, False)
    rollout_logp = scatter(np.concatenate([t.rollout_logp for t in trajectories]), np.float32)
    rollout_logp[~action_mask] = 0.0  # the contract: 0 off actions, whatever a caller stored
    arrays = dict(
        input_ids=scatter(np.concatenate([t.token_ids for t in trajectories]), np.int32, pad_id),
        attention_mask=attention_mask,
        action_mask=action_mask,
        rollout_logp=rollout_logp,
        advantages=scatter(np.repeat(advantages, lengths), np.float32),
    )
    if pack_width is not None:
        arrays["segment_ids"] = scatter(np.repeat(np.arange(1, len(lengths) + 1), lengths), np.int32)
    return arrays


def first_fit_rows(lengths: Sequence[int], width: int) -> tuple[np.ndarray, np.ndarray, int]:
    """First-fit decreasing bin packing of sequences into rows of ``width`` tokens:
    (row [n], start [n], number of rows). The longest goes first (ties by index), each into
    the first row with room left; deterministic. Raises ValueError if one is longer than
    ``width``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and int(lengths.max()) > width:
        raise ValueError(f"a sequence of {int(lengths.max())} tokens does not fit a row of {width}")
    rows = np.zeros(len(lengths), np.int64)
    starts = np.zeros(len(lengths), np.int64)
    used: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        row = next((r for r, filled in enumerate(used) if filled + lengths[i] <= width), len(used))
        if row == len(used):
            used.append(0)
        rows[i], starts[i] = row, used[row]
        used[row] += int(lengths[i])
    return rows, starts, len(used)


def packed_layout(lengths: Sequence[int], pack_width: int, pad_to_multiple: int = 1,
                  row_multiple: int = 1) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(row [n], start [n], rows R, width W) of the packed batch: for every width W from
    the longest sequence rounded up to ``pad_to_multiple`` up to ``pack_width`` (in steps
    of ``pad_to_multiple``), `first_fit_rows` into rows of W, rows rounded up to a
    multiple of ``row_multiple`` (the learner's mini- x micro-batches); the (R, W) of
    least padded area R·W wins, the narrower on a tie (less attention work per row: the
    per-row attention grows as W², the rest as W). The narrowest W with one sequence per
    row is the unpacked layout, so the area never exceeds it (when ``row_multiple``
    divides n)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if pack_width < 1 or pad_to_multiple < 1 or row_multiple < 1 or pack_width % pad_to_multiple:
        raise ValueError(f"pack_width ({pack_width}) must be a positive multiple of pad_to_multiple "
                         f"({pad_to_multiple}); row_multiple ({row_multiple}) >= 1")
    narrowest = -(-max(int(lengths.max()), 1) // pad_to_multiple) * pad_to_multiple
    if narrowest > pack_width:
        raise ValueError(f"a trajectory of {int(lengths.max())} tokens does not fit "
                         f"pack_width={pack_width}")
    best = None
    for width in range(narrowest, pack_width + 1, pad_to_multiple):
        rows, starts, used = first_fit_rows(lengths, width)
        num_rows = -(-used // row_multiple) * row_multiple
        if best is None or num_rows * width < best[2] * best[3]:
            best = (rows, starts, num_rows, width)
    return best


def unpack_rows(values: np.ndarray, segment_ids: np.ndarray, count: int | None = None,
                width: int | None = None) -> np.ndarray:
    """Per-token ``values`` [R, W] of a packed batch back to one right-padded row per
    trajectory, [count, width] (row i = the tokens whose ``segment_ids`` is i + 1, in
    order; 0 after them); ``count`` defaults to the largest id, ``width`` to the longest
    trajectory."""
    values, segment_ids = np.asarray(values), np.asarray(segment_ids)
    if values.shape != segment_ids.shape:
        raise ValueError(f"values {values.shape} and segment_ids {segment_ids.shape} differ")
    flat_ids, flat_values = segment_ids.reshape(-1), values.reshape(-1)
    count = int(flat_ids.max(initial=0)) if count is None else count
    if flat_ids.min(initial=0) < 0 or flat_ids.max(initial=0) > count:
        raise ValueError(f"segment_ids must lie in [0, {count}]")
    lengths = np.bincount(flat_ids, minlength=count + 1)[1:]
    width = int(lengths.max(initial=0)) if width is None else width
    out = np.zeros((count, width), values.dtype)
    order = np.argsort(flat_ids, kind="stable")[int((flat_ids == 0).sum()):]  # real tokens, by trajectory
    offsets = np.arange(order.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    out[np.repeat(np.arange(count), lengths), offsets] = flat_values[order]
    return out


def pack_train_batch(trajectories: Sequence[Trajectory], advantages, **kwargs):
    """:func:`pack_train_arrays` wrapped in ``spopp_jax.learner.TrainBatch``."""
    from spopp_jax.learner import TrainBatch  # the learner's contract type

    return TrainBatch(**pack_train_arrays(trajectories, advantages, **kwargs))
