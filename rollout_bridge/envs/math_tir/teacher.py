"""Teacher trajectories for the cold start: JSONL in, checked, filtered, split by prompt.

A record (one JSONL line):
    {"key": "<prompt id>", "ground_truth": "34",
     "messages": [{"role": "user", "content": ...},
                  {"role": "assistant", "content": "<tool_call>...</tool_call>"},
                  {"role": "tool", "content": "<the tool's output>"},
                  ...,
                  {"role": "assistant", "content": "... \\boxed{34}"}]}
An assistant message may carry its call as OpenAI/Qwen ``tool_calls``
(``[{"function": {"name": "python", "arguments": {"code": ...}}}]``) instead of text; it is
rendered into the text block of ``tool_format``.

Structurally valid = one user message first; then (assistant with exactly one parseable
tool call, tool message) pairs, at most ``max_tool_calls`` of them; then one final
assistant message with no tool call. Filter (``python -m rollout_bridge.envs.math_tir.teacher
filter``): keep the valid, verifier-positive records, then split the PROMPTS (keys) into
train / held-out with a seeded permutation (a prompt's samples never straddle the split).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from rollout_bridge.envs.math_tir.tool_format import ToolFormat, parse_call, render_call, render_response
from rollout_bridge.atomic_files import write_text_atomic

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class FilterReport:
    read: int
    invalid: int
    verifier_negative: int
    train: int
    held_out: int
    train_prompts: int
    held_out_prompts: int


def read_jsonl(path: str | Path) -> list[dict]:
    """Records of a JSONL file (blank lines skipped); a bad line names file and line."""
    records = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path} line {number}: not JSON ({exc.msg})") from None
    return records


def write_jsonl(path: str | Path, records: Sequence[dict]) -> None:
    """One JSON record a line (UTF-8), written whole or not at all by `write_text_atomic`."""
    write_text_atomic(path, "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records))


def assistant_text(message: dict, tool_format: ToolFormat) -> str:
    """The assistant message as the policy would type it (a ``tool_calls`` entry rendered)."""
    content = message.get("content") or ""
    calls = message.get("tool_calls") or []
    for call in calls:
        function = call.get("function", call)
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
        content += ("\n" if content else "") + render_call(arguments.get("code", ""), tool_format)
    return content


def structure_error(record: dict, tool_format: ToolFormat, max_tool_calls: int) -> str | None:
    """Why ``record`` is not a valid teacher trajectory (None if it is)."""
    messages = record.get("messages")
    if not isinstance(messages, list) or len(messages) < 2:
        return "messages must be a list of at least 2 messages"
    if not isinstance(record.get("ground_truth"), str) or "key" not in record:
        return "record needs 'key' and a string 'ground_truth'"
    roles = [m.get("role") for m in messages]
    if roles[0] != "user" or roles[-1] != "assistant":
        return "must start with a user message and end with an assistant message"
    middle = roles[1:-1]
    if middle != ["assistant", "tool"] * (len(middle) // 2):
        return f"after the user message, roles must alternate assistant/tool, got {roles}"
    if len(middle) // 2 > max_tool_calls:
        return f"{len(middle) // 2} tool calls > max_turns={max_tool_calls}"
    for message in messages[1:-1:2]:
        call = parse_call(assistant_text(message, tool_format), tool_format)
        if call is None or call.error:
            return "a non-final assistant message has no well-formed tool call"
    if parse_call(assistant_text(messages[-1], tool_format), tool_format) is not None:
        return "the final assistant message contains a tool call"
    return None


def demonstration_pairs(record: dict, tool_format: ToolFormat) -> list[tuple[str, str]]:
    """(observation, reply) turns as the agent loop sees them: the user prompt, then each
    tool output as a ``<tool_response>`` observation."""
    messages = record["messages"]
    observations = [messages[0]["content"]] + [render_response(m["content"]) for m in messages[2:-1:2]]
    replies = [assistant_text(m, tool_format) for m in messages[1::2]]
    return list(zip(observations, replies))


def split_keys(keys: Sequence[str], held_out_fraction: float, seed: int) -> tuple[set, set]:
    """Seeded split of the distinct keys; at least one train key when any exist."""
    distinct = sorted(set(keys))
    order = np.random.default_rng(seed).permutation(len(distinct))
    n_held = min(int(round(held_out_fraction * len(distinct))), max(len(distinct) - 1, 0))
    held = {distinct[i] for i in order[:n_held]}
    return set(distinct) - held, held


def filter_teacher(records: Sequence[dict], score: Callable[[str, str], float], tool_format: ToolFormat,
                   max_tool_calls: int, held_out_fraction: float, seed: int):
    """(train records, held-out records, FilterReport)."""
    invalid = negative = 0
    kept = []
    for record in records:
        why = structure_error(record, tool_format, max_tool_calls)
        if why is not None:
            invalid += 1
            logger.info("teacher record %s dropped: %s", record.get("key"), why)
            continue
        if score(record["ground_truth"], assistant_text(record["messages"][-1], tool_format)) != 1.0:
            negative += 1
            continue
        kept.append(record)
    train_keys, held_keys = split_keys([r["key"] for r in kept], held_out_fraction, seed)
    train = [r for r in kept if r["key"] in train_keys]
    held = [r for r in kept if r["key"] in held_keys]
    report = FilterReport(len(records), invalid, negative, len(train), len(held),
                          len(train_keys), len(held_keys))
    return train, held, report


def main(argv: Sequence[str] | None = None) -> FilterReport:
    parser = argparse.ArgumentParser(description="Keep valid, verifier-positive teacher "
                                     "trajectories; split train/held-out by prompt.")
    parser.add_argument("command", choices=["filter"])
    parser.add_argument("--input", required=True, help="teacher JSONL")
    parser.add_argument("--out_dir", required=True, help="writes train.jsonl, held_out.jsonl")
    parser.add_argument("--tool_format", default="qwen", choices=["qwen", "plain"])
    parser.add_argument("--max_turns", type=int, default=8)
    parser.add_argument("--held_out_fraction", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from rollout_bridge.envs.math_tir.verifier import MathVerifier

    with MathVerifier() as verifier:
        train, held, report = filter_teacher(read_jsonl(args.input), verifier.score, args.tool_format,
                                             args.max_turns, args.held_out_fraction, args.seed)
    write_jsonl(Path(args.out_dir) / "train.jsonl", train)
    write_jsonl(Path(args.out_dir) / "held_out.jsonl", held)
    print(json.dumps(dataclasses.asdict(report)))
    return report


if __name__ == "__main__":
    main()
