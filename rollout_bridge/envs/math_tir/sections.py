"""The ``math_tir`` section of the run config: Math-TIR settings beyond the shared ``env``
section, pure data validated on construction.

``MathTIRSection`` and what it nests: ``ArithmeticSpec`` (the CPU arithmetic task,
`rollout_bridge.envs.math_tir.arithmetic`), ``SandboxConfig`` (the tool sandbox's own,
`rollout_bridge.tools.sandbox_config`) and ``VerifierConfig`` (math-verify in its process,
`rollout_bridge.envs.math_tir.verifier`). Each is re-exported by the module that uses it.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from rollout_bridge.tools.sandbox_config import MIB, SandboxConfig

__all__ = ["OPERATORS", "MIB", "ArithmeticSpec", "VerifierConfig", "SandboxConfig", "MathTIRSection"]

OPERATORS = ("*", "+")   # the arithmetic task's operators


@dataclasses.dataclass(frozen=True)
class ArithmeticSpec:
    """How problems are drawn (``operators`` a subset of ``*`` and ``+``)."""

    min_operand: int = 317
    max_operand: int = 999
    operators: tuple[str, ...] = ("*",)
    slip_rate: float = 0.1
    direct_rate: float = 0.0

    def __post_init__(self):
        if not 0 <= self.min_operand <= self.max_operand:
            raise ValueError(f"math_tir.arithmetic: need 0 <= min_operand <= max_operand, got "
                             f"{self.min_operand}, {self.max_operand}")
        if not self.operators or set(self.operators) - set(OPERATORS):
            raise ValueError(f"math_tir.arithmetic.operators must be a non-empty subset of {OPERATORS}")
        if not 0.0 <= self.slip_rate <= 1.0:
            raise ValueError(f"math_tir.arithmetic.slip_rate must be in [0, 1], got {self.slip_rate}")
        if not 0.0 <= self.direct_rate <= 1.0:
            raise ValueError(f"math_tir.arithmetic.direct_rate must be in [0, 1], got {self.direct_rate}")


@dataclasses.dataclass(frozen=True)
class VerifierConfig:
    """``timeout_s``: the caller's bound per check (includes the process round trip);
    ``parse_timeout_s`` / ``verify_timeout_s``: math-verify's own time-outs (integers)."""

    timeout_s: float = 10.0
    parse_timeout_s: int = 5
    verify_timeout_s: int = 5
    start_timeout_s: float = 60.0

    def __post_init__(self):
        for name in ("timeout_s", "parse_timeout_s", "verify_timeout_s", "start_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"verifier.{name} must be > 0, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class MathTIRSection:
    """Math-TIR settings beyond the shared ``env`` section.

    source: ``arithmetic`` (the seeded CPU task + scripted teacher) or ``dapo`` (parquet
    files in ``env.data_dir`` + ``teacher_file``, a filtered teacher JSONL, relative to
    ``env.data_dir``). ``teacher_samples_per_task``: arithmetic teacher samples per
    warm-start problem; ``held_out_fraction``: share of teacher prompts held out.
    """

    source: Literal["arithmetic", "dapo"] = "arithmetic"
    tool_format: Literal["plain", "qwen"] = "plain"
    tools_enabled: bool = True
    teacher_file: Optional[str] = None
    teacher_samples_per_task: int = 1
    held_out_fraction: float = 0.1
    arithmetic: ArithmeticSpec = dataclasses.field(default_factory=ArithmeticSpec)
    sandbox: SandboxConfig = dataclasses.field(default_factory=SandboxConfig)
    verifier: VerifierConfig = dataclasses.field(default_factory=VerifierConfig)

    def __post_init__(self):
        if self.source not in ("arithmetic", "dapo"):
            raise ValueError(f"math_tir.source must be 'arithmetic' or 'dapo', got {self.source!r}")
        if not 0.0 <= self.held_out_fraction < 1.0:
            raise ValueError(f"math_tir.held_out_fraction must be in [0, 1), got {self.held_out_fraction}")
        if self.teacher_samples_per_task < 1:
            raise ValueError(f"math_tir.teacher_samples_per_task must be >= 1, got {self.teacher_samples_per_task}")
