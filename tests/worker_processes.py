"""Waiting on test worker processes (multi-process learner tests). Imports nothing heavy:
the worker scripts set XLA_FLAGS before jax is imported."""

from __future__ import annotations

import subprocess


def wait_all(procs: list[subprocess.Popen], timeout_s: float) -> list[str]:
    """The output of every process; each must exit 0 (all are killed on a time-out)."""
    try:
        logs = [proc.communicate(timeout=timeout_s)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, log in zip(procs, logs):
        assert proc.returncode == 0, log[-4000:]
    return logs
