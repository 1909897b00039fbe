"""A child process spoken to in JSON lines (one request line in, one reply line out), with
a deadline on every reply and a kill of its whole process group.

Shared by the sandbox workers (``sandbox._Worker``) and the math-verify process
(``envs.math_tir.verifier``). A plain ``subprocess`` rather than ``multiprocessing``: no
re-import of the caller's ``__main__`` (spawn) and no fork of a threaded JAX process.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time

READ_CHUNK = 65536
STDERR_WAIT_S = 0.5


class JsonLineProcess:
    """``request(obj, timeout_s) -> dict | None`` (None: no reply in time, or the process
    died). Not thread-safe: one request at a time."""

    def __init__(self, command: list[str], env: dict | None = None, cwd: str | None = None, *,
                 executable: str | None = None, pass_fds: tuple[int, ...] = ()):
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=env, cwd=cwd, start_new_session=True,
                                     executable=executable, pass_fds=pass_fds)
        self._buffer = b""

    def read_reply(self, timeout_s: float) -> dict | None:
        """The next reply line, or None after ``timeout_s`` or at end of output."""
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            data = os.read(fd, READ_CHUNK)
            if not data:
                return None
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def request(self, message: dict, timeout_s: float) -> dict | None:
        try:
            self.proc.stdin.write(json.dumps(message).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        return self.read_reply(timeout_s)

    def stderr_text(self) -> str:
        """What the process wrote to stderr so far (for start-up errors)."""
        try:
            if select.select([self.proc.stderr], [], [], STDERR_WAIT_S)[0]:
                return os.read(self.proc.stderr.fileno(), READ_CHUNK).decode("utf-8", "replace")
        except (OSError, ValueError):
            pass
        return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the process group (the process and everything it started)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                pipe.close()
            except OSError:
                pass
