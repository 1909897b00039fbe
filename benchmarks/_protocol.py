"""The benchmark protocol every speed script follows (STYLE.md "Benchmarks").

A speed claim is a same-run ratio taken on an idle machine:
  * systems are timed in interleaved rounds (a, b, c, a, b, c, ...), so load from other
    users of a shared machine hits all of them alike;
  * the 1-minute load average is read before every round and printed; a round whose load
    exceeds ``cores + max_load_excess`` is flagged BUSY and left out of the headline
    (``--allow-busy`` keeps it, and the headline then says so);
  * every system runs with the same thread count (``pin_threads`` before the first import
    of numpy/jax/torch);
  * each system is reported as median and spread (min, max) over the kept rounds, and the
    headline is the ratio of medians from the same run, with the median of the per-round
    ratios next to it (steadier when the load drifts during the run).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

DEFAULT_MAX_LOAD_EXCESS = 0.5


def pin_threads(threads: int) -> None:
    """Ask every runtime for ``threads`` threads. Call before numpy / jax / torch import.

    OpenMP (torch, OpenBLAS) reads OMP_NUM_THREADS; torch is also set directly when it is
    already imported. XLA gets ``--xla_cpu_multi_thread_eigen=true`` unless XLA_FLAGS sets
    it; the ``intra_op_parallelism_threads=N`` token appended as well is no XLA flag (no
    leading "--") and XLA skips it, so XLA's intra-op pool has one thread per core the
    process may use (``taskset`` limits it).
    """
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[name] = str(threads)
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_multi_thread_eigen" not in flags:  # a given setting is kept (flag A/B)
        flags = f"{flags} --xla_cpu_multi_thread_eigen=true"
    if "intra_op_parallelism_threads" not in flags:
        flags = f"{flags} intra_op_parallelism_threads={threads}"
    os.environ["XLA_FLAGS"] = flags.strip()
    import sys

    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)


@dataclass(frozen=True)
class Round:
    """One interleaved round: the load before it, whether it was busy, seconds per system."""

    load_1min: float
    busy: bool
    seconds: Mapping[str, float]


@dataclass
class Timings:
    """All rounds of one run, and the summaries the headline is made of."""

    cores: int
    max_load_excess: float
    rounds: list[Round] = field(default_factory=list)

    def kept(self, allow_busy: bool = False) -> list[Round]:
        return [r for r in self.rounds if allow_busy or not r.busy]

    def summary(self, name: str, allow_busy: bool = False) -> tuple[float, float, float]:
        """(median, min, max) seconds of ``name`` over the kept rounds."""
        values = [r.seconds[name] for r in self.kept(allow_busy)]
        if not values:
            raise RuntimeError(
                f"every round was busy (load > {self.cores} + {self.max_load_excess}); "
                "rerun on an idle machine or pass --allow-busy (the figures then say so)"
            )
        return statistics.median(values), min(values), max(values)


def is_busy(load_1min: float, cores: int, max_load_excess: float) -> bool:
    """A round is busy when the 1-minute load average exceeds cores + max_load_excess."""
    return load_1min > cores + max_load_excess


def interleaved_rounds(
    fns: Mapping[str, Callable[[], object]],
    rounds: int,
    *,
    max_load_excess: float = DEFAULT_MAX_LOAD_EXCESS,
    cores: int | None = None,
    loadavg: Callable[[], tuple[float, float, float]] = os.getloadavg,
    clock: Callable[[], float] = time.perf_counter,
    verbose: bool = True,
    self_timed: bool = False,
) -> Timings:
    """Time each function once per round, in the same order every round, load checked
    before each round (printed when ``verbose``).

    self_timed: each function returns its own duration in seconds (a worker process
    that timed the call itself, without the pipe round trip); ``clock`` is then unused.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    cores = cores or os.cpu_count() or 1
    timings = Timings(cores=cores, max_load_excess=max_load_excess)
    for index in range(rounds):
        load = loadavg()[0]
        busy = is_busy(load, cores, max_load_excess)
        seconds = {}
        for name, fn in fns.items():
            if self_timed:
                seconds[name] = float(fn())
                continue
            start = clock()
            fn()
            seconds[name] = clock() - start
        timings.rounds.append(Round(load_1min=load, busy=busy, seconds=seconds))
        if verbose:
            flag = "  BUSY (left out)" if busy else ""
            cells = "  ".join(f"{n} {s * 1e3:.1f} ms" for n, s in seconds.items())
            print(f"round {index + 1}/{rounds}: load {load:.2f}{flag}  {cells}", flush=True)
    return timings


