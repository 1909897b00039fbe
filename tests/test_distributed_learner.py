"""``train.py --distributed``'s learner data path (rollout_bridge/distributed_learner.py):
2 processes x 2 virtual CPU devices (gloo collectives). Only process 0 holds the batches
(the orchestrator's role) and drives a `LeaderLearner`; process 1 runs `follow` with no
data of its own. One process drives its `PolicyLearner` with no LeaderLearner in between. Checked against one process on one device (this pytest process) running
the same `PolicyLearner` calls:

  * process 1 followed every call (3 CALLs, then STOP) and got process 0's shared value;
  * the weights process 0 publishes after 3 updates equal the one-device learner's (a
    follower training on anything but process 0's batch would change them), the losses too;
  * the checkpoint both processes wrote (SAVE: each its shards) restores, in one process,
    to those same parameters with the orchestrator's policy event;
  * (slow) ``--resume`` (RESTORE): two NEW processes, built from the initial parameters, restore
    that checkpoint (each its shards) and train one more update on the same batch: the
    result equals the one-device learner after 4 updates (a process that kept its
    initial shards would change it);
  * (slow) ``method: spo``'s learner path (previous responses y′ in the payload, π_then of
    the batch, D_i of each y′ after the update) as two processes equals one device: the
    divergences, the trained log-probs and the weights after 2 calls;
  * (slow) ``python train.py --distributed`` as two processes completes a tiny job.

Worker: ``python tests/test_distributed_learner.py OUT PROCESS_ID PORT [train|resume|spo]``.
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import pytest

from worker_processes import wait_all

NUM_UPDATES = 3
NUM_PROCESSES = 2
SHARED = {"policy": "/run/warmstart_model"}
EXTRAS = {"orchestrator": {"counters": {"policy_event": np.asarray(NUM_UPDATES, np.int64)}}}
CHECKPOINT_CONFIG = {"method": "spopp"}
WORKER_TIMEOUT_S = 600
TRAIN_TIMEOUT_S = 1100


def flat_weights(module) -> dict:
    from flax import nnx

    from test_sharding import flat_numpy

    return flat_numpy(nnx.split(module)[1])


def learner_calls(learner, batch, num_updates: int = NUM_UPDATES):
    from rollout_bridge.methods import LearnerInput

    return [learner(LearnerInput(batch, (), None)).metrics["loss"] for _ in range(num_updates)]


def worker(out_dir: str, process_id: int, port: int, phase: str = "train") -> None:
    from rollout_bridge import distributed_learner as dl
    from rollout_bridge.policy_learner import PolicyLearner, learner_store
    from spopp_jax import sharding
    from spopp_jax.checkpoint import Checkpointer
    from test_sharding import build_case

    dl.initialize(dl.DistributedSettings(f"127.0.0.1:{port}", NUM_PROCESSES, process_id))
    assert jax.device_count() == 4 and jax.process_count() == NUM_PROCESSES
    model_def, state, batch, config = build_case()
    # No program store with several processes: each holds shards no one process can export.
    assert learner_store(model_def) is None
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=1)
    learner = PolicyLearner(model_def, state, config, pad_to_multiple=20, mesh=mesh)
    checkpointer = Checkpointer(os.path.join(out_dir, "checkpoints"))
    if phase == "resume":
        resume_worker(learner, batch, checkpointer, out_dir, process_id)
        return
    if phase == "spo":
        checkpointer.close()
        spo_worker(learner, batch, out_dir, process_id)
        return
    if process_id == 0:
        dl.share_from_process_0(SHARED)
        leader = dl.LeaderLearner(learner)
        losses = learner_calls(leader, jax.device_get(batch))
        weights = flat_weights(leader.weights())
        leader.save(checkpointer, NUM_UPDATES, EXTRAS, CHECKPOINT_CONFIG)
        leader.stop()
        out = {f"params/{k}": v for k, v in weights.items()}
        out["losses"] = np.asarray(losses)
    else:
        shared = dl.share_from_process_0()
        calls = dl.follow(learner, checkpointer)
        out = {"calls": np.asarray(calls), "shared_ok": np.asarray(shared == SHARED)}
    checkpointer.wait_until_finished()
    checkpointer.close()
    np.savez(os.path.join(out_dir, f"process-{process_id}.npz"), **out)


def resume_worker(learner, batch, checkpointer, out_dir: str, process_id: int) -> None:
    """Both processes restore the train phase's checkpoint, then one more update."""
    from rollout_bridge import distributed_learner as dl

    if process_id == 0:
        leader = dl.LeaderLearner(learner)
        restored = leader.restore(checkpointer, NUM_UPDATES, CHECKPOINT_CONFIG)
        policy_event = int(restored.train_state.policy_event)  # before the next step donates it
        loss = learner_calls(leader, jax.device_get(batch), 1)[0]
        out = {f"params/{k}": v for k, v in flat_weights(leader.weights()).items()}
        out.update(loss=np.asarray(loss), policy_event=np.asarray(policy_event))
        leader.stop()
    else:
        out = {"calls": np.asarray(dl.follow(learner, checkpointer))}
    checkpointer.close()
    np.savez(os.path.join(out_dir, f"resume-{process_id}.npz"), **out)


