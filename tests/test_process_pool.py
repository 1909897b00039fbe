"""The game pools' workers (rollout_bridge.envs.process_pool) are spawned, not forked from
the job's JAX-running process, and leave Ctrl-C to the parent."""

import signal

from rollout_bridge.envs.process_pool import worker_pool

_SET_IN_THE_PARENT = []  # a forked worker would inherit what the parent put here; a spawned one imports it anew


def _worker_state():
    return list(_SET_IN_THE_PARENT), signal.getsignal(signal.SIGINT) == signal.SIG_IGN


def test_workers_are_spawned_and_ignore_sigint():
    _SET_IN_THE_PARENT.append("parent state")
    try:
        with worker_pool(2) as pool:
            states = [pool.submit(_worker_state).result(timeout=120) for _ in range(2)]
    finally:
        _SET_IN_THE_PARENT.clear()
    assert states == [([], True), ([], True)]
