"""The tool sandbox holds against a determined model: an escape suite.

Every case is an attack a model could write, run through ``ToolSandbox`` as the env does,
and judged from the HOST: what a later call could read, what the host's memory holds after
the call, how much CPU the call's processes reported, which host paths the sandbox showed,
whether the pool still answers. A case raises ``AssertionError`` when the attack worked.

The same cases run against
  * the bubblewrap sandbox as the user running pytest (``test_escape``, the default suite),
  * the bubblewrap sandbox as an unprivileged uid when pytest runs as root
    (``test_escape_suite_as_unprivileged_user``: the suite again under ``setpriv``),
  * the unisolated fallback (``test_escape_fallback``, slow): cases marked ``fallback="open"`` are
    what it does not isolate (its warning names them); they are strict xfails, so the
    table flips when one starts to hold.
``SBX_ESCAPE_IMPL=<folder>`` runs the cases against another copy of the sandbox (a folder
holding ``sandbox.py``, ``_worker_main.py``, ``jsonl_process.py`` and ``env_sections.py``),
e.g. the code before the hardening; ``escape_table.py`` renders docs/RELIABILITY.md's
"Tool sandbox: escape suite" section from such runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import importlib.util
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import pytest

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# host paths a sandboxed call must not learn: the checkout, the Python install, the venv, homes
HOST_MARKERS = sorted({PROJECT_ROOT, os.path.realpath(sys.base_prefix), sys.prefix, "/root/", "/home/",
                       os.path.dirname(os.path.dirname(PROJECT_ROOT)) + "/"} - {"/"})
MIB = 1 << 20
LIMITS = dict(num_workers=1, wall_s=4.0, cpu_s=1, memory_bytes=256 * MIB, max_processes=8,
              file_size_bytes=1 * MIB, scratch_bytes=4 * MIB, max_output_bytes=4096, host_grace_s=2.0)
BOUND_S = LIMITS["wall_s"] + 4.0  # wall limit + worker replacement + a busy shared machine


def _load_impl(folder: str | None):
    """(ToolSandbox, SandboxConfig, SandboxUnavailable) of this checkout or of ``folder``."""
    if not folder:
        from rollout_bridge.tools.sandbox import SandboxConfig, SandboxUnavailable, ToolSandbox
        return ToolSandbox, SandboxConfig, SandboxUnavailable
    package = "sbx_impl_" + uuid.uuid4().hex[:8]
    spec = importlib.util.spec_from_file_location(package, os.path.join(folder, "__init__.py"),
                                                  submodule_search_locations=[folder])
    module = importlib.util.module_from_spec(spec)
    sys.modules[package] = module
    spec.loader.exec_module(module)
    sandbox = importlib.import_module(f"{package}.sandbox")
    return sandbox.ToolSandbox, sandbox.SandboxConfig, sandbox.SandboxUnavailable


ToolSandbox, SandboxConfig, SandboxUnavailable = _load_impl(os.environ.get("SBX_ESCAPE_IMPL"))


def make_config(**overrides):
    """A SandboxConfig with the suite's limits (fields the implementation lacks dropped)."""
    known = {f.name for f in dataclasses.fields(SandboxConfig)}
    values = {**LIMITS, **overrides}
    if values.get("isolation") == "rlimits_only":
        values["allow_unsafe_fallback"] = True
    return SandboxConfig(**{k: v for k, v in values.items() if k in known})


def make_box(**overrides):
    try:
        return ToolSandbox(make_config(**overrides))
    except SandboxUnavailable as exc:
        pytest.skip(f"sandbox unavailable here: {exc}")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    group: str
    title: str
    fn: object
    fallback: str  # "holds" | "open": what the unisolated fallback does against it
    slow: bool


CASES: list[Case] = []


def case(group: str, title: str, fallback: str = "holds", slow: bool = False):
    def register(fn):
        CASES.append(Case(fn.__name__, group, title, fn, fallback, slow))
        return fn
    return register


def call(box, code: str):
    """One call, bounded in time; the pool must answer the next call."""
    start = time.monotonic()
    result = box.run_sync(code)
    assert time.monotonic() - start < BOUND_S, f"call took {time.monotonic() - start:.1f}s"
    follow_up = box.run_sync("print(6 * 7)")
    assert follow_up.status == "ok" and follow_up.stdout.strip() == "42", follow_up
    return result


def no_host_paths(text: str) -> None:
    leaked = [m for m in HOST_MARKERS if m in text]
    assert not leaked, f"host paths visible in the sandbox: {leaked}: {text[:600]}"


