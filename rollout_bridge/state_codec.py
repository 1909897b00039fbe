"""Host state as checkpointable arrays: ragged sequences and ``Trajectory`` records.

Orbax refuses zero-size arrays, so every array written here has at least one element:
a ragged list of n rows is ``{"flat": rows concatenated + 1 pad element, "offsets":
[n + 1] int64}`` (row i is ``flat[offsets[i]:offsets[i+1]]``); a per-item vector of n
items is stored with one pad entry and its length is the ragged offsets' n.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from rollout_bridge.trajectory import DispatchStamp, Trajectory

_TEXT_SEPARATOR = "\x1f"  # joins the finish reasons of one trajectory (never in a reason)


def nonempty(values: np.ndarray) -> np.ndarray:
    """``values`` with one zero pad entry appended along axis 0 (orbax: no empty arrays)."""
    values = np.asarray(values)
    return np.concatenate([values, np.zeros((1,) + values.shape[1:], values.dtype)])


def encode_ragged(rows: Sequence[Any], dtype) -> dict[str, np.ndarray]:
    """Rows of different lengths -> {"flat", "offsets"} (see the module docstring)."""
    arrays = [np.asarray(r, dtype).reshape(-1) for r in rows]
    offsets = np.zeros(len(arrays) + 1, np.int64)
    np.cumsum([a.size for a in arrays], out=offsets[1:])
    flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype)
    return {"flat": nonempty(flat.astype(dtype)), "offsets": offsets}


def decode_ragged(encoded: Mapping[str, Any]) -> list[np.ndarray]:
    flat, offsets = np.asarray(encoded["flat"]), np.asarray(encoded["offsets"])
    return [flat[offsets[i]:offsets[i + 1]] for i in range(offsets.size - 1)]


def _encode_text(texts: Sequence[str]) -> dict[str, np.ndarray]:
    return encode_ragged([np.frombuffer(t.encode("utf-8"), np.uint8) for t in texts], np.uint8)


def _decode_text(encoded: Mapping[str, Any]) -> list[str]:
    return [bytes(row.astype(np.uint8)).decode("utf-8") for row in decode_ragged(encoded)]


_STAMP_INT = ("request_id", "task_id", "policy_event", "group_id")
_STAMP_FLOAT = ("z", "frozen_baseline", "dispatch_time")
_FLAGS = ("truncated", "failed", "aborted")


def encode_trajectories(trajectories: Sequence[Trajectory]) -> dict[str, Any]:
    """Every field of each trajectory (stamp included) as arrays; exact round trip with
    :func:`decode_trajectories` (floats are stored as float64)."""
    ts = list(trajectories)
    column = lambda get, dtype: nonempty(np.asarray([get(t) for t in ts], dtype))
    return {
        "stamp_int": {k: column(lambda t, k=k: getattr(t.stamp, k), np.int64) for k in _STAMP_INT},
        "stamp_float": {k: column(lambda t, k=k: getattr(t.stamp, k), np.float64) for k in _STAMP_FLOAT},
        "token_ids": encode_ragged([t.token_ids for t in ts], np.int64),
        "action_mask": encode_ragged([t.action_mask for t in ts], bool),
        "rollout_logp": encode_ragged([t.rollout_logp for t in ts], np.float64),
        "turn_latencies": encode_ragged([t.turn_latencies for t in ts], np.float64),
        "env_latencies": encode_ragged([t.env_latencies for t in ts], np.float64),
        "turn_policy_events": encode_ragged([t.turn_policy_events for t in ts], np.int64),
        "turn_last_policy_events": encode_ragged([t.turn_last_policy_events for t in ts], np.int64),
        "finish_reasons": _encode_text([_TEXT_SEPARATOR.join(t.finish_reasons) for t in ts]),
        "error": _encode_text([t.error or "" for t in ts]),
        "has_error": column(lambda t: t.error is not None, bool),
        "prompt_length": column(lambda t: t.prompt_length, np.int64),
        "reward": column(lambda t: t.reward, np.float64),
        "finish_time": column(lambda t: t.finish_time, np.float64),
        "flags": {k: column(lambda t, k=k: getattr(t, k), bool) for k in _FLAGS},
    }


def decode_trajectories(encoded: Mapping[str, Any]) -> list[Trajectory]:
    token_ids = decode_ragged(encoded["token_ids"])
    n = len(token_ids)
    masks, logps = decode_ragged(encoded["action_mask"]), decode_ragged(encoded["rollout_logp"])
    turns, envs = decode_ragged(encoded["turn_latencies"]), decode_ragged(encoded["env_latencies"])
    events, reasons = decode_ragged(encoded["turn_policy_events"]), _decode_text(encoded["finish_reasons"])
    errors = _decode_text(encoded["error"])
    # checkpoints written before in-flight publishing have no last events ("same as first")
    last_events = (decode_ragged(encoded["turn_last_policy_events"]) if "turn_last_policy_events" in encoded
                   else [()] * n)
    out = []
    for i in range(n):
        stamp = DispatchStamp(
            **{k: int(encoded["stamp_int"][k][i]) for k in _STAMP_INT},
            **{k: float(encoded["stamp_float"][k][i]) for k in _STAMP_FLOAT})
        out.append(Trajectory(
            stamp=stamp, token_ids=token_ids[i], action_mask=masks[i], rollout_logp=logps[i],  # -> arrays
            prompt_length=int(encoded["prompt_length"][i]), reward=float(encoded["reward"][i]),
            finish_time=float(encoded["finish_time"][i]),
            turn_latencies=tuple(np.asarray(turns[i], np.float64).tolist()),
            env_latencies=tuple(np.asarray(envs[i], np.float64).tolist()),
            turn_policy_events=tuple(np.asarray(events[i], np.int64).tolist()),
            turn_last_policy_events=tuple(np.asarray(last_events[i], np.int64).tolist()),
            finish_reasons=tuple(reasons[i].split(_TEXT_SEPARATOR)) if reasons[i] else (),
            error=errors[i] if bool(encoded["has_error"][i]) else None,
            **{k: bool(encoded["flags"][k][i]) for k in _FLAGS}))
    return out
