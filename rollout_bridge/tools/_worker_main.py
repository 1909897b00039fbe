"""The warm worker that runs INSIDE the sandbox (stdlib only: nothing of the project is
visible there).

Protocol: one JSON object per line on fd 0 (``{"code": str}``), one JSON reply per line on
fd 1 (``{"status", "exit_code", "stdout", "stderr", "elapsed_s"}``). The worker's own
stdin/stdout are moved off fds 0/1 first, so model code can never write into the protocol.

Each call forks this warm interpreter (so a call costs a fork, not an interpreter start;
every call starts from the same clean image). The forked child:
  * runs in a fresh, empty ``/scratch/work`` (the only writable path);
  * drops to ``child_uid`` when the sandbox was started by root (then RLIMIT_NPROC holds);
  * gets rlimits: CPU seconds, address space, process count, file size, no core files;
  * gets a seccomp filter refusing exec, ptrace, new namespaces, mount, bpf, perf, keys
    (x86_64; skipped elsewhere);
  * has stdout/stderr on pipes that the worker reads up to ``max_output_bytes`` each.
After the call, EVERY other process of the sandbox's pid namespace is SIGKILLed (except
pid 1, bwrap's init, and the worker itself) and the scratch directory is wiped.

Usage: python -I -B _worker_main.py '<json settings>'
"""

import ctypes
import io
import json
import os
import resource
import select
import shutil
import signal
import struct
import sys
import time
import traceback

SCRATCH = "/scratch/work"
READ_CHUNK = 65536
KILL_ROUNDS = 200  # at most this many /proc sweeps to empty the namespace
KILL_SWEEP_SLEEP_S = 0.001

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
# keyctl, add_key, request_key, userfaultfd (x86_64 numbers)
SYSCALLS_REFUSED_X86_64 = (59, 322, 101, 272, 308, 165, 166, 155, 321, 298, 250, 248, 249, 323)


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
        resource.RLIMIT_NPROC: (settings["max_processes"],) * 2,
        resource.RLIMIT_FSIZE: (settings["file_size_bytes"],) * 2,
        resource.RLIMIT_CORE: (0, 0),
        resource.RLIMIT_NOFILE: (settings["max_open_files"],) * 2,
    }
    for kind, value in limits.items():
        resource.setrlimit(kind, value)


def _child(code, settings, out_w, err_w, keep_closed, libc, program):
    """Runs in the forked child; never returns."""
    try:
        os.setsid()
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        for fd in keep_closed:
            os.close(fd)
        os.chdir(SCRATCH)
        if settings["child_uid"] is not None:
            uid = settings["child_uid"]
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
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


def _kill_namespace() -> None:
    """SIGKILL every process of this pid namespace except init (1) and this worker."""
    me = os.getpid()
    for _ in range(KILL_ROUNDS):
        others = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, me)]
        if not others:
            return
        for pid in others:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        _reap()
        time.sleep(KILL_SWEEP_SLEEP_S)


def _kill_call(pid, own_pid_namespace) -> None:
    """Kill the call's processes: the whole pid namespace inside the sandbox; only the
    call's session (the child called setsid) in the unisolated fallback."""
    if own_pid_namespace:
        _kill_namespace()
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    _reap()


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _reset_scratch() -> None:
    shutil.rmtree(SCRATCH, ignore_errors=True)
    os.makedirs(SCRATCH, exist_ok=True)
    os.chmod(SCRATCH, 0o777)


def _collect(pid, out_r, err_r, settings):
    """Read both pipes until the child exits, the wall limit passes or output overflows."""
    deadline = time.monotonic() + settings["wall_s"]
    cap = settings["max_output_bytes"]
    chunks = {out_r: bytearray(), err_r: bytearray()}
    pidfd = os.pidfd_open(pid)
    status, exit_code = None, None
    open_fds = [out_r, err_r]
    try:
        while status is None:
            left = deadline - time.monotonic()
            if left <= 0:
                status = "timeout"
                break
            ready, _, _ = select.select(open_fds + [pidfd], [], [], left)
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
    _reset_scratch()
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
        _kill_call(pid, settings["own_pid_namespace"])
        os.close(out_r)
        os.close(err_r)
    elapsed = time.monotonic() - start
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_used = (usage.ru_utime + usage.ru_stime) - (usage_before.ru_utime + usage_before.ru_stime)
    _reset_scratch()
    text = lambda b: bytes(b).decode("utf-8", errors="replace")  # noqa: E731
    return {"status": _classify(status, exit_code, settings, elapsed, cpu_used), "exit_code": exit_code,
            "stdout": text(out), "stderr": text(err), "elapsed_s": elapsed}


def main() -> None:
    settings = json.loads(sys.argv[1])
    for path in settings["python_path"]:
        sys.path.insert(0, path)
    for name in settings["preload"]:
        __import__(name)
    requests = os.fdopen(os.dup(0), "r")
    replies = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    libc = ctypes.CDLL(None, use_errno=True)
    program = _seccomp_program()
    keep_closed = [requests.fileno(), replies.fileno(), null]
    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    for line in requests:
        request = json.loads(line)
        reply = run_one(request["code"], settings, keep_closed, libc, program)
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()
