"""The warm worker that runs INSIDE the sandbox (stdlib only: nothing of the project is
visible there).

Protocol: the first line on fd 0 is the JSON settings (so the worker's command line holds no
setting), answered by ``{"ready": true}``; then one JSON object per line on fd 0
(``{"code": str}``), one JSON reply per line on fd 1 (``{"status", "exit_code", "stdout",
"stderr", "elapsed_s"}``). The worker's own stdin/stdout are moved off fds 0/1 first, so
model code can never write into the protocol, and every other inherited fd is closed.

The worker is non-dumpable (its ``/proc/<pid>/mem``, ``environ``, ``maps`` are closed to a
call even one running with the worker's uid) and a child subreaper (every orphan of a call
is re-parented to it, so the call's whole process tree stays below it).

Each call forks this warm interpreter (so a call costs a fork, not an interpreter start;
every call starts from the same clean image). The forked child:
  * runs in a fresh, empty scratch directory;
  * drops to ``child_uid`` when the sandbox was started by root;
  * enters a new user + IPC namespace of its own (its uid mapped onto itself, no
    capability kept): no SysV or POSIX IPC object of an earlier call is reachable and the
    call's own are freed with its last process (``call_namespaces``: required in the bwrap sandbox, best effort, with a
    new network namespace too, in the unisolated fallback);
  * gets rlimits: CPU seconds, address space, tasks, file size, no core files;
  * gets a seccomp filter refusing exec, ptrace, new namespaces, mount, bpf, perf, keys,
    SysV IPC and POSIX message queues (x86_64; skipped elsewhere);
  * has stdout/stderr on pipes that the worker reads up to ``max_output_bytes`` each (the
    whole process tree shares them).
While the call runs the worker measures the call's whole process tree (``POLL_S`` after the
fork, then every ``POLL_MAX_S`` at most):
tasks (processes and threads), CPU seconds (user + system, children included) and memory
(proportional set size, plus what ``/dev/shm`` holds in the sandbox). Over a limit, the
tree is killed and the status names the limit: ``process_limit``, ``timeout`` (CPU or
wall), ``memory_limit``; ``output_limit`` when a stream overflows.
After the call EVERY process of the call is SIGKILLed and reaped (in the sandbox: all of
its pid namespace except pid 1, bwrap's init, and the worker; in the fallback: the
worker's descendants) and the writable folders (scratch, and ``/dev/shm`` in the sandbox)
are emptied; a worker that cannot empty them exits (the host replaces it).

Usage: python -I -B _worker_main.py   (settings on the first stdin line)
"""

import ctypes
import io
import json
import os
import resource
import select
import signal
import stat
import struct
import sys
import time
import traceback

READ_CHUNK = 65536
KILL_ROUNDS = 200  # at most this many /proc sweeps to empty the namespace
KILL_SWEEP_SLEEP_S = 0.001
# the call's process tree is measured POLL_S after the fork, then at intervals doubling up
# to POLL_MAX_S (a long call pays a few polls per 100 ms; what the tree can overshoot in
# between is bounded by the per-process rlimits)
POLL_S = 0.01
POLL_MAX_S = 0.04
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
SANDBOX_SHM = "/dev/shm"

# stdlib modules imported once by the worker, so a call finds them in its forked image:
# what arithmetic tool code imports, and importlib.resources, whose imports (typing,
# pathlib, tempfile, random, zipfile, ...) the benchmark found to take several ms off
# every call, trivial ones included (benchmarks/tool_sandbox.py --before)
COMMON_MODULES = ("math", "cmath", "fractions", "decimal", "itertools", "functools", "collections",
                  "statistics", "random", "re", "importlib.resources")

PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWNET = 0x08000000, 0x10000000, 0x40000000
LINUX_CAPABILITY_VERSION_3 = 0x20080522

