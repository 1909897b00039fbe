"""Data parallelism in one process: the learner train.py builds (`build_learner` on the
`mesh` section's mesh, default data 1 x fsdp -1) splits every batch's rows over the data x
fsdp devices, and its step equals the one-device step.

The worker (this file run as a script) sees 8 simulated CPU devices, builds the job's
learner from configs/smoke.yaml and, in the same process, the one-device reference (the
same folder loaded onto device 0 with no mesh), runs one update on each, and writes what
it saw; the tests read it.
"""

import json
import os
import sys

import numpy as np

if __name__ == "__main__":  # the 8-device worker must set this before jax is imported
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import jax.numpy as jnp
import pytest

ROWS, LENGTH, VOCAB = 16, 24, 128
DEVICES = 8


def make_batch():
    """16 rows with unequal action counts (the global token mean must weigh them all)."""
    from spopp_jax.learner import TrainBatch

    rng = np.random.default_rng(0)
    lengths = rng.integers(1, LENGTH - 4, size=ROWS)
    positions = np.arange(LENGTH)[None, :]
    action = (positions >= 3) & (positions < 3 + lengths[:, None])
    return TrainBatch(
        input_ids=rng.integers(0, VOCAB, size=(ROWS, LENGTH)).astype(np.int32),
        attention_mask=positions < 4 + lengths[:, None],
        action_mask=action,
        rollout_logp=np.where(action, rng.normal(-4.0, 0.5, size=(ROWS, LENGTH)), 0.0).astype(np.float32),
        advantages=np.repeat(rng.normal(size=(ROWS, 1)), LENGTH, axis=1).astype(np.float32))


def job_config(folder, *flags):
    import train

    return train.parse_config(["--config_path", "configs/smoke.yaml", "--model.path", str(folder),
                               "--optim.num_micro_batches", "2", *flags])


def worker(out_dir: str) -> None:
    from rollout_bridge import components
    from rollout_bridge.learner_processes import build_learner, build_sft_learner
    from rollout_bridge.methods import LearnerInput
    from rollout_bridge.warmstart import SFTExample, run_sft
    from spopp_jax import learner
    from spopp_jax.models import init_model, save_pretrained
    from spopp_jax.models.testing import tiny_config

    assert jax.device_count() == DEVICES
    folder = os.path.join(out_dir, "policy")
    save_pretrained(init_model(tiny_config("qwen3", vocab_size=VOCAB, num_hidden_layers=1), seed=0), folder)
    cfg = job_config(folder)
    agent = components.build_agent_config(cfg, max_turns=1)
    orchestrator_cfg = components.build_orchestrator_config(cfg, agent, cfg.seed)
    learner_cfg = components.build_learner_config(cfg)
    batch = make_batch()

    # train.py's learner on 8 devices
    policy = build_learner(cfg, learner_cfg, orchestrator_cfg, folder)
    placed = policy._place(batch)
    compiled = policy.train_step.lower(policy.state, placed).compile()
    _, batch_in = compiled.input_shardings[0]
    checks = {
        "mesh": dict(policy.mesh.shape),
        "compiled_batch_shards": {name: list(getattr(batch_in, name).shard_shape((ROWS, LENGTH)))
                                  for name in ("input_ids", "attention_mask", "action_mask", "rollout_logp",
                                               "advantages")},
        "placed_devices": len(placed.input_ids.sharding.device_set),
        "embedding_shard": list(policy.state.params["model"]["embed_tokens"]["embedding"].sharding.shard_shape(
            (VOCAB, 64))),
    }
    output = policy(LearnerInput(batch=batch, trajectories=()))
    sharded_params = jax.device_get(policy.state.params)

    # the one-device step: the same folder on device 0, no mesh
    model = components.load_policy(folder, cfg.model, mesh=None, train=True)
    model_def, state = learner.init_train_state(model, learner_cfg)
    state, metrics = learner.make_train_step(model_def, learner_cfg)(state, jax.device_put(batch, jax.devices()[0]))
    checks["single_devices"] = len(jax.tree.leaves(state.params)[0].sharding.device_set)
    single_params = jax.device_get(state.params)

    # the warm start on the same mesh: its state and batches split as the RL learner's
    sft_cfg = learner.LearnerConfig(num_mini_batches=1, action_logits_fraction=None, learning_rate=1e-3)
    _, sft_state, sft_mesh = build_sft_learner(cfg, folder, sft_cfg)
    checks["sft_mesh"] = dict(sft_mesh.shape)
    checks["sft_embedding_shard"] = list(
        sft_state.params["model"]["embed_tokens"]["embedding"].sharding.shard_shape((VOCAB, 64)))
    seen = []

    def sft_step(state, batch):
        seen.append(len(batch.input_ids.sharding.device_set))
        return state, {"loss": jnp.zeros(())}

    examples = [SFTExample(tuple(range(5 + i)), (False, False) + (True,) * (3 + i)) for i in range(8)]
    run_sft(sft_step, None, examples, epochs=1, batch_size=8, pad_id=0, mesh=sft_mesh)
    checks["sft_batch_devices"] = seen

    with open(os.path.join(out_dir, "checks.json"), "w") as f:
        json.dump(checks, f)
    flat = {f"sharded/{jax.tree_util.keystr(p)}": np.asarray(v)
            for p, v in jax.tree_util.tree_flatten_with_path(sharded_params)[0]}
    flat.update({f"single/{jax.tree_util.keystr(p)}": np.asarray(v)
                 for p, v in jax.tree_util.tree_flatten_with_path(single_params)[0]})
    flat.update({f"metric_sharded/{k}": np.asarray(v) for k, v in output.metrics.items()})
    flat.update({f"metric_single/{k}": np.asarray(v) for k, v in metrics.items()})
    np.savez(os.path.join(out_dir, "result.npz"), **flat)


