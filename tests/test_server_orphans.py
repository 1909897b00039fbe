"""Launched servers die with a SIGKILLed trainer: ``VllmServerLauncher``'s
watchdog stops every server process group, children included, when the launching
process dies without ``close()``. Fake servers (small Python scripts, not vLLM): one that
exits on SIGTERM and leaves an engine-core-like child that IGNORES SIGTERM (the watchdog
must SIGKILL it after the grace time)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from rollout_bridge.engine.vllm_watchdog import group_alive, read_registrations

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRACE_S = 1.0
GONE_WITHIN_S = 8.0  # grace + polling + interpreter start, with margin for a loaded box

FAKE_SERVER = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    # the "engine core": same process group, ignores SIGTERM, outlives its server
    child = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('child', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True)
    child.stdout.readline()  # the child now ignores SIGTERM (before this line a SIGTERM would still kill it)
    open(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"ready-{os.getpid()}"), "w").close()
    print("server", flush=True)
    time.sleep(600)
""")

TRAINER = textwrap.dedent("""
    import sys, time
    from rollout_bridge.engine.vllm_launcher import ServerLaunchConfig, VllmServerLauncher
    server_script, log_dir, grace = sys.argv[1], sys.argv[2], float(sys.argv[3])
    launcher = VllmServerLauncher(ServerLaunchConfig(count=2, gpus_per_server=0, stop_grace_s=grace), "unused",
                                  log_dir, command=lambda index, port: [sys.executable, server_script])
    launcher.start()
    print(" ".join(str(s.process.pid) for s in launcher.servers()), launcher._watchdog.pid, flush=True)
    time.sleep(600)
""")


def wait_until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def ready(script_dir, pids) -> bool:
    """Every fake server's child has installed its SIGTERM handler (the server wrote its ready file).
    Counting the group's processes is not enough: the child is in the group from its fork, an
    interpreter start before it ignores SIGTERM."""
    return all((script_dir / f"ready-{pid}").exists() for pid in pids)


def group_size(pgid: int) -> int:
    """Live processes of group ``pgid`` (via ``ps``, independent of the code under test)."""
    out = subprocess.run(["ps", "-e", "-o", "pgid=,stat="], capture_output=True, text=True, check=True).stdout
    return sum(1 for line in out.splitlines() if line.split()[0] == str(pgid) and not line.split()[1].startswith("Z"))


def test_servers_and_their_children_die_with_a_sigkilled_trainer(tmp_path):
    server_script = tmp_path / "fake_server.py"
    server_script.write_text(FAKE_SERVER)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(server_script), str(tmp_path / "logs"),
                                str(GRACE_S)], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        *servers, watchdog = (int(p) for p in trainer.stdout.readline().split())
        assert len(servers) == 2
        # each server group holds the server and its SIGTERM-ignoring child
        assert wait_until(lambda: ready(tmp_path, servers), 30.0)
        assert all(group_size(p) == 2 for p in servers), [group_size(p) for p in servers]
        started = time.monotonic()   # the grace runs from the trainer's death, never before this
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        assert wait_until(lambda: not any(group_size(p) for p in servers), GONE_WITHIN_S), \
            [group_size(p) for p in servers]
        gone_after = time.monotonic() - started
        assert gone_after >= GRACE_S * 0.9  # the children ignored SIGTERM: they went at the SIGKILL
        assert wait_until(lambda: not group_alive(watchdog), 5.0)
    finally:
        if trainer.poll() is None:
            trainer.kill()
        for pgid in servers if "servers" in dir() else ():
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_close_stops_the_servers_and_the_watchdog(tmp_path):
    from rollout_bridge.engine.vllm_launcher import ServerLaunchConfig, VllmServerLauncher

    server_script = tmp_path / "fake_server.py"
    server_script.write_text(FAKE_SERVER)
    launcher = VllmServerLauncher(ServerLaunchConfig(count=1, gpus_per_server=0, stop_grace_s=GRACE_S), "unused",
                                  str(tmp_path), command=lambda index, port: [sys.executable, str(server_script)])
    launcher.start()
    pgid, watchdog = launcher.servers()[0].process.pid, launcher._watchdog
    assert wait_until(lambda: ready(tmp_path, [pgid]), 30.0)
    assert group_size(pgid) == 2
    launcher.close()
    assert group_size(pgid) == 0 and not group_alive(pgid)
    assert watchdog.poll() == 0  # it found nothing registered and exited


@pytest.mark.parametrize("lines, expected", [
    (["+12\n", "+13\n", "-12\n"], {13}),
    (["+5\n", "-5\n", "\n"], set()),
])
def test_watchdog_registrations(lines, expected):
    assert read_registrations(lines) == expected