# seccomp (linux/seccomp.h, linux/filter.h, linux/audit.h; x86_64 syscall numbers)
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
AUDIT_ARCH_X86_64 = 0xC000003E
BPF_LD_W_ABS = 0x20
BPF_JEQ_K = 0x15
BPF_JSET_K = 0x45
BPF_RET_K = 0x06
SECCOMP_DATA_NR, SECCOMP_DATA_ARCH, SECCOMP_DATA_ARG0 = 0, 4, 16
EPERM, ENOSYS = 1, 38
NR_CLONE, NR_CLONE3 = 56, 435
# clone flags that create namespaces: NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
CLONE_NAMESPACE_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
# execve, execveat, ptrace, unshare, setns, mount, umount2, pivot_root, bpf, perf_event_open,
# keyctl, add_key, request_key, userfaultfd; SysV IPC: shmget, shmat, shmctl, shmdt, semget,
# semop, semctl, semtimedop, msgget, msgsnd, msgrcv, msgctl; POSIX message queues: mq_open,
# mq_unlink, mq_timedsend, mq_timedreceive, mq_notify, mq_getsetattr (x86_64 numbers)
SYSCALLS_REFUSED_X86_64 = (59, 322, 101, 272, 308, 165, 166, 155, 321, 298, 250, 248, 249, 323,
                           29, 30, 31, 67, 64, 65, 66, 220, 68, 69, 70, 71,
                           240, 241, 242, 243, 244, 245)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _seccomp_program():
    """Classic BPF over seccomp_data: wrong arch -> EPERM; clone3 -> ENOSYS (libc falls back
    to clone, whose flags ARE checkable); clone with namespace flags -> EPERM; a refused
    syscall -> EPERM; anything else allowed. Jump offsets count from the next insn."""
    refused = SYSCALLS_REFUSED_X86_64
    n = len(refused)
    deny = SECCOMP_RET_ERRNO | EPERM
    insns = [
        (BPF_LD_W_ABS, 0, 0, SECCOMP_DATA_ARCH),         # 0
        (BPF_JEQ_K, 1, 0, AUDIT_ARCH_X86_64),            # 1
        (BPF_RET_K, 0, 0, deny),                         # 2
        (BPF_LD_W_ABS, 0, 0, SECCOMP_DATA_NR),           # 3
        (BPF_JEQ_K, 0, 1, NR_CLONE3),                    # 4
        (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | ENOSYS),   # 5
        (BPF_JEQ_K, 0, 2, NR_CLONE),                     # 6 -> 7, else 9
        (BPF_LD_W_ABS, 0, 0, SECCOMP_DATA_ARG0),         # 7
        (BPF_JSET_K, n + 1, n, CLONE_NAMESPACE_FLAGS),   # 8 -> deny / allow
    ]
    insns += [(BPF_JEQ_K, n - i, 0, nr) for i, nr in enumerate(refused)]  # 9 .. 8+n
    insns += [(BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW), (BPF_RET_K, 0, 0, deny)]
    raw = b"".join(struct.pack("HBBI", *insn) for insn in insns)
    buffer = ctypes.create_string_buffer(raw)
    return buffer, _SockFprog(len(insns), ctypes.addressof(buffer))


def _install_seccomp(libc, program) -> None:
    if os.uname().machine != "x86_64":
        return
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(NO_NEW_PRIVS) failed")
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(program[1]), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(SECCOMP) failed")


def _set_limits(settings) -> None:
    cpu = int(settings["cpu_s"])
    limits = {
        resource.RLIMIT_CPU: (cpu, cpu + 1),
        resource.RLIMIT_AS: (settings["memory_bytes"],) * 2,
        # one over the limit: the supervisor sees max + 1 tasks and names the limit
        resource.RLIMIT_NPROC: (settings["max_processes"] + 1,) * 2,
        resource.RLIMIT_FSIZE: (settings["file_size_bytes"],) * 2,
        resource.RLIMIT_CORE: (0, 0),
        resource.RLIMIT_NOFILE: (settings["max_open_files"],) * 2,
    }
    for kind, value in limits.items():
        resource.setrlimit(kind, value)


def _write(path, text) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _enter_call_namespaces(libc, mode) -> None:
    """A new user + IPC namespace for this call (its uid and gid mapped onto themselves);
    ``mode``: "required" (raise on failure) or "best_effort" (also a new network
    namespace; silently keep the current ones when user namespaces are refused)."""
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWUSER | CLONE_NEWIPC | (CLONE_NEWNET if mode == "best_effort" else 0)
    if libc.unshare(flags) != 0:
        if mode == "required":
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER | CLONE_NEWIPC) failed")
        return
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")
    _drop_capabilities(libc)


def _drop_capabilities(libc) -> None:
    """Empty effective, permitted and inheritable sets (those a new user namespace grants
    over itself)."""
    header = (ctypes.c_uint32 * 2)(LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()
    if libc.capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")


def _child(code, settings, out_w, err_w, keep_closed, libc, program):
    """Runs in the forked child; never returns."""
    try:
        os.setsid()
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        for fd in [*keep_closed, out_w, err_w]:
            os.close(fd)
        os.chdir(settings["scratch"])
        if settings["child_uid"] is not None:
            uid = settings["child_uid"]
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        # this process's own memory image (a copy after fork): dumpable again, so it may
        # write its own uid_map; the worker stays non-dumpable
        libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
        if settings["call_namespaces"] != "off":
            _enter_call_namespaces(libc, settings["call_namespaces"])
        _set_limits(settings)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a too-big write raises, not kills
        _install_seccomp(libc, program)
        sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0), write_through=True)
        sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", buffering=0), write_through=True)
    except BaseException:  # noqa: BLE001 - report set-up failures as exit 70
        os._exit(70)
    status = 0
    try:
        exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - the traceback is the tool output
        traceback.print_exc()
        status = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001
        pass
    os._exit(status)


