"""`rollout_bridge.huge_pages`: when the job restarts itself with glibc's malloc on
transparent huge pages, that the restart keeps the command line, and that the tunable cuts
the page faults of a large XLA buffer (the reason it exists)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from rollout_bridge import huge_pages
from rollout_bridge.huge_pages import SETTING, huge_page_tunables

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLIBC = (2, 36)


@pytest.mark.parametrize("environ, glibc, thp_mode, expected", [
    ({}, GLIBC, "madvise", SETTING),
    ({}, GLIBC, "always", SETTING),
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, GLIBC, "madvise",
     "glibc.malloc.arena_max=2:" + SETTING),
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, GLIBC, "madvise", None),  # the user's choice
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=2"}, GLIBC, "always", None),
    ({"SPOPP_HUGE_PAGES": "0"}, GLIBC, "madvise", None),
    ({"SPOPP_HUGE_PAGES": "1"}, GLIBC, "madvise", SETTING),
    ({}, (2, 34), "madvise", None),  # glibc without the tunable
    ({}, None, "madvise", None),  # not glibc
    ({}, GLIBC, "never", None),
    ({}, GLIBC, None, None),  # no transparent huge pages in this kernel
])
def test_which_tunables_the_job_runs_with(environ, glibc, thp_mode, expected):
    assert huge_page_tunables(environ, glibc, thp_mode) == expected


def test_the_kernel_mode_is_the_bracketed_word(tmp_path):
    path = tmp_path / "enabled"
    path.write_text("always [madvise] never\n")
    assert huge_pages.transparent_huge_page_mode(str(path)) == "madvise"
    path.write_text("[always] madvise never\n")
    assert huge_pages.transparent_huge_page_mode(str(path)) == "always"
    assert huge_pages.transparent_huge_page_mode(str(tmp_path / "missing")) is None


def this_machines_tunables(environ) -> str | None:
    return huge_page_tunables(environ, huge_pages.glibc_version(),
                              huge_pages.transparent_huge_page_mode())


def run_python(args, environ, timeout=120):
    return subprocess.run([sys.executable, *args], env=environ, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, check=True)


def test_the_restart_keeps_the_command_line_and_happens_once(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        print("started", os.getpid(), flush=True)
        from rollout_bridge.huge_pages import reexec_with_huge_pages
        reexec_with_huge_pages()
        print("running", os.getpid(), os.environ.get("GLIBC_TUNABLES"), sys.argv[1:],
              sys.orig_argv[1] == "-u")
    """))
    environ = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    environ["PYTHONPATH"] = REPO
    expected = this_machines_tunables(environ)
    lines = run_python(["-u", str(script), "--steps", "3"], environ).stdout.splitlines()
    started = [line.split()[1] for line in lines if line.startswith("started")]
    running = [line for line in lines if line.startswith("running")]
    assert len(running) == 1, lines
    pid, tunables, rest = running[0].split(" ", 3)[1:]
    assert rest == "['--steps', '3'] True"  # the script's arguments and python's -u kept
    assert started[-1] == pid  # exec keeps the process
    if expected is None or sys.platform != "linux":
        assert tunables == "None" and len(started) == 1
    else:
        assert tunables == expected and len(started) == 2


def test_the_opt_out_runs_without_a_restart(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import os\nprint('started')\nfrom rollout_bridge.huge_pages import "
                      "reexec_with_huge_pages\nreexec_with_huge_pages()\n"
                      "print(os.environ.get('GLIBC_TUNABLES'))\n")
    environ = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    environ.update(PYTHONPATH=REPO, SPOPP_HUGE_PAGES="0")
    assert run_python([str(script)], environ).stdout.split() == ["started", "None"]


FAULTS_PER_CALL = textwrap.dedent("""
    import resource
    import jax, jax.numpy as jnp
    x, w = jnp.ones((16384, 8)), jnp.ones((8, 1024))
    make = jax.jit(lambda x, w: x @ w)  # a 64 MiB result buffer per call
    make(x, w).block_until_ready()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
        make(x, w).block_until_ready()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 4)
""")


@pytest.mark.skipif(this_machines_tunables({}) is None,
                    reason="glibc < 2.35, not glibc, or transparent huge pages off: no tunable")
def test_the_tunable_cuts_the_page_faults_of_a_large_xla_buffer():
    """64 MiB in 4 KiB pages is 16,384 faults per call; in 2 MiB pages, 32."""
    environ = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    environ["JAX_PLATFORMS"] = "cpu"
    small_pages = float(run_python(["-c", FAULTS_PER_CALL], environ).stdout)
    huge = float(run_python(["-c", FAULTS_PER_CALL], dict(environ, GLIBC_TUNABLES=SETTING)).stdout)
    assert small_pages > 8_000, small_pages
    assert huge < small_pages / 10, (huge, small_pages)
