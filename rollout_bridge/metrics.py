"""Training metrics: one JSON line per update (+ TensorBoard scalars) and the learning curve.

`metrics.jsonl` in the run folder holds one object per learner update, `{"step": k, ...}`,
flushed on every write so a crash loses nothing already written. On `--resume` from the
checkpoint of step k, rows with step > k (work after that checkpoint, about to be redone)
are moved out first (`MetricsWriter(..., resume_step=k)`; a run that starts over, with no
checkpoint yet, k = 0), so the file never holds two rows for one step; they are kept, as
written, in `metrics_set_aside/after_step_<k>.jsonl` (as the checkpoints newer than k go to
`checkpoints_set_aside/`), and one log line says so. TensorBoard hides the same steps:
each writer's event file starts with its purge marker at step k + 1 (0 when starting over),
and the earlier files stay on disk. Each checkpoint also holds the rows
written since the previous one (`MetricsWriter.checkpoint_extras`, the checkpoint's extra
``metrics``): a resume rebuilds from it any row of that interval that is torn (a line that
is not a whole JSON object, e.g. a crash or a full disk mid-write) or missing, and says so
in one log line.

Optional Weights & Biases sink (`WandbSink`, the `wandb` extra: `pip install
'spopp-jax[wandb]'`): off by default; `offline` mode (the default when on) writes the run
under `<run_dir>/wandb` for a later `wandb sync`, `online` logs live. It receives exactly the
row written to metrics.jsonl, so the metric names are the same in all three places.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Protocol, Sequence

import numpy as np

from rollout_bridge.atomic_files import write_text_atomic

METRICS_FILE = "metrics.jsonl"
SET_ASIDE_FOLDER = "metrics_set_aside"   # rows after a resume's checkpoint: after_step_<k>[-<n>].jsonl
WANDB_MODES = ("offline", "online")
WANDB_FOLDER = "wandb"


def _scalar(value):
    if isinstance(value, (bool, np.bool_)):
        return int(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def scan_metrics(path: str | os.PathLike) -> tuple[list[dict], int]:
    """(rows, torn): every whole row of a metrics.jsonl and the number of torn lines
    skipped (not a JSON object with a ``step``, or a last line without its newline)."""
    rows, torn = [], 0
    path = Path(path)
    if not path.exists():
        return rows, torn
    with open(path, "rb") as f:
        for raw in f:
            try:
                row = json.loads(raw) if raw.endswith(b"\n") else None
            except (json.JSONDecodeError, UnicodeDecodeError):
                row = None
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                rows.append(row)
            elif raw.strip():
                torn += 1
    return rows, torn


def _jsonl(rows: Iterable[dict]) -> str:
    """``rows`` as metrics.jsonl lines (one JSON object per line)."""
    return "".join(json.dumps(row) + "\n" for row in rows)


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """All whole rows of a metrics.jsonl; torn lines (crash mid-write) are skipped."""
    return scan_metrics(path)[0]


CHECKPOINT_EXTRA = "metrics"


def checkpoint_rows(checkpoints_dir: str | os.PathLike, step: int) -> list[dict]:
    """The metric rows saved with checkpoint ``step`` (`MetricsWriter.checkpoint_extras`);
    [] for a checkpoint without them."""
    folder = Path(checkpoints_dir) / str(step) / f"extra_{CHECKPOINT_EXTRA}"
    if not folder.is_dir():
        return []
    import orbax.checkpoint as ocp

    restored = ocp.PyTreeCheckpointHandler().restore(folder)
    data = np.asarray(restored["tree"]["rows_json"], np.uint8)
    return json.loads(data.tobytes().decode()) if data.size else []


class MetricSink(Protocol):
    """Receives every row MetricsWriter writes (the same names and values)."""

    def write(self, step: int, row: Mapping[str, float | int]) -> None: ...

    def close(self) -> None: ...


class WandbSink:
    """Logs each row to a Weights & Biases run: `wandb.log(row without "step", step=step)`.

    `mode="offline"` needs no account or network: the run is written to
    `<run_dir>/wandb/offline-run-*` (upload later with `wandb sync <that folder>`).
    wandb's own console output is silenced (`Settings(silent=True)`); `location` says
    where the run went. A resumed job starts a new wandb run whose first step is
    resume_step + 1 (steps are the learner updates, as in metrics.jsonl)."""

    def __init__(self, run_dir: str | os.PathLike, project: str, mode: str = "offline",
                 name: str | None = None, config: Mapping[str, Any] | None = None):
        if mode not in WANDB_MODES:
            raise ValueError(f"wandb mode must be one of {list(WANDB_MODES)}, got {mode!r}")
        try:
            import wandb
        except ImportError:
            raise ImportError("wandb logging needs the wandb package: pip install "
                              "'spopp-jax[wandb]' (or turn wandb off)") from None
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.mode = mode
        self._run = wandb.init(project=project, name=name or self.run_dir.name, mode=mode,
                               dir=str(self.run_dir), config=dict(config or {}),
                               settings=wandb.Settings(silent=True))

    @property
    def location(self) -> str:
        """The local run folder (offline) or the run's URL (online)."""
        if self.mode == "offline":    # no URL (asking wandb for one prints a warning)
            return str(Path(self._run.dir).parent)
        return self._run.url or str(Path(self._run.dir).parent)

    def write(self, step: int, row: Mapping[str, float | int]) -> None:
        self._run.log({k: v for k, v in row.items() if k != "step"}, step=int(step))

    def close(self) -> None:
        self._run.finish()


