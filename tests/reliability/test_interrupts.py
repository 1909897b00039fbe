"""Interrupts: Ctrl-C (SIGINT) and SIGTERM end train.py with one line saying what the run
folder keeps and the command that continues it, at any stage (including while XLA
compiles); a torn metrics.jsonl line is rebuilt from the checkpoint on `--resume`, and the rows of the
work redone after a resume are set aside, not deleted.

The signal is sent from outside, as a terminal or a scheduler would, once the job's log
shows the stage (`tests/reliability/fault_loop.py` sends them at random moments)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from reliability_table import Row, covers

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(HERE))
from fault_loop import longest_traceback  # noqa: E402
from tiny_run import tiny_train_args  # noqa: E402

RUN_TIMEOUT_S = 600


def signal_at(args: list[str], marker: str, signum: int, log: Path, wait_s: float = 0.0):
    """Starts train.py, sends ``signum`` once ``marker`` appears in its log (+ ``wait_s``)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], stdout=out,
                                   stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
        deadline = time.time() + RUN_TIMEOUT_S
        while marker not in log.read_text() and process.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(wait_s)
        assert process.poll() is None, log.read_text()[-2000:]
        process.send_signal(signum)
        stderr = process.stderr.read()
        process.wait(timeout=RUN_TIMEOUT_S)
    return process.returncode, stderr


@covers(
    Row("interrupt", "Ctrl-C (SIGINT) while XLA compiles the warm start's first SFT step",
        "exit 130 and one line: 'interrupted (SIGINT): kept in R: ...; continue with: python train.py ... --resume' "
        "(the signal is handled in the main thread between bytecodes, after the compile returns; the process "
        "ends with os._exit, so no interpreter teardown races XLA's threads: no segfault, no traceback)",
        "what the run made so far; `--resume` (run here) finishes the job", kind="fault"),
    Row("interrupt", "SIGTERM during RL (after update 1)",
        "exit 143 and the same one line, naming the checkpoints kept",
        "the checkpoints and their metrics rows; `--resume` finishes with every update once", kind="fault"),
)
@pytest.mark.slow
def test_sigint_during_compile_and_sigterm_during_rl(tmp_path):
    args = tiny_train_args(tmp_path, 4) + ["--progress", "false", "--tensorboard", "false"]
    run = Path(args[args.index("--output_dir") + 1])
    status, stderr = signal_at(args, "warm start: SFT on", signal.SIGINT, tmp_path / "a.log")
    assert status == 130, stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("interrupted (SIGINT): kept in"), stderr[-3000:]
    assert lines[0].endswith("--resume") and longest_traceback(stderr) == 0
    assert not (run / ".spopp-run.lock").exists()

    status, stderr = signal_at(args + ["--resume"], "RL: update 3", signal.SIGTERM, tmp_path / "b.log")
    assert status == 143, stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("interrupted (SIGTERM)") and "checkpoints up to step 2" in lines[0]

    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), *args, "--resume"], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    from rollout_bridge.metrics import read_metrics

    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4]


@covers(Row("interrupt", "a torn row in metrics.jsonl (the last line cut mid-write, e.g. a crash or a full disk) "
            "for an update a checkpoint holds",
            "on `--resume` one line 'metrics: ... had 1 torn line(s); rows of steps [2] rebuilt from checkpoint 2'",
            "the row comes back equal to the one written (each checkpoint holds the rows since the previous one)",
            kind="fault"))
