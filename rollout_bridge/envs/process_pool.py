"""The process pool that generates and scores games beside a running job.

Spawned, not forked: the parent may already run JAX's threads (a forked child of a
multithreaded process can deadlock on a lock another thread held, and Python warns so on
stderr). Workers ignore SIGINT: Ctrl-C reaches the whole process group, and only the parent
decides how the job ends (`rollout_bridge.run_guard`); the parent's shutdown ends them.
"""

from __future__ import annotations

import multiprocessing
import signal
from concurrent.futures import ProcessPoolExecutor


def _ignore_interrupts() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def worker_pool(workers: int) -> ProcessPoolExecutor:
    """A `ProcessPoolExecutor` of `workers` spawned processes that ignore SIGINT."""
    return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_ignore_interrupts)
