"""A disk that fills up during a checkpoint save: the user sees one line naming the disk,
what the run folder keeps (the newest intact checkpoint) and the command that continues;
orbax's and tensorstore's worker-thread tracebacks go to ``<run>/storage_error.log``.

Two ways to fill it:

- a real one (root only): a small tmpfs holds the run folder and `kill_hook.py fill_disk`
  fills it just before the job's second checkpoint save, so the save meets ENOSPC
  part-way, as another job's output would make it;
- a fast, unprivileged one: a writer (``python tests/reliability/test_disk_full.py
  DIR``, under `run_guard.run_guarded` like train.py) saves step 1, then tries step 2
  under RLIMIT_FSIZE (writes past the limit fail with EFBIG; the same worker-thread
  failures as ENOSPC: absl ERROR records and "Event loop is closed" callbacks)."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
LIMIT_BYTES = 64 * 1024
SHOWN_LINES = 5   # the most a failing run may print on stderr (the bar)


def _worker(directory: str) -> None:
    """Step 1 saved, then step 2 under RLIMIT_FSIZE, inside run_guarded (exits there)."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(HERE))
    import numpy as np
    from test_checkpoint_faults import config_for, state_for

    from rollout_bridge import run_guard
    from spopp_jax.checkpoint import Checkpointer

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    run_guard._run["root"] = root   # what prepare_run records for train.py

    def main() -> None:
        checkpointer = Checkpointer(root / "checkpoints", max_to_keep=2)
        checkpointer.save(1, state_for(1), {"counter": np.int64(1)}, config_for())
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT_BYTES, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        try:
            checkpointer.save(2, state_for(2), {"counter": np.int64(2)}, config_for())
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))

    run_guard.run_guarded(main)


if __name__ == "__main__":
    _worker(sys.argv[1])
    raise SystemExit(0)

import pytest  # noqa: E402
from reliability_table import Row, covers  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(HERE))
from fault_loop import longest_traceback  # noqa: E402
from test_checkpoint_faults import assert_restores_exactly  # noqa: E402
from tiny_run import tiny_train_args  # noqa: E402

RUN_TIMEOUT_S = 600
TMPFS_SIZE = "40m"


@covers(Row("checkpoint", "a file-size limit met during a checkpoint save (RLIMIT_FSIZE=64 KiB on a job run "
            "through train.py's entry point; orbax's threads fail with EFBIG)",
            "exit 2 and one line 'error: a file reached the size limit ... while writing checkpoint step 2: <mount> "
            "has <free> free of <size>; kept in R: checkpoints up to step 1; raise the limit or free space, then "
            "continue with: ... "
            "--resume (details: R/storage_error.log)'; the worker threads' tracebacks are in that file, "
            "none on the terminal", "step 1 restores bit-identical; no step 2",
            kind="fault"))
def test_failed_save_prints_one_line_and_keeps_the_tracebacks_in_the_run_folder(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    done = subprocess.run([sys.executable, str(Path(__file__)), str(tmp_path / "run")], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=300)
    shown = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 2, "\n".join(shown[-40:])
    assert len(shown) <= SHOWN_LINES and longest_traceback(done.stderr + done.stdout) == 0, "\n".join(shown[-40:])
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: a file reached the size limit") and "while writing checkpoint step 2: " in line and " free of " in line
    assert f"kept in {tmp_path / 'run'}: checkpoints up to step 1" in line and "--resume" in line
    details = tmp_path / "run" / "storage_error.log"
    assert f"(details: {details})" in line
    assert "Traceback" in details.read_text() and "reported by a checkpoint worker thread" in details.read_text()
    assert not (tmp_path / "run" / "checkpoints" / "2").exists()
    assert_restores_exactly(tmp_path / "run" / "checkpoints", 1)


def _mount_tmpfs(folder: Path) -> str | None:
    """Mounts a TMPFS_SIZE tmpfs on ``folder``; None, or why it cannot."""
    if os.geteuid() != 0:
        return "needs root to mount a small tmpfs (the fast RLIMIT_FSIZE test covers the output)"
    if shutil.which("mount") is None:
        return "no mount command"
    folder.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        return f"mount -t tmpfs failed: {mounted.stderr.strip()}"
    return None


@covers(Row("checkpoint", "the disk fills up during the job (a real 40 MB tmpfs holding the run folder, filled "
            "by another file just before the second checkpoint save of a 4-update run)",
            "exit 2 and one line 'error: the disk is full while writing checkpoint step 4: <mount> has <free> free "
            "of <size>; kept in R: the warm start, the prior, checkpoints up to step 2, ...; free space, then "
            "continue with: python train.py ... --resume (details: R/storage_error.log, or a file in the temporary "
            "folder when the disk has no room even for that)'; no traceback",
            "checkpoint 2 and its metrics; once space is freed, the printed command finishes the run with every "
            "update once", kind="fault"))
@pytest.mark.slow
def test_disk_fills_during_a_checkpoint_save_of_a_real_run(tmp_path):
    disk = Path(f"/tmp/spopp-full-{uuid.uuid4().hex[:8]}")
    why = _mount_tmpfs(disk)
    if why is not None:
        pytest.skip(why)
    try:
        args = tiny_train_args(tmp_path, 4) + ["--progress", "false", "--tensorboard", "false"]
        run = disk / "run"
        args[args.index("--output_dir") + 1] = str(run)
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
        failed = subprocess.run([sys.executable, str(HERE / "kill_hook.py"), "fill_disk", "2", "--", *args],
                                capture_output=True, text=True, cwd=ROOT, env=env, timeout=RUN_TIMEOUT_S)
        lines = failed.stderr.strip().splitlines()
        assert failed.returncode == 2, failed.stderr[-3000:]
        assert "KILL_HOOK fill_disk" in failed.stdout
        assert len(lines) <= SHOWN_LINES and longest_traceback(failed.stderr) == 0, failed.stderr[-3000:]
        line = lines[-1]
        assert line.startswith(f"error: the disk is full while writing checkpoint step 4: {disk} has "), line
        assert f"kept in {run}: the warm start, the prior, checkpoints up to step 2" in line, line
        # the details go to the run folder, or (no room left there) to the temporary folder
        assert "--resume (details: " in line and line.endswith(".log)"), line
        details = Path(line.rsplit("(details: ", 1)[1][:-1])
        assert "No space left on device" in details.read_text()
        if details.parent != run:
            details.unlink()
        assert [int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()] == [2]

        (disk / "disk_filler").unlink()
        resumed = subprocess.run([sys.executable, str(ROOT / "train.py"), *args, "--resume"], capture_output=True,
                                 text=True, cwd=ROOT, env=env, timeout=RUN_TIMEOUT_S)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        from rollout_bridge.metrics import read_metrics

        assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4]
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
        shutil.rmtree(disk, ignore_errors=True)


def test_a_save_that_succeeds_keeps_no_details_and_leaves_the_hooks_as_they_were(tmp_path):
    import logging

    import numpy as np

    from spopp_jax.checkpoint import Checkpointer, failure_details

    hook, filters, kept = sys.unraisablehook, list(logging.getLogger("absl").filters), len(failure_details())
    with Checkpointer(tmp_path / "checkpoints") as checkpointer:
        checkpointer.save(1, {"w": np.arange(4, dtype=np.float32)})
    assert sys.unraisablehook is hook and logging.getLogger("absl").filters == filters
    assert len(failure_details()) == kept
