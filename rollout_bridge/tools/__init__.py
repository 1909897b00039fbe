"""Tools the policy can call: the sandboxed Python interpreter (``sandbox``)."""

from rollout_bridge.tools.sandbox import SandboxConfig, SandboxUnavailable, ToolResult, ToolSandbox

__all__ = ["SandboxConfig", "SandboxUnavailable", "ToolResult", "ToolSandbox"]
