"""XLA flag sets in the learner-step benchmark (benchmarks/learner_step.py
``--xla-flag-sets`` / ``--probe-xla-flags``): each set reaches its own worker process as the
XLA_FLAGS it starts with, a set this jaxlib refuses is reported in one line (not a crash),
and the thread pinning keeps a setting the set gives."""

import ast
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "benchmarks")
sys.path.insert(0, BENCH)

import _protocol  # noqa: E402

# A one-layer Qwen3 of a few thousand parameters, 2 x 8 tokens: compiles in seconds.
TINY = ["--vocab", "32", "--hidden", "16", "--ffn", "32", "--layers", "1", "--heads", "2",
        "--kv-heads", "1", "--head-dim", "8", "--batch", "2", "--seq", "8"]
UNKNOWN = "--xla_no_such_flag_in_any_xla=1"


def bench(*argv, timeout=120):
    return subprocess.run([sys.executable, os.path.join(BENCH, "learner_step.py"), *argv],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_probe_reports_an_accepted_set_and_a_refused_flag_in_one_line_each():
    result = bench("--probe-xla-flags", "--xla_cpu_enable_fast_math=true", UNKNOWN)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert lines[1].split() == ["accepted", "'--xla_cpu_enable_fast_math=true'"]
    refused = [line for line in lines if UNKNOWN in line]
    assert len(refused) == 1 and "REFUSED" in refused[0]
    assert f"Unknown flag in XLA_FLAGS: {UNKNOWN}" in refused[0]
    assert len(lines) == 3  # the header and one line per set, no traceback


@pytest.mark.parametrize("given, kept", [
    ("", "--xla_cpu_multi_thread_eigen=true"),
    ("--xla_cpu_multi_thread_eigen=false", "--xla_cpu_multi_thread_eigen=false"),
])
def test_pin_threads_keeps_a_given_eigen_setting(monkeypatch, given, kept):
    monkeypatch.setattr(os, "environ", dict(os.environ, XLA_FLAGS=given))  # restored after
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # its threads are not the point
    _protocol.pin_threads(2)
    flags = os.environ["XLA_FLAGS"].split()
    assert kept in flags and "intra_op_parallelism_threads=2" in flags
    assert sum("xla_cpu_multi_thread_eigen" in flag for flag in flags) == 1


@pytest.mark.slow
def test_a_flag_set_reaches_its_worker():
    """The worker `--xla-flag-sets` starts (learner_ab's) runs XLA under the set's flags
    and says so in its first reply, with a finite first step. Slow at any model size: the
    worker imports torch to build its random model and compiles the train step twice (the
    second step's state is committed to the device, the first one's was not)."""
    import argparse

    import learner_ab
    from _model_shapes import SHAPE_FLAGS

    options = dict(zip((a.lstrip("-").replace("-", "_") for a in TINY[::2]),
                       map(int, TINY[1::2])))
    assert set(SHAPE_FLAGS) <= set(options)
    options.update(micro_batches=1, mini_batches=1, threads=1)
    flags = "--xla_cpu_enable_fast_math=true"
    worker = learner_ab.Worker("fast math", learner_ab.REPO, flags, argparse.Namespace(**options))
    try:
        first = worker.read()
        seconds = worker.step()
    finally:
        worker.close()
    assert first["xla_flags"].split()[0] == flags
    assert "intra_op_parallelism_threads=1" in first["xla_flags"].split()
    assert first["loss"] == first["loss"] and seconds > 0  # not NaN, and it stepped


@pytest.mark.slow
def test_flag_sets_run_in_the_same_rounds_with_their_ratios():
    """End to end (tiny model, no torch): the no-flag set, one accepted set and one
    refused set. The refused one is one line; the others are timed, each worker saw its
    flags, and the accepted set's ratio to the no-flag set is printed."""
    fast = "--xla_cpu_enable_fast_math=true"
    result = bench(*TINY, "--micro-batches", "1", "--rounds", "1", "--no-torch",
                   "--allow-busy", "--xla-flag-sets", "", fast, UNKNOWN, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    refused = [line for line in out.splitlines() if UNKNOWN in line]
    assert refused == [f"XLA flag set '{UNKNOWN}': refused by this jaxlib (Unknown flag in "
                       f"XLA_FLAGS: {UNKNOWN}); left out"]
    seen = {line.split(":")[0]: line.split("XLA_FLAGS seen ")[1]
            for line in out.splitlines() if "XLA_FLAGS seen" in line}
    assert ast.literal_eval(seen["jax xla[no flags] M=1"]).split()[0] == (
        "--xla_cpu_multi_thread_eigen=true")
    assert ast.literal_eval(seen[f"jax xla[{fast}] M=1"]).split()[0] == fast
    assert f"jax xla[{fast}] M=1 vs jax xla[no flags] M=1: " in out
    assert "jax train_step M=1 vs jax xla[no flags] M=1: " in out