def shmem_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no Shmem in /proc/meminfo")


# --- cross-call state: a later call on the same worker must find nothing ---------------------

LIBC = "import ctypes, ctypes.util\nlibc = ctypes.CDLL(None, use_errno=True)\n"
KEY = 0x5BC0FFEE & 0x7FFFFFFF


@case("cross-call IPC", "SysV shared memory written by one call, read by the next")
def sysv_shm_between_calls(box):
    call(box, LIBC + f"""
shm = libc.shmget({KEY}, 4096, 0o1666)
libc.shmat.restype = ctypes.c_void_p
addr = libc.shmat(shm, None, 0)
if shm >= 0 and addr not in (None, ctypes.c_void_p(-1).value):
    ctypes.memmove(addr, b'LEFT-BY-A', 9)
""")
    later = call(box, LIBC + f"""
shm = libc.shmget({KEY}, 4096, 0o666)
libc.shmat.restype = ctypes.c_void_p
addr = libc.shmat(shm, None, 0) if shm >= 0 else None
print(ctypes.string_at(addr, 9) if addr not in (None, ctypes.c_void_p(-1).value) else 'none')
""")
    assert "LEFT-BY-A" not in later.stdout, later


@case("cross-call IPC", "SysV message queue filled by one call, drained by the next")
def sysv_msg_between_calls(box):
    call(box, LIBC + f"""
q = libc.msgget({KEY}, 0o1666)
msg = ctypes.create_string_buffer(8 + 9); ctypes.memmove(msg, (1).to_bytes(8, 'little') + b'LEFT-BY-A', 17)
libc.msgsnd(q, msg, 9, 0o4000)
""")
    later = call(box, LIBC + f"""
q = libc.msgget({KEY}, 0o666)
buf = ctypes.create_string_buffer(64)
n = libc.msgrcv(q, buf, 56, 0, 0o4000) if q >= 0 else -1
print(buf.raw[8:8 + n] if n > 0 else 'none')
""")
    assert "LEFT-BY-A" not in later.stdout, later


@case("cross-call IPC", "SysV semaphore value set by one call, read by the next")
def sysv_sem_between_calls(box):
    call(box, LIBC + f"""
s = libc.semget({KEY}, 1, 0o1666)
if s >= 0: libc.semctl(s, 0, 16, 4242)  # SETVAL
""")
    later = call(box, LIBC + f"""
s = libc.semget({KEY}, 1, 0o666)
print('value', libc.semctl(s, 0, 12) if s >= 0 else -1)  # GETVAL
""")
    assert "value 4242" not in later.stdout, later


@case("cross-call IPC", "POSIX message queue left by one call, read by the next")
def posix_mq_between_calls(box):
    setup = LIBC + "rt = ctypes.CDLL(ctypes.util.find_library('rt') or None, use_errno=True)\n"
    call(box, setup + """
q = rt.mq_open(b'/sbxq', 0o100 | 0o2, 0o666, None)
if q >= 0: rt.mq_send(q, b'LEFT-BY-A', 9, 0)
""")
    later = call(box, setup + """
q = rt.mq_open(b'/sbxq', 0o2 | 0o4000)
buf = ctypes.create_string_buffer(8192)
n = rt.mq_receive(q, buf, 8192, None) if q >= 0 else -1
print(buf.raw[:n] if n > 0 else 'none')
""")
    assert "LEFT-BY-A" not in later.stdout, later


@case("cross-call IPC", "a /dev/shm file left by one call, read by the next", fallback="open")
def dev_shm_file_between_calls(box):
    call(box, "open('/dev/shm/sbx-left', 'w').write('LEFT-BY-A')")
    later = call(box, "import os\ntry: print(open('/dev/shm/sbx-left').read())\nexcept OSError as e: print(e)")
    assert "LEFT-BY-A" not in later.stdout, later


@case("cross-call IPC", "a POSIX shared memory object (shm_open) left by one call, read by the next",
      fallback="open")
def posix_shm_between_calls(box):
    call(box, LIBC + """
import os
fd = libc.shm_open(b'/sbxblock', os.O_CREAT | os.O_RDWR, 0o666)
if fd >= 0: os.write(fd, b'LEFT-BY-A')
""")
    later = call(box, LIBC + """
import os
fd = libc.shm_open(b'/sbxblock', os.O_RDONLY, 0)
print(os.read(fd, 9) if fd >= 0 else 'none')
""")
    assert "LEFT-BY-A" not in later.stdout, later


