"""The benchmark protocol (benchmarks/_protocol.py): busy rounds are flagged and left out
of the headline, the ratio is a same-run ratio of medians, spreads are min/max."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import _protocol  # noqa: E402


def scripted(values):
    it = iter(values)
    return lambda: next(it)


def run(loads, durations, cores=2):
    """Interleaved rounds of systems 'ours' and 'theirs' on a scripted clock and load."""
    clock_values = []
    now = 0.0
    for ours, theirs in durations:
        clock_values += [now, now + ours, now + ours, now + ours + theirs]
        now += ours + theirs
    return _protocol.interleaved_rounds(
        {"ours": lambda: None, "theirs": lambda: None},
        len(durations),
        cores=cores,
        loadavg=scripted([(load, 0.0, 0.0) for load in loads]),
        clock=scripted(clock_values),
        verbose=False,
    )


def test_busy_threshold_is_cores_plus_excess():
    assert not _protocol.is_busy(2.5, cores=2, max_load_excess=0.5)
    assert _protocol.is_busy(2.51, cores=2, max_load_excess=0.5)


def test_busy_rounds_are_left_out_of_the_headline():
    # Round 2 is busy and has a wild time for 'theirs'; it must not move the median.
    timings = run(loads=[1.0, 9.0, 1.2, 0.8], durations=[(1.0, 2.0), (1.0, 50.0), (1.0, 3.0), (2.0, 4.0)])
    assert [r.busy for r in timings.rounds] == [False, True, False, False]
    assert timings.summary("theirs") == (3.0, 2.0, 4.0)
    assert timings.summary("ours") == (1.0, 1.0, 2.0)
    line = _protocol.headline(timings, "ours", "theirs")
    assert "3.00x" in line and "median of 3" in line and "BUSY" not in line
    # per-round ratios 2, 3, 2 (the busy round's 50 is left out)
    assert _protocol.paired_ratio(timings, "ours", "theirs") == pytest.approx(2.0)
    assert "per-round ratio median 2.00x" in line
    # With busy rounds allowed, the medians change and the headline says so.
    assert timings.summary("theirs", allow_busy=True)[0] == pytest.approx(3.5)
    assert "not a headline figure" in _protocol.headline(timings, "ours", "theirs", allow_busy=True)


def test_all_busy_refuses():
    timings = run(loads=[7.0, 7.0], durations=[(1.0, 1.0), (1.0, 1.0)])
    with pytest.raises(RuntimeError, match="every round was busy"):
        _protocol.headline(timings, "ours", "theirs")


def test_bad_arguments():
    with pytest.raises(ValueError, match="rounds"):
        _protocol.interleaved_rounds({"a": lambda: None}, 0)
    with pytest.raises(ValueError, match="threads"):
        _protocol.pin_threads(0)


def test_named_model_shape_fills_only_unset_dimensions():
    import argparse

    import _model_shapes

    parser = argparse.ArgumentParser()
    _model_shapes.add_shape_arguments(parser)
    args = parser.parse_args(["--model", "10m", "--ffn", "7"])
    _model_shapes.resolve_shape(args)
    assert (args.hidden, args.layers, args.vocab, args.ffn) == (384, 5, 2048, 7)
    args = parser.parse_args([])
    _model_shapes.resolve_shape(args)
    assert (args.hidden, args.heads, args.kv_heads, args.head_dim) == (256, 8, 2, 32)


def test_self_timed_rounds_use_the_reported_seconds():
    """self_timed: each function returns its own duration (a worker's); the clock is unused."""
    def broken_clock():
        raise AssertionError("the clock must not be read")

    timings = _protocol.interleaved_rounds(
        {"ours": scripted([1.0, 2.0, 3.0]), "theirs": scripted([4.0, 4.0, 9.0])}, 3, cores=2,
        loadavg=lambda: (0.5, 0.0, 0.0), clock=broken_clock, verbose=False, self_timed=True)
    assert timings.summary("ours") == (2.0, 1.0, 3.0)
    assert timings.summary("theirs") == (4.0, 4.0, 9.0)
    assert _protocol.paired_ratio(timings, "ours", "theirs") == pytest.approx(3.0)


def test_process_rounds_warm_each_system_once_then_time_the_rounds(capsys):
    """Whole-process runs: one warm-up run each (not timed), then the rounds; the medians
    and the headline printed."""
    runs = {"ours": scripted([9.0, 1.0, 2.0]), "theirs": scripted([9.0, 3.0, 4.0])}
    timings = _protocol.process_rounds(runs, 2, 1.5, cores=2, loadavg=lambda: (0.5, 0.0, 0.0))
    assert timings.summary("ours") == (1.5, 1.0, 2.0) and timings.summary("theirs") == (3.5, 3.0, 4.0)
    out = capsys.readouterr().out
    assert "warming the cache with ours: 9.0 s" in out and "ours vs theirs: 2.33x" in out
    cold = _protocol.process_rounds({"ours": scripted([1.0]), "theirs": scripted([2.0])}, 1, 1.5, warm=False,
                                    cores=2, loadavg=lambda: (0.5, 0.0, 0.0))
    assert cold.summary("ours") == (1.0, 1.0, 1.0)


WORKER_SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])
import _protocol
print("library noise the driver must skip", flush=True)
_protocol.reply({"ready": True})
for line in sys.stdin:
    if line.strip() == "die":
        sys.stderr.write("worker stderr: dying on request\\n")
        sys.exit(3)
    _protocol.reply({"echo": line.strip()})
"""


def test_worker_process_answers_and_reports_its_death(tmp_path):
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    argv = [sys.executable, "-c", WORKER_SCRIPT, bench]
    worker = _protocol.WorkerProcess("echo", argv, str(tmp_path / "echo.stderr"))
    try:
        assert worker.read() == {"ready": True}
        assert worker.ask("time x c=1") == {"echo": "time x c=1"}
        with pytest.raises(RuntimeError, match=r"(?s)worker echo exited \(rc=3\).*dying on request"):
            worker.ask("die")
    finally:
        worker.close()
    assert worker.process.poll() == 3


def test_a_variants_environment_is_its_own_and_checked():
    """learner_ab.py --variant-env NAME:VAR=VALUE: one variant's worker environment."""
    import learner_ab

    names = ["small", "huge"]
    assert learner_ab.variant_environs(
        ["huge:GLIBC_TUNABLES=glibc.malloc.hugetlb=1", "huge:X=", "small:Y=2"], names) == {
        "huge": {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1", "X": ""}, "small": {"Y": "2"}}
    for bad in ("other:X=1", "huge:X", "huge:=1", "X=1"):
        with pytest.raises(ValueError, match="--variant-env"):
            learner_ab.variant_environs([bad], names)
