"""The Python tool call in the model's chat format.

Two formats (``tool_format``):
  * ``qwen``: the Qwen2.5/Qwen3 (Hermes) tool-call block the Qwen chat template renders,
        <tool_call>
        {"name": "python", "arguments": {"code": "print(2 + 2)"}}
        </tool_call>
  * ``plain``: the same tags around the bare code (what a tiny byte-level model can learn),
        <tool_call>
        print(2 + 2)
        </tool_call>
The tool's output comes back as the next user turn
        <tool_response>
        4
        </tool_response>
which is exactly what the Qwen template renders for a ``{"role": "tool"}`` message, so the
agent loop's observation turn (never action tokens) matches the model's native format.
A reply without a ``<tool_call>`` block is the final answer.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Literal

TOOL_NAME = "python"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
ToolFormat = Literal["qwen", "plain"]

# The JSON schema passed to the Qwen chat template as ``tools=[PYTHON_TOOL_SCHEMA]``.
PYTHON_TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Run Python 3 code in a sandbox (no network, no files kept) and return "
                       "what it prints. Use print() to see results.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                       "required": ["code"]},
    },
}


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A parsed call: ``code`` to run, or ``error`` saying why the block is malformed."""

    code: str | None
    error: str | None = None


def check_format(tool_format: str) -> str:
    if tool_format not in ("qwen", "plain"):
        raise ValueError(f"math_tir.tool_format must be 'qwen' or 'plain', got {tool_format!r}")
    return tool_format


def render_call(code: str, tool_format: ToolFormat) -> str:
    """The assistant text of a call to the Python tool with ``code``."""
    if check_format(tool_format) == "qwen":
        body = json.dumps({"name": TOOL_NAME, "arguments": {"code": code}}, ensure_ascii=False)
    else:
        body = code
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


def render_response(output: str) -> str:
    """The observation (user-turn content) carrying the tool's output."""
    return f"{RESPONSE_OPEN}\n{output}\n{RESPONSE_CLOSE}"


def parse_call(reply: str, tool_format: ToolFormat) -> ToolCall | None:
    """The first tool call in ``reply``; None when the reply has no ``<tool_call>`` (a final
    answer). A block without its closing tag, bad JSON or a wrong tool name is a call with
    an ``error`` (the model is told, and the call counts against the turn budget)."""
    start = reply.find(CALL_OPEN)
    if start < 0:
        return None
    end = reply.find(CALL_CLOSE, start)
    if end < 0:
        return ToolCall(None, f"missing {CALL_CLOSE}")
    body = reply[start + len(CALL_OPEN):end].strip("\n")
    if check_format(tool_format) == "plain":
        return ToolCall(body)
    return _parse_json_call(body)


def _parse_json_call(body: str) -> ToolCall:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCall(None, f"tool call is not valid JSON: {exc.msg}")
    if not isinstance(call, dict) or call.get("name") != TOOL_NAME:
        return ToolCall(None, f"unknown tool: only {TOOL_NAME!r} is available")
    arguments = call.get("arguments")
    if isinstance(arguments, str):  # some models emit the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = None
    if not isinstance(arguments, dict) or not isinstance(arguments.get("code"), str):
        return ToolCall(None, "tool call needs arguments.code (a string)")
    return ToolCall(arguments["code"])
