"""Mesh construction, learner-state / batch shardings, and the same train step on 1 CPU
device (this process) and on 8 simulated CPU devices with a (data=2, fsdp=2, tensor=2)
mesh (a subprocess: `python tests/test_sharding.py OUT_DIR` is the 8-device worker)."""

import dataclasses
import os
import sys

import numpy as np

if __name__ == "__main__":  # the 8-device worker must set this before jax is imported
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from spopp_jax import learner, sharding
from spopp_jax.models import init_model
from spopp_jax.models.testing import tiny_config

NUM_STEPS = 2


def build_case():
    """A tiny model, its TrainState and a fixed batch of 8 rows with unequal action counts."""
    config = learner.LearnerConfig(num_mini_batches=1, action_logits_fraction=None,
                                   learning_rate=1e-3, num_micro_batches=2)
    model = init_model(tiny_config("qwen3", vocab_size=128, num_hidden_layers=1), seed=0)
    model_def, state = learner.init_train_state(model, config)
    rng = np.random.default_rng(0)
    batch_size, length = 8, 20
    lengths = np.array([3, 12, 1, 7, 15, 4, 9, 2])
    positions = np.arange(length)[None, :]
    action_mask = (positions >= 3) & (positions < 3 + lengths[:, None])
    batch = learner.TrainBatch(
        input_ids=jnp.asarray(rng.integers(0, 128, size=(batch_size, length)), jnp.int32),
        attention_mask=jnp.asarray(positions < 3 + lengths[:, None] + 1),
        action_mask=jnp.asarray(action_mask),
        rollout_logp=jnp.asarray(
            np.where(action_mask, rng.normal(-4.8, 0.5, action_mask.shape), 0.0), jnp.float32
        ),
        advantages=jnp.asarray(np.repeat(rng.normal(size=(batch_size, 1)), length, 1), jnp.float32),
    )
    return model_def, state, batch, config


def run_steps(model_def, state, batch, config, state_sharding=None, batch_sharding=None):
    """grads of the first batch, then NUM_STEPS train steps; returns flat numpy results."""
    loss_and_grad = jax.jit(
        lambda p, b: learner.loss_and_grads(model_def, p, b, config, "policy"),
        in_shardings=None if state_sharding is None else (state_sharding.params, batch_sharding),
    )
    _, grads, _ = loss_and_grad(state.params, batch)
    step = learner.make_train_step(model_def, config, state_sharding, batch_sharding)
    out = {f"grad/{k}": v for k, v in flat_numpy(grads).items()}
    for i in range(NUM_STEPS):
        state, metrics = step(state, batch)
        out.update({f"metrics{i}/{k}": np.asarray(v) for k, v in metrics.items()})
    out.update({f"params/{k}": v for k, v in flat_numpy(state.params).items()})
    out.update({f"opt/{k}": v for k, v in flat_numpy(state.opt_state).items()})
    return out, state


def mini_batch_config(config):
    """K = 2 PPO mini-batches (rows 0,2,4,6 / 1,3,5,7), one micro-batch each."""
    return dataclasses.replace(config, num_mini_batches=2, num_micro_batches=1)


def bucketed_config(config):
    """K = 2 mini-batches of 2 micro-batches, each at its used length in multiples of 8
    (`OptimConfig.length_bucket`; the batch is 20 wide, its rows use 5 to 19 positions)."""
    return dataclasses.replace(config, num_mini_batches=2, num_micro_batches=2, length_bucket=8)


def run_mini_batch_step(model_def, state, batch, config, state_sharding=None,
                        batch_sharding=None):
    """One train step of K = 2 optimizer steps; flat numpy metrics, params, moments."""
    step = learner.make_train_step(model_def, config, state_sharding, batch_sharding)
    state, metrics = step(state, batch)
    out = {f"metrics/{k}": np.asarray(v) for k, v in metrics.items()}
    out.update({f"params/{k}": v for k, v in flat_numpy(state.params).items()})
    out.update({f"opt/{k}": v for k, v in flat_numpy(state.opt_state).items()})
    return out, state


