"""Math-TIR tasks: a prompt and its ground truth; the DAPO-Math-17K parquet loader.

DAPO-Math-17K's public schema (one row per prompt; the published file repeats prompts):
    data_source   str
    prompt        list of {"role": str, "content": str}  (chat messages)
    ability       str
    reward_model  {"ground_truth": str, "style": str}
    extra_info    {"index": str}
The task text is the content of the prompt's last user message; the task key is
``extra_info.index`` (else the row number). Rows repeating an earlier prompt text are
dropped, then ``num_prompts`` are chosen with ``numpy.random.default_rng(seed)`` (without
replacement) and kept in file order, so the same files and seed give the same task ids.

A row whose ground truth cannot be scored is skipped, and the loader prints one line
counting them by reason: a null ground truth (``str(None)`` would make the answer "None",
which ``\\boxed{None}`` matches: a reward any policy could learn to collect), an empty one,
the text "None"/"null"/"nan", or (for the chosen prompts) one math-verify cannot parse
(every answer would score 0). A skipped chosen prompt is replaced by another draw of the
same generator, so files without such rows give the same task ids as before.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

REQUIRED_COLUMNS = ("prompt", "reward_model")


@dataclasses.dataclass(frozen=True)
class MathTask:
    """One prompt: the user text, its ground-truth answer, and a stable key."""

    prompt: str
    ground_truth: str
    key: str


@dataclasses.dataclass(frozen=True)
class MathTaskSet:
    """An ordered set of tasks; task id = index (SPEC 2 "task identity")."""

    tasks: tuple[MathTask, ...]

    def __post_init__(self):
        if not self.tasks:
            raise ValueError("a Math-TIR task set needs at least one task")

    @property
    def num_tasks(self) -> int:
        return len(self.tasks)

    def __getitem__(self, task_id: int) -> MathTask:
        return self.tasks[task_id]


def parquet_files(path: str | Path) -> list[Path]:
    """``path`` itself if it is a file, else the sorted ``*.parquet`` files in it."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"DAPO-Math data: {str(path)!r} does not exist")
    files = sorted(path.glob("*.parquet"))
    if not files:
        raise FileNotFoundError(f"DAPO-Math data: no *.parquet file in {str(path)!r}")
    return files


def _user_text(messages, where: str) -> str:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"{where}: 'prompt' must be a non-empty list of chat messages")
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if not users or not isinstance(users[-1].get("content"), str):
        raise ValueError(f"{where}: 'prompt' has no user message with text content")
    return users[-1]["content"]


NOT_ANSWERS = ("none", "null", "nan")


def ground_truth_problem(truth) -> str | None:
    """Why a raw ``reward_model.ground_truth`` cannot be scored (cheap checks), or None."""
    if isinstance(truth, (list, tuple)):  # some exports store a list of accepted answers
        truth = truth[0] if truth else None
    if truth is None:
        return "null ground truth"
    text = str(truth).strip()
    if not text:
        return "empty ground truth"
    if text.lower() in NOT_ANSWERS:
        return f"ground truth is the text {text!r}"
    return None


def unparseable(truth: str) -> bool:
    """True when math-verify finds no expression in the ground truth, only its text back
    (every answer would score 0). Its parse time-out uses signal.alarm, so off the main thread none is set."""
    from math_verify import parse

    from rollout_bridge.envs.math_tir.verifier import gold_text

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    try:   # parse returns [expression, text]; only the text when nothing parsed
        return not any(not isinstance(item, str) for item in parse(gold_text(truth), parsing_timeout=timeout))
    except Exception:  # noqa: BLE001 - any failure to parse is "cannot be scored"
        return True


def _ground_truth(reward_model, where: str) -> tuple[str | None, str | None]:
    """(ground truth text, None) or (None, why the row is skipped)."""
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise ValueError(f"{where}: 'reward_model' needs a 'ground_truth' field")
    truth = reward_model["ground_truth"]
    problem = ground_truth_problem(truth)
    if problem is not None:
        return None, problem
    if isinstance(truth, (list, tuple)):
        truth = truth[0]
    return str(truth), None


def read_dapo_file(file: Path) -> tuple[list[MathTask], list[str]]:
    """(tasks, skipped): every row of one parquet file as a task (schema checked, errors
    name file and row), rows whose ground truth cannot be scored skipped (their reasons)."""
    import pyarrow.parquet as pq

    table = pq.read_table(file)
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(f"{file}: missing column(s) {missing}; the DAPO-Math-17K schema has "
                         f"{list(REQUIRED_COLUMNS) + ['extra_info']}")
    columns = table.to_pydict()
    extra = columns.get("extra_info") or [None] * table.num_rows
    tasks, skipped = [], []
    for row in range(table.num_rows):
        where = f"{file} row {row}"
        index = (extra[row] or {}).get("index") if isinstance(extra[row], dict) else None
        key = str(index) if index is not None else f"{file.name}:{row}"
        prompt = _user_text(columns["prompt"][row], where)
        truth, why = _ground_truth(columns["reward_model"][row], where)
        if why is not None:
            skipped.append(why)
            continue
        tasks.append(MathTask(prompt, truth, key))
    return tasks, skipped


