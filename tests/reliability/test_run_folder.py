"""The run folder is never lost to a user's command: one job per folder (the run lock),
export never writes over a run or a checkpoint, and a `--resume` with other settings is
refused before anything in the folder changes.

train.py runs through its CLI (a subprocess); each case is refused (or the stale lock
taken over) before any stage starts, so these runs take seconds. Evidence that nothing was
touched: a digest of every file of the folder (path, bytes) before and after."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import socket
import re
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
from tiny_run import make_tiny_run, tiny_train_args  # noqa: E402

RUN_TIMEOUT_S = 240


def folder_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def train(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=RUN_TIMEOUT_S)


def lock_record(pid: int) -> str:
    import json

    from rollout_bridge.run_lock import process_start_ticks, _boot_id

    return json.dumps({"pid": pid, "host": socket.gethostname(), "boot_id": _boot_id(),
                       "start_ticks": process_start_ticks(pid), "argv": "train.py --output_dir x",
                       "since": time.time()})


@covers(Row("run folder", "two train.py on one output_dir (the second started while the first runs)",
            "the second exits 2 before any work: 'output_dir ... is in use by pid N on HOST (since ...: "
            "train.py ...); wait for it to finish or choose another --output_dir'",
            "the first job's folder is untouched (every file's digest equal)", kind="malformed input"))
def test_second_job_on_one_output_dir_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        (run / ".spopp-run.lock").write_text(lock_record(holder.pid))
        before = folder_digest(run)
        result = train(["--config_path", str(ROOT / "configs/smoke.yaml"), "--output_dir", str(run),
                        "--progress", "false"])
    finally:
        holder.kill()
        holder.wait()
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"is in use by pid {holder.pid} on {socket.gethostname()}" in lines[0]
    assert folder_digest(run) == before


@covers(Row("run folder", "a run lock left by a job killed with kill -9 (its pid gone)",
            "taken over with a log line '... was held by pid N ..., which is gone (a crash or kill); taking it "
            "over'; the job goes on (here to its next check, a refused `--resume_step`) and releases the lock "
            "when it ends",
            "the lock file is gone after the job; a reused pid (another start time) counts as gone too",
            kind="fault"))
def test_stale_lock_is_taken_over(tmp_path):
    from rollout_bridge.run_lock import Holder, is_stale, this_process

    run = tmp_path / "run"
    run.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run / ".spopp-run.lock").write_text(lock_record(dead.pid))
    result = train(["--config_path", str(ROOT / "configs/smoke.yaml"), "--output_dir", str(run),
                    "--progress", "false", "--resume", "--resume_step", "99"])
    assert f"was held by pid {dead.pid}" in result.stdout and "which is gone" in result.stdout, result.stdout
    assert result.returncode == 2 and "--resume_step 99: no such checkpoint" in result.stderr, result.stderr[-2000:]
    assert not (run / ".spopp-run.lock").exists()
    me = this_process()
    assert not is_stale(me)
    assert is_stale(dataclasses.replace(me, start_ticks=(me.start_ticks or 0) + 1))   # pid reused
    assert not is_stale(Holder(1, "another-host", "", None, "", 0.0))  # another host: never judged


@covers(
    Row("run folder", "`python -m spopp_jax.export --checkpoint R/checkpoints/2 --out R --overwrite` (the run "
        "folder itself)",
        "exit 2: 'export error: --out R contains the checkpoint being exported; choose a new folder'",
        "the run folder (checkpoints, warm start, metrics) untouched, digest equal"),
    Row("run folder", "export `--out` a run folder or any folder holding checkpoints, `--overwrite` or not",
        "exit 2: 'export error: --out ... is a training run's folder (it holds checkpoints, ...)' / '... holds "
        "checkpoints (...)'",
        "the folder untouched, digest equal"),
)
def test_export_never_writes_over_a_run(tmp_path):
    import shutil

    from spopp_jax import export

    run = make_tiny_run(tmp_path / "R").root
    (run / "metrics.jsonl").write_text('{"step": 2}\n')
    other = tmp_path / "other"
    shutil.copytree(run / "checkpoints", other / "nested" / "ckpt")
    step = run / "checkpoints" / "2"
    sibling = tmp_path / "another_run"
    sibling.mkdir()
    (sibling / "prior.json").write_text("{}")
    for out, says in ((run, "contains the checkpoint"), (run / "checkpoints", "contains the checkpoint"),
                      (other, "holds checkpoints"), (sibling, "training run's folder")):
        before = {p: folder_digest(p) for p in (run, other, sibling)}
        status = export.main(["--checkpoint", str(step), "--out", str(out), "--overwrite"])
        assert status == 2
        assert {p: folder_digest(p) for p in (run, other, sibling)} == before, out
        with pytest.raises(FileExistsError, match=says):
            export.refuse_run_folder(out, step)
    assert export.main(["--checkpoint", str(step), "--out", str(run / "hf_2")]) == 0   # a new folder is fine
    assert (run / "hf_2" / "config.json").is_file()


def _run_with_checkpoint(tmp_path: Path, with_checkpoint: bool, flags: tuple[str, ...] = ()):
    """A run folder as train.py leaves it (lock released): a checkpoint whose config is the
    tiny job's checkpoint key (or only run_config.json), a warm start and a prior; ``flags``
    added to the tiny job's."""
    from rollout_bridge import components as build
    from rollout_bridge.run_folder import RunPaths
    from rollout_bridge.run_guard import check_resume
    from spopp_jax.checkpoint import Checkpointer
    from rollout_bridge.config import load_config

    args = tiny_train_args(tmp_path, 2) + ["--progress", "false", "--tensorboard", "false", *flags]
    cfg = load_config(build.preprocess_argv(list(args)))
    paths = RunPaths(Path(cfg.output_dir))
    paths.root.mkdir(parents=True)
    check_resume(cfg, paths, log=lambda _: None)   # a first start: writes run_config.json (and start_policy.json)
    if with_checkpoint:
        from rollout_bridge.run_folder import checkpoint_key

        with Checkpointer(paths.checkpoints) as checkpointer:
            checkpointer.save(2, {"params": np.ones(3, np.float32)}, config=checkpoint_key(cfg))
    paths.warmstart_model.mkdir()
    (paths.warmstart_model / "warmstart.json").write_text('{"key": "w"}')
    paths.prior.write_text('{"key": "p"}')
    return args, paths


