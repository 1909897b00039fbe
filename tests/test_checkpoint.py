"""Orbax checkpoints of TrainState + extras: bitwise round trip, keep-last-k, training
resumed from a checkpoint equals uninterrupted training, refusal of mismatched configs and
shapes, and restore onto a different mesh (8 simulated devices in a subprocess:
`python tests/test_checkpoint.py CKPT_DIR` is that worker)."""

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

from spopp_jax import checkpoint, learner, sharding
from spopp_jax.models import init_model
from spopp_jax.models.testing import tiny_config

MODEL_CONFIG = tiny_config("qwen3", vocab_size=128, num_hidden_layers=1)
LEARNER_CONFIG = learner.LearnerConfig(num_mini_batches=1, action_logits_fraction=None,
                                       learning_rate=1e-3, num_micro_batches=2)
B, T = 4, 16


def run_config(model_config=MODEL_CONFIG, learner_config=LEARNER_CONFIG):
    return {"model": model_config.hf_config, "learner": learner_config}


def fresh_state(model_config=MODEL_CONFIG, seed=0):
    return learner.init_train_state(init_model(model_config, seed=seed), LEARNER_CONFIG)


def sample_batch(key):
    """A random batch drawn from `key` (so the sampler key is real training state)."""
    k_ids, k_len, k_adv, k_logp = jax.random.split(key, 4)
    lengths = jax.random.randint(k_len, (B, 1), 1, T - 2)
    positions = jnp.arange(T)[None, :]
    action_mask = (positions >= 2) & (positions < 2 + lengths)
    return learner.TrainBatch(
        input_ids=jax.random.randint(k_ids, (B, T), 0, 128, jnp.int32),
        attention_mask=positions < 2 + lengths,
        action_mask=action_mask,
        rollout_logp=jnp.where(action_mask, -4.8 + 0.3 * jax.random.normal(k_logp, (B, T)), 0.0),
        advantages=jnp.broadcast_to(jax.random.normal(k_adv, (B, 1)), (B, T)),
    )


def train(step_fn, state, key, num_steps):
    for _ in range(num_steps):
        key, batch_key = jax.random.split(key)
        state, _ = step_fn(state, sample_batch(batch_key))
    return state, key


def extras_example(key):
    return {
        "tracker": {"alpha": jnp.arange(5.0), "beta": jnp.ones(5), "z_ref": jnp.float32(3.5)},
        "counters": {"dispatched": 17, "policy_event": np.int64(4), "ids": np.arange(3)},
        "sampler_key": key,
        "legacy_key": jax.random.PRNGKey(7),
    }


def assert_bitwise_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        if hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(
            np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path)
        )
        assert np.asarray(x).dtype == np.asarray(y).dtype, jax.tree_util.keystr(path)


# ----------------------------------------------------------------------------- round trip


@pytest.fixture(scope="module")
def trained():
    model_def, state = fresh_state()
    step = learner.make_train_step(model_def, LEARNER_CONFIG)
    state, key = train(step, state, jax.random.key(0), 1)
    return model_def, step, state, key


def test_round_trip_is_bitwise(tmp_path, trained):
    _, _, state, key = trained
    state = dataclasses.replace(state, policy_event=jnp.int32(9))
    extras = extras_example(key)
    with checkpoint.Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(1, state, extras, config=run_config())
    with checkpoint.Checkpointer(tmp_path / "ckpt") as ckpt:  # a fresh process's view
        _, target = fresh_state(seed=1)
        restored = ckpt.restore(
            target, extras_targets={"sampler_key": key}, expected_config=run_config()
        )
    assert restored.step == 1
    assert_bitwise_equal(restored.train_state, state)
    assert int(restored.train_state.policy_event) == 9
    assert restored.config == checkpoint.to_json_config(run_config())
    assert restored.config["learner"]["learning_rate"] == 1e-3
    assert set(restored.extras) == set(extras)
    assert jax.dtypes.issubdtype(restored.extras["sampler_key"].dtype, jax.dtypes.prng_key)
    assert_bitwise_equal(restored.extras["sampler_key"], key)
    assert_bitwise_equal(restored.extras["tracker"], extras["tracker"])
    np.testing.assert_array_equal(restored.extras["legacy_key"], extras["legacy_key"])
    assert int(restored.extras["counters"]["dispatched"]) == 17
    assert int(restored.extras["counters"]["policy_event"]) == 4
    np.testing.assert_array_equal(restored.extras["counters"]["ids"], np.arange(3))