class MetricsWriter:
    """Appends `{"step": step, **metrics}` rows to `<run_dir>/metrics.jsonl` and, when
    `tensorboard`, the same scalars to a tensorboardX event file in `<run_dir>/tb`;
    each of `sinks` (e.g. a `WandbSink`) receives the same row."""

    def __init__(self, run_dir: str | os.PathLike, tensorboard: bool = True,
                 resume_step: int | None = None, sinks: Sequence[MetricSink] = (),
                 checkpoints_dir: str | os.PathLike | None = None):
        self.sinks = list(sinks)
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self._since_checkpoint: list[dict] = []
        if resume_step is None:   # RL starts over: rows of an attempt that made no checkpoint are set aside
            self._set_aside(scan_metrics(self.path)[0], 0)
            kept: list[dict] = []
        else:
            kept = self._rows_to_keep(resume_step, checkpoints_dir)
        write_text_atomic(self.path, _jsonl(kept))
        self._file = open(self.path, "a")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            # TensorBoard hides the earlier files' events from this step on, as the rows
            # set aside above: after the checkpoint when resuming, all when starting over.
            # The suffix keeps a writer started in the same second as the last one (whose
            # file name would be the same: seconds and host) from overwriting its file.
            self._tb = SummaryWriter(str(self.run_dir / "tb"),
                                     purge_step=0 if resume_step is None else resume_step + 1,
                                     filename_suffix=f".{time.time_ns()}")

    def _rows_to_keep(self, resume_step: int, checkpoints_dir) -> list[dict]:
        """Rows up to ``resume_step``, one per step; rows of the checkpoint's interval
        that are torn or missing come back from the checkpoint (one log line)."""
        rows, torn = scan_metrics(self.path)
        self._set_aside([r for r in rows if r["step"] > resume_step], resume_step)
        by_step = {r["step"]: r for r in rows if r["step"] <= resume_step}
        saved = checkpoint_rows(checkpoints_dir or self.run_dir / "checkpoints", resume_step)
        rebuilt = [r["step"] for r in saved if r["step"] not in by_step]
        for row in saved:
            by_step.setdefault(row["step"], row)
        if torn or rebuilt:
            print(f"metrics: {self.path} had {torn} torn line(s); "
                  + (f"rows of steps {rebuilt} rebuilt from checkpoint {resume_step}" if rebuilt
                     else "no row up to the checkpoint was lost"), flush=True)
        return [by_step[s] for s in sorted(by_step)]

    def _set_aside(self, later: list[dict], resume_step: int) -> None:
        """Keep the rows of the work after checkpoint ``resume_step`` (redone now) in a file
        of their own under `SET_ASIDE_FOLDER`, a new one per resume (one log line)."""
        if not later:
            return
        folder = self.run_dir / SET_ASIDE_FOLDER
        folder.mkdir(exist_ok=True)
        target, n = folder / f"after_step_{resume_step}.jsonl", 1
        while target.exists():
            n += 1
            target = folder / f"after_step_{resume_step}-{n}.jsonl"
        write_text_atomic(target, _jsonl(later))
        steps = sorted({r["step"] for r in later})
        redone = f"after checkpoint {resume_step}" if resume_step else "no checkpoint: RL starts over"
        print(f"metrics: rows of steps {steps[0]}-{steps[-1]} ({redone}, about to be redone) set aside in "
              f"{target}", flush=True)

    def checkpoint_extras(self) -> dict[str, Any]:
        """``{"metrics": ...}`` for a checkpoint's extras: the rows written since the
        previous call (JSON bytes), so a resume can rebuild a torn or lost row."""
        data = json.dumps(self._since_checkpoint).encode()
        self._since_checkpoint = []
        return {CHECKPOINT_EXTRA: {"rows_json": np.frombuffer(data, np.uint8).copy()}}

    def write(self, step: int, metrics: Mapping[str, object]) -> dict:
        row = {"step": int(step)}
        for key, value in metrics.items():
            scalar = _scalar(value)
            if scalar is not None and math.isfinite(scalar):
                row[key] = scalar
        self._since_checkpoint.append(row)
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        if self._tb is not None:
            for key, value in row.items():
                if key != "step":
                    self._tb.add_scalar(key, value, int(step))
            self._tb.flush()
        for sink in self.sinks:
            sink.write(int(step), row)
        return row

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        for sink in self.sinks:
            sink.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def trailing_mean(values: Sequence[float], window: int) -> np.ndarray:
    """m_t = mean(values[max(0, t-window+1) .. t]) (float64)."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"values must be 1-D, got shape {x.shape}")
    csum = np.concatenate([[0.0], np.cumsum(x)])
    t = np.arange(len(x))
    lo = np.maximum(0, t - window + 1)
    return (csum[t + 1] - csum[lo]) / (t + 1 - lo)


def plot_learning_curve(rows: Iterable[Mapping], path: str | os.PathLike,
                        key: str = "success_rate", window: int = 5,
                        title: str = "SPO++ on TextWorld",
                        reference_lines: Mapping[str, float] | None = None) -> Path:
    """PNG of the per-step `key`, its trailing mean over `window` steps and optional
    horizontal reference lines (e.g. success before / after RL from evaluation rollouts)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [(r["step"], r[key]) for r in rows if key in r]
    if not points:
        raise ValueError(f"no rows with {key!r} to plot")
    steps, values = map(np.asarray, zip(*points))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, values, "o-", alpha=0.4, label=f"{key} per step")
    ax.plot(steps, trailing_mean(values, window), "-", lw=2,
            label=f"trailing mean ({window} steps)")
    for (label, value), style in zip((reference_lines or {}).items(), ("--", ":", "-.")):
        if value is not None and math.isfinite(value):
            ax.axhline(value, ls=style, color="gray", label=f"{label}: {value:.2f}")
    ax.set_xlabel("learner update")
    ax.set_ylabel(key)
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