SPO_CALLS = 2


def spo_previous(batch, call: int, trained_logp) -> tuple:
    """SPO's y′ per batch row. Call 0: odd rows' y′ is the row before, in the same batch
    (π_then = this batch's log-probs at the starting parameters), even rows have none;
    call 1: every row's y′ is itself as trained at call 0 (π_then = call 0's trained_logp)."""
    from rollout_bridge.methods.base import PreviousResponse

    ids, mask = np.asarray(batch.input_ids), np.asarray(batch.action_mask)
    if call == 0:
        return tuple(None if row % 2 == 0 else PreviousResponse(row, ids[row - 1], mask[row - 1], None, batch_row=row - 1)
                     for row in range(ids.shape[0]))
    return tuple(PreviousResponse(row, ids[row], mask[row], np.where(mask[row], trained_logp[row], 0.0).astype(np.float32))
                 for row in range(ids.shape[0]))


def spo_calls(learner, batch) -> dict:
    """SPO_CALLS learner calls with previous responses: losses, D_i (nan: no y′), trained
    log-probs of each call, and the weights after them."""
    from rollout_bridge.methods import LearnerInput

    out, trained = {}, None
    for call in range(SPO_CALLS):
        output = learner(LearnerInput(batch, (), spo_previous(batch, call, trained)))
        trained = np.array(output.trained_logp)
        out[f"loss{call}"] = np.asarray(output.metrics["loss"])
        out[f"divergence{call}"] = np.array([np.nan if d is None else d for d in output.divergence], np.float64)
        out[f"trained_logp{call}"] = trained
    out.update({f"params/{k}": np.array(v) for k, v in flat_weights(learner.weights()).items()})
    return out