def test_torn_metrics_row_is_rebuilt_from_the_checkpoint(tmp_path, capsys):
    from rollout_bridge.metrics import MetricsWriter, read_metrics
    from spopp_jax.checkpoint import Checkpointer

    writer = MetricsWriter(tmp_path, tensorboard=False)
    checkpointer = Checkpointer(tmp_path / "checkpoints")
    written = [writer.write(step, {"success_rate": 0.25 * step, "loss": 1.0 / step}) for step in (1, 2)]
    checkpointer.save(2, {"w": np.zeros(2, np.float32)}, extras=writer.checkpoint_extras())
    writer.write(3, {"success_rate": 0.5})      # after the checkpoint: redone on resume
    writer.close()
    checkpointer.close()
    path = tmp_path / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + lines[1][: len(lines[1]) // 2])     # row 2 torn, row 3 lost
    capsys.readouterr()
    resumed = MetricsWriter(tmp_path, tensorboard=False, resume_step=2)
    resumed.close()
    said = capsys.readouterr().out
    assert "1 torn line(s)" in said and "rows of steps [2] rebuilt from checkpoint 2" in said
    assert read_metrics(path) == written
    assert path.read_text().endswith("\n")


@covers(Row("interrupt", "`--resume --resume_step 1` on a run whose metrics.jsonl holds rows 1-3 (the work "
            "after checkpoint 1 is redone)",
            "one line 'metrics: rows of steps 2-3 (after checkpoint 1, about to be redone) set aside in "
            "R/metrics_set_aside/after_step_1.jsonl'",
            "metrics.jsonl keeps row 1 only, so no step has two rows; rows 2-3 are kept as written, a new "
            "file per resume (after_step_1-2.jsonl, ...), as checkpoints 2-3 go to checkpoints_set_aside/; "
            "a run resumed with no checkpoint yet (RL starts over) sets every row aside (after_step_0.jsonl)",
            kind="fault"))
def test_rows_after_the_resumed_checkpoint_are_set_aside(tmp_path, capsys):
    from rollout_bridge.metrics import MetricsWriter, read_metrics

    writer = MetricsWriter(tmp_path, tensorboard=False)
    written = [writer.write(step, {"success_rate": 0.25 * step}) for step in (1, 2, 3)]
    writer.close()
    capsys.readouterr()
    MetricsWriter(tmp_path, tensorboard=False, resume_step=1).close()
    aside = tmp_path / "metrics_set_aside" / "after_step_1.jsonl"
    assert f"metrics: rows of steps 2-3 (after checkpoint 1, about to be redone) set aside in {aside}" \
        in capsys.readouterr().out
    assert read_metrics(tmp_path / "metrics.jsonl") == written[:1]
    assert read_metrics(aside) == written[1:]
    MetricsWriter(tmp_path, tensorboard=False).close()       # no checkpoint: RL starts over
    assert read_metrics(aside.with_name("after_step_0.jsonl")) == written[:1]
    assert read_metrics(tmp_path / "metrics.jsonl") == []


def _tensorboard_view(tb_dir: Path) -> dict[int, float]:
    """{step: success_rate} as TensorBoard shows it: the event files read in name order
    (seconds, host, then the writer's nanosecond suffix: the order they were made), a
    SessionLog START at step s hiding every earlier event at steps >= s (TensorBoard's
    purge of orphaned data)."""
    import struct

    from tensorboardX.proto.event_pb2 import Event, SessionLog

    header = struct.Struct("<QI")  # TFRecord framing: length, masked crc of the length
    footer_bytes = 4  # masked crc of the data
    shown: dict[int, float] = {}
    for path in sorted(tb_dir.glob("events.out.tfevents.*")):
        data, offset = path.read_bytes(), 0
        while offset < len(data):
            length, _ = header.unpack_from(data, offset)
            offset += header.size
            event = Event.FromString(data[offset:offset + length])
            offset += length + footer_bytes
            if event.session_log.status == SessionLog.START:
                shown = {step: v for step, v in shown.items() if step < event.step}
            for value in event.summary.value:
                if value.tag == "success_rate":
                    shown[event.step] = value.simple_value
    return shown


@covers(Row("interrupt", "a run resumed from checkpoint 2 after steps 3-4 were written, then started over "
            "(no checkpoint)",
            "TensorBoard shows steps 1-2 of the first attempt and 3-5 of the second, then only the third "
            "attempt's steps: each writer's event file starts with TensorBoard's purge marker (SessionLog "
            "START) at the resumed step + 1, or at 0 when RL starts over, as metrics.jsonl sets those rows aside",
            "no step shown twice; earlier event files stay on disk; writers started in the same second "
            "keep separate files",
            kind="fault"))
def test_tensorboard_hides_the_steps_a_restart_redoes(tmp_path):
    """Resumed from checkpoint 2, steps 3-4 of the first attempt are hidden and redone;
    started over, every earlier step is hidden, as metrics.jsonl sets their rows aside."""
    from rollout_bridge.metrics import METRICS_FILE, MetricsWriter, read_metrics

    def attempt(values, resume_step=None, first_step=1):
        with MetricsWriter(tmp_path, tensorboard=True, resume_step=resume_step) as writer:
            for step, value in enumerate(values, start=first_step):
                writer.write(step, {"success_rate": value})

    attempt([0.1, 0.2, 0.3, 0.4])
    assert _tensorboard_view(tmp_path / "tb") == pytest.approx({1: 0.1, 2: 0.2, 3: 0.3, 4: 0.4})
    attempt([0.33, 0.44, 0.55], resume_step=2, first_step=3)
    assert _tensorboard_view(tmp_path / "tb") == pytest.approx({1: 0.1, 2: 0.2, 3: 0.33, 4: 0.44,
                                                                5: 0.55})
    attempt([0.9])
    assert _tensorboard_view(tmp_path / "tb") == pytest.approx({1: 0.9})
    assert [r["success_rate"] for r in read_metrics(tmp_path / METRICS_FILE)] == pytest.approx([0.9])