@case("cross-call IPC", "an abstract unix socket served by a process one call left behind")
def abstract_socket_between_calls(box):
    call(box, """
import os, socket, time
if os.fork() == 0:
    os.setsid()
    s = socket.socket(socket.AF_UNIX); s.bind(b'\\0sbx-sock'); s.listen(1)
    while True:
        c, _ = s.accept(); c.sendall(b'LEFT-BY-A'); c.close()
time.sleep(0.3)
""")
    later = call(box, """
import socket
s = socket.socket(socket.AF_UNIX)
try: s.connect(b'\\0sbx-sock'); print(s.recv(64))
except OSError as e: print(e)
""")
    assert "LEFT-BY-A" not in later.stdout, later


@case("cross-call IPC", "a file in a folder made unreadable (mode 000) in scratch")
def locked_scratch_folder_between_calls(box):
    call(box, "import os\nos.makedirs('d/e'); open('d/e/f', 'w').write('LEFT-BY-A'); os.chmod('d/e', 0); os.chmod('d', 0)")
    later = call(box, "import os\nprint(os.listdir('.'), os.path.exists('d'))")
    assert later.stdout.strip() == "[] False", later


@case("cross-call IPC", "a file written next to the scratch folder (its parent)", fallback="open")
def scratch_parent_between_calls(box):
    call(box, "import os\nfor p in ('..', '/scratch', '/tmp'):\n    try: open(os.path.join(p, 'sbx-left'), 'w').write('LEFT-BY-A')\n    except OSError: pass")
    later = call(box, "import os\nfor p in ('..', '/scratch', '/tmp'):\n    try: print(open(os.path.join(p, 'sbx-left')).read())\n    except OSError: pass")
    assert "LEFT-BY-A" not in later.stdout, later


# --- memory that outlives the call ----------------------------------------------------------

@case("memory after the call", "SysV segments (3 x 100 MiB, detached) left in the host's memory", slow=True)
def sysv_memory_outlives_call(box):
    before = shmem_bytes()
    call(box, LIBC + """
libc.shmat.restype = ctypes.c_void_p
for i in range(3):
    shm = libc.shmget(0x5BC00 + i, 100 << 20, 0o1666)
    if shm < 0: break
    addr = libc.shmat(shm, None, 0)
    ctypes.memset(addr, 1, 100 << 20)
    libc.shmdt(ctypes.c_void_p(addr))
""")
    grown = shmem_bytes() - before
    assert grown < 150 * MIB, f"host shared memory grew by {grown / MIB:.0f} MiB after the call"


@case("memory after the call", "/dev/shm filled (200 files of 1 MB), left in the host's memory",
      fallback="open", slow=True)
def dev_shm_memory_outlives_call(box):
    before = shmem_bytes()
    call(box, """
for i in range(200):  # files under file_size_bytes (1 MiB)
    with open(f'/dev/shm/sbx-fill-{i}', 'wb') as f:
        f.write(b'1' * 1_000_000)
""")
    grown = shmem_bytes() - before
    left = [name for name in os.listdir("/dev/shm") if name.startswith("sbx-fill-")]
    for name in left:  # the fallback writes the host's /dev/shm
        os.unlink(os.path.join("/dev/shm", name))
    assert not left, f"{len(left)} files of the call left in the host's /dev/shm"
    assert grown < 100 * MIB, f"host shared memory grew by {grown / MIB:.0f} MiB after the call"


# --- limits per call, over the whole process tree -------------------------------------------

HOLD = """
import os, sys, time
def hold(mib):
    x = b'1' * (mib << 20)
    print('holding', mib, flush=True)
    time.sleep(1.5)
    os._exit(0)
"""


@case("per-call limits", "three forked processes each holding 100 MiB (memory_bytes 256 MiB)")
def memory_over_forks(box):
    result = call(box, HOLD + """
kids = []
for _ in range(3):
    pid = os.fork()
    if pid == 0:
        hold(100)
    kids.append(pid)
ok = all(os.waitpid(k, 0)[1] == 0 for k in kids)
print('ALL-HELD' if ok else 'stopped')
""")
    assert "ALL-HELD" not in result.stdout, result


@case("per-call limits", "three children in new sessions each holding 100 MiB")
def memory_over_setsid_children(box):
    result = call(box, HOLD + """
import signal
r, w = os.pipe()
for _ in range(3):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            x = b'1' * (100 << 20); os.write(w, b'h'); time.sleep(1.5); os.write(w, b'd'); os._exit(0)
        os._exit(0)
os.close(w)
got = b''
deadline = time.time() + 3
while time.time() < deadline:
    data = os.read(r, 16)
    if not data: break
    got += data
print('ALL-HELD' if got.count(b'd') == 3 else 'stopped', got)
""")
    assert "ALL-HELD" not in result.stdout, result