def test_keeps_only_the_last_k(tmp_path, trained):
    _, _, state, _ = trained
    with checkpoint.Checkpointer(tmp_path, max_to_keep=2) as ckpt:
        for step in (1, 2, 3, 4):
            ckpt.save(step, state, config=run_config())
        assert ckpt.all_steps() == [3, 4]
        assert ckpt.latest_step() == 4
        with pytest.raises(FileNotFoundError, match="no checkpoint step 1"):
            ckpt.restore(state, step=1)
    assert sorted(os.listdir(tmp_path)) == ["3", "4"]  # no temporary leftovers
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        checkpoint.Checkpointer(tmp_path / "empty").restore(state)


def test_resumed_training_equals_uninterrupted_training(tmp_path, trained):
    """3 steps straight == 1 step, save, restore in a new manager/step function, 2 steps;
    the sampler key that draws the batches is checkpointed with the state."""
    model_def, step, _, _ = trained
    _, state = fresh_state()
    straight, straight_key = train(step, state, jax.random.key(42), 3)

    _, state = fresh_state()
    state, key = train(step, state, jax.random.key(42), 1)
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state, {"sampler_key": key}, config=run_config())
    del state, key
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        _, target = fresh_state(seed=5)
        restored = ckpt.restore(target, expected_config=run_config())
    resumed_step = learner.make_train_step(model_def, LEARNER_CONFIG)
    resumed, resumed_key = train(
        resumed_step, restored.train_state, restored.extras["sampler_key"], 2
    )
    assert int(resumed.step) == 3
    assert_bitwise_equal(resumed, straight)
    assert_bitwise_equal(resumed_key, straight_key)


def test_existing_step_is_not_overwritten_and_config_is_readable(tmp_path):
    tree = {"w": jnp.arange(4.0)}
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        ckpt.save(3, tree, config={"run": "a"})
        with pytest.raises(FileExistsError, match="step 3 already exists"):
            ckpt.save(3, {"w": jnp.zeros(4)}, config={"run": "b"})
        assert ckpt.read_config() == {"run": "a"}
        restored = ckpt.restore({"w": jnp.zeros(4)})
    np.testing.assert_array_equal(restored.train_state["w"], np.arange(4.0))


# ----------------------------------------------------------------------------- refusals


def test_mismatched_config_is_refused_naming_the_key(tmp_path, trained):
    _, _, state, _ = trained
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state, config=run_config())
        other_learner = dataclasses.replace(LEARNER_CONFIG, clip_high=0.3)
        with pytest.raises(checkpoint.CheckpointMismatchError) as err:
            ckpt.restore(state, expected_config=run_config(learner_config=other_learner))
        assert "learner.clip_high: saved 0.28, expected 0.3" in str(err.value)
        bigger = {**MODEL_CONFIG.hf_config, "intermediate_size": 96}
        with pytest.raises(checkpoint.CheckpointMismatchError, match="model.intermediate_size"):
            ckpt.restore(state, expected_config={"model": bigger, "learner": LEARNER_CONFIG})
        with pytest.raises(checkpoint.CheckpointMismatchError, match="no extras"):
            ckpt.restore(state, extras_targets={"tracker": {}})


def test_mismatched_shapes_are_refused_naming_the_parameter(tmp_path, trained):
    _, _, state, _ = trained
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
        wider = dataclasses.replace(MODEL_CONFIG, intermediate_size=96)
        _, target = fresh_state(wider)
        with pytest.raises(checkpoint.CheckpointMismatchError) as err:
            ckpt.restore(target)
        message = str(err.value)
        assert (
            "params.model.layers.0.mlp.up_proj.kernel: saved shape (64, 128), expected (64, 96)"
            in message
        )
        assert "lm_head" not in message  # only what differs is named
        deeper = dataclasses.replace(MODEL_CONFIG, num_hidden_layers=2, layer_types=())
        _, target = fresh_state(deeper)
        with pytest.raises(
            checkpoint.CheckpointMismatchError, match="layers.1.*missing in checkpoint"
        ):
            ckpt.restore(target)