@pytest.fixture(scope="module")
def eight_devices(tmp_path_factory, run_on_8_devices):
    out_dir = tmp_path_factory.mktemp("data_parallel")
    proc = run_on_8_devices([os.path.abspath(__file__), out_dir])
    assert proc.returncode == 0, proc.stderr[-4000:]
    with np.load(out_dir / "result.npz") as data:
        return json.loads((out_dir / "checks.json").read_text()), dict(data), proc.stdout + proc.stderr


def test_train_py_learner_splits_every_batch_eight_ways(eight_devices):
    checks, _, log = eight_devices
    assert checks["mesh"] == {"data": 1, "fsdp": DEVICES, "tensor": 1}   # the default mesh section
    # the jitted step's compiled input shardings: each device holds 16 / 8 = 2 rows
    assert checks["compiled_batch_shards"] == {name: [ROWS // DEVICES, LENGTH] for name in
                                               checks["compiled_batch_shards"]}
    assert checks["placed_devices"] == DEVICES
    assert checks["embedding_shard"] == [VOCAB, 64 // DEVICES]           # fsdp: parameters too
    assert checks["single_devices"] == 1
    assert "learner memory estimate per device" in log


def test_train_py_learner_step_equals_the_one_device_step(eight_devices):
    """Loss, token count and parameters after one AdamW step (lr 1e-3) agree; the
    parameter tolerance is 1% of one step (reduction order moves Adam's g/sqrt(v) on
    near-zero gradients)."""
    _, result, _ = eight_devices
    for key in ("loss", "tokens", "grad_norm"):
        np.testing.assert_allclose(result[f"metric_sharded/{key}"], result[f"metric_single/{key}"], rtol=1e-5,
                                   atol=1e-7, err_msg=key)
    names = [k.split("/", 1)[1] for k in result if k.startswith("single/")]
    assert names
    for name in names:
        np.testing.assert_allclose(result[f"sharded/{name}"], result[f"single/{name}"], rtol=1e-4, atol=1e-5,
                                   err_msg=name)


def test_warm_start_uses_the_same_mesh(eight_devices):
    checks, _, _ = eight_devices
    assert checks["sft_mesh"] == checks["mesh"]
    assert checks["sft_embedding_shard"] == [VOCAB, 64 // DEVICES]
    assert checks["sft_batch_devices"] == [DEVICES]


if __name__ == "__main__":
    worker(sys.argv[1])