@case("per-call limits", "150 MiB in /dev/shm plus 150 MiB of heap (memory_bytes 256 MiB)", fallback="open")
def memory_dev_shm_plus_heap(box):
    result = call(box, """
import time
for i in range(150):  # files under file_size_bytes (1 MiB)
    with open(f'/dev/shm/sbx-half-{i}', 'wb') as f:
        f.write(b'1' * 1_000_000)
x = b'1' * (150 << 20)
time.sleep(1.0)
print('ALL-HELD')
""")
    for name in os.listdir("/dev/shm"):  # the fallback writes the host's /dev/shm
        if name.startswith("sbx-half-"):
            os.unlink(os.path.join("/dev/shm", name))
    assert "ALL-HELD" not in result.stdout, result


def _cpu_reported(stdout: str) -> float:
    """Sum over the call's processes of the last CPU time each reported (``cpu <id> <s>``)."""
    last = {}
    for who, seconds in re.findall(r"cpu (\S+) ([0-9.]+)", stdout):
        last[who] = float(seconds)
    return sum(last.values())


BURN = """
import os, time
def burn(tag):
    last = 0.0
    while True:
        for _ in range(20000): pass
        now = time.process_time()
        if now - last >= 0.1:
            print('cpu', tag, round(now, 2), flush=True)
            last = now
"""


@case("per-call limits", "four busy children in new sessions (cpu_s 1): CPU summed over the tree")
def cpu_over_setsid_children(box):
    result = call(box, BURN + """
for i in range(4):
    if os.fork() == 0:
        os.setsid(); burn(i)
os.wait()
""")
    used = _cpu_reported(result.stdout)
    assert used < box.config.cpu_s + 0.25, f"the call's processes used {used:.2f}s CPU (cpu_s {box.config.cpu_s})"


@case("per-call limits", "three busy children one after another, each under cpu_s (reaped: children's CPU)")
def cpu_over_sequential_children(box):
    result = call(box, BURN.replace("while True:", "while time.process_time() < 0.8:") + """
for i in range(3):
    pid = os.fork()
    if pid == 0:
        burn(i); os._exit(0)
    os.waitpid(pid, 0)
""")
    used = _cpu_reported(result.stdout)
    assert used < box.config.cpu_s + 0.25, f"the call's processes used {used:.2f}s CPU (cpu_s {box.config.cpu_s})"


@case("per-call limits", "busy orphans (double fork) that exit before the call ends")
def cpu_over_orphans(box):
    result = call(box, BURN.replace("while True:", "while time.process_time() < 0.7:") + """
for i in range(3):
    if os.fork() == 0:
        if os.fork() == 0:
            burn(i); os._exit(0)
        os._exit(0)
    time.sleep(0.05)
time.sleep(3)
""")
    used = _cpu_reported(result.stdout)
    assert used < box.config.cpu_s + 0.25, f"the call's processes used {used:.2f}s CPU (cpu_s {box.config.cpu_s})"


@case("per-call limits", "processes in new sessions beyond max_processes, all alive at once")
def processes_over_setsid(box):
    result = call(box, """
import os, time
r, w = os.pipe()
for i in range(20):
    try: pid = os.fork()
    except OSError: break
    if pid == 0:
        os.setsid(); os.write(w, b'a'); time.sleep(2); os._exit(0)
os.close(w); time.sleep(0.5)
os.set_blocking(r, False)
try: print('alive', len(os.read(r, 100)) + 1)
except BlockingIOError: print('alive', 1)
""")
    alive = [int(n) for n in re.findall(r"alive (\d+)", result.stdout)]
    assert all(n <= box.config.max_processes for n in alive), result


@case("per-call limits", "a thread bomb (threads are tasks)")
def thread_bomb(box):
    result = call(box, """
import threading, time
threads = []
for i in range(200):
    try:
        t = threading.Thread(target=time.sleep, args=(2,)); t.start(); threads.append(t)
    except RuntimeError: break
print('threads', len(threads) + 1)
""")
    counts = [int(n) for n in re.findall(r"threads (\d+)", result.stdout)]
    assert all(n <= box.config.max_processes for n in counts), result


@case("per-call limits", "output from forked children together over max_output_bytes")
def output_over_children(box):
    result = call(box, """
import os
for i in range(4):
    if os.fork() == 0:
        os.write(1, b'x' * 3000); os._exit(0)
    os.wait()
""")
    assert len(result.stdout) <= box.config.max_output_bytes, len(result.stdout)


