"""Checkpoint faults: `kill -9` in the middle of an orbax write, a full disk during a save,
and malformed checkpoints (truncated data, another config, a newer format, other shapes,
a missing manifest, a stray temporary folder).

The kill and disk-full cases run a writer in a subprocess (`python
tests/reliability/test_checkpoint_faults.py write|full DIR ...` is that worker) whose
state at step s is a known function of s, so whatever step survives is checked bit for
bit. "Disk full" is simulated with RLIMIT_FSIZE (the per-file size limit of the writer
process; SIGXFSZ ignored, so a write past it fails with EFBIG like ENOSPC would): an
unprivileged stand-in for a full tmpfs."""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SIZE = 1 << 20          # float32 elements per leaf: 4 MiB, so a save takes a while
LEAVES = 4


def state_for(step: int) -> dict:
    base = np.arange(SIZE, dtype=np.float32)
    return {f"leaf{i}": base * step + i for i in range(LEAVES)}


def config_for() -> dict:
    return {"model": {"hidden": 8}, "seed": 0}


def _worker(argv: list[str]) -> None:
    """write DIR FIRST LAST: save steps FIRST..LAST (print each); full DIR LIMIT REPORT:
    save step 1, limit file size to LIMIT bytes, try step 2 and write the error to REPORT
    (a file: orbax/tensorstore threads may print onto stdout around it)."""
    sys.path.insert(0, str(ROOT))
    from spopp_jax.checkpoint import Checkpointer

    mode, directory = argv[0], argv[1]
    checkpointer = Checkpointer(directory, max_to_keep=2)
    if mode == "write":
        for step in range(int(argv[2]), int(argv[3]) + 1):
            checkpointer.save(step, state_for(step), {"counter": np.int64(step)}, config_for())
            print(f"saved {step}", flush=True)
        return
    checkpointer.save(1, state_for(1), {"counter": np.int64(1)}, config_for())
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limit, report = int(argv[2]), Path(argv[3])
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        checkpointer.save(2, state_for(2), {"counter": np.int64(2)}, config_for())
    except Exception as error:  # noqa: BLE001 - the worker reports whatever surfaced
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        report.write_text(json.dumps({"type": type(error).__name__, "message": str(error)}))
        os._exit(3)
    print("saved 2 despite the limit", flush=True)


if __name__ == "__main__":
    _worker(sys.argv[1:])
    raise SystemExit(0)

import pytest  # noqa: E402
from reliability_table import Row, covers  # noqa: E402

# When an orbax read or write fails part-way (truncated file, EFBIG), orbax's own event
# loop is closed while tensorstore still completes the other leaves' futures; their
# callbacks hit the closed loop ("Event loop is closed", reported by pytest as an
# unraisable exception in a third-party thread). Our error is raised and tested below;
# this noise is not ours to fix, so these tests ignore it rather than print it.
ORBAX_CLOSED_LOOP_NOISE = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

from spopp_jax.checkpoint import (  # noqa: E402
    CHECKPOINT_FORMAT_VERSION,
    Checkpointer,
    CheckpointMismatchError,
)


def run_worker(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(Path(__file__)), *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)


def restore_latest(directory: Path):
    with Checkpointer(directory) as checkpointer:
        target = {k: np.zeros(SIZE, np.float32) for k in state_for(0)}
        return checkpointer.restore(target, expected_config=config_for())


def assert_restores_exactly(directory: Path, step: int) -> None:
    restored = restore_latest(directory)
    assert restored.step == step
    for key, value in state_for(step).items():
        np.testing.assert_array_equal(np.asarray(restored.train_state[key]), value)
    assert int(restored.extras["counter"]) == step


TMP_GLOB = "*.orbax-checkpoint-tmp*"


def kill_mid_write(directory: Path, rng: random.Random) -> tuple[int, bool]:
    """Start the writer; once step 1 is complete and a later step's temporary folder has
    appeared, SIGKILL it after a random 0-0.3 s. Returns (newest step it reported saved,
    whether a temporary folder was still there after the kill, i.e. it died mid-write)."""
    process = run_worker("write", str(directory), "1", "40")
    assert process.stdout.readline().strip() == "saved 1"
    deadline = time.time() + 60
    while not list(directory.glob(TMP_GLOB)) and time.time() < deadline:
        time.sleep(0.005)
    time.sleep(rng.uniform(0.0, 0.3))
    process.send_signal(signal.SIGKILL)
    output, _ = process.communicate(timeout=60)
    saved = [1] + [int(line.split()[1]) for line in output.splitlines() if line.startswith("saved")]
    assert process.returncode == -signal.SIGKILL, output[-2000:]
    return max(saved), bool(list(directory.glob(TMP_GLOB)))


