"""Micro-batches at their used length (spopp_jax.length_buckets): the branch a batch takes, and
the learner's loss, gradient and update unchanged against the full-width step."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from spopp_jax import learner
from spopp_jax.length_buckets import bucket_lengths, call_at_used_length, cut_positions, used_length
from spopp_jax.models import init_model
from spopp_jax.models.testing import tiny_config
from test_learner import B, T, TINY, assert_trees_close, copy_tree, make_batch


def _mask(lengths, width):
    mask = np.zeros((len(lengths), width), bool)
    for row, n in enumerate(lengths):
        mask[row, :n] = True
    return jnp.asarray(mask)


@settings(max_examples=30, deadline=None)
@given(rows=st.lists(st.lists(st.booleans(), min_size=9, max_size=9), min_size=1, max_size=4))
def test_property_used_length_is_one_past_the_last_real_position(rows):
    mask = np.asarray(rows, bool)
    real = np.nonzero(mask.any(axis=0))[0]
    expected = 0 if real.size == 0 else int(real[-1]) + 1
    assert int(used_length(jnp.asarray(mask))) == expected
    assert int(jax.jit(used_length)(jnp.asarray(mask))) == expected


def test_bucket_lengths_and_their_checks():
    assert bucket_lengths(28, 8) == (8, 16, 24, 28)
    assert bucket_lengths(32, 8) == (8, 16, 24, 32)
    assert bucket_lengths(5, 8) == (5,)
    with pytest.raises(ValueError, match="bucket"):
        bucket_lengths(28, 0)
    assert len(bucket_lengths(8192, 256)) == 32
    with pytest.raises(ValueError, match="33 branches.*at least 257"):
        bucket_lengths(8193, 256)
    with pytest.raises(ValueError, match="attention_mask"):
        used_length(jnp.ones((3,), bool))


@pytest.mark.parametrize("lengths, width", [((3, 1), 8), ((8, 2), 8), ((9, 0), 16), ((0, 0), 8),
                                           ((25, 4), 28), ((28, 28), 28), ((17,), 24)])
def test_a_batch_runs_at_the_smallest_bucket_holding_its_rows(maybe_jit, lengths, width):
    """fn sees the batch cut to the smallest multiple of 8 >= its used length (the full width
    past the last multiple): the width fn was traced at is what it returns."""
    full = 28
    mask = _mask(lengths, full)
    batch = {"ids": jnp.arange(len(lengths) * full).reshape(len(lengths), full), "mask": mask,
             "scalar": jnp.float32(2.0)}

    def fn(cut):
        assert cut["scalar"].shape == ()
        return jnp.int32(cut["ids"].shape[1]), jnp.sum(cut["ids"] * cut["mask"])

    run = maybe_jit(lambda b: call_at_used_length(fn, b, b["mask"], 8))
    seen, total = run(batch)
    assert int(seen) == width
    assert int(total) == int(jnp.sum(batch["ids"] * mask))   # nothing real was cut


def test_positions_out_are_padded_back_to_the_full_width(maybe_jit):
    mask = _mask((5, 3), 20)
    ids = jnp.arange(40, dtype=jnp.float32).reshape(2, 20) + 1.0
    run = maybe_jit(lambda i, m: call_at_used_length(lambda cut: cut[0] * 2.0, (i, m), m, 8, positions_out=True))
    out = np.asarray(run(ids, mask))
    assert out.shape == (2, 20)
    np.testing.assert_array_equal(out[:, :8], 2.0 * np.asarray(ids)[:, :8])
    np.testing.assert_array_equal(out[:, 8:], 0.0)   # past the cut: not computed, zero


def test_no_bucket_or_a_bucket_past_the_width_calls_fn_on_the_whole_batch():
    mask = _mask((2,), 8)
    for bucket in (None, 8, 64):
        assert call_at_used_length(lambda b: b.shape[1], jnp.zeros((1, 8)), mask, bucket) == 8
    assert cut_positions({"a": jnp.zeros((2, 8, 3)), "b": jnp.zeros((8,))}, 8, 4)["a"].shape == (2, 4, 3)


def test_learner_config_checks_the_bucket():
    with pytest.raises(ValueError, match="length_bucket"):
        learner.LearnerConfig(length_bucket=0)
    with pytest.raises(ValueError, match="length_bucket"):
        learner.LearnerConfig(length_bucket=2.5)


# ----------------------------------------------------------------------------- the learner


@pytest.fixture(scope="module")
def tiny_model():
    model = init_model(tiny_config("qwen3", **TINY), seed=0)
    return learner.split_model(model)


def _batch(seed, lengths):
    batch, noise = make_batch(seed=seed, lengths=lengths)
    return dataclasses.replace(batch, rollout_logp=jnp.asarray(noise) * batch.action_mask)


_STEPS = {}


def _train_step(model_def, bucket, micro, mini, fraction):
    key = (id(model_def), bucket, micro, mini, fraction)
    if key not in _STEPS:
        config = learner.LearnerConfig(learning_rate=1e-3, num_micro_batches=micro, num_mini_batches=mini,
                                       action_logits_fraction=fraction, length_bucket=bucket)
        _STEPS[key] = (config, learner.make_train_step(model_def, config))
    return _STEPS[key]


def _step(model_def, params, batch, bucket, micro, mini, fraction):
    config, step = _train_step(model_def, bucket, micro, mini, fraction)
    state = learner.TrainState(params=copy_tree(params), opt_state=learner.make_optimizer(config).init(params),
                               step=jnp.zeros((), jnp.int32), policy_event=jnp.zeros((), jnp.int32))
    return step(state, batch)


def _assert_same_step(model_def, params, batch, micro, mini, fraction):
    (full_state, full), (cut_state, cut) = (
        _step(model_def, params, batch, bucket, micro, mini, fraction) for bucket in (None, 8))
    for key in full:
        np.testing.assert_allclose(float(cut[key]), float(full[key]), rtol=2e-5, atol=1e-6, err_msg=key)
    # AdamW at lr 1e-3 moves a weight by up to ~1e-3 per mini-batch, a wrong update by that
    # much. Where a weight's gradient is near Adam's eps (1e-8; a batch of one 2-token row),
    # g / (|g| + eps) turns the gradient's float rounding into ~1e-5 of movement
    # (lengths [0, 0, 0, 0, 2, 0, 0, 0], seed 521: 1.04e-5 in one weight of 4,096); the loss,
    # gradient norm and metrics above are compared at float rounding.
    assert_trees_close(cut_state.params, full_state.params, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("micro, mini, fraction", [(4, 1, None), (2, 4, 0.25), (1, 2, None), (1, 1, 0.25)])
def test_train_step_at_used_lengths_equals_the_full_width_step(tiny_model, micro, mini, fraction):
    """K mini-batches (π_old recomputed at the starting params for K > 1), M micro-batches,
    with and without the action-only head: loss, gradient norm, every metric and the
    updated parameters as at the full width (T = 28, used lengths 2 to 25, buckets of 8)."""
    model_def, params = tiny_model
    batch = _batch(0, (1, 5, 11, 0, 3, 20, 2, 7))
    used = np.asarray(batch.attention_mask).sum(axis=1)
    assert used.min() < 8 and used.max() > 24   # rows in the first and the last branch
    _assert_same_step(model_def, params, batch, micro, mini, fraction)


@settings(max_examples=6, deadline=None)
@given(lengths=st.lists(st.integers(0, 18), min_size=B, max_size=B).filter(lambda v: sum(v) > 0),
       seed=st.integers(0, 2**16))
@example(lengths=[0, 0, 0, 0, 2, 0, 0, 0], seed=521)   # Adam's eps amplifies rounding (see above)
def test_property_used_lengths_never_change_the_update(tiny_model, lengths, seed):
    model_def, params = tiny_model
    _assert_same_step(model_def, params, _batch(seed, lengths), 4, 2, 0.25)


def test_a_branch_past_a_real_token_would_be_caught(tiny_model):
    """The comparisons above can fail: a branch chosen from a mask one position short of the
    longest row (its last token, an action at position 24, cut by the 24-wide branch)
    changes the loss; the batch's own mask gives the full-width loss."""
    model_def, params = tiny_model
    batch = _batch(0, (1, 5, 11, 0, 3, 20, 2, 7))
    assert int(used_length(batch.attention_mask)) == 25 and bool(batch.action_mask[5, 24])
    config = learner.LearnerConfig(num_mini_batches=1, action_logits_fraction=None)

    def loss(b):
        return learner.loss_and_grads(model_def, params, b, config, "policy")[0]

    full = float(loss(batch))
    right = float(call_at_used_length(loss, batch, batch.attention_mask, 8))
    wrong = float(call_at_used_length(loss, batch, batch.attention_mask.at[:, 24:].set(False), 8))
    np.testing.assert_allclose(right, full, rtol=1e-5)
    assert abs(wrong - full) > 1e-4 * max(abs(full), 1e-3)


def test_compute_logprobs_row_by_row_at_used_lengths(tiny_model):
    """`make_compute_logprobs(..., length_bucket)`: the action log-probs of the full-width
    forward (each row at its own length; 0 off the action mask)."""
    model_def, params = tiny_model
    batch = _batch(1, (1, 5, 11, 0, 3, 20, 2, 7))
    for fraction in (None, 0.25):
        full = learner.make_compute_logprobs(model_def, action_logits_fraction=fraction)(params, batch)
        cut = learner.make_compute_logprobs(model_def, action_logits_fraction=fraction,
                                            length_bucket=8)(params, batch)
        np.testing.assert_allclose(np.asarray(cut), np.asarray(full), rtol=1e-5, atol=1e-6)
        assert np.all(np.asarray(cut)[~np.asarray(batch.action_mask)] == 0.0)
