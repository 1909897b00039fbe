"""Math-TIR: tool-integrated math reasoning (SPEC 6).

``env`` (the environment and the kind's builder), ``tool_format`` (tool calls in the chat
format), ``verifier`` (math-verify in a killable process), ``tasks`` (DAPO-Math-17K
loader), ``arithmetic`` (the CPU task and its scripted teacher), ``teacher`` (teacher JSONL:
checks, verifier filter, split by prompt).
"""

from rollout_bridge.envs.math_tir.env import (
    EpisodeRules,
    MathTIREnv,
    MathTIRSetup,
    build_math_tir,
)

__all__ = ["EpisodeRules", "MathTIREnv", "MathTIRSetup", "build_math_tir"]
