"""benchmarks/matched_runs.py never deletes a run folder another job trains, continues an
interrupted run from its checkpoints, and never counts a finished run made with other
settings as done. train.py is replaced by a fake that records each command and writes what
train.py writes (checkpoints, metrics.jsonl, summary.json, its log)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import matched_runs  # noqa: E402
from rollout_bridge.run_lock import LOCK_FILE, RunLock  # noqa: E402

STEPS = 4


@pytest.fixture
def train(monkeypatch):
    """A fake train.py: records each command, then writes a finished run in its output_dir."""
    calls = []

    def fake_run(command, stdout=None, **kw):
        calls.append(list(command))
        out = Path(command[command.index("--output_dir") + 1])
        steps = int(command[command.index("--steps") + 1])
        (out / "checkpoints" / str(steps)).mkdir(parents=True, exist_ok=True)
        with open(out / "metrics.jsonl", "a") as f:
            f.writelines(json.dumps({"step": s, "success_rate": 0.5}) + "\n" for s in range(1, steps + 1))
        (out / "summary.json").write_text(json.dumps({"success_after_rl": 0.5}))
        stdout.write("fake train.py ran\n")
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(matched_runs.subprocess, "run", fake_run)
    return calls


def command_for(root, arm="spopp", seed=0, steps=STEPS, extra=()):
    return matched_runs.train_command(arm, seed, steps, root / arm / f"seed{seed}", root / "shared" / "model",
                                      root / "shared" / "prior.json", list(extra))


def run_one(root, arm="spopp", seed=0, steps=STEPS, extra=(), archived=None):
    return matched_runs.run_one(arm, seed, steps, root, root / "shared" / "model", root / "shared" / "prior.json",
                                list(extra), archived=archived)


def interrupted_run(folder, command, step=2):
    """What a killed train.py leaves: a complete checkpoint step, an unfinished one, metrics, a log."""
    (folder / "checkpoints" / str(step)).mkdir(parents=True)
    (folder / "checkpoints" / f"{step + 2}.orbax-checkpoint-tmp-1").mkdir()   # an interrupted save
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    (folder / "train.log").write_text("first start\n")
    (folder / "command.json").write_text(json.dumps(command, indent=1))


def finished_run(folder, command):
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text('{"step": 1, "success_rate": 0.5}\n')
    (folder / "summary.json").write_text(json.dumps({"success_after_rl": 0.5}))
    if command is not None:
        (folder / "command.json").write_text(json.dumps(command, indent=1))


def tree(folder):
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None)
            for p in sorted(folder.rglob("*"))}


def test_a_folder_a_live_job_holds_is_refused_and_left_untouched(tmp_path, train):
    out = tmp_path / "spopp" / "seed0"
    out.mkdir(parents=True)
    (out / "train.log").write_text("another campaign's run, training now\n")
    with RunLock(out):   # held by this (live) process, as train.py holds it for its whole run
        before = tree(out)
        with pytest.raises(SystemExit, match=f"{out} is in use by pid {os.getpid()}"):
            run_one(tmp_path)
        assert tree(out) == before and train == []


def test_a_lock_left_by_a_dead_job_does_not_block_the_redo(tmp_path, train):
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    out = tmp_path / "spopp" / "seed0"
    out.mkdir(parents=True)
    (out / LOCK_FILE).write_text(json.dumps({"pid": gone.pid, "host": socket.gethostname(), "boot_id": "",
                                             "start_ticks": None, "argv": "train.py", "since": 0}))
    assert run_one(tmp_path) is not None
    assert train == [command_for(tmp_path)] and not (out / LOCK_FILE).exists()


def test_an_interrupted_run_with_a_checkpoint_and_the_same_command_is_resumed(tmp_path, train, capsys):
    out = tmp_path / "spopp" / "seed0"
    command = command_for(tmp_path)
    interrupted_run(out, command)
    assert run_one(tmp_path) is not None
    assert train == [command + ["--resume"]]
    assert (out / "checkpoints" / "2").is_dir()                                  # kept for train.py to load
    assert (out / "train.log").read_text() == "first start\nfake train.py ran\n"  # appended, not truncated
    assert json.loads((out / "command.json").read_text()) == command             # the run's own record stays
    said = capsys.readouterr().out
    assert f"{out}: an interrupted run, continued from its checkpoint step 2 with --resume" in said


def test_an_interrupted_run_with_another_command_is_redone_from_scratch(tmp_path, train, capsys):
    out = tmp_path / "spopp" / "seed0"
    interrupted_run(out, command_for(tmp_path, steps=80))
    assert run_one(tmp_path, steps=120) is not None
    assert train == [command_for(tmp_path, steps=120)]            # no --resume
    assert not (out / "checkpoints" / "2").exists() and (out / "train.log").read_text() == "fake train.py ran\n"
    assert json.loads((out / "command.json").read_text()) == train[0]
    assert "redone from scratch (its command differs: --steps: made with 80, asked 120)" in capsys.readouterr().out


def test_an_interrupted_run_without_a_complete_checkpoint_is_redone(tmp_path, train, capsys):
    out = tmp_path / "spopp" / "seed0"
    interrupted_run(out, command_for(tmp_path))
    (out / "checkpoints" / "2").rmdir()            # only the interrupted save is left
    run_one(tmp_path)
    assert train == [command_for(tmp_path)] and "(no complete checkpoint step)" in capsys.readouterr().out


@pytest.mark.parametrize("where", ["root", "archive"])
def test_a_finished_run_made_with_other_steps_is_refused(tmp_path, train, where):
    root, archive = tmp_path / "runs", tmp_path / "kept"
    folder = (root if where == "root" else archive) / "spopp" / "seed0"
    finished_run(folder, command_for(root, steps=80))
    before = tree(folder)
    word = "made with" if where == "root" else "archived"
    with pytest.raises(SystemExit, match=f"--steps: {word} 80, asked 120") as refused:
        run_one(root, steps=120, archived=archive)
    assert str(folder) in str(refused.value) and "--seed" not in str(refused.value)
    assert tree(folder) == before and train == []


def test_run_refuses_a_finished_run_of_other_settings_before_any_work(tmp_path, train):
    root = tmp_path / "runs"
    finished_run(root / "spopp" / "seed1", command_for(root, seed=1, steps=80))
    args = matched_runs.parse_args(["run", "--root", str(root), "--arms", "spopp", "--seeds", "0", "1",
                                    "--steps", "120", "--config", str(matched_runs.REPO / "configs" / "smoke.yaml")])
    with pytest.raises(SystemExit, match="seed1 was made with another command.*--steps: made with 80, asked 120"):
        matched_runs.run(args)
    assert train == [] and not (root / "shared").exists() and not (root / "spopp" / "seed0").exists()


def test_a_finished_run_from_another_checkout_and_interpreter_is_done(tmp_path, train):
    """The archive was made on another checkout, from another root, with another python, before
    methods owned their recipes and without checkpoint retention: the same run."""
    root, archive = tmp_path / "runs", tmp_path / "kept"
    repo, elsewhere = str(matched_runs.REPO), "/home/someone/spopp-jax"
    asked = command_for(root, extra=["--config_path", f"{repo}/configs/default.yaml", "--keep_checkpoints", "13",
                                     "--env.data_dir", str(root / "data")])
    stored = [token.replace(repo, elsewhere).replace(str(root), "/scratch/old_root") for token in asked]
    stored[0] = "/usr/bin/python3.12"
    method = stored.index("--method")
    stored[method:method + 2] = ["--method", "spopp", "--advantage.measure", "token", "--loss.dual_clip", "2.0"]
    keep = stored.index("--keep_checkpoints")
    del stored[keep:keep + 2]
    assert stored[1] == f"{elsewhere}/train.py" and "/scratch/old_root/data" in stored
    finished_run(archive / "spopp" / "seed0", stored)
    assert run_one(root, extra=asked[asked.index("--config_path"):], archived=archive) is None
    assert train == []
    assert matched_runs.command_differences(stored, asked) == []


def test_a_finished_run_without_a_command_record_is_done(tmp_path, train):
    finished_run(tmp_path / "kept" / "spopp" / "seed0", None)
    assert run_one(tmp_path / "runs", archived=tmp_path / "kept") is None and train == []


def test_command_differences_name_each_flag_that_changes_the_run():
    root = Path("/r")
    base = command_for(root, extra=["--config_path", "/x/configs/smoke.yaml"])
    other = matched_runs.train_command("spopp", 0, STEPS, root / "spopp" / "seed0", root / "m", root / "p.json",
                                       ["--config_path", "/x/configs/default.yaml", "--rollout.result_delay_s", "12"],
                                       drain=[], eval_rollouts=4)
    assert matched_runs.command_differences(base, other) == [
        "--config_path: archived /x/configs/smoke.yaml, asked /x/configs/default.yaml",
        "--rollout.result_delay_s: archived (not given), asked 12",
        "--prior.rollouts_per_task: archived (not given), asked 4",
        "--rollout.drain: archived finish, asked (not given)",
    ]
    # another arm's old recipe flags are not this arm's method
    old_event_traj = base[:base.index("--method")] + matched_runs.RECIPE_FLAGS_BEFORE_METHODS["event_traj"] + \
        base[base.index("--method") + 2:]
    assert matched_runs.command_differences(old_event_traj, base) == [
        "--method: archived event_trajectory, asked spopp"]


def test_a_resume_train_py_refuses_says_how_to_redo_the_run(tmp_path, monkeypatch):
    out = tmp_path / "spopp" / "seed0"
    interrupted_run(out, command_for(tmp_path))
    monkeypatch.setattr(matched_runs.subprocess, "run", lambda command, **kw: subprocess.CompletedProcess(command, 2))
    with pytest.raises(SystemExit, match=f"exit 2.*continued with --resume: remove {out} to redo it from scratch"):
        run_one(tmp_path)
    assert (out / "checkpoints" / "2").is_dir()


def shared_stage_record(root, alpha0=(1.0, 2.0), digest="ab" * 32, wall_s=1.0, model="/checkout/assets/warmstart"):
    """What a shared stage leaves in ``root``/shared: the prior and the warm-start record."""
    shared = root / "shared"
    shared.mkdir(parents=True, exist_ok=True)
    (shared / "prior.json").write_text(json.dumps({"alpha0": list(alpha0), "beta0": [1.0, 1.0], "wall_s": wall_s}))
    (shared / "warm_start.txt").write_text(f"{model}\nsha256 {digest}\n")


def finished_runs(root, summaries):
    """Finished runs in ``root``: {(arm, seed): success_after_rl}."""
    for (arm, seed), success in summaries.items():
        finished_run(root / arm / f"seed{seed}", command_for(root, arm, seed))
        (root / arm / f"seed{seed}" / "summary.json").write_text(json.dumps({"success_after_rl": success}))


@pytest.mark.parametrize("other", [{"alpha0": (3.0, 2.0)}, {"digest": "cd" * 32}], ids=["prior", "warm_start"])
def test_archive_refuses_another_campaign_and_leaves_the_archive_as_it_was(tmp_path, other):
    archive, root = tmp_path / "kept", tmp_path / "runs"
    shared_stage_record(archive)
    finished_runs(archive, {("spopp", 0): 0.5, ("spo", 0): 0.4})
    shared_stage_record(root, **other)
    finished_runs(root, {("spopp", 0): 0.7, ("spopp", 1): 0.6})
    before = tree(archive)
    what = "priors" if "alpha0" in other else "warm starts"
    with pytest.raises(SystemExit, match=f"holds another campaign.*the {what} {root / 'shared'}") as refused:
        matched_runs.archive(root, archive)
    assert str(archive / "shared") in str(refused.value) and "\n" not in str(refused.value)
    assert tree(archive) == before


def test_archiving_the_same_root_twice_changes_nothing(tmp_path, capsys):
    archive, root = tmp_path / "kept", tmp_path / "runs"
    shared_stage_record(root)
    finished_runs(root, {("spopp", 0): 0.5, ("spo", 0): 0.4})
    assert matched_runs.archive(root, archive) == 2
    before = tree(archive)
    assert matched_runs.archive(root, archive) == 0
    assert tree(archive) == before and "replaced" not in capsys.readouterr().out


def test_a_new_seed_of_the_same_campaign_is_added_to_the_archive(tmp_path):
    """Seed 1 made later on another checkout: its prior written again (another wall time, the
    same alpha0/beta0), its warm start at another path (the same sha256)."""
    archive, root = tmp_path / "kept", tmp_path / "runs"
    shared_stage_record(archive)
    finished_runs(archive, {("spopp", 0): 0.5})
    shared_stage_record(root, wall_s=7.0, model="/elsewhere/assets/warmstart")
    finished_runs(root, {("spopp", 1): 0.6})
    kept = tree(archive)
    assert matched_runs.archive(root, archive) == 1
    assert json.loads((archive / "spopp" / "seed1" / "summary.json").read_text()) == {"success_after_rl": 0.6}
    now = tree(archive)
    assert {name: now[name] for name, (_, data) in kept.items() if data is not None} == \
        {name: was for name, was in kept.items() if was[1] is not None}   # seed 0's and the shared files: as they were


def test_an_archived_run_with_another_summary_is_replaced_only_when_asked(tmp_path, capsys):
    archive, root = tmp_path / "kept", tmp_path / "runs"
    shared_stage_record(archive)
    finished_runs(archive, {("spopp", 0): 0.5})
    shared_stage_record(root)
    finished_runs(root, {("spopp", 0): 0.9, ("spopp", 1): 0.6})
    before = tree(archive)
    seed0 = archive / "spopp" / "seed0"
    with pytest.raises(SystemExit, match=f"other runs of the same arm and seed.*{seed0} \\(pass --replace"):
        matched_runs.archive(root, archive)
    assert tree(archive) == before                        # seed 1 not added either: nothing is copied
    matched_runs.main(["archive", "--root", str(root), "--to", str(archive), "--replace"])
    assert json.loads((seed0 / "summary.json").read_text()) == {"success_after_rl": 0.9}
    assert (archive / "spopp" / "seed1" / "summary.json").is_file()
    said = capsys.readouterr().out
    assert f"replaced: {seed0} (its summary.json differed) by {root / 'spopp' / 'seed0'}" in said
    assert "archived 2 runs" in said


def campaign_args(root, archive, warm_start):
    return matched_runs.parse_args(["run", "--root", str(root), "--archive", str(archive), "--arms", "spopp",
                                    "--seeds", "0", "1", "--steps", str(STEPS), "--warm-start", str(warm_start),
                                    "--config", str(matched_runs.REPO / "configs" / "smoke.yaml")])


def warm_start_folder(folder):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights")
    return matched_runs.weights_digest(folder)


def test_run_refuses_a_root_prior_other_than_the_archives_before_any_work(tmp_path, train):
    archive, root = tmp_path / "kept", tmp_path / "runs"
    digest = warm_start_folder(tmp_path / "warmstart")
    shared_stage_record(archive, digest=digest)
    shared_stage_record(root, alpha0=(3.0, 2.0), digest=digest, model=str((tmp_path / "warmstart").resolve()))
    before = tree(root)
    with pytest.raises(SystemExit, match="are two campaigns: the priors") as refused:
        matched_runs.run(campaign_args(root, archive, tmp_path / "warmstart"))
    assert str(root / "shared" / "prior.json") in str(refused.value)
    assert str(archive / "shared" / "prior.json") in str(refused.value)
    assert train == [] and tree(root) == before


def test_run_continues_an_archive_from_a_root_with_the_same_prior(tmp_path, train):
    """The root's prior written again (another wall time): the same alpha0/beta0, the same prior."""
    archive, root = tmp_path / "kept", tmp_path / "runs"
    digest = warm_start_folder(tmp_path / "warmstart")
    shared_stage_record(archive, digest=digest)
    finished_run(archive / "spopp" / "seed0", None)
    shared_stage_record(root, digest=digest, wall_s=7.0, model=str((tmp_path / "warmstart").resolve()))
    matched_runs.run(campaign_args(root, archive, tmp_path / "warmstart"))
    assert [command[command.index("--seed") + 1] for command in train] == ["1"]