def flat_numpy(tree):
    return {
        jax.tree_util.keystr(path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def worker(out_dir):
    assert jax.device_count() == 8, jax.devices()
    model_def, state, batch, config = build_case()
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    state_sharding = sharding.train_state_sharding(state, mesh, learner.make_optimizer(config))
    batch_sharding = sharding.batch_sharding(mesh, batch)
    state = sharding.shard_train_state(state, state_sharding)
    batch = sharding.shard_batch(batch, mesh)
    q_kernel = state.params["model"]["layers"][0]["self_attn"]["q_proj"]["kernel"]
    checks = {
        "q_kernel_spec": str(q_kernel.sharding.spec),
        "q_kernel_shard_shape": str(q_kernel.addressable_shards[0].data.shape),
        "batch_spec": str(batch.input_ids.sharding.spec),
        "batch_shard_shape": str(batch.input_ids.addressable_shards[0].data.shape),
    }
    out, new_state = run_steps(model_def, state, batch, config, state_sharding, batch_sharding)
    new_q = new_state.params["model"]["layers"][0]["self_attn"]["q_proj"]["kernel"]
    checks["updated_q_kernel_spec"] = str(new_q.sharding.spec)
    mu = new_state.opt_state[1][0].mu["model"]["layers"][0]["self_attn"]["q_proj"]["kernel"]
    checks["adam_mu_spec"] = str(mu.sharding.spec)
    np.savez(os.path.join(out_dir, "result.npz"), **out)
    model_def, state, batch, config = build_case()
    config = mini_batch_config(config)
    state = sharding.shard_train_state(state, state_sharding)
    batch = sharding.shard_batch(batch, mesh)
    mini, _ = run_mini_batch_step(model_def, state, batch, config, state_sharding, batch_sharding)
    np.savez(os.path.join(out_dir, "mini_batches.npz"), **mini)
    model_def, state, batch, config = build_case()
    state = sharding.shard_train_state(state, state_sharding)
    batch = sharding.shard_batch(batch, mesh)
    bucketed, _ = run_mini_batch_step(model_def, state, batch, bucketed_config(config), state_sharding,
                                      batch_sharding)
    np.savez(os.path.join(out_dir, "bucketed.npz"), **bucketed)
    with open(os.path.join(out_dir, "checks.txt"), "w") as f:
        f.write(repr(checks))


# ----------------------------------------------------------------------------- mesh / init


def test_mesh_axis_sizes_resolve_minus_one():
    assert sharding._resolve_axis_sizes((-1, 2, 2), 8) == (2, 2, 2)
    assert sharding._resolve_axis_sizes((2, -1, 1), 8) == (2, 4, 1)
    assert sharding._resolve_axis_sizes((1, 1, 8), 8) == (1, 1, 8)
    with pytest.raises(ValueError, match="at most one"):
        sharding._resolve_axis_sizes((-1, -1, 1), 8)
    with pytest.raises(ValueError, match="not divisible"):
        sharding._resolve_axis_sizes((-1, 3, 1), 8)
    with pytest.raises(ValueError, match="needs 4 devices"):
        sharding._resolve_axis_sizes((2, 2, 1), 8)
    with pytest.raises(ValueError, match="`tensor`"):
        sharding._resolve_axis_sizes((-1, 1, 0), 8)


def test_make_mesh_on_one_device():
    mesh = sharding.make_mesh()
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1}
    with pytest.raises(ValueError, match="needs 2 devices"):
        sharding.make_mesh(data=2)


def test_initialize_distributed_single_host_is_a_no_op():
    assert sharding.initialize_distributed() is False
    assert sharding.initialize_distributed(None, 1, 0) is False
    with pytest.raises(ValueError, match="coordinator_address"):
        sharding.initialize_distributed(None, num_processes=2, process_id=0)
    with pytest.raises(ValueError, match="process_id"):
        sharding.initialize_distributed("localhost:1234", num_processes=2, process_id=2)


def test_train_state_sharding_follows_partition_rules():
    model_def, state, batch, config = build_case()
    mesh = sharding.make_mesh()
    shardings = sharding.train_state_sharding(state, mesh, learner.make_optimizer(config))
    layer = shardings.params["model"]["layers"][0]
    assert layer["self_attn"]["q_proj"]["kernel"].spec == P("fsdp", "tensor")
    assert layer["self_attn"]["o_proj"]["kernel"].spec == P("tensor", "fsdp")
    adam = shardings.opt_state[1][0]
    assert adam.mu["model"]["layers"][0]["self_attn"]["o_proj"]["kernel"].spec == P(
        "tensor", "fsdp"
    )
    assert adam.count.spec == P()
    assert shardings.step.spec == P() and shardings.policy_event.spec == P()
    batch_shardings = sharding.batch_sharding(mesh, batch)
    assert batch_shardings.input_ids.spec == P(("data", "fsdp"))


# ----------------------------------------------------------------------------- 1 vs 8 devices


@pytest.fixture(scope="module")
def eight_device_result(tmp_path_factory, run_on_8_devices):
    out_dir = tmp_path_factory.mktemp("sharded")
    proc = run_on_8_devices([os.path.abspath(__file__), out_dir])
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out_dir / "checks.txt") as f:
        checks = eval(f.read())  # our own repr of a dict of strings
    with np.load(out_dir / "result.npz") as data, np.load(out_dir / "mini_batches.npz") as mini, \
            np.load(out_dir / "bucketed.npz") as bucketed:
        return checks, dict(data), dict(mini), dict(bucketed)