def process_rounds(runs: Mapping[str, Callable[[], float]], rounds: int, max_load_excess: float,
                   warm: bool = True, **options) -> Timings:
    """Interleaved rounds of whole-process runs (``runs``: system -> a call that runs one
    process and returns its own seconds; ours first, theirs second), after one run of each
    when ``warm`` (filling the caches they share); prints each system's median and spread,
    then the headline. ``options``: `interleaved_rounds`'s (cores, loadavg)."""
    if warm:
        for name, run in runs.items():
            print(f"warming the cache with {name}: {run():.1f} s", flush=True)
    timings = interleaved_rounds(runs, rounds, max_load_excess=max_load_excess, self_timed=True, **options)
    for name in runs:
        median, low, high = timings.summary(name)
        print(f"{name:12s} {median:7.1f} s  [{low:.1f}, {high:.1f}]")
    print(headline(timings, *runs))
    return timings


def headline(timings: Timings, ours: str, theirs: str, allow_busy: bool = False) -> str:
    """The same-run speed ratio theirs_time / ours_time (> 1: ours is faster), with the
    number of kept rounds and whether busy rounds were included."""
    ours_median, _, _ = timings.summary(ours, allow_busy)
    theirs_median, _, _ = timings.summary(theirs, allow_busy)
    kept = len(timings.kept(allow_busy))
    busy = sum(r.busy for r in timings.rounds)
    note = ""
    if allow_busy and busy:
        note = f"; includes {busy} BUSY round(s): not a headline figure"
    paired = paired_ratio(timings, ours, theirs, allow_busy)
    return (
        f"{ours} vs {theirs}: {theirs_median / ours_median:.2f}x "
        f"(median of {kept} interleaved rounds; per-round ratio median {paired:.2f}x{note})"
    )


def paired_ratio(timings: Timings, ours: str, theirs: str, allow_busy: bool = False) -> float:
    """Median over the kept rounds of theirs / ours within each round. Both ran in the
    same round, back to back, so a load change between rounds cancels; the ratio of
    medians can pair a fast round of one with a slow round of the other."""
    rounds = timings.kept(allow_busy)
    if not rounds:
        timings.summary(ours, allow_busy)  # raises the "every round was busy" error
    return statistics.median(r.seconds[theirs] / r.seconds[ours] for r in rounds)


def report(timings: Timings, work_units: float, unit: str, allow_busy: bool = False) -> None:
    """Print median and spread per system, as seconds and as ``work_units`` per second."""
    for name in timings.rounds[0].seconds:
        median, low, high = timings.summary(name, allow_busy)
        print(
            f"{name:34s} {median * 1e3:9.1f} ms  [{low * 1e3:.1f}, {high * 1e3:.1f}]  "
            f"{work_units / median:10.0f} {unit}/s"
        )


REPLY_PREFIX = "BENCH_REPLY "


def reply(payload: Mapping[str, object]) -> None:
    """Worker side of ``WorkerProcess``: one JSON reply line on stdout (other output of
    the worker's libraries, e.g. log lines, is ignored by the driver)."""
    print(REPLY_PREFIX + json.dumps(payload), flush=True)


class WorkerProcess:
    """A benchmarked system in its own process (its own venv's python if need be),
    started once and driven line by line: the driver writes one command line to its
    stdin and reads its JSON reply (``reply``). A worker that is not asked blocks on its
    stdin, so one system computes at a time. stderr goes to ``log_path``, quoted when the
    worker dies."""

    def __init__(self, name: str, argv: list[str], log_path: str,
                 env: Mapping[str, str] | None = None, cwd: str | None = None):
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in close())
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self._log, text=True, env=env, cwd=cwd)

    def read(self) -> dict:
        for line in self.process.stdout:
            if line.startswith(REPLY_PREFIX):
                return json.loads(line[len(REPLY_PREFIX):])
        code = self.process.wait()
        self._log.flush()
        with open(self.log_path) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"worker {self.name} exited (rc={code}); end of its stderr:\n{tail}")

    def ask(self, line: str) -> dict:
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        return self.read()

    def close(self, timeout_s: float = 60.0) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:  # a hung worker must not outlive the driver
                self.process.kill()
                self.process.wait()
        self._log.close()