@case("per-call limits", "a stderr flood")
def stderr_flood(box):
    result = call(box, "import sys\nwhile True:\n    sys.stderr.write('E' * 1000)")
    assert len(result.stderr) <= box.config.max_output_bytes and result.status == "output_limit", result


@case("verdicts", "over memory over forks: the feedback says 'memory limit'")
def memory_verdict_named(box):
    result = call(box, """
import os, time
for _ in range(3):
    if os.fork() == 0:
        x = b'1' * (100 << 20); time.sleep(2); os._exit(0)
time.sleep(2.5)
""")
    assert "[memory limit]" in result.feedback(200), result


@case("verdicts", "over CPU over children: the feedback says 'time limit'")
def time_verdict_named(box):
    result = call(box, BURN + "\nfor i in range(2):\n    if os.fork() == 0: burn(i)\nos.wait()")
    assert "[time limit]" in result.feedback(10_000)[-40:], result.feedback(10_000)[-200:]


@case("verdicts", "a fork bomb: the feedback says 'process limit'")
def process_verdict_named(box):
    result = call(box, "import os, time\nwhile True:\n    try: os.fork()\n    except OSError: time.sleep(0.01)")
    assert "[process limit]" in result.feedback(10_000)[-40:], result.feedback(10_000)[-200:]


@case("verdicts", "a stdout flood: the feedback says 'output limit'")
def output_verdict_named(box):
    result = call(box, "while True:\n    print('A' * 1000)")
    assert result.feedback(200).endswith("[output limit]"), result.feedback(200)


# --- the worker is closed to its calls ------------------------------------------------------

@case("reading the worker", "the worker's memory (/proc/<ppid>/mem): an earlier call's code")
def worker_memory(box):
    call(box, "note = 'EARLIER-' + 'X' * 3 + '-CODE-7q'\nprint(len('EARLIER-XXX-CODE-7q'))")
    later = call(box, """
import os
needle = ''.join(reversed('q7-EDOC-XXX-REILRAE')).encode()  # built at run time: this call's own source never holds it
found = 'no'
try:
    ppid = os.getppid()
    with open(f'/proc/{ppid}/maps') as maps, open(f'/proc/{ppid}/mem', 'rb') as mem:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split('-'))
            if 'rw' not in line.split()[1] or hi - lo > (64 << 20): continue
            try:
                mem.seek(lo)
                if needle in mem.read(hi - lo): found = 'FOUND'
            except OSError: pass
except OSError as e:
    print('denied', type(e).__name__)
print(found)
""")
    assert "FOUND" not in later.stdout, later


@case("reading the worker", "the worker's environment (/proc/<ppid>/environ)")
def worker_environ(box):
    result = call(box, "import os\ntry: print(open(f'/proc/{os.getppid()}/environ', 'rb').read())\nexcept OSError as e: print('denied')")
    assert "PATH=" not in result.stdout, result


@case("reading the worker", "the worker's memory map (/proc/<ppid>/maps)")
def worker_maps(box):
    result = call(box, "import os\ntry: print(open(f'/proc/{os.getppid()}/maps').read())\nexcept OSError as e: print('denied')")
    assert "python" not in result.stdout, result


@case("reading the worker", "the worker's open files (/proc/<ppid>/fd)")
def worker_fds(box):
    result = call(box, "import os\ntry: print(os.listdir(f'/proc/{os.getppid()}/fd'))\nexcept OSError as e: print('denied')")
    assert "denied" in result.stdout, result


@case("reading the worker", "this call's own open files: nothing of the host or the protocol")
def own_fds(box):
    result = call(box, "import os\nfor fd in os.listdir('/proc/self/fd'):\n    try: print(fd, os.readlink(f'/proc/self/fd/{fd}'))\n    except OSError: pass")
    fds = [int(line.split()[0]) for line in result.stdout.splitlines() if line.strip()]
    assert max(fds) <= 3, result  # 0, 1, 2 and listdir's own descriptor
    no_host_paths(result.stdout)


@case("reading the worker", "signal the worker (SIGSTOP): bounded, the pool recovers")
def stop_the_worker(box):
    call(box, "import os, signal, time\ntry: os.kill(os.getppid(), signal.SIGSTOP)\nexcept OSError: pass\ntime.sleep(0.2)")


# --- host paths ------------------------------------------------------------------------------

@case("host paths", "/proc/1/cmdline (bwrap's arguments)")
def init_cmdline(box):
    result = call(box, "print(open('/proc/1/cmdline').read().replace('\\0', ' '))")
    no_host_paths(result.stdout)
    assert "child_uid" not in result.stdout, result