def test_eight_device_mesh_really_shards_params_and_batch(eight_device_result):
    checks, _, _, _ = eight_device_result
    assert checks["q_kernel_spec"] == str(P("fsdp", "tensor"))
    assert checks["q_kernel_shard_shape"] == "(32, 32)"  # [64, 64] over fsdp=2 x tensor=2
    assert checks["batch_spec"] == str(P(("data", "fsdp")))
    assert checks["batch_shard_shape"] == "(2, 20)"  # 8 rows over data*fsdp = 4
    assert checks["updated_q_kernel_spec"] == checks["q_kernel_spec"]
    assert checks["adam_mu_spec"] == checks["q_kernel_spec"]


def test_same_step_on_one_and_eight_devices(eight_device_result):
    """Loss, gradients, metrics and params after 2 steps agree within float tolerance."""
    assert jax.device_count() == 1
    _, sharded, _, _ = eight_device_result
    model_def, state, batch, config = build_case()
    single, _ = run_steps(model_def, state, batch, config)
    assert set(single) == set(sharded)
    for key, value in single.items():
        if key.startswith("grad/"):
            scale = np.abs(value).max() + 1e-12
            np.testing.assert_allclose(sharded[key], value, atol=1e-5 * scale, rtol=0, err_msg=key)
        elif key.startswith("metrics"):
            np.testing.assert_allclose(sharded[key], value, rtol=1e-5, atol=1e-7, err_msg=key)
        else:
            # params / Adam moments after two steps: atol = 1% of one AdamW step (lr 1e-3);
            # Adam's g/sqrt(v) amplifies reduction-order noise on near-zero gradients.
            np.testing.assert_allclose(sharded[key], value, rtol=1e-4, atol=1e-5, err_msg=key)
    assert int(single["metrics0/tokens"]) == 53


def test_same_mini_batch_step_on_one_and_eight_devices(eight_device_result):
    """K = 2 mini-batches (strided rows, local to each device) on the (2, 2, 2) mesh agree
    with 1 device: metrics, params and Adam moments after the K optimizer steps."""
    _, _, sharded, _ = eight_device_result
    model_def, state, batch, config = build_case()
    single, new_state = run_mini_batch_step(model_def, state, batch, mini_batch_config(config))
    assert int(new_state.step) == 2
    assert set(single) == set(sharded)
    for key, value in single.items():
        if key.startswith("metrics"):
            np.testing.assert_allclose(sharded[key], value, rtol=1e-5, atol=1e-7, err_msg=key)
        else:  # atol = 1% of one AdamW step (lr 1e-3), as in the test above
            np.testing.assert_allclose(sharded[key], value, rtol=1e-4, atol=1e-5, err_msg=key)
    assert int(single["metrics/tokens"]) == 53 and float(single["metrics/grad_norm_last"]) > 0


def test_used_length_step_on_eight_devices_equals_the_full_width_step_on_one(eight_device_result):
    """Micro-batches at their used lengths (length_bucket 8) with rows sharded over the
    (2, 2, 2) mesh: the same update as the full-width step on 1 device."""
    _, _, _, sharded = eight_device_result
    model_def, state, batch, config = build_case()
    full = dataclasses.replace(bucketed_config(config), length_bucket=None)
    single, _ = run_mini_batch_step(model_def, state, batch, full)
    assert set(single) == set(sharded)
    for key, value in single.items():
        if key.startswith("metrics"):
            np.testing.assert_allclose(sharded[key], value, rtol=1e-5, atol=1e-7, err_msg=key)
        else:  # atol = 1% of one AdamW step (lr 1e-3), as above
            np.testing.assert_allclose(sharded[key], value, rtol=1e-4, atol=1e-5, err_msg=key)


if __name__ == "__main__":
    worker(sys.argv[1])