def _kill_loop(tmp_path: Path, rounds: int, seed: int) -> int:
    """Kill / check / continue `rounds` times; returns how many kills landed mid-write."""
    rng = random.Random(seed)
    mid_write = 0
    for round_index in range(rounds):
        directory = tmp_path / f"round{round_index}"
        reported, interrupted = kill_mid_write(directory, rng)
        mid_write += interrupted
        with Checkpointer(directory) as checkpointer:
            latest = checkpointer.latest_step()
        # a step is reported after it is complete; the kill may land after the rename
        # and before the print, so the newest step on disk is `reported` or one more
        assert latest in (reported, reported + 1)
        assert_restores_exactly(directory, latest)
        # and the run can go on writing from there
        process = run_worker("write", str(directory), str(latest + 1), str(latest + 1))
        output, _ = process.communicate(timeout=120)
        assert process.returncode == 0, output[-2000:]
        assert_restores_exactly(directory, latest + 1)
    return mid_write


@covers(Row("checkpoint", "`kill -9` of the writer while an orbax save is in progress",
            "the interrupted step never appears (orbax renames a finished temporary folder); "
            "the latest step is the last complete one",
            "latest step restores bit-identical to what was saved; the next save succeeds",
            kind="fault"))
def test_kill_during_checkpoint_write_leaves_a_loadable_latest(tmp_path):
    _kill_loop(tmp_path, rounds=1, seed=0)


@covers(Row("checkpoint", "`kill -9` mid orbax save, 12 random moments (most with the "
            "temporary folder still on disk after the kill)", "as above", "as above",
            kind="fault"))
@pytest.mark.slow
def test_kill_during_checkpoint_write_many(tmp_path):
    mid_write = _kill_loop(tmp_path, rounds=12, seed=1)
    assert mid_write >= 6, f"only {mid_write}/12 kills landed mid-write"


@ORBAX_CLOSED_LOOP_NOISE
@covers(Row("checkpoint", "disk full during a save (RLIMIT_FSIZE=64 KiB on the writer, "
            "writes fail with EFBIG)",
            "OSError 'checkpoint step 2 could not be written to DIR ...; the previous "
            "checkpoints [1] are intact'", "step 1 restores bit-identical; no step 2 folder",
            kind="fault"))
def test_disk_full_during_save(tmp_path):
    # the worker writes its report to a file: orbax/tensorstore threads print the
    # closed-loop noise (see ORBAX_CLOSED_LOOP_NOISE) on stdout before, after and on the
    # same line as anything the worker prints (both seen on a loaded machine); the file sits
    # beside tmp_path, which is the checkpoint folder under test
    report_file = tmp_path.parent / f"{tmp_path.name}-report.json"
    process = run_worker("full", str(tmp_path), str(64 * 1024), str(report_file))
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 3, output[-3000:]
    report = json.loads(report_file.read_text())
    assert report["type"] == "CheckpointWriteError", report
    assert "checkpoint step 2 could not be written" in report["message"]
    assert "previous checkpoints [1] are intact" in report["message"]
    assert not (tmp_path / "2").exists()
    assert_restores_exactly(tmp_path, 1)


# ------------------------------------------------------------------ malformed checkpoints


@pytest.fixture
def saved(tmp_path) -> Path:
    with Checkpointer(tmp_path / "ckpt") as checkpointer:
        for step in (1, 2):
            checkpointer.save(step, state_for(step), {"counter": np.int64(step)}, config_for())
    return tmp_path / "ckpt"


def _data_files(step_dir: Path) -> list[Path]:
    files = [p for p in (step_dir / "train_state").rglob("*") if p.is_file()]
    return sorted(files, key=lambda p: p.stat().st_size, reverse=True)


