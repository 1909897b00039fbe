"""What the ``env`` section of kind ``math_tir`` (``rollout_bridge.envs.kinds.math_tir``)
nests, pure data validated on construction: ``ArithmeticSpec`` (the CPU arithmetic task,
`rollout_bridge.envs.math_tir.arithmetic`), ``SandboxConfig`` (the tool sandbox's own,
`rollout_bridge.tools.sandbox_config`) and ``VerifierConfig`` (math-verify in its process,
`rollout_bridge.envs.math_tir.verifier`). Each is re-exported by the module that uses it.
"""

from __future__ import annotations

import dataclasses
from rollout_bridge.tools.sandbox_config import MIB, SandboxConfig

__all__ = ["OPERATORS", "MIB", "ArithmeticSpec", "VerifierConfig", "SandboxConfig"]

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
            raise ValueError(f"env.arithmetic: need 0 <= min_operand <= max_operand, got "
                             f"{self.min_operand}, {self.max_operand}")
        if not self.operators or set(self.operators) - set(OPERATORS):
            raise ValueError(f"env.arithmetic.operators must be a non-empty subset of {OPERATORS}")
        if not 0.0 <= self.slip_rate <= 1.0:
            raise ValueError(f"env.arithmetic.slip_rate must be in [0, 1], got {self.slip_rate}")
        if not 0.0 <= self.direct_rate <= 1.0:
            raise ValueError(f"env.arithmetic.direct_rate must be in [0, 1], got {self.direct_rate}")


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
                raise ValueError(f"env.verifier.{name} must be > 0, got {getattr(self, name)}")
