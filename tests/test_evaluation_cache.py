"""The evaluation cache (``prior.cache_dir``): records of fixed-policy evaluations reused
across runs only when their key matches; a rerun into another output_dir reads the
prior instead of playing it again."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_bridge.evaluation_cache import EVALUATION_SCHEME, cache_file, read_cached, write_cached
from tiny_run import tiny_train_args

ROOT = Path(__file__).resolve().parents[1]
KEY = {"policy": "abc", "seed": 0, "episodes": EVALUATION_SCHEME}


def test_a_record_is_read_back_only_under_its_own_key(tmp_path):
    assert read_cached(None, "prior", KEY) is None and write_cached(None, "prior", KEY, {"a": 1}) is None
    assert read_cached(tmp_path, "prior", KEY) is None                          # nothing there yet
    path = write_cached(tmp_path, "prior", KEY, {"success_rate": 0.25})
    assert path == cache_file(tmp_path, "prior", KEY) and path.name.startswith("prior-")
    assert read_cached(tmp_path, "prior", KEY) == {"success_rate": 0.25}
    assert read_cached(tmp_path, "evaluation", KEY) is None                     # another kind
    assert read_cached(tmp_path, "prior", {**KEY, "seed": 1}) is None           # another key
    assert cache_file(tmp_path, "prior", dict(reversed(KEY.items()))) == path   # key order does not matter
    stored = json.loads(path.read_text())
    path.write_text(json.dumps({**stored, "key": {**KEY, "seed": 1}}))          # a hash collision's stand-in
    assert read_cached(tmp_path, "prior", KEY) is None
    path.write_text("{not json")                                                 # a torn or corrupt file
    assert read_cached(tmp_path, "prior", KEY) is None


def _prior_stage(tmp_path: Path, output: str, *extra: str) -> tuple[str, dict]:
    args = tiny_train_args(tmp_path)
    args[args.index("--output_dir") + 1] = str(tmp_path / output)
    job = subprocess.run([sys.executable, str(ROOT / "train.py"), *args, "--stage", "prior", "--progress", "false",
                          "--prior.cache_dir", str(tmp_path / "cache"), *extra],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert job.returncode == 0, job.stderr[-3000:]
    return job.stdout + job.stderr, json.loads((tmp_path / output / "prior.json").read_text())


def test_a_rerun_into_another_folder_reads_the_prior(tmp_path):
    """(Another seed playing again is tested on the held-out evaluation: test_heldout_eval.)"""
    first_log, first = _prior_stage(tmp_path, "a")
    assert "from an earlier run" not in first_log
    again_log, again = _prior_stage(tmp_path, "b")
    assert "from an earlier run" in again_log and again == first
    assert len(list((tmp_path / "cache").glob("prior-*.json"))) == 1


# (field, value, another field of its section that IS keyed, its value)
UNKEYED = [
    # changes nothing a fixed policy plays (no publish there)
    ("rollout.engine.prefix_reuse_across_publish", "true", "rollout.temperature", "0.5"),
    # float rounding only: a prefill padded to a larger compiled shape while its own compiles
    ("rollout.engine.background_compile", "true", "rollout.temperature", "0.5"),
    # the learner's batch layout: the same loss and gradient, nothing the rollouts play
    ("rollout.pack_rows", "true", "rollout.max_new_tokens", "20"),
    # a finished run printed beside the agent's success, read for the report only
    ("env.blind_control", "runs/blind", "env.max_turns", "5"),
]


@pytest.mark.parametrize("field, value, keyed, keyed_value", UNKEYED)
def test_unkeyed_fields_change_no_key(field, value, keyed, keyed_value):
    """Records and checkpoints stay valid whichever way an unkeyed field is set; a keyed
    field of the same section (the control) does change the key."""
    from rollout_bridge.run_folder import checkpoint_key, stage_key
    from rollout_bridge.config import load_config

    section, name = field.split(".", 1)
    plain = load_config([])
    changed = load_config([f"--{field}", value])
    assert name.rsplit(".", 1)[-1] not in stage_key(changed, section)[section]
    assert stage_key(changed, section) == stage_key(plain, section)
    assert checkpoint_key(changed) == checkpoint_key(plain)
    assert stage_key(load_config([f"--{keyed}", keyed_value]), section) != stage_key(plain, section)


def test_the_program_store_changes_no_key():
    """``program_store`` (top level): the same programs, compiled from their stored modules
    instead of traced, so no record or checkpoint key holds it; the seed (the control) does
    change them."""
    from rollout_bridge.config import load_config
    from rollout_bridge.run_folder import checkpoint_key, stage_key

    plain, off, seeded = (load_config(args) for args in ([], ["--program_store", "false"], ["--seed", "1"]))
    assert plain.program_store and not off.program_store
    assert checkpoint_key(off) == checkpoint_key(plain) != checkpoint_key(seeded)
    for section in ("model", "env", "warmstart", "prior", "rollout"):
        assert stage_key(off, section) == stage_key(plain, section)
        assert "program_store" not in repr(stage_key(off, section))


def test_the_receipt_delay_is_keyed_by_runs_not_by_fixed_policy_records(tmp_path):
    """`rollout.result_delay_s` holds results before the orchestrator receives them; the
    prior and the evaluations play a fixed policy without it, so a record made at one delay
    serves every delay (and records written at the default stay valid), while a checkpoint
    is resumed only at its own delay."""
    from rollout_bridge.config import load_config
    from rollout_bridge.evaluation import evaluation_key
    from rollout_bridge.prior_stage import prior_key
    from rollout_bridge.run_folder import checkpoint_key, stage_key

    plain, delayed = load_config([]), load_config(["--rollout.result_delay_s", "12"])
    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "config.json").write_text("{}")
    assert stage_key(delayed, "rollout") != stage_key(plain, "rollout")          # the control
    assert checkpoint_key(delayed) != checkpoint_key(plain)
    assert evaluation_key(delayed, policy, 4, {"heldout": "d"}) == evaluation_key(plain, policy, 4, {"heldout": "d"})
    assert evaluation_key(plain, policy, 4, {"heldout": "d"})["rollout"]["result_delay_s"] == 0.0
    assert prior_key(delayed, policy, 0.9, "t") == prior_key(plain, policy, 0.9, "t")
    assert prior_key(delayed, policy, 0.9, "t") != prior_key(load_config(["--rollout.temperature", "0.5"]), policy,
                                                             0.9, "t")


def test_the_learner_batch_width_is_keyed_by_runs_not_by_fixed_policy_records(tmp_path):
    """`rollout.pad_to_multiple` lays out the learner's batches; the prior and the evaluations
    play a fixed policy and do not use it, so their records key it at 256 (its value when the
    shipped records were written) whatever the run sets, while a checkpoint is resumed only
    at its own width."""
    from rollout_bridge.config import load_config
    from rollout_bridge.evaluation import evaluation_key
    from rollout_bridge.prior_stage import prior_key
    from rollout_bridge.run_folder import checkpoint_key

    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "config.json").write_text("{}")
    configs = [load_config(["--rollout.pad_to_multiple", "512"]), load_config(["--rollout.pad_to_multiple", "256"]),
               load_config(["--rollout.pad_to_multiple", "64"])]
    assert len({json.dumps(checkpoint_key(c), sort_keys=True) for c in configs}) == 3   # the control
    for cfg in configs:
        assert evaluation_key(cfg, policy, 4, {"heldout": "d"}) == evaluation_key(configs[1], policy, 4, {"heldout": "d"})
        assert prior_key(cfg, policy, 0.9, "t") == prior_key(configs[1], policy, 0.9, "t")
        assert evaluation_key(cfg, policy, 4, {"heldout": "d"})["rollout"]["pad_to_multiple"] == 256



def test_the_decode_chunk_length_is_keyed_by_runs_not_by_fixed_policy_records(tmp_path):
    """`rollout.engine.steps_per_call` is how many decode steps the embedded engine runs per
    host round trip; it changes no sampled token (tests/test_jax_engine.py), so the prior
    and the evaluations key it at 8 (its value when the shipped records were written) whatever
    the run sets, while a checkpoint is resumed only at its own value (it decides when an
    in-flight publish lands)."""
    from rollout_bridge.config import load_config
    from rollout_bridge.evaluation import evaluation_key
    from rollout_bridge.prior_stage import prior_key
    from rollout_bridge.run_folder import checkpoint_key

    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "config.json").write_text("{}")
    configs = [load_config(["--rollout.engine.steps_per_call", str(steps)]) for steps in (2, 8, 4)]
    assert len({json.dumps(checkpoint_key(c), sort_keys=True) for c in configs}) == 3   # the control
    for cfg in configs:
        assert evaluation_key(cfg, policy, 4, {"heldout": "d"}) == evaluation_key(configs[1], policy, 4, {"heldout": "d"})
        assert prior_key(cfg, policy, 0.9, "t") == prior_key(configs[1], policy, 0.9, "t")
        assert evaluation_key(cfg, policy, 4, {"heldout": "d"})["rollout"]["engine_steps_per_call"] == 8

def test_two_jobs_writing_one_cache_record_at_once_both_succeed(tmp_path, monkeypatch):
    """The two arms of a seed run at once write the same evaluation record (the method is not
    in its key): the second writer, starting while the first is between its write and its
    rename, must neither fail nor leave a torn file or a temporary behind."""
    import os

    from rollout_bridge import atomic_files

    path = tmp_path / "cache" / "evaluation-x.json"
    real_replace = os.replace
    raced = []

    def replace_after_a_second_writer(src, dst):
        if not raced:
            raced.append(src)
            atomic_files.write_json_atomic(path, {"writer": 2})   # the other job, mid-way through ours
        real_replace(src, dst)

    monkeypatch.setattr(atomic_files.os, "replace", replace_after_a_second_writer)
    atomic_files.write_json_atomic(path, {"writer": 1})
    assert json.loads(path.read_text()) in ({"writer": 1}, {"writer": 2})
    assert [p.name for p in path.parent.iterdir()] == [path.name]                 # no temporary left
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())            # as open() would make it


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask
