"""The CPU-sized tool-use task: seeded multi-digit arithmetic, and a scripted teacher.

A problem is ``a op b`` with ``op`` in {*, +} and operands drawn uniformly from
``[min_operand, max_operand]``, stated as ``Compute:\n673*342`` (the newline keeps the
byte-level tokenizer from gluing a space to the first number, so the prompt's number
tokens are the code's). A tiny model cannot multiply 3-digit numbers in its head, but it
can copy them into ``print(673*342)`` and copy the tool's answer into ``\\boxed{230166}``.
The default range 317..999 makes every operand 3 digits and every product exactly 6: the
copies then sit at fixed relative positions, which a 2-layer model with rotary attention
learns far sooner than content-addressed copying. Problem sets are drawn with
``numpy.random.default_rng(seed)``; ``disjoint_from`` excludes every expression of another
set (warm-start problems never repeat a training problem).

The scripted teacher writes the tool-using trajectory a good solver would: one tool call
with the expression, then the boxed tool output; with probability ``slip_rate`` it
miscopies one digit of the code (so its samples include wrong ones, as a real teacher's
do, and the verifier filter has something to remove). The tool output is whatever the
given ``run_code`` (the sandbox) printed. With probability ``direct_rate`` it instead
answers in its head, as a strong teacher model often does on arithmetic it finds easy: the
boxed value with no tool call (right, or with one digit slipped at ``slip_rate``). Those
samples are verifier-positive, so the filter keeps them, but a student that imitates them
guesses a 6-digit number: the cold start then calls the tool on only part of the problems,
and RL has to learn to prefer the tool (the student's skill, not the teacher's).
"""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

from rollout_bridge.envs.math_tir.sections import ArithmeticSpec  # noqa: F401 (re-exported)
from rollout_bridge.envs.math_tir.tasks import MathTask, MathTaskSet
from rollout_bridge.envs.math_tir.tool_format import ToolFormat, render_call

PROMPT_TEMPLATE = "Compute:\n{expression}"
MAX_DRAW_ATTEMPTS_PER_PROBLEM = 100


def expression_of(task: MathTask) -> str:
    """``673*342`` from ``Compute:\n673*342``."""
    prefix, suffix = PROMPT_TEMPLATE.split("{expression}")
    if not (task.prompt.startswith(prefix) and task.prompt.endswith(suffix)):
        raise ValueError(f"not an arithmetic prompt: {task.prompt!r}")
    return task.prompt[len(prefix):len(task.prompt) - len(suffix)]


def _operand(rng: np.random.Generator, spec: ArithmeticSpec) -> int:
    return int(rng.integers(spec.min_operand, spec.max_operand + 1))


def _evaluate(a: int, op: str, b: int) -> int:
    return a * b if op == "*" else a + b


def generate_problems(num: int, seed: int, spec: ArithmeticSpec,
                      disjoint_from: Iterable[MathTask] = ()) -> MathTaskSet:
    """``num`` distinct problems drawn with ``seed``, none equal to one in ``disjoint_from``."""
    if num < 1:
        raise ValueError(f"number of arithmetic problems must be >= 1, got {num}")
    rng = np.random.default_rng(seed)
    taken = {t.prompt for t in disjoint_from}
    tasks = []
    for _ in range(num * MAX_DRAW_ATTEMPTS_PER_PROBLEM):
        if len(tasks) == num:
            break
        a, b = _operand(rng, spec), _operand(rng, spec)
        op = spec.operators[int(rng.integers(len(spec.operators)))]
        prompt = PROMPT_TEMPLATE.format(expression=f"{a}{op}{b}")
        if prompt in taken:
            continue
        taken.add(prompt)
        tasks.append(MathTask(prompt, str(_evaluate(a, op, b)), f"arith-{seed}-{len(tasks)}"))
    if len(tasks) < num:
        raise ValueError(f"could not draw {num} distinct problems with {spec}")
    return MathTaskSet(tuple(tasks))


def _slip(expression: str, rng: np.random.Generator) -> str:
    """``expression`` with one digit replaced by a different digit."""
    positions = [i for i, c in enumerate(expression) if c.isdigit()]
    i = positions[int(rng.integers(len(positions)))]
    wrong = str((int(expression[i]) + int(rng.integers(1, 10))) % 10)
    return expression[:i] + wrong + expression[i + 1:]


def direct_answer_trajectory(task: MathTask, rng: np.random.Generator, slip_rate: float) -> dict:
    """A teacher sample answered in the head: messages user -> assistant (boxed value, one
    digit slipped with probability ``slip_rate``)."""
    value = task.ground_truth
    if rng.random() < slip_rate:
        value = _slip(value, rng)
    messages = [{"role": "user", "content": task.prompt}, {"role": "assistant", "content": f"\\boxed{{{value}}}"}]
    return {"key": task.key, "ground_truth": task.ground_truth, "messages": messages}


def teacher_trajectory(task: MathTask, run_code: Callable[[str], str], tool_format: ToolFormat,
                       rng: np.random.Generator, slip_rate: float, direct_rate: float = 0.0) -> dict:
    """One teacher sample as a JSONL record: ``{"key", "ground_truth", "messages"}`` with
    messages user -> assistant (tool call) -> tool -> assistant (boxed answer), or, with
    probability ``direct_rate``, the direct answer of :func:`direct_answer_trajectory`."""
    if direct_rate > 0.0 and rng.random() < direct_rate:  # no draw at 0: old seeds unchanged
        return direct_answer_trajectory(task, rng, slip_rate)
    expression = expression_of(task)
    if rng.random() < slip_rate:
        expression = _slip(expression, rng)
    code = f"print({expression})"
    output = run_code(code).strip()
    messages = [
        {"role": "user", "content": task.prompt},
        {"role": "assistant", "content": render_call(code, tool_format)},
        {"role": "tool", "content": output},
        {"role": "assistant", "content": f"\\boxed{{{output}}}"},
    ]
    return {"key": task.key, "ground_truth": task.ground_truth, "messages": messages}


def teacher_trajectories(tasks: MathTaskSet, run_code: Callable[[str], str], tool_format: ToolFormat,
                         samples_per_task: int, seed: int, slip_rate: float,
                         direct_rate: float = 0.0) -> list[dict]:
    """``samples_per_task`` teacher samples of every task (seeded slips and direct answers)."""
    rng = np.random.default_rng(seed)
    return [teacher_trajectory(task, run_code, tool_format, rng, slip_rate, direct_rate)
            for task in tasks.tasks for _ in range(samples_per_task)]