def test_config_differences_and_json_conversion(tmp_path):
    assert checkpoint.config_differences({"a": 1, "b": {"c": 2}}, {"a": 1, "b": {"c": 2}}) == []
    assert checkpoint.config_differences({"a": 1}, {"a": 1, "d": [1]}) == [
        "d: saved '<missing>', expected [1]"
    ]
    assert checkpoint.to_json_config(LEARNER_CONFIG)["dual_clip"] == 2.0
    with pytest.raises(TypeError, match="not JSON-able"):
        checkpoint.to_json_config({"f": object()})
    with pytest.raises(ValueError, match="identifier"):
        checkpoint.Checkpointer(tmp_path).save(1, {"x": jnp.zeros(2)}, {"bad name": 1})


# ----------------------------------------------------------------------------- other meshes


def worker(directory):
    """Saves a state sharded over (data=2, fsdp=2, tensor=2), restores it onto (8, 1, 1) and
    (1, 1, 8) meshes and checks values and target shardings; writes the values to npz."""
    assert jax.device_count() == 8
    model_def, state = fresh_state()
    state, key = train(
        learner.make_train_step(model_def, LEARNER_CONFIG), state, jax.random.key(3), 1
    )
    optimizer = learner.make_optimizer(LEARNER_CONFIG)
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    state = sharding.shard_train_state(state, sharding.train_state_sharding(state, mesh, optimizer))
    with checkpoint.Checkpointer(directory) as ckpt:
        ckpt.save(1, state, {"sampler_key": key}, config=run_config())
    for shape in ((8, 1, 1), (1, 1, 8)):
        other = sharding.make_mesh(*shape)
        target_sharding = sharding.train_state_sharding(state, other, optimizer)
        target = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, target_sharding
        )
        with checkpoint.Checkpointer(directory) as ckpt:
            restored = ckpt.restore(target, expected_config=run_config()).train_state
        assert_bitwise_equal(restored, state)
        for leaf, want in zip(jax.tree.leaves(restored), jax.tree.leaves(target_sharding)):
            assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (leaf.sharding, want)
        q = restored.params["model"]["layers"][0]["self_attn"]["q_proj"]["kernel"]
        expected_shard = (64, 8) if shape == (1, 1, 8) else (64, 64)
        assert q.addressable_shards[0].data.shape == expected_shard, q.addressable_shards[
            0
        ].data.shape
    flat = {
        jax.tree_util.keystr(p): np.asarray(x)
        for p, x in jax.tree_util.tree_flatten_with_path(state)[0]
    }
    np.savez(os.path.join(directory, "..", "values.npz"), **flat)


def test_restore_onto_other_meshes_and_device_counts(tmp_path, run_on_8_devices):
    directory = tmp_path / "ckpt"
    proc = run_on_8_devices([os.path.abspath(__file__), directory])
    assert proc.returncode == 0, proc.stderr[-4000:]
    # This process has one device: restore the 8-device checkpoint onto it.
    _, target = fresh_state(seed=2)
    with checkpoint.Checkpointer(directory) as ckpt:
        restored = ckpt.restore(target, expected_config=run_config())
    with np.load(tmp_path / "values.npz") as saved:
        flat = jax.tree_util.tree_flatten_with_path(restored.train_state)[0]
        assert len(flat) == len(saved.files)
        for path, leaf in flat:
            np.testing.assert_array_equal(np.asarray(leaf), saved[jax.tree_util.keystr(path)])
    assert all(
        leaf.sharding.device_set == {jax.devices()[0]}
        for leaf in jax.tree.leaves(restored.train_state)
    )


if __name__ == "__main__":
    worker(sys.argv[1])