def read_dapo_rows(file: Path) -> list[MathTask]:
    """The scorable rows of one parquet file as tasks (`read_dapo_file`)."""
    return read_dapo_file(file)[0]


def _read_all(path, log: Callable[[str], None]) -> list[MathTask]:
    tasks, skipped = [], []
    for file in parquet_files(path):
        read, why = read_dapo_file(file)
        tasks += read
        skipped += why
    rows = unique_prompts(tasks)
    if skipped:
        log(f"DAPO-Math data {path}: skipped {len(skipped)} row(s) whose ground truth cannot be scored ("
            + ", ".join(f"{reason}: {n}" for reason, n in sorted(Counter(skipped).items())) + ")")
    if not rows:
        raise ValueError(f"DAPO-Math data {path}: no row with a ground truth that can be scored")
    return rows


def _choose_scorable(rows: Sequence[MathTask], num_prompts: int, seed: int, path,
                     log: Callable[[str], None], what: str) -> list[MathTask]:
    """``num_prompts`` rows drawn with ``seed`` (file order) whose ground truth math-verify
    parses; an unparseable draw is replaced by further draws of the same generator."""
    rng = np.random.default_rng(seed)
    chosen = set(rng.choice(len(rows), num_prompts, replace=False).tolist())
    bad = {i for i in chosen if unparseable(rows[i].ground_truth)}
    rejected = set(bad)
    chosen -= bad
    while len(chosen) < num_prompts:
        left = [i for i in range(len(rows)) if i not in chosen and i not in rejected]
        if len(left) < num_prompts - len(chosen):
            raise ValueError(f"{what}={num_prompts} prompts asked for, {path} has only "
                             f"{len(chosen) + len(left)} whose ground truth math-verify can parse")
        for i in rng.choice(left, num_prompts - len(chosen), replace=False).tolist():
            (rejected if unparseable(rows[i].ground_truth) else chosen).add(i)
    if rejected:
        log(f"DAPO-Math data {path}: skipped {len(rejected)} drawn prompt(s) whose ground truth math-verify "
            f"cannot parse (e.g. {rows[min(rejected)].ground_truth!r}, key {rows[min(rejected)].key})")
    return [rows[i] for i in sorted(chosen)]


def unique_prompts(tasks: Sequence[MathTask]) -> list[MathTask]:
    """First occurrence of each prompt text, in order."""
    seen, kept = set(), []
    for task in tasks:
        if task.prompt not in seen:
            seen.add(task.prompt)
            kept.append(task)
    return kept


def load_dapo_math(path: str | Path, num_prompts: int, seed: int,
                   log: Callable[[str], None] = print) -> MathTaskSet:
    """``num_prompts`` distinct prompts (0 = all) chosen with ``seed`` from the parquet
    file(s) at ``path``; rows whose ground truth cannot be scored are skipped (one line
    to ``log``)."""
    if num_prompts < 0:
        raise ValueError(f"env.num_games (prompts) must be >= 0, got {num_prompts}")
    rows = _read_all(path, log)
    if num_prompts > len(rows):
        raise ValueError(f"env.num_games={num_prompts} prompts asked for, {path} has {len(rows)} distinct")
    if num_prompts == 0:
        kept = [t for t in rows if not unparseable(t.ground_truth)]
        if len(kept) < len(rows):
            log(f"DAPO-Math data {path}: skipped {len(rows) - len(kept)} prompt(s) whose ground truth "
                "math-verify cannot parse")
        if not kept:
            raise ValueError(f"DAPO-Math data {path}: no row with a ground truth that can be scored")
        return MathTaskSet(tuple(kept))
    return MathTaskSet(tuple(_choose_scorable(rows, num_prompts, seed, path, log, "env.num_games")))


def load_dapo_heldout(path: str | Path, num_prompts: int, seed: int,
                      exclude_prompts: Iterable[str], log: Callable[[str], None] = print) -> MathTaskSet:
    """``num_prompts`` distinct prompts chosen with ``seed`` from the parquet file(s) at
    ``path`` among those whose text is not in ``exclude_prompts`` (the training prompts and
    the teacher demonstrations' prompts): problems never trained on nor demonstrated."""
    if num_prompts < 1:
        raise ValueError(f"env.heldout_games (prompts) must be >= 1, got {num_prompts}")
    excluded = set(exclude_prompts)
    rows = [t for t in _read_all(path, log) if t.prompt not in excluded]
    if num_prompts > len(rows):
        raise ValueError(f"env.heldout_games={num_prompts} held-out prompts asked for, {path} has "
                         f"{len(rows)} distinct ones outside the training and teacher prompts")
    return MathTaskSet(tuple(_choose_scorable(rows, num_prompts, seed, path, log, "env.heldout_games")))