@covers(Row("run folder", "`--resume` with another model config (`--model.tiny_hidden_size 48`), with a "
            "checkpoint or before the first one",
            "exit 2 before any stage: '--resume: R was made with other settings than these (checkpoint ... / "
            "run_config.json): model.tiny_hidden_size: saved 32, expected 48. Nothing was changed; ...'",
            "warm start, prior, checkpoints untouched (digest equal)"))
@pytest.mark.parametrize("with_checkpoint", [True, False])
def test_resume_with_other_settings_changes_nothing(tmp_path, with_checkpoint):
    args, paths = _run_with_checkpoint(tmp_path, with_checkpoint)
    before = folder_digest(paths.root)
    result = train(args + ["--resume", "--model.tiny_hidden_size", "48"])
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "other settings" in lines[0] and "model.tiny_hidden_size: saved 32, expected 48" in lines[0]
    assert folder_digest(paths.root) == before


def _start_model(folder: Path, weights: str) -> Path:
    """A model folder as check_model_folder accepts it; ``weights``: its safetensors' bytes."""
    folder.mkdir(exist_ok=True)
    for name, text in (("config.json", "{}"), ("tokenizer.json", "{}"), ("model.safetensors", weights)):
        (folder / name).write_text(text)
    return folder


@covers(Row("run folder", "`--resume` after the files at `--model.path` changed since the run started (weights "
            "re-exported there, a shipped asset updated by a pull)",
            "exit 2 before any stage: '--resume: the starting policy's files in M changed since the run in R "
            "started (its checkpoints were trained from other weights). Nothing was changed; point --model.path "
            "at the original weights, or choose a new --output_dir'",
            "warm start, prior, checkpoints untouched (digest equal); notes or shipped evaluation records added "
            "beside the weights resume; a run started before `start_policy.json` was kept resumes, saying its "
            "start is not checked"))
def test_resume_after_the_starting_policy_changed_is_refused(tmp_path):
    from rollout_bridge import components as build
    from rollout_bridge.config import load_config
    from rollout_bridge.run_errors import UserError
    from rollout_bridge.run_guard import START_POLICY_FILE, check_resume

    model = _start_model(tmp_path / "start_model", "weights the run started from")
    args, paths = _run_with_checkpoint(tmp_path, True, ("--model.path", str(model)))
    resume = load_config(build.preprocess_argv(args + ["--resume"]))
    (model / "README.md").write_text("notes")                      # what it plays is unchanged
    (model / "evaluations").mkdir()
    (model / "evaluations" / "prior-0.json").write_text("{}")
    assert check_resume(resume, paths, log=lambda _: None) == 2

    (model / "model.safetensors").write_text("weights exported later")
    before = folder_digest(paths.root)
    result = train(args + ["--resume"])
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"the starting policy's files in {model} changed since the run in {paths.root} started" in lines[0]
    assert "point --model.path at the original weights, or choose a new --output_dir" in lines[0]
    assert folder_digest(paths.root) == before

    (paths.root / START_POLICY_FILE).unlink()                      # a run started before the record was kept
    said = []
    assert check_resume(resume, paths, log=said.append) == 2
    assert said == [f"resume: {paths.root} keeps no record of the starting policy's content (a run started "
                    f"before it was kept): the files in {model} are not checked"]

    for damaged in ("{not json", "[]", '{"folder": "x"}'):                  # edited by hand, or torn on a bad disk
        (paths.root / START_POLICY_FILE).write_text(damaged)
        with pytest.raises(UserError, match=f"--resume: {re.escape(str(paths.root / START_POLICY_FILE))} is damaged"):
            check_resume(resume, paths, log=lambda _: None)


