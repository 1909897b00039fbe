"""One job per output folder: a lock file held for the whole run.

``<output_dir>/.spopp-run.lock`` is created with O_EXCL and holds who owns the folder:
pid, host, the boot id and the process start time (clock ticks since boot, from
/proc/<pid>/stat), the command line and when it was taken. A second job on the same
folder is refused with one line naming the holder. A lock whose holder is gone is stale
and is taken over with a log line: on the same host (and boot) the holder is gone when no
process has its pid, or the process with its pid started at another time (the pid was
reused). A lock held from another host is never judged stale (its process cannot be
seen); the message says which file to remove once that job is known to be gone.

The takeover of a stale lock runs under an flock on the run folder, so two jobs finding
the same stale lock cannot both take it. The lock is released (removed, if still
ours) when the job ends, by `release` or at interpreter exit; `kill -9` leaves it behind,
stale, for the next job to take over.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from rollout_bridge.run_errors import UserError

LOCK_FILE = ".spopp-run.lock"


@contextlib.contextmanager
def folder_flock(folder: str | os.PathLike):
    """An exclusive flock on ``folder`` itself (no extra file is left), released on exit:
    one holder at a time, whether the others are processes or threads (each call opens
    its own descriptor)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)   # closing the descriptor releases the flock


@dataclasses.dataclass(frozen=True)
class Holder:
    """Who holds a run folder."""

    pid: int
    host: str
    boot_id: str
    start_ticks: int | None
    argv: str
    since: float

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        command = self.argv if len(self.argv) <= 120 else self.argv[:117] + "..."
        return f"pid {self.pid} on {self.host} (since {when}: {command})"


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def process_start_ticks(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks since boot; None when there is no such
    process (or no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # field 2 (comm) may hold spaces and parentheses: split after its closing ')'
    return int(stat[stat.rindex(")") + 2:].split()[19])


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def this_process() -> Holder:
    return Holder(os.getpid(), socket.gethostname(), _boot_id(), process_start_ticks(os.getpid()),
                  " ".join([Path(sys.argv[0]).name if sys.argv else "python", *sys.argv[1:]]), time.time())


def is_stale(holder: Holder) -> bool:
    """True when ``holder``'s process is known to be gone (same host and boot only)."""
    me = this_process()
    if holder.host != me.host:
        return False
    if holder.boot_id and me.boot_id and holder.boot_id != me.boot_id:
        return True   # the machine rebooted since: no process of that boot lives
    if not _pid_alive(holder.pid):
        return True
    ticks = process_start_ticks(holder.pid)
    return holder.start_ticks is not None and ticks is not None and ticks != holder.start_ticks


def read_holder(path: Path) -> Holder | None:
    """The holder recorded in ``path``; None when the file is gone or unreadable (a lock
    being written at this moment, or torn by a crash)."""
    try:
        record = json.loads(path.read_text())
        return Holder(int(record["pid"]), str(record["host"]), str(record.get("boot_id", "")),
                      record.get("start_ticks"), str(record.get("argv", "")), float(record.get("since", 0)))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def settled_holder(path: Path) -> Holder | None:
    """``read_holder``, read once more after a moment when the file exists but does not
    parse (a writer mid-way); None then means it is gone or torn (left by a crash)."""
    holder = read_holder(path)
    if holder is None and path.exists():
        time.sleep(0.2)
        holder = read_holder(path)
    return holder


def live_holder(folder: str | os.PathLike) -> Holder | None:
    """Who holds ``folder``'s run lock, when that process is alive or cannot be seen
    (another host); None when there is no lock or its holder is gone."""
    holder = settled_holder(Path(folder) / LOCK_FILE)
    return holder if holder is not None and not is_stale(holder) else None


class RunLock:
    """The lock of one run folder (`acquire`, `release`; a context manager)."""

    def __init__(self, folder: str | os.PathLike, log=None):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self.log = log or (lambda message: print(message, flush=True))
        self.held = False

    def acquire(self) -> "RunLock":
        """Takes the lock or raises UserError naming the holder."""
        me = this_process()
        for _ in range(3):
            if self._create(me):
                self.held = True
                atexit.register(self.release)
                return self
            with self._guard():
                holder = settled_holder(self.path)   # a writer mid-way gets a moment
                if holder is None and self.path.exists():
                    self.log(f"run lock: {self.path} is unreadable (left by a crash); taking it over")
                    self.path.unlink(missing_ok=True)
                    continue
                if holder is None:
                    continue
                if holder.pid == me.pid and holder.host == me.host and holder.start_ticks == me.start_ticks:
                    self.held = True   # this process took it already
                    return self
                if not is_stale(holder):
                    raise UserError(self.refusal(holder))
                self.log(f"run lock: {self.folder} was held by {holder.describe()}, which is gone "
                         "(a crash or kill); taking it over")
                self.path.unlink(missing_ok=True)
        raise UserError(f"output_dir {self.folder}: could not take the run lock {self.path} "
                        "(another job keeps taking it); choose another --output_dir")

    def refusal(self, holder: Holder) -> str:
        remote = "" if holder.host == socket.gethostname() else \
            f" (another host: if that job is gone, remove {self.path})"
        return (f"output_dir {self.folder} is in use by {holder.describe()}{remote}; wait for it to "
                "finish or choose another --output_dir")

    def _create(self, me: Holder) -> bool:
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / f"{LOCK_FILE}.{me.pid}.tmp"
        tmp.write_text(json.dumps(dataclasses.asdict(me)))
        try:
            os.link(tmp, self.path)   # atomic: the lock appears complete or not at all
            return True
        except FileExistsError:
            return False
        except OSError as error:
            if error.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
            try:   # a file system without hard links
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "w") as f:
                f.write(tmp.read_text())
            return True
        finally:
            tmp.unlink(missing_ok=True)

    @contextlib.contextmanager
    def _guard(self):
        """An flock on the run folder itself (no extra file is left behind)."""
        with folder_flock(self.folder):
            yield

    def release(self) -> None:
        """Removes the lock file if this process still holds it."""
        if not self.held:
            return
        self.held = False
        holder = read_holder(self.path)
        if holder is not None and holder.pid == os.getpid():
            self.path.unlink(missing_ok=True)

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