@case("host paths", "the worker's command line (/proc/<ppid>/cmdline)")
def worker_cmdline(box):
    result = call(box, "import os\nprint(open(f'/proc/{os.getppid()}/cmdline').read().replace('\\0', ' '))")
    no_host_paths(result.stdout)
    assert "child_uid" not in result.stdout, result


@case("host paths", "/proc/self/mountinfo")
def mountinfo(box):
    result = call(box, "print(open('/proc/self/mountinfo').read())")
    no_host_paths(result.stdout)


@case("host paths", "/proc/self/maps (mapped interpreter and libraries)")
def own_maps(box):
    result = call(box, "print(open('/proc/self/maps').read())")
    no_host_paths(result.stdout)


@case("host paths", "sys.executable, sys.prefix, sys.path, os.__file__")
def interpreter_paths(box):
    result = call(box, "import sys, os\nprint(sys.executable, sys.prefix, sys.base_prefix, sys.path, os.__file__)")
    no_host_paths(result.stdout)


@case("host paths", "the environment and the working directory")
def environment_and_cwd(box):
    result = call(box, "import os\nprint(dict(os.environ), os.getcwd())")
    no_host_paths(result.stdout)


@case("host paths", "a traceback's file names")
def traceback_paths(box):
    result = call(box, "import json\njson.loads('{')")
    assert result.status == "error"
    no_host_paths(result.stderr)


# --- the worker's lifetime -------------------------------------------------------------------

KILL_WORKER = "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nimport time; time.sleep(2)"


def crash_workers(box) -> None:
    """Host-side fault: SIGKILL every idle worker's process group (as a crash would)."""
    import signal

    for worker in list(box._idle.queue):
        os.killpg(worker.process.proc.pid, signal.SIGKILL)


@case("worker lifetime", "a worker replaced in one asyncio.run answers in the next")
def replacement_across_asyncio_run(box):
    crash_workers(box)
    asyncio.run(box.run("print(1)"))  # finds the worker dead: replaced in the loop's executor thread
    time.sleep(0.3)  # the default executor's threads are gone; so would be workers they parented
    results = [asyncio.run(box.run("print(7)")) for _ in range(box.config.num_workers + 1)]
    assert all(r.status == "ok" and r.stdout.strip() == "7" for r in results), results


@case("worker lifetime", "a worker replaced in a thread that then exits answers afterwards")
def replacement_in_exited_thread(box):
    crash_workers(box)
    thread = threading.Thread(target=box.run_sync, args=("print(1)",))
    thread.start()
    thread.join()
    time.sleep(0.3)
    results = [box.run_sync("print(7)") for _ in range(box.config.num_workers + 1)]
    assert all(r.status == "ok" for r in results), results


@case("worker lifetime", "a sandbox built in a thread that then exits still answers")
def built_in_exited_thread(box):
    built = []
    thread = threading.Thread(target=lambda: built.append(ToolSandbox(box.config)))
    thread.start()
    thread.join()
    time.sleep(0.3)
    with built[0] as other:
        results = [other.run_sync("print(7)") for _ in range(2)]
    assert all(r.status == "ok" for r in results), results


@case("worker lifetime", "close() leaves no worker process behind")
def close_leaves_nothing(box):
    def mine():
        kids = subprocess.run(["ps", "-o", "pid=,comm=", "--ppid", str(os.getpid())], capture_output=True, text=True)
        return {line.split()[0] for line in kids.stdout.splitlines() if line.split()[1:] != ["ps"]}

    before = mine()
    other = ToolSandbox(box.config)
    assert other.run_sync("print(1)").status == "ok"
    other.close()
    time.sleep(0.3)
    left = mine() - before
    assert not left, f"processes left after close(): {left}"


# --- the classics ----------------------------------------------------------------------------

@case("classics", "read /etc/shadow and /etc/passwd", fallback="open")
def read_etc(box):
    result = call(box, "for p in ('/etc/shadow', '/etc/passwd'):\n    try: print(open(p).read())\n    except OSError: pass")
    assert "root:" not in result.stdout, result


@case("classics", "read the project's files", fallback="open")
def read_project(box):
    path = os.path.join(PROJECT_ROOT, "pyproject.toml")
    result = call(box, f"try: print(open({path!r}).read())\nexcept OSError as e: print(type(e).__name__)")
    assert "[project]" not in result.stdout, result


