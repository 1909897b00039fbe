"""Checkpoint integrity: every step's files carry checksums (``checksums.json``) verified on
restore, on `--resume` and on export; a damaged step is named in one line and `--resume`
continues from the newest intact one (or `--resume_step`); a non-finite train state is
never written.

Damage is made by hand on a finished step: one byte of array data flipped (orbax reads it
back without complaint: other numbers, possibly NaN) or a data file cut in half."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from reliability_table import Row, covers

from spopp_jax.checkpoint import CheckpointCorruptError, Checkpointer, NonFiniteStateError

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from tiny_run import make_tiny_run, tiny_train_args  # noqa: E402


def state_for(step: int) -> dict:
    return {"params": {"w": np.arange(64, dtype=np.float32) * step + 1.0}, "step": np.int32(step)}


def largest_data_file(step_dir: Path) -> Path:
    files = [p for p in (step_dir / "train_state").rglob("*") if p.is_file() and "/d/" in str(p)]
    return max(files, key=lambda p: p.stat().st_size)


def flip_a_byte(step_dir: Path) -> Path:
    target = largest_data_file(step_dir)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    return target


@covers(Row("checkpoint", "one flipped byte in the latest step's array data (orbax reads it back without an error)",
            "restore raises CheckpointCorruptError: 'checkpoint step 2 in DIR is unreadable: train_state/... does "
            "not match its checksum (its bytes changed after the save); restore an older one with step=1'",
            "no wrong numbers restored; step 1 restores bit-identical", kind="fault"))
def test_flipped_byte_is_detected_on_restore(tmp_path):
    with Checkpointer(tmp_path, max_to_keep=3) as checkpointer:
        for step in (1, 2):
            checkpointer.save(step, state_for(step), config={"k": 1})
    assert (tmp_path / "2" / "checksums.json").is_file()
    damaged = flip_a_byte(tmp_path / "2")
    with Checkpointer(tmp_path) as checkpointer:
        with pytest.raises(CheckpointCorruptError, match="does not match its checksum") as error:
            checkpointer.restore(state_for(0))
        message = str(error.value)
        assert "\n" not in message and str(damaged.relative_to(tmp_path / "2")) in message and "step=1" in message
        restored = checkpointer.restore(state_for(0), step=1)
    np.testing.assert_array_equal(np.asarray(restored.train_state["params"]["w"]), state_for(1)["params"]["w"])


@covers(Row("numerics", "a train state holding NaN handed to `Checkpointer.save` (a diverged run)",
            "NonFiniteStateError: 'checkpoint step 2 was not written: the train state holds NaN/inf (in "
            "['params']['w']); the last finite checkpoint is step 1 in DIR'",
            "no step 2 folder; step 1 stays the newest, finite", kind="fault"))
def test_non_finite_state_is_never_saved(tmp_path):
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(1, state_for(1))
        bad = state_for(2)
        bad["params"]["w"][3] = np.nan
        with pytest.raises(NonFiniteStateError, match=r"step 2 was not written.*\['w'\].*step 1"):
            checkpointer.save(2, bad)
        assert checkpointer.all_steps() == [1]
    assert not (tmp_path / "2").exists()


def _run(tmp_path: Path, steps=(1, 2, 3)):
    """A run folder with checkpoints `steps` saved with the tiny job's checkpoint key."""
    from rollout_bridge import components as build
    from rollout_bridge.run_folder import RunPaths, checkpoint_key
    from rollout_bridge.config import load_config

    cfg = load_config(build.preprocess_argv(tiny_train_args(tmp_path, 4)))
    paths = RunPaths(Path(cfg.output_dir))
    with Checkpointer(paths.checkpoints, max_to_keep=5) as checkpointer:
        for step in steps:
            checkpointer.save(step, state_for(step), config=checkpoint_key(cfg))
    return cfg, paths


@covers(Row("checkpoint", "`--resume` when the latest step is damaged (a flipped byte, or a data file cut in half)",
            "one log line 'resume: from checkpoint step 2; set aside in R/checkpoints_set_aside: step 3: ... does "
            "not match its checksum ...'; the run continues from step 2",
            "step 3 kept in checkpoints_set_aside/3 (not deleted); step 2 is the newest step orbax sees", kind="fault"))
@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_resume_falls_back_to_the_newest_intact_step(tmp_path, damage):
    from rollout_bridge.run_guard import check_resume

    cfg, paths = _run(tmp_path)
    target = largest_data_file(paths.checkpoints / "3")
    if damage == "flip":
        flip_a_byte(paths.checkpoints / "3")
    else:
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    lines = []
    chosen = check_resume(dataclasses.replace(cfg, resume=True), paths, log=lines.append)
    assert chosen == 2
    assert len(lines) == 1 and "from checkpoint step 2" in lines[0] and "step 3:" in lines[0]
    assert sorted(p.name for p in paths.checkpoints.iterdir()) == ["1", "2"]
    assert (paths.root / "checkpoints_set_aside" / "3" / "checksums.json").is_file()
    with Checkpointer(paths.checkpoints) as checkpointer:
        assert checkpointer.latest_step() == 2


@covers(Row("checkpoint", "`--resume --resume_step 1` on a run with intact steps 1-3; `--resume_step 7` (no such "
            "step); `--resume_step 1` without `--resume`",
            "resumes from step 1 (steps 2, 3 set aside, one log line); exit 2 '--resume_step 7: no such checkpoint "
            "in ... (it has [1, 2, 3])'; exit 2 '--resume_step 1 needs --resume'",
            "set-aside steps kept in checkpoints_set_aside/; a refused choice moves nothing"))
def test_resume_step_picks_a_step(tmp_path):
    from rollout_bridge.run_guard import check_resume
    from rollout_bridge.run_errors import UserError

    cfg, paths = _run(tmp_path)
    with pytest.raises(UserError, match=r"--resume_step 7: no such checkpoint .*\[1, 2, 3\]"):
        check_resume(dataclasses.replace(cfg, resume=True, resume_step=7), paths)
    with pytest.raises(UserError, match="--resume_step 1 needs --resume"):
        check_resume(dataclasses.replace(cfg, resume_step=1), paths)
    assert sorted(p.name for p in paths.checkpoints.iterdir()) == ["1", "2", "3"]
    lines = []
    assert check_resume(dataclasses.replace(cfg, resume=True, resume_step=1), paths, log=lines.append) == 1
    assert sorted(p.name for p in (paths.root / "checkpoints_set_aside").iterdir()) == ["2", "3"]
    assert len(lines) == 1 and "newer than --resume_step" in lines[0]


@covers(Row("checkpoint", "export of a step with a flipped byte in its parameter data",
            "exit 2: 'export error: checkpoint R/checkpoints/2 is damaged: train_state/... does not match its "
            "checksum ...; use another step'",
            "no output folder written (no non-finite or wrong weights exported)", kind="fault"))
def test_export_refuses_a_damaged_step(tmp_path):
    tiny = make_tiny_run(tmp_path / "R")
    step_dir = tiny.root / "checkpoints" / str(tiny.step)
    flip_a_byte(step_dir)
    out = tmp_path / "hf"
    result = subprocess.run([sys.executable, "-m", "spopp_jax.export", "--checkpoint", str(step_dir),
                             "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[0].startswith("export error: checkpoint")
    assert "is damaged" in result.stderr and "does not match its checksum" in result.stderr
    assert not out.exists()
