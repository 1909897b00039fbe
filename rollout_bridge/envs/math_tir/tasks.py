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
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterable, Sequence

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


def _ground_truth(reward_model, where: str) -> str:
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise ValueError(f"{where}: 'reward_model' needs a 'ground_truth' field")
    truth = reward_model["ground_truth"]
    if isinstance(truth, (list, tuple)):  # some exports store a list of accepted answers
        truth = truth[0] if truth else ""
    if not str(truth).strip():
        raise ValueError(f"{where}: 'reward_model.ground_truth' is empty")
    return str(truth)


def read_dapo_rows(file: Path) -> list[MathTask]:
    """Every row of one parquet file as a task (schema checked, errors name file and row)."""
    import pyarrow.parquet as pq

    table = pq.read_table(file)
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(f"{file}: missing column(s) {missing}; the DAPO-Math-17K schema has "
                         f"{list(REQUIRED_COLUMNS) + ['extra_info']}")
    columns = table.to_pydict()
    extra = columns.get("extra_info") or [None] * table.num_rows
    tasks = []
    for row in range(table.num_rows):
        where = f"{file} row {row}"
        index = (extra[row] or {}).get("index") if isinstance(extra[row], dict) else None
        key = str(index) if index is not None else f"{file.name}:{row}"
        tasks.append(MathTask(_user_text(columns["prompt"][row], where),
                              _ground_truth(columns["reward_model"][row], where), key))
    return tasks


def unique_prompts(tasks: Sequence[MathTask]) -> list[MathTask]:
    """First occurrence of each prompt text, in order."""
    seen, kept = set(), []
    for task in tasks:
        if task.prompt not in seen:
            seen.add(task.prompt)
            kept.append(task)
    return kept


def load_dapo_math(path: str | Path, num_prompts: int, seed: int) -> MathTaskSet:
    """``num_prompts`` distinct prompts (0 = all) chosen with ``seed`` from the parquet
    file(s) at ``path``."""
    if num_prompts < 0:
        raise ValueError(f"env.num_games (prompts) must be >= 0, got {num_prompts}")
    rows = unique_prompts([t for f in parquet_files(path) for t in read_dapo_rows(f)])
    if num_prompts > len(rows):
        raise ValueError(f"env.num_games={num_prompts} prompts asked for, {path} has {len(rows)} distinct")
    if num_prompts == 0:
        return MathTaskSet(tuple(rows))
    chosen = np.sort(np.random.default_rng(seed).choice(len(rows), num_prompts, replace=False))
    return MathTaskSet(tuple(rows[i] for i in chosen))

def load_dapo_heldout(path: str | Path, num_prompts: int, seed: int,
                      exclude_prompts: Iterable[str]) -> MathTaskSet:
    """``num_prompts`` distinct prompts chosen with ``seed`` from the parquet file(s) at
    ``path`` among those whose text is not in ``exclude_prompts`` (the training prompts and
    the teacher demonstrations' prompts): problems never trained on nor demonstrated."""
    if num_prompts < 1:
        raise ValueError(f"env.heldout_games (prompts) must be >= 1, got {num_prompts}")
    excluded = set(exclude_prompts)
    rows = [t for t in unique_prompts([t for f in parquet_files(path) for t in read_dapo_rows(f)])
            if t.prompt not in excluded]
    if num_prompts > len(rows):
        raise ValueError(f"env.heldout_games={num_prompts} held-out prompts asked for, {path} has "
                         f"{len(rows)} distinct ones outside the training and teacher prompts")
    chosen = np.sort(np.random.default_rng(seed).choice(len(rows), num_prompts, replace=False))
    return MathTaskSet(tuple(rows[k] for k in chosen))