def test_resume_before_the_first_checkpoint_records_the_start_again(tmp_path):
    """No checkpoint yet: RL starts afresh from what is at model.path now, so that is the
    start a later --resume compares with."""
    from rollout_bridge import components as build
    from rollout_bridge.config import load_config
    from rollout_bridge.run_folder import checkpoint_key
    from rollout_bridge.run_guard import check_resume
    from spopp_jax.checkpoint import Checkpointer

    model = _start_model(tmp_path / "start_model", "first weights")
    args, paths = _run_with_checkpoint(tmp_path, False, ("--model.path", str(model)))
    resume = load_config(build.preprocess_argv(args + ["--resume"]))
    _start_model(model, "weights exported before the first checkpoint")
    assert check_resume(resume, paths, log=lambda _: None) is None
    with Checkpointer(paths.checkpoints) as checkpointer:
        checkpointer.save(2, {"params": np.ones(3, np.float32)}, config=checkpoint_key(resume))
    assert check_resume(resume, paths, log=lambda _: None) == 2


@covers(Row("run folder", "`--resume` of a run that keeps more checkpoints (`--keep_checkpoints 4`) "
            "with fewer (the default 2)",
            "refused before anything is written: '--resume: R/checkpoints holds 4 checkpoints (steps [1, 2, 3, 4]); "
            "with --keep_checkpoints 2 the next save would delete steps [1, 2]. Nothing was changed; ...'",
            "every checkpoint kept (folder digest equal); the same resume with --keep_checkpoints 4 starts "
            "from step 4; 3 steps with 2 kept (a kill between a save and orbax's deletion) resume"))
def test_resume_with_fewer_kept_checkpoints_deletes_none(tmp_path):
    from rollout_bridge import components as build
    from rollout_bridge.config import load_config
    from rollout_bridge.run_errors import UserError
    from rollout_bridge.run_folder import RunPaths, checkpoint_key
    from rollout_bridge.run_guard import check_resume
    from spopp_jax.checkpoint import Checkpointer

    args = tiny_train_args(tmp_path, 4) + ["--keep_checkpoints", "4"]
    made = load_config(build.preprocess_argv(list(args)))
    paths = RunPaths(Path(made.output_dir))
    paths.root.mkdir(parents=True)
    with Checkpointer(paths.checkpoints, max_to_keep=4) as checkpointer:
        for step in (1, 2, 3, 4):
            checkpointer.save(step, {"params": np.full(3, step, np.float32)}, config=checkpoint_key(made))
    before = folder_digest(paths.root)
    fewer = load_config(build.preprocess_argv(tiny_train_args(tmp_path, 4) + ["--resume"]))
    with pytest.raises(UserError, match=r"holds 4 checkpoints \(steps \[1, 2, 3, 4\]\); with --keep_checkpoints 2 "
                                        r"the next save would delete steps \[1, 2\]"):
        check_resume(fewer, paths, log=lambda _: None)
    assert folder_digest(paths.root) == before
    assert check_resume(dataclasses.replace(made, resume=True), paths, log=lambda _: None) == 4
    shutil.rmtree(paths.checkpoints / "1")                                   # an interrupted rotation: kept + 1
    assert check_resume(fewer, paths, log=lambda _: None) == 4


@covers(Row("run folder", "`--stage prior` / `--stage warmstart` with other settings (`--prior.rollouts_per_task 2`, "
            "`--warmstart.epochs 1`) on a run's folder (it holds checkpoints), without `--resume`",
            "exit 2 before any stage: 'R/checkpoints holds checkpoints up to step 2: pass --resume to continue "
            "that run, or choose a new --output_dir'",
            "the run's warm start, prior and checkpoints untouched (digest equal)"))
@pytest.mark.parametrize("stage_flags", [["--stage", "prior", "--prior.rollouts_per_task", "2"],
                                         ["--stage", "warmstart", "--warmstart.epochs", "1"]])
def test_a_stage_on_a_runs_folder_changes_nothing(tmp_path, stage_flags):
    args, paths = _run_with_checkpoint(tmp_path, with_checkpoint=True)
    before = folder_digest(paths.root)
    result = train(args + stage_flags)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "holds checkpoints up to step 2: pass --resume" in lines[0], result.stderr
    assert folder_digest(paths.root) == before


