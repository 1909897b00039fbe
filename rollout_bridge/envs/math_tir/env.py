"""The Math-TIR environment and its builder (env kind ``math_tir``).

An episode: ``reset(task_id)`` returns the problem text. Each reply of the policy is either
  * a Python tool call (``tool_format``): the code runs in the sandbox and its output comes
    back as a ``<tool_response>`` observation (context tokens, never actions), reward 0,
    not done; at most ``max_tool_calls`` (``env.max_turns``) calls — one more is a failed
    episode (reward 0, done); with ``tools_enabled=False`` the call is answered
    ``[tool disabled]`` without running anything (the no-tool ablation);
  * anything else: the final answer, scored by math-verify against the ground truth
    (reward 1 or 0; a verifier error or time-out is 0, logged), done.
The agent loop therefore needs ``max_turns = max_tool_calls + 1`` model turns.

``build_math_tir`` is the kind's entry point: from the ``env`` section of kind
``math_tir`` (``rollout_bridge.envs.kinds.math_tir.MathTIRConfig``: data_dir, num_games,
game_seed, max_turns, max_feedback_chars, the warm-start and held-out counts and seeds,
source, tool_format, arithmetic, sandbox, verifier, ...) it returns a
:class:`MathTIRSetup` holding the training task set, the held-out problems (arithmetic
source: ``heldout_games`` drawn problems; dapo source: ``heldout_games`` prompts of the
same files drawn with ``heldout_seed``; either way never trained on nor demonstrated), the cold-start
demonstrations, the env factory and the shared sandbox/verifier (``close()`` them at the
end of the job).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path

from rollout_bridge.envs.base import AsyncEnvironment, StepResult, check_task_id
from rollout_bridge.envs.math_tir.arithmetic import ArithmeticSpec, generate_problems, teacher_trajectories
from rollout_bridge.envs.math_tir.tasks import MathTaskSet, load_dapo_heldout, load_dapo_math
from rollout_bridge.envs.math_tir.teacher import (
    demonstration_pairs,
    filter_teacher,
    read_jsonl,
    structure_error,
    write_jsonl,
)
from rollout_bridge.envs.math_tir.tool_format import ToolFormat, parse_call, render_response
from rollout_bridge.envs.math_tir.verifier import MathVerifier
from rollout_bridge.tools.sandbox import ToolSandbox, truncate_text

logger = logging.getLogger(__name__)

TOOL_DISABLED_TEXT = "[tool disabled]"
DIGITS_REMOVED = str.maketrans("", "", "0123456789")


@dataclasses.dataclass(frozen=True)
class EpisodeRules:
    """What one episode allows (from the ``env`` section)."""

    tool_format: ToolFormat
    max_tool_calls: int
    max_feedback_chars: int
    tools_enabled: bool = True


class MathTIREnv(AsyncEnvironment):
    """One Math-TIR episode at a time over a shared sandbox and verifier."""

    def __init__(self, tasks: MathTaskSet, sandbox: ToolSandbox, verifier: MathVerifier, rules: EpisodeRules):
        self.tasks, self.sandbox, self.verifier, self.rules = tasks, sandbox, verifier, rules
        self.num_tasks = tasks.num_tasks
        self.task = None
        self.tool_calls = 0

    async def reset(self, task_id: int) -> str:
        self.task = self.tasks[check_task_id(task_id, self.num_tasks)]
        self.tool_calls = 0
        return self.task.prompt

    async def step(self, action_text: str) -> StepResult:
        if self.task is None:
            raise RuntimeError("step() before reset()")
        call = parse_call(action_text, self.rules.tool_format)
        if call is None:
            reward = await asyncio.to_thread(self.verifier.score, self.task.ground_truth, action_text)
            return StepResult("", reward, True)
        if self.tool_calls >= self.rules.max_tool_calls:
            return StepResult("", 0.0, True)
        self.tool_calls += 1
        return StepResult(render_response(await self._tool_output(call)), 0.0, False)

    async def _tool_output(self, call) -> str:
        if call.error is not None:
            return truncate_text(f"[tool call error] {call.error}", self.rules.max_feedback_chars)
        if not self.rules.tools_enabled:
            return TOOL_DISABLED_TEXT
        result = await self.sandbox.run(call.code)
        return result.feedback(self.rules.max_feedback_chars)


class TeacherDemonstrations:
    """Teacher records as warm-start demonstrations (``num_tasks`` / ``demonstration(t)``,
    the interface of ``rollout_bridge.warmstart.sft_examples``)."""

    def __init__(self, records: list[dict], tool_format: ToolFormat):
        if not records:
            raise ValueError("no teacher trajectories for the cold start")
        self.records, self.tool_format = records, tool_format
        self.num_tasks = len(records)

    def demonstration(self, index: int) -> list[tuple[str, str]]:
        return demonstration_pairs(self.records[index], self.tool_format)


@dataclasses.dataclass
class MathTIRSetup:
    """Everything the job needs for env kind ``math_tir``."""

    train: MathTaskSet
    demonstrations: TeacherDemonstrations | None
    held_out_demonstrations: TeacherDemonstrations | None
    sandbox: ToolSandbox
    verifier: MathVerifier
    rules: EpisodeRules
    held_out: MathTaskSet | None = None

    @property
    def num_tasks(self) -> int:
        return self.train.num_tasks

    def env_factory(self, tools_enabled: bool | None = None, tasks: MathTaskSet | None = None):
        """A zero-argument env builder over ``tasks`` (default: the training set;
        ``tools_enabled`` overrides the section's)."""
        rules = self.rules if tools_enabled is None else dataclasses.replace(self.rules, tools_enabled=tools_enabled)
        tasks = self.train if tasks is None else tasks
        return lambda: MathTIREnv(tasks, self.sandbox, self.verifier, rules)

    def corpus(self) -> list[str]:
        """Texts a tiny tokenizer is trained on: prompts and teacher turns WITHOUT their
        digits, so BPE learns no digit merges and every digit stays its own token (as in
        Qwen's tokenizer): copying a number is then copying digits."""
        texts = [t.prompt for t in self.train.tasks]
        for demos in (self.demonstrations, self.held_out_demonstrations):
            if demos is not None:
                texts += [f"{obs}\n{reply}" for i in range(demos.num_tasks) for obs, reply in demos.demonstration(i)]
        return [text.translate(DIGITS_REMOVED) for text in texts]

    def close(self) -> None:
        self.sandbox.close()
        self.verifier.close()


def _sandbox_stdout(sandbox: ToolSandbox, max_chars: int):
    return lambda code: sandbox.run_sync(code).feedback(max_chars)


def arithmetic_problem_sets(env, spec: ArithmeticSpec):
    """(train, warm-start, held-out) problems, pairwise disjoint: train from
    ``env.game_seed``, warm-start (``env.warmstart_games``, None if 0) from
    ``env.warmstart_seed``, held-out (``env.heldout_games``, None if 0) from
    ``env.heldout_seed``."""
    train = generate_problems(env.num_games, env.game_seed, spec)
    warm = (generate_problems(env.warmstart_games, env.warmstart_seed, spec, train.tasks)
            if env.warmstart_games > 0 else None)
    seen = train.tasks + (warm.tasks if warm is not None else ())
    held = generate_problems(env.heldout_games, env.heldout_seed, spec, seen) if env.heldout_games > 0 else None
    return train, warm, held


def arithmetic_teacher(env, warm: MathTaskSet, sandbox, verifier, seed: int):
    """Scripted teacher on the warm-start problems, filtered and split (records are also
    written to ``env.data_dir`` for inspection)."""
    if warm is None:
        raise ValueError("env.warmstart_games must be >= 1 for the arithmetic teacher's cold start")
    spec = env.arithmetic
    records = teacher_trajectories(warm, _sandbox_stdout(sandbox, env.max_feedback_chars), env.tool_format,
                                   env.teacher_samples_per_task, seed, spec.slip_rate, spec.direct_rate)
    kept, held, report = filter_teacher(records, verifier.score, env.tool_format, env.max_turns,
                                        env.held_out_fraction, seed)
    folder = Path(env.data_dir)
    write_jsonl(folder / "teacher_raw.jsonl", records)
    write_jsonl(folder / "teacher_train.jsonl", kept)
    write_jsonl(folder / "teacher_held_out.jsonl", held)
    logger.info("math_tir teacher: %s", report)
    return kept, held, report


def dapo_teacher(env) -> list[dict]:
    """The filtered teacher JSONL named by ``env.teacher_file`` (every record checked)."""
    if env.teacher_file is None:
        raise ValueError("env.teacher_file is required for the cold start with source=dapo "
                         "(a JSONL written by `python -m rollout_bridge.envs.math_tir.teacher filter`)")
    path = Path(env.data_dir) / env.teacher_file
    if not path.is_file():
        raise FileNotFoundError(f"env.teacher_file: {str(path)!r} does not exist")
    records = read_jsonl(path)
    for number, record in enumerate(records, 1):
        why = structure_error(record, env.tool_format, env.max_turns)
        if why is not None:
            raise ValueError(f"{path} record {number}: {why}")
    return records


def dapo_seen_prompts(train: MathTaskSet, demos: "TeacherDemonstrations | None") -> set[str]:
    """Prompt texts a DAPO held-out set must avoid: the training prompts and every
    teacher demonstration's user prompt."""
    seen = {task.prompt for task in train.tasks}
    if demos is not None:
        seen |= {str(record["messages"][0].get("content", "")) for record in demos.records}
    return seen


def build_math_tir(env, seed: int, with_teacher: bool = True) -> MathTIRSetup:
    """The ``math_tir`` kind's builder (see the module docstring)."""
    if env.max_turns < 1:
        raise ValueError(f"env.max_turns (max tool calls) must be >= 1, got {env.max_turns}")
    warm = held_out = None
    if env.source == "dapo":
        train = load_dapo_math(env.data_dir, env.num_games, env.game_seed)
    else:
        train, warm, held_out = arithmetic_problem_sets(env, env.arithmetic)
    rules = EpisodeRules(env.tool_format, env.max_turns, env.max_feedback_chars, env.tools_enabled)
    sandbox = ToolSandbox(env.sandbox)
    verifier = MathVerifier(env.verifier)
    demos = held = None
    try:
        if with_teacher and env.source == "arithmetic":
            kept, held_records, _ = arithmetic_teacher(env, warm, sandbox, verifier, seed)
            demos = TeacherDemonstrations(kept, env.tool_format)
            held = TeacherDemonstrations(held_records, env.tool_format) if held_records else None
        elif with_teacher:
            demos = TeacherDemonstrations(dapo_teacher(env), env.tool_format)
        if env.source == "dapo" and env.heldout_games > 0:
            held_out = load_dapo_heldout(env.data_dir, env.heldout_games, env.heldout_seed,
                                         dapo_seen_prompts(train, demos))
    except BaseException:
        sandbox.close()
        verifier.close()
        raise
    return MathTIRSetup(train, demos, held, sandbox, verifier, rules, held_out)
