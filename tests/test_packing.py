"""Packed learner batches (several trajectories per row, `rollout.pack_rows`): the layout's
invariants (hypothesis), the same log-probs, loss and gradient as one trajectory per row
(jitted and not), the values read back per trajectory, and the PPO mini-batch path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_bridge.trajectory import (DispatchStamp, Trajectory, first_fit_rows,
                                       pack_train_arrays, pack_train_batch, packed_layout,
                                       unpack_rows)
from spopp_jax import learner
from spopp_jax.models import init_model
from spopp_jax.models.testing import tiny_config


def _trajectory(rng, prompt: int, reply: int, task: int = 0) -> Trajectory:
    ids = rng.integers(1, 60, size=prompt + reply)
    mask = np.r_[np.zeros(prompt, bool), np.ones(reply, bool)]
    logp = np.where(mask, rng.normal(-3.0, 0.5, prompt + reply), 0.0)
    return Trajectory(DispatchStamp(task, task, 0, 0.0, 0.5, 0.0), tuple(int(i) for i in ids),
                      tuple(bool(m) for m in mask), tuple(float(x) for x in logp), prompt,
                      float(task % 2), 0.0)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=20),
       multiple=st.sampled_from([1, 4, 8]), row_multiple=st.sampled_from([1, 2, 4]),
       extra=st.integers(0, 3))
def test_packed_layout_places_every_sequence_once_inside_its_row(lengths, multiple, row_multiple,
                                                                extra):
    narrowest = -(-max(lengths) // multiple) * multiple
    pack_width = narrowest + extra * multiple
    rows, starts, num_rows, width = packed_layout(lengths, pack_width, multiple, row_multiple)
    assert narrowest <= width <= pack_width and width % multiple == 0
    assert num_rows % row_multiple == 0
    occupied = np.zeros((num_rows, width), int)
    for n, row, start in zip(lengths, rows, starts):
        assert 0 <= start and start + n <= width
        occupied[row, start:start + n] += 1
    assert occupied.max() <= 1 and occupied.sum() == sum(lengths)  # no overlap, nothing lost
    # never more padded area than one sequence per row (when row_multiple divides n)
    unpacked_rows = -(-len(lengths) // row_multiple) * row_multiple
    assert num_rows * width <= unpacked_rows * narrowest


def test_unpack_rows_refuses_mismatched_or_out_of_range_ids():
    ids = np.array([[1, 1, 2, 0]])
    with pytest.raises(ValueError, match="differ"):
        unpack_rows(np.zeros((1, 3)), ids)
    with pytest.raises(ValueError, match=r"lie in \[0, 1\]"):
        unpack_rows(np.zeros((1, 4)), ids, count=1)
    with pytest.raises(ValueError, match="lie in"):
        unpack_rows(np.zeros((1, 4)), -ids, count=2)
    # a trailing trajectory with no tokens still gets its (empty) row
    assert unpack_rows(np.arange(4.0)[None], ids, count=3).tolist() == [[0, 1], [2, 0], [0, 0]]


def test_first_fit_rows_fills_the_longest_first_and_refuses_overlong():
    rows, starts, used = first_fit_rows([5, 3, 6, 2], 8)
    # 6 -> row 0, 5 -> row 1, 3 -> row 1 (5 + 3), 2 -> row 0 (6 + 2)
    assert rows.tolist() == [1, 1, 0, 0] and starts.tolist() == [0, 5, 0, 6] and used == 2
    with pytest.raises(ValueError, match="does not fit"):
        first_fit_rows([9], 8)
    with pytest.raises(ValueError, match="does not fit"):
        packed_layout([9], 8)
    with pytest.raises(ValueError, match="multiple of pad_to_multiple"):
        packed_layout([3], 10, 4)


def test_packed_arrays_hold_each_trajectory_contiguously_with_its_id():
    rng = np.random.default_rng(0)
    trajs = [_trajectory(rng, 3, 4, 0), _trajectory(rng, 2, 2, 1), _trajectory(rng, 4, 5, 2),
             _trajectory(rng, 1, 2, 3)]
    arrays = pack_train_arrays(trajs, [0.5, -1.0, 2.0, 0.25], pad_to_multiple=4, pad_id=0,
                               pack_width=12, row_multiple=2)
    assert arrays["segment_ids"].shape == arrays["input_ids"].shape
    assert arrays["input_ids"].shape[0] % 2 == 0
    plain = pack_train_arrays(trajs, [0.5, -1.0, 2.0, 0.25], pad_to_multiple=4)
    assert arrays["input_ids"].size < plain["input_ids"].size  # the point of packing
    for name in ("input_ids", "attention_mask", "action_mask", "rollout_logp", "advantages"):
        back = unpack_rows(arrays[name], arrays["segment_ids"], width=plain[name].shape[1])
        np.testing.assert_array_equal(back, np.where(plain["attention_mask"], plain[name], 0))
    assert not arrays["attention_mask"][arrays["segment_ids"] == 0].any()
    with pytest.raises(ValueError, match="start with an action"):
        bad = Trajectory(DispatchStamp(0, 0, 0, 0.0, 0.5, 0.0), (0, 1, 2), (False, True, True),
                         (0.0, -1.0, -1.0), 1, 1.0, 0.0)
        object.__setattr__(bad, "action_mask", np.array([True, True, True]))
        pack_train_arrays([bad], [1.0], pack_width=4)


@pytest.fixture(scope="module")
def tiny_learner():
    model = init_model(tiny_config(vocab_size=64), seed=3)
    config = learner.LearnerConfig(num_mini_batches=1, action_logits_fraction=None,
                                   learning_rate=1e-3, weight_decay=0.0)
    model_def, state = learner.init_train_state(model, config)
    rng = np.random.default_rng(5)
    trajs = [_trajectory(rng, int(p), int(r), i) for i, (p, r) in
             enumerate([(6, 9), (4, 3), (9, 14), (3, 5), (5, 2), (7, 8), (2, 6), (8, 4)])]
    advantages = rng.normal(size=len(trajs)).astype(np.float32)
    return model_def, state, trajs, advantages


@pytest.mark.parametrize("jit", [True, False])
def test_packed_batch_gives_the_same_logprobs_loss_and_gradient(tiny_learner, jit):
    model_def, state, trajs, advantages = tiny_learner
    plain = pack_train_batch(trajs, advantages, pad_to_multiple=8)
    packed = pack_train_batch(trajs, advantages, pad_to_multiple=8, pack_width=32, row_multiple=2)
    assert packed.input_ids.shape[0] < plain.input_ids.shape[0]
    config = learner.LearnerConfig(learning_rate=1e-6, num_mini_batches=1, action_logits_fraction=None)
    maybe_jit = jax.jit if jit else (lambda f: f)

    def logprobs(batch):
        return learner.model_token_logprobs(model_def, state.params, batch.input_ids,
                                            batch.attention_mask, None, batch.segment_ids)

    plain_logp = np.asarray(maybe_jit(logprobs)(plain))
    packed_logp = np.asarray(maybe_jit(logprobs)(packed))
    back = unpack_rows(packed_logp, np.asarray(packed.segment_ids), width=plain_logp.shape[1])
    actions = np.asarray(plain.action_mask)
    np.testing.assert_allclose(back[actions], plain_logp[actions], atol=2e-5, rtol=0)

    # the gradient under jit only: op by op it takes ~30 s on 2 cores for no extra coverage
    # (the loss value is compared both ways)
    grad_fn = jax.jit(lambda p, b: learner.loss_and_grads(model_def, p, b, config, "policy"))
    loss_plain, grads_plain, metrics_plain = grad_fn(state.params, plain)
    loss_packed, grads_packed, metrics_packed = grad_fn(state.params, packed)
    assert int(metrics_plain["tokens"]) == int(metrics_packed["tokens"])
    np.testing.assert_allclose(float(loss_packed), float(loss_plain), atol=1e-6, rtol=1e-5)
    if not jit:
        loss_eager = learner._policy_token_loss(config)(
            learner.model_token_logprobs(model_def, state.params, packed.input_ids,
                                         packed.attention_mask, None, packed.segment_ids),
            packed)[0] / float(metrics_packed["tokens"])
        np.testing.assert_allclose(float(loss_eager), float(loss_plain), atol=1e-6, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads_packed), jax.tree.leaves(grads_plain)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6, rtol=1e-4)


def test_packed_batch_trains_with_ppo_mini_batches(tiny_learner):
    """K = 2 mini-batches of packed rows: every action token is trained exactly once
    (the token count equals the unpacked batch's) and the step is finite."""
    model_def, state, trajs, advantages = tiny_learner
    config = learner.LearnerConfig(action_logits_fraction=None, learning_rate=1e-3, num_mini_batches=2,
                                   num_micro_batches=1)
    _, fresh = learner.init_train_state(model_def.merge(state.params), config)
    packed = pack_train_batch(trajs, advantages, pad_to_multiple=8, pack_width=32, row_multiple=2)
    step = learner.make_train_step(model_def, config)
    new_state, metrics = step(jax.tree.map(jnp.copy, fresh), packed)
    assert int(metrics["tokens"]) == sum(int(np.sum(t.action_mask)) for t in trajs)
    assert np.isfinite(float(metrics["loss"])) and int(metrics["skipped_updates"]) == 0
    assert int(new_state.step) == 2


def test_segment_ids_must_be_integers(tiny_learner):
    model_def, state, trajs, advantages = tiny_learner
    packed = pack_train_batch(trajs, advantages, pad_to_multiple=8, pack_width=32)
    bad = packed.replace(segment_ids=jnp.asarray(packed.segment_ids, jnp.float32))
    with pytest.raises(ValueError, match="segment_ids"):
        learner.make_compute_logprobs(model_def)(state.params, bad)