def test_a_torn_lock_file_is_taken_over_and_holds_no_one(tmp_path):
    """A lock file that does not parse, even after a writer's moment (a crash mid-write), names
    no live holder and is taken over by the next job."""
    from rollout_bridge.run_lock import LOCK_FILE, RunLock, live_holder

    (tmp_path / LOCK_FILE).write_text('{"pid": 12')
    assert live_holder(tmp_path) is None
    said = []
    with RunLock(tmp_path, log=said.append) as lock:
        assert lock.held and live_holder(tmp_path) is not None and live_holder(tmp_path).pid == os.getpid()
    assert said and "unreadable" in said[0]


@covers(Row("run folder", "`--resume` of a run that already finished (to re-export, re-evaluate or train on)",
            "summary.json is written anew; `total_wall_s` is the earlier summary's plus this job's time, "
            "`resumed_wall_s` the resumes' part of it; the stage times are this job's: `rl_stage_wall_s` its RL "
            "stage, `evaluation_wall_s` that stage less the updates it trained (the metrics rows after the "
            "checkpoint it resumed from), while `rl_wall_s` sums the updates of every part",
            "the first run's wall time is kept (total_wall_s - resumed_wall_s); a resume that trains nothing "
            "reports its whole stage as evaluation (not that stage less the earlier job's updates); a run "
            "without --resume reports its own time only"))
def test_resume_of_a_finished_run_keeps_its_wall_time(tmp_path):
    """write_summary as train.py calls it at the end of a job: the first job took 100 s (an
    RL stage of 60 s, 43 s of it two updates), a --resume of the finished run 30 s (a stage
    of 10 s, no update: it continued from the last checkpoint), another 20 s that trained
    one more update of 5 s in a stage of 15 s."""
    import json
    from types import SimpleNamespace

    from rollout_bridge import components as build
    from rollout_bridge.config import load_config
    from rollout_bridge.job_report import write_summary
    from rollout_bridge.run_folder import RunPaths

    args = tiny_train_args(tmp_path, 2)
    paths = RunPaths(tmp_path / "run")
    paths.root.mkdir()
    metrics = paths.root / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": k, "success_rate": 0.5, "update_wall_s": s, "wall_s": w}) + "\n"
                               for k, s, w in [(1, 40.0, 40.0), (2, 3.0, 43.0)]))
    env = SimpleNamespace(reference_success={}, reference_se={}, tasks_record=None)
    prior = {"successes": [0, 1], "trials": [2, 2], "success_rate": 0.25}

    def finish(flags: list[str], job_s: float, stage_s: float, resumed_from: int | None) -> tuple[dict, float]:
        """The summary and how long write_summary took (its own time counts in the job's)."""
        job = SimpleNamespace(cfg=load_config(build.preprocess_argv(args + flags)), paths=paths, env=env)
        now = time.time()
        write_summary(job, prior, np.array([1, 1]), np.array([2, 2]), {}, {}, now - stage_s, now - job_s,
                      resumed_from=resumed_from)
        return json.loads(paths.summary.read_text()), time.time() - now

    first, took = finish([], 100.0, 60.0, None)
    assert 100.0 <= first["total_wall_s"] <= 100.0 + took and "resumed_wall_s" not in first
    assert 60.0 <= first["rl_stage_wall_s"] <= 60.0 + took and first["rl_wall_s"] == 43.0
    assert first["evaluation_wall_s"] == pytest.approx(first["rl_stage_wall_s"] - 43.0)
    resumed, took = finish(["--resume"], 30.0, 10.0, 2)
    assert 30.0 <= resumed["resumed_wall_s"] <= 30.0 + took
    assert resumed["total_wall_s"] == pytest.approx(first["total_wall_s"] + resumed["resumed_wall_s"])
    assert 10.0 <= resumed["rl_stage_wall_s"] <= 10.0 + took and resumed["rl_wall_s"] == 43.0
    assert resumed["evaluation_wall_s"] == resumed["rl_stage_wall_s"]   # not 10 s less the first job's 43 s
    with metrics.open("a") as f:
        f.write(json.dumps({"step": 3, "success_rate": 1.0, "update_wall_s": 5.0, "wall_s": 5.0}) + "\n")
    again, took = finish(["--resume"], 20.0, 15.0, 2)
    assert 20.0 <= again["resumed_wall_s"] - resumed["resumed_wall_s"] <= 20.0 + took
    assert again["total_wall_s"] - again["resumed_wall_s"] == pytest.approx(first["total_wall_s"])
    assert again["rl_wall_s"] == 48.0 and again["evaluation_wall_s"] == pytest.approx(again["rl_stage_wall_s"] - 5.0)
    fresh, took = finish([], 10.0, 5.0, None)
    assert 10.0 <= fresh["total_wall_s"] <= 10.0 + took and "resumed_wall_s" not in fresh   # a new run: its own