@case("classics", "write outside the writable folders", fallback="open")
def write_outside(box):
    target = os.path.join("/var/tmp", f"sbx-escape-{uuid.uuid4().hex[:8]}")
    call(box, f"try: open({target!r}, 'w').write('x')\nexcept OSError: pass")
    exists = os.path.exists(target)
    if exists:
        os.unlink(target)
    assert not exists, f"the call wrote {target} on the host"


@case("classics", "a TCP connection to a host listener")
def tcp_to_host(box):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.1)
    port = server.getsockname()[1]
    try:
        call(box, f"import socket\ntry: socket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'hi')\nexcept OSError: pass")
        try:
            server.accept()[0].close()
            connected = True
        except (TimeoutError, socket.timeout, BlockingIOError):
            connected = False
    finally:
        server.close()
    assert not connected, "the call reached a host TCP listener"


@case("classics", "the environment holds no host secret")
def env_secret(box):
    result = call(box, "import os\nprint(dict(os.environ))")
    assert "SBX_HOST_SECRET" not in result.stdout, result


@case("classics", "a fork bomb: bounded, later calls see no leftover process")
def fork_bomb(box):
    call(box, "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass")
    listing = call(box, "import os\nprint(len([p for p in os.listdir('/proc') if p.isdigit()]))")
    assert int(listing.stdout) <= 3 or box.isolation != "bwrap", listing


@case("classics", "a background process left by a call (new session, double fork) is gone")
def background_process_gone(box):
    name = "sbx" + uuid.uuid4().hex[:10]
    call(box, f"""
import os, ctypes, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        ctypes.CDLL(None).prctl(15, {name.encode()!r}, 0, 0, 0)
        time.sleep(30)
    os._exit(0)
time.sleep(0.2)
""")
    time.sleep(0.2)
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == name:
                    alive.append(pid)
        except OSError:
            pass
    assert not alive, f"process {name} survived its call: {alive}"


@case("classics", "exec a shell")
def exec_shell(box):
    result = call(box, "import os\nprint(os.system('echo pwned'))")
    assert "pwned" not in result.stdout, result


@case("classics", "kill the worker (SIGKILL to the parent): bounded, the pool recovers")
def kill_the_worker(box):
    call(box, KILL_WORKER)


@case("classics", "a memory bomb in one process")
def memory_bomb(box):
    result = call(box, "x = b'1' * (1 << 30)\nprint('ALLOCATED')")
    assert "ALLOCATED" not in result.stdout, result


@case("classics", "fill the scratch disk")
def fill_disk(box):
    call(box, "import os\ntry:\n    for i in range(100): open(f'f{i}', 'wb').write(b'0' * 500_000)\nexcept OSError: pass")
    later = call(box, "import os\nprint(os.listdir('.'))")
    assert later.stdout.strip() == "[]", later


# --- the fallback ----------------------------------------------------------------------------

@case("fallback", "the fallback is refused unless allow_unsafe_fallback is set")
def fallback_refused_by_default(box):
    known = {f.name for f in dataclasses.fields(SandboxConfig)}
    try:
        config = SandboxConfig(**{k: v for k, v in {**LIMITS, "isolation": "rlimits_only"}.items() if k in known})
    except ValueError as exc:
        assert "allow_unsafe_fallback" in str(exc), exc
        return
    ToolSandbox(config).close()
    raise AssertionError("an unisolated sandbox started without allow_unsafe_fallback")


@case("fallback", "two fallback workers: a call deletes / reads the other's files")
def fallback_scratch_shared(box):
    other = ToolSandbox(make_config(isolation="rlimits_only", num_workers=2))

    async def both():
        writer = other.run("import os, time\nopen('mine', 'w').write('A')\ntime.sleep(0.8)\nprint(sorted(os.listdir('.')))")
        thief = other.run("import os, time\ntime.sleep(0.3)\nfor f in os.listdir('.'):\n    print('saw', f); os.unlink(f)")
        return await asyncio.gather(writer, thief)

    with other:
        written, thief = asyncio.run(both())
    assert "mine" in written.stdout and "saw mine" not in thief.stdout, (written, thief)


@case("fallback", "the fallback starts and answers (as root and as non-root)")
def fallback_starts(box):
    with ToolSandbox(make_config(isolation="rlimits_only")) as other:
        result = other.run_sync("print(6 * 7)")
    assert result.status == "ok" and result.stdout.strip() == "42", result


# --- the suite ------------------------------------------------------------------------------

LEFTOVERS = ("sbx-left", "sbx-fill-", "sbx-half-", "sbxblock")


