"""Numeric guards: a non-finite loss or gradient skips the update (state unchanged leaf for
leaf, counted in ``skipped_updates``), `SkipGuard` stops a run after N skipped steps in a
row, and the robust KL diagnostic (k3 on the clipped ratio) stays bounded where k3 does not.

References: the k3 formula r − 1 − log r written here in NumPy float64; the bound
max(k3(1 − ε_low), k3(1 + ε_high)) derived by hand (k3 falls on (0, 1], rises on [1, ∞))."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st
from reliability_table import Row, covers

from spopp_jax import learner
from spopp_jax.losses import loss_metric_means, policy_loss
from spopp_jax.models import init_model
from spopp_jax.models.testing import tiny_config

VOCAB, ROWS, LENGTH = 64, 4, 12
CLIP_LOW, CLIP_HIGH = 0.2, 0.28


def k3(log_ratio):
    """r − 1 − log r in float64 (the reference, independent of spopp_jax)."""
    log_ratio = np.asarray(log_ratio, np.float64)
    return np.exp(log_ratio) - 1.0 - log_ratio


def make_batch(rng, advantages=None) -> learner.TrainBatch:
    input_ids = rng.integers(0, VOCAB, size=(ROWS, LENGTH)).astype(np.int32)
    action = np.zeros((ROWS, LENGTH), bool)
    action[:, 3:9] = True
    if advantages is None:
        advantages = np.repeat(rng.normal(size=(ROWS, 1)), LENGTH, axis=1)
    return learner.TrainBatch(
        input_ids=jnp.asarray(input_ids),
        attention_mask=jnp.ones((ROWS, LENGTH), bool),
        action_mask=jnp.asarray(action),
        rollout_logp=jnp.asarray(np.where(action, -4.0, 0.0), jnp.float32),
        advantages=jnp.asarray(advantages, jnp.float32),
    )


@pytest.fixture(scope="module")
def tiny_model():
    return init_model(tiny_config("qwen3", vocab_size=VOCAB, num_hidden_layers=1), seed=0)


def host_copy(tree):
    return jax.tree.map(lambda x: np.array(x), tree)


def assert_same_tree(a, b):
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def poisoned(batch: learner.TrainBatch, field: str, value: float, row: int = 0):
    arr = np.array(getattr(batch, field))
    arr[row, 4] = value
    return dataclasses.replace(batch, **{field: jnp.asarray(arr)})


@covers(
    Row("numerics", "NaN advantage on one action token (jitted train_step)",
        "update skipped, `skipped_updates`=1 in the step's metrics",
        "params, AdamW moments/count and `step` bit-identical to before", kind="fault"),
    Row("numerics", "NaN rollout log-prob on one action token (jitted train_step)",
        "update skipped, `skipped_updates`=1", "state bit-identical to before", kind="fault"),
    Row("numerics", "NaN parameter (corrupted weights) -> NaN gradient",
        "update skipped, `skipped_updates`=1", "state bit-identical to before", kind="fault"),
)
@pytest.mark.parametrize("poison", ["advantages", "rollout_logp", "params"])
def test_non_finite_update_is_skipped_and_state_unchanged(tiny_model, poison):
    config = learner.LearnerConfig(num_mini_batches=1, action_logits_fraction=None, learning_rate=1e-2)
    model_def, state = learner.init_train_state(tiny_model, config)
    step = learner.make_train_step(model_def, config)
    batch = make_batch(np.random.default_rng(0))
    if poison == "params":
        params = host_copy(state.params)
        leaf = params["model"]["embed_tokens"]["embedding"]
        leaf[int(batch.input_ids[0, 3])] = np.nan
        state = dataclasses.replace(state, params=jax.tree.map(jnp.asarray, params))
    else:
        batch = poisoned(batch, poison, np.nan)
    before = host_copy(state)
    after, metrics = step(state, batch)
    assert int(metrics["skipped_updates"]) == 1
    assert not np.isfinite(float(metrics["loss"])) or not np.isfinite(float(metrics["grad_norm"]))
    assert_same_tree(after, before)

    # the next clean batch (clean params) updates as usual
    if poison != "params":
        clean = make_batch(np.random.default_rng(1))
        stepped, metrics = step(after, clean)
        assert int(metrics["skipped_updates"]) == 0 and int(stepped.step) == 1
        moved = [np.max(np.abs(np.asarray(a) - b)) for a, b in
                 zip(jax.tree.leaves(stepped.params), jax.tree.leaves(before.params))]
        assert max(moved) > 0


@covers(Row("numerics", "NaN in one of K=2 PPO mini-batches",
            "that optimizer step skipped, the other taken; `skipped_updates`=1",
            "`step` advances by 1 not 2; params finite", kind="fault"))
def test_mini_batch_skip_counts_only_the_bad_step(tiny_model):
    config = learner.LearnerConfig(action_logits_fraction=None, learning_rate=1e-2, num_mini_batches=2,
                                   num_micro_batches=1)
    model_def, state = learner.init_train_state(tiny_model, config)
    step = learner.make_train_step(model_def, config)
    batch = poisoned(make_batch(np.random.default_rng(0)), "advantages", np.nan, row=1)
    after, metrics = step(state, batch)   # row 1 is in mini-batch 1 (rows 1, 3)
    assert int(metrics["skipped_updates"]) == 1
    assert int(after.step) == 1
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(after.params))


@covers(Row("numerics", "NaN in a supervised (warm-start SFT) step",
            "update skipped, `skipped_updates`=1", "state bit-identical to before", kind="fault"))
def test_sft_step_skips_non_finite(tiny_model):
    config = learner.LearnerConfig(num_mini_batches=1, action_logits_fraction=None, learning_rate=1e-2)
    model_def, state = learner.init_train_state(tiny_model, config)
    params = host_copy(state.params)
    params["lm_head"]["kernel"][:, 0] = np.inf
    state = dataclasses.replace(state, params=jax.tree.map(jnp.asarray, params))
    before = host_copy(state)
    after, metrics = learner.make_sft_step(model_def, config)(state, make_batch(np.random.default_rng(0)))
    assert int(metrics["skipped_updates"]) == 1
    assert_same_tree(after, before)


def test_apply_update_select_eager_and_jit(maybe_jit):
    """`_apply_update` alone, eagerly and under jit: finite -> AdamW step, else identity."""
    optimizer = optax.adamw(0.1)
    params = {"w": jnp.arange(3.0)}
    state = learner.TrainState(params, optimizer.init(params), jnp.zeros((), jnp.int32),
                               jnp.zeros((), jnp.int32))
    apply = maybe_jit(lambda s, g, l: learner._apply_update(optimizer, s, g, l))
    good, norm, skipped = apply(state, {"w": jnp.ones(3)}, jnp.float32(1.0))
    assert int(skipped) == 0 and int(good.step) == 1 and float(norm) == pytest.approx(3 ** 0.5)
    assert not np.allclose(good.params["w"], params["w"])
    for grads, loss in [({"w": jnp.array([1.0, np.inf, 0.0])}, 1.0),
                        ({"w": jnp.ones(3)}, np.nan), ({"w": jnp.full(3, np.nan)}, 1.0)]:
        same, _, skipped = apply(state, grads, jnp.float32(loss))
        assert int(skipped) == 1
        assert_same_tree(same, state)


@covers(Row("numerics", "N consecutive train steps with a non-finite loss/gradient",
            "`SkipGuard` raises NonFiniteUpdatesError naming the streak, loss and grad norm",
            "a clean step resets the streak; skipped steps left the state unchanged",
            kind="fault"))
def test_skip_guard_stops_after_n_consecutive():
    guard = learner.SkipGuard(max_consecutive=3)
    bad = {"skipped_updates": np.int32(1), "loss": np.float32(np.nan), "grad_norm": np.inf}
    good = {"skipped_updates": np.int32(0), "loss": 0.5, "grad_norm": 1.0}
    assert guard.observe(bad) == 1 and guard.observe(bad) == 2
    assert guard.observe(good) == 0       # a clean step resets the streak
    guard.observe(bad)
    guard.observe(bad)
    with pytest.raises(learner.NonFiniteUpdatesError, match=r"3 train steps in a row.*nan"):
        guard.observe(bad)
    assert guard.total == 5
    with pytest.raises(ValueError, match="max_consecutive"):
        learner.SkipGuard(max_consecutive=0)
    assert learner.SkipGuard.from_config(learner.LearnerConfig()).max_consecutive == 5
    with pytest.raises(ValueError, match="max_consecutive_skips"):
        learner.LearnerConfig(max_consecutive_skips=0)


def _kl_metrics(log_ratio, mask=None):
    log_ratio = jnp.asarray(log_ratio, jnp.float32)
    mask = jnp.ones(log_ratio.shape, bool) if mask is None else mask
    old = jnp.zeros_like(log_ratio)
    _, count, sums = policy_loss(log_ratio, old, old, jnp.ones_like(log_ratio), mask,
                                 clip_low=CLIP_LOW, clip_high=CLIP_HIGH)
    return loss_metric_means(sums, count)


@covers(Row("numerics", "one far-off-policy token (log r = 8) among 99 on-policy tokens",
            "`approx_kl` (k3) explodes to ~30, `approx_kl_clipped` stays <= 0.0231/token",
            "both logged; the clipped k3 matches the float64 formula", kind="fault"))
def test_robust_kl_bounded_where_k3_explodes(maybe_jit):
    log_ratio = np.zeros(100, np.float32)
    log_ratio[:50] = 0.05
    log_ratio[7] = 8.0
    metrics = maybe_jit(_kl_metrics)(log_ratio)
    np.testing.assert_allclose(float(metrics["approx_kl"]), k3(log_ratio).mean(), rtol=1e-5)
    clipped = np.clip(np.exp(log_ratio.astype(np.float64)), 1 - CLIP_LOW, 1 + CLIP_HIGH)
    np.testing.assert_allclose(float(metrics["approx_kl_clipped"]), k3(np.log(clipped)).mean(),
                               rtol=1e-5)
    assert float(metrics["approx_kl"]) > 25.0
    assert float(metrics["approx_kl_clipped"]) < 0.03


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(-30.0, 30.0, width=32), min_size=1, max_size=40))
def test_robust_kl_properties(log_ratios):
    """0 <= clipped k3 <= k3 per token; clipped <= the hand bound; equal inside the range."""
    metrics = _kl_metrics(np.asarray(log_ratios, np.float32))
    robust, raw = float(metrics["approx_kl_clipped"]), float(metrics["approx_kl"])
    bound = max(k3(np.log(1 - CLIP_LOW)), k3(np.log(1 + CLIP_HIGH)))
    assert 0.0 <= robust <= bound + 1e-6
    assert robust <= raw * (1 + 1e-5) + 1e-6
    inside = np.clip(np.asarray(log_ratios), np.log(1 - CLIP_LOW) + 1e-3, np.log(1 + CLIP_HIGH) - 1e-3)
    metrics = _kl_metrics(inside.astype(np.float32))
    np.testing.assert_allclose(float(metrics["approx_kl_clipped"]), float(metrics["approx_kl"]),
                               rtol=1e-4, atol=1e-7)


@covers(Row("numerics", "an infinite learning rate (`--optim.learning_rate inf`): finite loss and gradient, "
            "non-finite updated parameters",
            "every such update skipped (`skipped_updates`=1; the guard checks the updated parameters too); "
            "`SkipGuard` stops the run after 5 in a row",
            "params, moments and `step` bit-identical to before: no NaN model is ever checkpointed",
            kind="malformed input"))
def test_infinite_learning_rate_never_reaches_the_weights(tiny_model):
    config = learner.LearnerConfig(num_mini_batches=1, action_logits_fraction=None,
                                   learning_rate=float("inf"))
    model_def, state = learner.init_train_state(tiny_model, config)
    before = host_copy(state)
    after, metrics = learner.make_train_step(model_def, config)(state, make_batch(np.random.default_rng(0)))
    assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
    assert int(metrics["skipped_updates"]) == 1
    assert_same_tree(after, before)


class _Tokens:
    pad_token_id = 0


@covers(Row("numerics", "an infinite warm-start learning rate (`--warmstart.learning_rate inf`)",
            "every SFT step skipped; the warm start stops with NonFiniteUpdatesError ('warm start: all N SFT "
            "steps had a non-finite loss, gradient or updated parameters ...'; after 5 in a row for a longer one); "
            "train.py prints it as one line and exits 1",
            "no warm-start model is saved (never a NaN `hf_model` reported as done)", kind="malformed input"))
def test_warm_start_with_infinite_learning_rate_stops(tiny_model):
    from rollout_bridge.warmstart import SFTExample, run_sft

    config = learner.LearnerConfig(num_mini_batches=1, action_logits_fraction=None,
                                   learning_rate=float("inf"))
    model_def, state = learner.init_train_state(tiny_model, config)
    examples = [SFTExample(tuple(range(1, 9)), (False,) + (True,) * 7) for _ in range(4)]
    step = learner.make_sft_step(model_def, config)
    with pytest.raises(learner.NonFiniteUpdatesError, match="warm start: all 1 SFT steps"):
        run_sft(step, state, examples, epochs=1, batch_size=4, pad_id=0)
    model_def, state = learner.init_train_state(tiny_model, config)
    with pytest.raises(learner.NonFiniteUpdatesError, match="5 train steps in a row"):
        run_sft(step, state, examples, epochs=6, batch_size=4, pad_id=0)


@covers(Row("numerics", "exporting a policy whose parameters hold NaN (train.py's end-of-run export, "
            "`export_every`, `python -m spopp_jax.export` of a NaN step)",
            "NonFiniteStateError '... parameters hold NaN/inf (...); not exported ...' (train.py: one line, exit 1, "
            "no 'done')",
            "no output folder is written", kind="fault"))
def test_non_finite_policy_is_never_exported(tmp_path, tiny_model):
    import sys

    from flax import nnx

    from spopp_jax import export
    from spopp_jax.checkpoint import NonFiniteStateError

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tiny_run import make_model_folder

    folder = tmp_path / "start"
    model = make_model_folder(folder, tied=True)
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    leaves[0] = jnp.full_like(leaves[0], jnp.nan) if jnp.issubdtype(leaves[0].dtype, jnp.floating) else leaves[0]
    poisoned_model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    with pytest.raises(NonFiniteStateError, match="hold NaN/inf"):
        export.export_model(poisoned_model, folder, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    with pytest.raises(NonFiniteStateError, match="not exported"):
        export.check_finite({"w": np.array([1.0, np.inf], np.float32)}, "checkpoint X")