def spo_worker(learner, batch, out_dir: str, process_id: int) -> None:
    from rollout_bridge import distributed_learner as dl

    if process_id == 0:
        leader = dl.LeaderLearner(learner)
        out = spo_calls(leader, jax.device_get(batch))
        leader.stop()
    else:
        out = {"calls": np.asarray(dl.follow(learner))}
    np.savez(os.path.join(out_dir, f"spo-{process_id}.npz"), **out)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_workers(out, phase: str) -> list[dict]:
    """NUM_PROCESSES worker processes of ``phase``; the ``<prefix>-<i>.npz`` each wrote."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(tests_dir), tests_dir, env.get("PYTHONPATH")]))
    port = free_port()
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), str(out), str(i), str(port), phase],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(NUM_PROCESSES)]
    wait_all(procs, WORKER_TIMEOUT_S)
    prefix = "process" if phase == "train" else phase
    results = []
    for i in range(NUM_PROCESSES):
        with np.load(out / f"{prefix}-{i}.npz") as data:
            results.append(dict(data))
    return results


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    out = tmp_path_factory.mktemp("distributed")
    return out, run_workers(out, "train")


@pytest.fixture(scope="module")
def one_device():
    from rollout_bridge.policy_learner import PolicyLearner
    from test_sharding import build_case

    assert jax.device_count() == 1
    model_def, state, batch, config = build_case()
    learner = PolicyLearner(model_def, state, config, pad_to_multiple=20)
    losses = learner_calls(learner, jax.device_get(batch))
    # copies: the next step donates the buffers these may view
    reference = {"losses": np.asarray(losses),
                 **{f"params/{k}": np.array(v) for k, v in flat_weights(learner.weights()).items()}}
    fourth_loss = learner_calls(learner, jax.device_get(batch), 1)[0]  # the update after a resume
    after = {f"params/{k}": v for k, v in flat_weights(learner.weights()).items()}
    return {**reference, "after_resume": {"loss": np.asarray(fourth_loss), **after}}


def assert_same_params(result: dict, reference: dict) -> None:
    keys = [k for k in reference if k.startswith("params/")]
    assert keys and set(keys) == {k for k in result if k.startswith("params/")}
    for key in keys:  # atol = 1% of one AdamW step (lr 1e-3), as in tests/test_sharding.py
        np.testing.assert_allclose(result[key], reference[key], rtol=1e-4, atol=1e-5, err_msg=key)


def test_follower_runs_every_call_of_process_0(two_processes):
    _, (_, follower) = two_processes
    assert int(follower["calls"]) == NUM_UPDATES and bool(follower["shared_ok"])


def test_two_learner_processes_train_like_one_device(two_processes, one_device):
    _, (leader, _) = two_processes
    np.testing.assert_allclose(leader["losses"], one_device["losses"], rtol=1e-5)
    assert_same_params(leader, one_device)
    from test_sharding import build_case

    model_def, initial_state = build_case()[:2]
    initial = flat_weights(model_def.merge(initial_state.params))
    assert max(np.abs(one_device[f"params/{k}"] - v).max() for k, v in initial.items()) > 1e-4  # really trained


def test_checkpoint_written_by_both_processes_restores(two_processes, one_device):
    from spopp_jax.checkpoint import Checkpointer
    from test_sharding import build_case

    out, _ = two_processes
    model_def, template = build_case()[:2]
    with Checkpointer(out / "checkpoints") as checkpointer:
        assert checkpointer.latest_step() == NUM_UPDATES
        restored = checkpointer.restore(template, expected_config=CHECKPOINT_CONFIG)
    assert int(restored.train_state.policy_event) == NUM_UPDATES
    params = flat_weights(model_def.merge(restored.train_state.params))
    assert_same_params({f"params/{k}": v for k, v in params.items()}, one_device)


@pytest.mark.slow  # two more processes (~40 s on the loaded box): keeps the default file under a minute
def test_two_processes_resume_the_checkpoint_they_wrote(two_processes, one_device):
    """``--resume --distributed``: each new process restores its shards of the same
    checkpoint; the next update equals the one-device learner's 4th."""
    out, _ = two_processes
    leader, follower = run_workers(out, "resume")
    assert int(follower["calls"]) == 1 and int(leader["policy_event"]) == NUM_UPDATES
    reference = one_device["after_resume"]
    np.testing.assert_allclose(leader["loss"], reference["loss"], rtol=1e-4, atol=1e-6)
    assert_same_params(leader, reference)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_spo_previous_responses_under_two_processes_match_one_device(tmp_path):
    """``method: spo`` under ``--distributed``: the y′ travel in the CALL payload, π_then
    and π_now are computed SPMD on the global mesh; D_i, π_then and the weights after 2
    calls equal one process on one device."""
    from rollout_bridge.policy_learner import PolicyLearner
    from test_sharding import build_case

    model_def, state, batch, config = build_case()
    reference = spo_calls(PolicyLearner(model_def, state, config, pad_to_multiple=20), jax.device_get(batch))
    leader, follower = run_workers(tmp_path, "spo")
    assert int(follower["calls"]) == SPO_CALLS
    for call in range(SPO_CALLS):
        divergence = reference[f"divergence{call}"]
        assert np.isnan(divergence).sum() == (4 if call == 0 else 0)  # y′ where planned, D > 0 there
        assert np.nanmin(divergence) > 0
        np.testing.assert_allclose(leader[f"divergence{call}"], divergence, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(leader[f"trained_logp{call}"], reference[f"trained_logp{call}"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(leader[f"loss{call}"], reference[f"loss{call}"], rtol=1e-5)
    assert_same_params(leader, reference)


def test_one_process_drives_its_policy_learner_with_no_leader_in_between(tmp_path, monkeypatch):
    """One learner process: the RL stage (updates, checkpoints, exports) and the end-of-run
    hooks get the learner `build_learner` built, not a `LeaderLearner` over it; a
    LeaderLearner refuses to stand in for one process."""
    import asyncio
    import types

    from rollout_bridge import components, rl_stage
    from rollout_bridge.distributed_learner import LeaderLearner
    from rollout_bridge.run_folder import RunPaths

    built, seen = object(), {}

    async def train_and_evaluate(job, policy, chat, alpha0, beta0, learner, checkpointer, latest):
        seen["trained"] = learner
        return 3, 4, {}

    monkeypatch.setattr(rl_stage, "build_learner", lambda *args: built)
    monkeypatch.setattr(rl_stage, "train_and_evaluate", train_and_evaluate)
    monkeypatch.setattr(components, "END_OF_RUN_HOOKS", [lambda cfg, root, learner: seen.update(hook=learner)])
    job = types.SimpleNamespace(cfg=types.SimpleNamespace(keep_checkpoints=1, resume=False), paths=RunPaths(tmp_path),
                                learner=None, orchestrator=None)
    assert jax.process_count() == 1
    assert asyncio.run(rl_stage.run_rl(job, tmp_path / "policy", None, 1.0, 1.0)) == (3, 4, {})
    assert seen == {"trained": built, "hook": built}
    with pytest.raises(ValueError, match="several learner processes"):
        LeaderLearner(built)


def test_policy_learner_restores_the_checkpoint_it_saved(tmp_path):
    """One process: ``PolicyLearner.save`` writes the train state with the orchestrator's
    policy event; ``restore`` on a learner holding other parameters (zeros) brings back the
    saved ones and the extras."""
    import dataclasses

    from rollout_bridge.policy_learner import PolicyLearner
    from spopp_jax.checkpoint import Checkpointer
    from test_sharding import build_case

    model_def, state, _, config = build_case()
    saved = PolicyLearner(model_def, state, config, pad_to_multiple=20)
    expected = {f"params/{k}": np.array(v) for k, v in flat_weights(saved.weights()).items()}
    zeros = dataclasses.replace(state, params=jax.tree.map(np.zeros_like, state.params))
    other = PolicyLearner(model_def, zeros, config, pad_to_multiple=20)
    with Checkpointer(tmp_path / "checkpoints") as checkpointer:
        saved.save(checkpointer, 1, EXTRAS, CHECKPOINT_CONFIG)
        checkpointer.wait_until_finished()
        restored = other.restore(checkpointer, 1, CHECKPOINT_CONFIG)
    assert int(restored.train_state.policy_event) == NUM_UPDATES  # EXTRAS' policy event
    assert int(restored.extras["orchestrator"]["counters"]["policy_event"]) == NUM_UPDATES
    assert_same_params({f"params/{k}": v for k, v in flat_weights(other.weights()).items()}, expected)


def test_settings_from_env_name_the_variable():
    from rollout_bridge.distributed_learner import settings_from_env

    assert settings_from_env({}).coordinator_address is None  # a cluster jax detects
    full = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    settings = settings_from_env(full)
    assert (settings.num_processes, settings.process_id, settings.is_leader) == (4, 3, False)
    for broken, fragment in [({**full, "JAX_PROCESS_ID": ""}, "not JAX_PROCESS_ID"),
                             ({**full, "JAX_NUM_PROCESSES": "two"}, "must be integers"),
                             ({**full, "JAX_PROCESS_ID": "4"}, "0 <= JAX_PROCESS_ID")]:
        with pytest.raises(ValueError, match=fragment):
            settings_from_env(broken)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_train_py_distributed_runs_as_two_learner_processes(tmp_path):
    """``python train.py --distributed`` as 2 processes x 2 CPU devices: both exit 0,
    process 1 trained every update with process 0, the run wrote its checkpoints,
    metrics and the exported policy; then ``--resume --distributed`` to 6 updates: both
    processes restore step 4 and train the 2 new updates together."""
    from tiny_run import tiny_train_args

    steps, more = 4, 6
    logs = run_train_py_distributed(tmp_path, [*tiny_train_args(tmp_path, steps=steps)])
    assert f"learner process 1: {steps} updates with process 0" in logs[1], logs[1][-2000:]
    run = tmp_path / "run"
    assert len((run / "metrics.jsonl").read_text().splitlines()) == steps
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [2, 4]
    assert (run / "hf_model" / "config.json").exists()

    logs = run_train_py_distributed(tmp_path, [*tiny_train_args(tmp_path, steps=more), "--resume"])
    assert "resume: step 4" in logs[0], logs[0][-2000:]
    assert f"learner process 1: {more - steps} updates with process 0" in logs[1], logs[1][-2000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, more + 1))


def run_train_py_distributed(tmp_path, args: list[str]) -> list[str]:
    """``python train.py ARGS --distributed`` as NUM_PROCESSES processes x 2 CPU devices; their logs."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = [*args, "--progress", "false", "--tensorboard", "false", "--distributed"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}", JAX_NUM_PROCESSES=str(NUM_PROCESSES),
               PYTHONUNBUFFERED="1")
    procs = [subprocess.Popen([sys.executable, os.path.join(root, "train.py"), *args], cwd=root,
                              env={**env, "JAX_PROCESS_ID": str(i)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for i in range(NUM_PROCESSES)]
    return wait_all(procs, TRAIN_TIMEOUT_S)


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:5])