@ORBAX_CLOSED_LOOP_NOISE
@covers(Row("checkpoint", "the latest step's array data truncated on disk",
            "CheckpointCorruptError naming the step folder and suggesting `step=` an older "
            "one", "the older step still restores bit-identical"))
def test_truncated_checkpoint_data(saved):
    biggest = _data_files(saved / "2")[0]
    data = biggest.read_bytes()
    biggest.write_bytes(data[: len(data) // 3])
    from spopp_jax.checkpoint import CheckpointCorruptError

    with pytest.raises(CheckpointCorruptError, match=r"checkpoint step 2 in .*ckpt.* unreadable"):
        restore_latest(saved)
    with Checkpointer(saved) as checkpointer:
        restored = checkpointer.restore({k: np.zeros(SIZE, np.float32) for k in state_for(0)},
                                        step=1)
    np.testing.assert_array_equal(np.asarray(restored.train_state["leaf1"]), state_for(1)["leaf1"])


@covers(Row("checkpoint", "a checkpoint from another config (model.hidden 8 vs 16)",
            "CheckpointMismatchError listing 'model.hidden: saved 8, expected 16'",
            "nothing restored"))
def test_checkpoint_from_another_config(saved):
    with Checkpointer(saved) as checkpointer:
        with pytest.raises(CheckpointMismatchError, match="model.hidden: saved 8, expected 16"):
            checkpointer.restore(state_for(0), expected_config={"model": {"hidden": 16}, "seed": 0})


@covers(Row("checkpoint", "a checkpoint with other array shapes",
            "CheckpointMismatchError naming the leaf, saved and expected shapes", "nothing restored"))
def test_checkpoint_with_other_shapes(saved):
    target = {k: np.zeros(SIZE // 2, np.float32) for k in state_for(0)}
    with Checkpointer(saved) as checkpointer:
        with pytest.raises(CheckpointMismatchError, match=r"leaf0: saved shape \(1048576,\)"):
            checkpointer.restore(target)


@covers(Row("checkpoint", "a checkpoint written by a newer spopp-jax (manifest format_version "
            "above this build's)", "CheckpointMismatchError 'written by a newer spopp-jax "
            "(checkpoint format N, this build reads up to M)'", "nothing restored"))
def test_checkpoint_from_a_newer_version(saved):
    from spopp_jax.checkpoint_integrity import write_checksums

    manifest = saved / "2" / "manifest" / "metadata"
    record = json.loads(manifest.read_text())
    assert record["format_version"] == CHECKPOINT_FORMAT_VERSION
    record["format_version"] = CHECKPOINT_FORMAT_VERSION + 1
    manifest.write_text(json.dumps(record))
    write_checksums(saved / "2")   # as that newer build would have written them
    with pytest.raises(CheckpointMismatchError, match="written by a newer spopp-jax"):
        restore_latest(saved)


@covers(Row("checkpoint", "the latest step's manifest deleted",
            "CheckpointCorruptError naming the step folder", "the older step still restores"))
def test_checkpoint_without_manifest(saved):
    import shutil

    shutil.rmtree(saved / "2" / "manifest")
    from spopp_jax.checkpoint import CheckpointCorruptError

    with pytest.raises(CheckpointCorruptError, match="checkpoint step 2 in .* unreadable"):
        restore_latest(saved)


@covers(Row("checkpoint", "`--resume` with an empty checkpoint folder",
            "FileNotFoundError 'no checkpoint in DIR'", "nothing restored"))
def test_restore_from_empty_folder(tmp_path):
    with Checkpointer(tmp_path / "empty") as checkpointer:
        with pytest.raises(FileNotFoundError, match="no checkpoint in"):
            checkpointer.restore(state_for(0))


@covers(Row("checkpoint", "a stray temporary folder left by a crashed save "
            "(`3.orbax-checkpoint-tmp-...`)", "ignored: latest_step is the last complete step",
            "step 2 restores bit-identical", kind="fault"))
def test_stray_temporary_folder_is_ignored(saved):
    (saved / "3.orbax-checkpoint-tmp-1234").mkdir()
    (saved / "3.orbax-checkpoint-tmp-1234" / "garbage").write_bytes(b"\x00" * 10)
    assert_restores_exactly(saved, 2)
