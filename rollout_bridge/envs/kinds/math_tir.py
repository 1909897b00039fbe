"""The ``math_tir`` env kind (SPEC 6): tool-integrated math reasoning, the model's Python run
in the tool sandbox and the final answer scored by math-verify (rollout_bridge.envs.math_tir)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Literal, Optional

from rollout_bridge.envs.kinds.base import EnvBundle, EnvConfig, check
from rollout_bridge.envs.math_tir.sections import ArithmeticSpec, SandboxConfig, VerifierConfig
from rollout_bridge.run_errors import UserError

SOURCES = ("arithmetic", "dapo")
TOOL_FORMATS = ("plain", "qwen")


@EnvConfig.register_subclass("math_tir")
@dataclasses.dataclass
class MathTIRConfig(EnvConfig):
    """Math-TIR tasks. `source`: ``arithmetic`` (seeded problems drawn by `arithmetic` +
    a scripted teacher) or ``dapo`` (DAPO-Math-17K parquet files in `data_dir` +
    `teacher_file`, a filtered teacher JSONL relative to `data_dir`); `num_games`
    training problems, `warmstart_games` teacher problems, `heldout_games` held-out ones.
    An episode allows `max_turns` tool calls (`tool_format`: ``plain``
    <tool_call>CODE</tool_call> or ``qwen``, the chat template's JSON block; answered
    ``[tool disabled]`` unless `tools_enabled`), then one more turn for the final answer.
    `teacher_samples_per_task`: arithmetic teacher samples per warm-start problem;
    `held_out_fraction`: share of teacher prompts held out. `sandbox`: the tool sandbox's
    settings; `verifier`: math-verify's."""

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
        super().__post_init__()
        check(self.source in SOURCES, "env.source", f"one of {list(SOURCES)}", self.source)
        check(self.tool_format in TOOL_FORMATS, "env.tool_format", f"one of {list(TOOL_FORMATS)}", self.tool_format)
        check(0.0 <= self.held_out_fraction < 1.0, "env.held_out_fraction", "in [0, 1)", self.held_out_fraction)
        check(self.teacher_samples_per_task >= 1, "env.teacher_samples_per_task", ">= 1",
              self.teacher_samples_per_task)

    def record_key(self) -> dict:
        """Every field but the sandbox's worker count (how many calls run at once, not what a
        call returns): a cached prior, evaluation or warm start made on other problems, another
        teacher or another tool format is never served."""
        key = super().record_key()
        key["sandbox"] = {name: value for name, value in key["sandbox"].items() if name != "num_workers"}
        return key

    def build(self, seed: int, with_demonstrations: bool, log: Callable[[str], None] = print,
              progress: bool = False) -> EnvBundle:
        """The training problems (``max_turns`` tool calls, then one more turn for the final
        answer), the teacher's demonstrations, and the evaluations with the tool disabled
        and on held-out problems (:func:`math_tir_evaluations`)."""
        from rollout_bridge.envs.math_tir import build_math_tir
        from rollout_bridge.envs.math_tir.tool_format import PYTHON_TOOL_SCHEMA

        if self.source == "dapo" and not Path(self.data_dir).is_dir():
            raise UserError(f"env.data_dir={self.data_dir!r} does not exist: put the DAPO-Math-17K "
                            "prompts and the cold-start SFT data there")
        log(f"math_tir: {self.source} tasks, sandboxed Python tool ({self.sandbox.num_workers} warm workers)")
        setup = build_math_tir(self, seed, with_teacher=with_demonstrations)
        return EnvBundle(train=setup.train, env_factory=setup.env_factory(), max_turns=self.max_turns + 1,
                         corpus=setup.corpus, warm=setup.demonstrations,
                         chat_tools=[PYTHON_TOOL_SCHEMA] if self.tool_format == "qwen" else None,
                         extra_evals=math_tir_evaluations(setup), close=setup.close)


def math_tir_evaluations(setup) -> dict:
    """Math-TIR's extra evaluations: the training problems with the tool disabled
    (``no_tool``) and, when ``env.heldout_games`` > 0, the held-out
    problems with and without the tool (``heldout``, ``heldout_no_tool``); both sources."""
    evals = {"no_tool": (setup.train, setup.env_factory(tools_enabled=False))}
    if setup.held_out is not None:
        evals["heldout"] = (setup.held_out, setup.env_factory(tasks=setup.held_out))
        evals["heldout_no_tool"] = (setup.held_out, setup.env_factory(tools_enabled=False, tasks=setup.held_out))
    return evals