def _stat_fields(pid):
    """The fields of /proc/<pid>/stat after the command name (state is [0]), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return raw[raw.rfind(b")") + 2:].split()


def _call_pids(own_pid_namespace) -> list[int]:
    """Every process of the running call: in the sandbox, all of its pid namespace but init
    and this worker; in the fallback, this worker's descendants (it is their subreaper)."""
    me = os.getpid()
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    if own_pid_namespace:
        return [p for p in pids if p not in (1, me)]
    children: dict[int, list[int]] = {}
    for pid in pids:
        fields = _stat_fields(pid)
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(pid)
    tree, todo = [], list(children.get(me, []))
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def _pss_bytes(pid) -> int:
    """Proportional set size of ``pid`` (shared pages split between their sharers): its
    anonymous, file and shared memory pages (a mapped /dev/shm file is then counted twice,
    here and in /dev/shm's use: an overestimate)."""
    total = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return 0
    return total


def _used_bytes(path) -> int:
    try:
        info = os.statvfs(path)
    except OSError:
        return 0
    return (info.f_blocks - info.f_bfree) * info.f_frsize


def _over_limit(settings) -> str | None:
    """Measure the call's process tree; the name of the limit it is over, or None."""
    pids = _call_pids(settings["own_pid_namespace"])
    tasks, ticks, resident = 0, 0, 0
    for pid in pids:
        fields = _stat_fields(pid)
        if fields is None:
            continue
        tasks += int(fields[17])  # num_threads
        ticks += sum(int(v) for v in fields[11:15])  # utime, stime, cutime, cstime
        resident += int(fields[21]) * PAGE_BYTES  # rss
    shm = _used_bytes(SANDBOX_SHM) if settings["own_pid_namespace"] else 0
    if tasks > settings["max_processes"]:
        return "process_limit"
    # RSS >= Pss: the (costlier) Pss is read only when the resident pages could be over
    if resident + shm > settings["memory_bytes"] and sum(map(_pss_bytes, pids)) + shm > settings["memory_bytes"]:
        return "memory_limit"
    if ticks / CLOCK_TICKS > settings["cpu_s"]:
        return "timeout"
    return None


def _kill_call(own_pid_namespace) -> None:
    """SIGKILL every process of the call (see `_call_pids`) until none is left; reap them."""
    for _ in range(KILL_ROUNDS):
        pids = _call_pids(own_pid_namespace)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        _reap()
        time.sleep(KILL_SWEEP_SLEEP_S)


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _empty(folder) -> None:
    """Remove everything inside ``folder`` (folders the call made unreadable included);
    raise if anything is left."""
    _add_owner_rights(folder)
    for root, dirs, _files in os.walk(folder, topdown=True):
        for name in dirs:
            _add_owner_rights(os.path.join(root, name))
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isdir(path) and not os.path.islink(path):
            _rmtree(path)
        else:
            os.unlink(path)
    left = os.listdir(folder)
    if left:
        raise RuntimeError(f"could not empty {folder}: {left[:5]}")


def _add_owner_rights(path) -> None:
    try:
        mode = os.lstat(path).st_mode
        if stat.S_ISDIR(mode):
            os.chmod(path, stat.S_IMODE(mode) | stat.S_IRWXU)
    except OSError:  # root without CAP_FOWNER: DAC_OVERRIDE needs no rights
        pass


def _rmtree(path) -> None:
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files:
            os.unlink(os.path.join(root, name))
        for name in dirs:
            full = os.path.join(root, name)
            if os.path.islink(full):
                os.unlink(full)
            else:
                os.rmdir(full)
    os.rmdir(path)


def _reset_writable(settings) -> None:
    """Empty the call's writable folders and recreate the scratch directory for the next
    call (owned by the call uid, mode 0700)."""
    scratch = settings["scratch"]
    for folder in settings["wipe"]:
        _empty(folder)
    os.makedirs(scratch, exist_ok=True)
    _empty(scratch)
    if settings["child_uid"] is not None:
        os.chown(scratch, settings["child_uid"], settings["child_uid"])
    os.chmod(scratch, stat.S_IRWXU)


