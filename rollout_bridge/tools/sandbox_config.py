"""The tool sandbox's settings (the run config's ``env.sandbox`` section, kind math_tir): pure data,
validated on construction. It lives beside the sandbox, not in the Math-TIR package, so
that the sandbox imports no environment."""

from __future__ import annotations

import dataclasses
from typing import Literal

__all__ = ["MIB", "SandboxConfig"]

MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """Limits and layout of the tool sandbox (all limits are per call, over the call's whole
    process tree). ``isolation="rlimits_only"`` and ``fallback_to_rlimits`` need
    ``allow_unsafe_fallback=True``: the fallback does not isolate host files, processes or
    /dev/shm (see ``rollout_bridge.tools.sandbox``)."""

    num_workers: int = 4
    wall_s: float = 5.0
    cpu_s: int = 4
    memory_bytes: int = 512 * MIB
    max_processes: int = 16
    file_size_bytes: int = 8 * MIB
    scratch_bytes: int = 16 * MIB
    max_open_files: int = 64
    max_output_bytes: int = 64 * 1024
    allowed_modules: tuple[str, ...] = ()
    preload: tuple[str, ...] = ()
    isolation: Literal["bwrap", "rlimits_only"] = "bwrap"
    fallback_to_rlimits: bool = False
    allow_unsafe_fallback: bool = False
    host_grace_s: float = 5.0
    start_timeout_s: float = 30.0

    def __post_init__(self):
        positive = ("num_workers", "wall_s", "cpu_s", "memory_bytes", "max_processes",
                    "file_size_bytes", "scratch_bytes", "max_open_files", "max_output_bytes")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"sandbox.{name} must be > 0, got {getattr(self, name)}")
        if self.isolation not in ("bwrap", "rlimits_only"):
            raise ValueError(f"sandbox.isolation must be 'bwrap' or 'rlimits_only', got {self.isolation!r}")
        if (self.isolation == "rlimits_only" or self.fallback_to_rlimits) and not self.allow_unsafe_fallback:
            raise ValueError("sandbox.isolation 'rlimits_only' (or fallback_to_rlimits) runs model code without "
                             "namespace isolation (host files, processes, /dev/shm visible); set "
                             "sandbox.allow_unsafe_fallback: true to accept that")
        missing = set(self.preload) - set(self.allowed_modules)
        if missing:
            raise ValueError(f"sandbox.preload names modules not in allowed_modules: {sorted(missing)}")
