"""Stops launched server process groups when the process that launched them dies, even
by SIGKILL (``VllmServerLauncher``'s guard; standard library only, run as a script).

    python vllm_watchdog.py <grace_s>      # reads "+<pgid>" / "-<pgid>" lines on stdin

The launcher starts one watchdog in its own session with a pipe as its stdin and writes
``+pgid`` when it spawns a server (its own process group: the ``vllm serve`` process and
its engine-core / worker children) and ``-pgid`` when that group is gone or stopped. The
kernel closes the pipe when the launcher's process dies, however it dies; at end of input
the watchdog sends SIGTERM to every group still registered (vLLM's API server shuts its
engine core down on SIGTERM), waits up to ``grace_s`` for each group to be empty, then
SIGKILLs what is left (a child that ignores SIGTERM, a hung shutdown).

Why not ``prctl(PR_SET_PDEATHSIG)`` in the child: it reaches only the direct child (not
vLLM's engine-core grandchild), it fires when the spawning THREAD exits (the launcher
restarts servers from its watch thread), and it needs ``preexec_fn``, which CPython
documents as unsafe in a process with threads (JAX's, the event loop's).

A group counts as gone when no process of it is left except zombies (a zombie cannot run;
in a container whose PID 1 does not reap orphans they stay listed).
"""

from __future__ import annotations

import os
import signal
import sys
import time

POLL_S = 0.05


def group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` has a process that is not a zombie (``/proc`` scan;
    ``killpg(pgid, 0)`` would also count zombies)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_groups(pgids: set[int], grace_s: float) -> None:
    """SIGTERM every group, wait up to ``grace_s`` for all to be gone, SIGKILL the rest."""
    for pgid in pgids:
        signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    alive = {p for p in pgids if group_alive(p)}
    while alive and time.monotonic() < deadline:
        time.sleep(POLL_S)
        alive = {p for p in alive if group_alive(p)}
    for pgid in alive:
        signal_group(pgid, signal.SIGKILL)


def read_registrations(stream) -> set[int]:
    """Apply ``+pgid`` / ``-pgid`` lines until end of input; the groups still registered."""
    pgids: set[int] = set()
    for line in stream:
        line = line.strip()
        if line[:1] == "+":
            pgids.add(int(line[1:]))
        elif line[:1] == "-":
            pgids.discard(int(line[1:]))
    return pgids


def main(argv: list[str]) -> int:
    grace_s = float(argv[1]) if len(argv) > 1 else 10.0
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the launcher's group: its close() cleans up
    stop_groups(read_registrations(sys.stdin), grace_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