@pytest.fixture(autouse=True)
def remove_host_leftovers():
    """What the unisolated fallback lets a case write on the host (/dev/shm, /tmp) is
    removed after the case."""
    yield
    for folder in ("/dev/shm", "/tmp", "/var/tmp"):
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            if name.startswith(LEFTOVERS):
                try:
                    os.unlink(os.path.join(folder, name))
                except OSError:
                    pass


@pytest.fixture(scope="module")
def box():
    os.environ["SBX_HOST_SECRET"] = "sbx-secret-value"
    sandbox = make_box()
    yield sandbox
    sandbox.close()
    os.environ.pop("SBX_HOST_SECRET", None)


@pytest.fixture(scope="module")
def fallback_box():
    sandbox = make_box(isolation="rlimits_only")
    yield sandbox
    sandbox.close()


def _param(c: Case, for_fallback: bool):
    marks = [pytest.mark.slow] if c.slow or for_fallback else []
    if for_fallback and c.fallback == "open":
        marks.append(pytest.mark.xfail(strict=True, reason="the unisolated fallback does not isolate this"))
    return pytest.param(c, id=c.name, marks=marks)


@pytest.mark.parametrize("escape", [_param(c, False) for c in CASES])
def test_escape(box, escape):
    escape.fn(box)


@pytest.mark.parametrize("escape", [_param(c, True) for c in CASES if c.group not in ("fallback",)])
def test_escape_fallback(fallback_box, escape):
    escape.fn(fallback_box)


def unprivileged_command(uid: int, argv: list[str]) -> list[str]:
    """``argv`` as ``uid`` (no capabilities), in a private mount namespace where the folders
    it needs (the Python install, the venv, this checkout) are reachable: a parent folder
    closed to others (e.g. /root, 0700) is covered by a 0755 tmpfs and the needed folder
    bound back below it. The host's folders and modes are untouched."""
    needed = sorted({os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix), PROJECT_ROOT})
    script = ["set -e"]
    for path in needed:
        parts = path.strip("/").split("/")
        for i in range(1, len(parts)):
            parent = "/" + "/".join(parts[:i])
            if not os.stat(parent).st_mode & 0o001:
                hold = f"/tmp/sbx-hold-{uuid.uuid4().hex[:8]}"
                script += [f"mkdir {hold}", f"mount --bind {path} {hold}",
                           f"mount -t tmpfs -o mode=0755 tmpfs {parent}", f"mkdir -p {path}",
                           f"mount --move {hold} {path}", f"rmdir {hold}"]
                break
    script.append('exec setpriv --reuid="$SBX_UID" --regid="$SBX_UID" --clear-groups --inh-caps=-all '
                  '--bounding-set=-all -- "$@"')
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", "\n".join(script), "sh", *argv]


@pytest.mark.slow
def test_escape_suite_as_unprivileged_user():
    """The same cases as a plain user (uid 31337, no capabilities): bwrap then makes its
    own user namespace, and the call shares the worker's uid."""
    if os.geteuid() != 0:
        pytest.skip("pytest already runs unprivileged: test_escape is the non-root run")
    if shutil.which("setpriv") is None or shutil.which("unshare") is None:
        pytest.skip("setpriv/unshare (util-linux) not installed")
    home = tempfile.mkdtemp(prefix="sbx-user-", dir="/tmp")  # tmp_path's parents are closed to others
    os.chmod(home, 0o777)
    env = {**os.environ, "SBX_UID": "31337", "HOME": home, "USER": "sbxtest", "TMPDIR": home,
           "PYTHONPATH": PROJECT_ROOT}
    argv = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-m", "not integration",
            os.path.abspath(__file__), "-k", "test_escape and not test_escape_fallback and not unprivileged",
            "-o", "addopts="]
    try:
        done = subprocess.run(unprivileged_command(31337, argv), env=env, capture_output=True, text=True,
                              timeout=900, cwd=home)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.split("\n")[-2], done.stdout[-2000:]


def test_every_case_is_in_the_reliability_table():
    """docs/RELIABILITY.md's "Tool sandbox: escape suite" section lists every case (rendered
    by tests/sandbox_escape_table.py from runs of this suite)."""
    with open(os.path.join(PROJECT_ROOT, "docs", "RELIABILITY.md")) as f:
        text = f.read()
    assert "## Tool sandbox: escape suite" in text
    section = text.split("## Tool sandbox: escape suite", 1)[1]
    missing = [c.name for c in CASES if f"(`{c.name}`)" not in section]
    assert not missing, f"run tests/sandbox_escape_table.py: cases missing from the table: {missing}"
    assert len(CASES) >= 40