def _collect(pid, out_r, err_r, settings):
    """Read both pipes until the child exits, the wall limit passes, output overflows or
    the process tree goes over a limit."""
    start = time.monotonic()
    deadline = start + settings["wall_s"]
    poll_s = settings.get("poll_s", POLL_S)
    next_poll = start + poll_s
    cap = settings["max_output_bytes"]
    chunks = {out_r: bytearray(), err_r: bytearray()}
    pidfd = os.pidfd_open(pid)
    status, exit_code = None, None
    open_fds = [out_r, err_r]
    try:
        while status is None:
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                status = "timeout"
                break
            ready, _, _ = select.select(open_fds + [pidfd], [], [], max(0.0, min(left, next_poll - now)))
            for fd in ready:
                if fd == pidfd:
                    continue
                data = os.read(fd, READ_CHUNK)
                if not data:
                    open_fds.remove(fd)
                chunks[fd] += data
                if len(chunks[fd]) > cap:
                    status = "output_limit"
            if pidfd in ready and status is None:
                exit_code = _wait_exit_code(pid)
                _drain(open_fds, chunks, cap)
                status = "exited"
            if status is None and time.monotonic() >= next_poll:
                status = _over_limit(settings)
                poll_s = min(2 * poll_s, POLL_MAX_S)
                next_poll = time.monotonic() + poll_s
    finally:
        os.close(pidfd)
    return status, exit_code, chunks[out_r][:cap], chunks[err_r][:cap]


def _drain(fds, chunks, cap) -> None:
    """Read what the exited child left in the pipes (non-blocking: a background process
    may still hold them open)."""
    for fd in fds:
        os.set_blocking(fd, False)
        try:
            while len(chunks[fd]) <= cap:
                data = os.read(fd, READ_CHUNK)
                if not data:
                    break
                chunks[fd] += data
        except BlockingIOError:
            pass


def _wait_exit_code(pid) -> int:
    _, raw = os.waitpid(pid, 0)
    if os.WIFSIGNALED(raw):
        return -os.WTERMSIG(raw)
    return os.WEXITSTATUS(raw)


def _classify(status, exit_code, settings, elapsed, cpu_used) -> str:
    if status != "exited":
        return status
    if exit_code == 0:
        return "ok"
    # The kernel checks RLIMIT_CPU against tick-sampled time, while rusage reports the
    # scheduler's exact run time: on a loaded machine a child charged whole ticks gets
    # SIGXCPU with rusage well under cpu_s (a CI flake). So SIGXCPU is a CPU timeout
    # whatever rusage says. SIGKILL is one only from cpu_s of CPU on (the hard limit is
    # cpu_s + 1; below cpu_s the call most likely SIGKILLed itself).
    if exit_code == -signal.SIGXCPU:
        return "timeout"
    if exit_code == -signal.SIGKILL and cpu_used >= settings["cpu_s"]:
        return "timeout"
    return "error"


def run_one(code, settings, keep_closed, libc, program):
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    start = time.monotonic()
    usage_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    pid = os.fork()
    if pid == 0:
        _child(code, settings, out_w, err_w, keep_closed + [out_r, err_r], libc, program)
    os.close(out_w)
    os.close(err_w)
    try:
        status, exit_code, out, err = _collect(pid, out_r, err_r, settings)
    finally:
        _kill_call(settings["own_pid_namespace"])
        os.close(out_r)
        os.close(err_r)
    elapsed = time.monotonic() - start
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_used = (usage.ru_utime + usage.ru_stime) - (usage_before.ru_utime + usage_before.ru_stime)
    _reset_writable(settings)
    text = lambda b: bytes(b).decode("utf-8", errors="replace")  # noqa: E731
    return {"status": _classify(status, exit_code, settings, elapsed, cpu_used), "exit_code": exit_code,
            "stdout": text(out), "stderr": text(err), "elapsed_s": elapsed}


def main() -> None:
    os.closerange(3, 1 << 16)  # e.g. bwrap's --args file: nothing inherited reaches a call
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    requests = os.fdopen(os.dup(0), "r")
    replies = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    settings = json.loads(requests.readline())
    for path in settings["python_path"]:
        sys.path.insert(0, path)
    for name in (*COMMON_MODULES, *settings["preload"]):
        __import__(name)
    program = _seccomp_program()
    keep_closed = [requests.fileno(), replies.fileno(), null]
    _reset_writable(settings)
    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    for line in requests:
        request = json.loads(line)
        reply = run_one(request["code"], settings, keep_closed, libc, program)
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()
