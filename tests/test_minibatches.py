"""PPO mini-batches in the learner (`LearnerConfig.num_mini_batches` = K): K optimizer steps
per train step against one π_old fixed at the start. References: the K = 1 step composed by
hand from `loss_and_grads` + the optax optimizer, K sequential K = 1 steps on the row subsets
with π_old passed as `batch.old_logp`, and hand-derived clip / dual-clip values."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from spopp_jax import learner
from spopp_jax.models import init_model
from spopp_jax.models.testing import tiny_config

VOCAB, B, T = 128, 8, 20
# Strided mini-batches (K = 2: rows 0,2,4,6 / 1,3,5,7) with unequal action counts 26 / 12.
LENGTHS = (9, 1, 6, 7, 0, 4, 11, 0)


def make_batch(lengths=LENGTHS, seed=0):
    """Rows: a 3-token prompt, `lengths[b]` action tokens, one trailing token, padding.
    Rollout log-probs = the model's log-probs plus noise is filled in by the fixture."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths)
    positions = np.arange(T)[None, :]
    action_mask = (positions >= 3) & (positions < 3 + lengths[:, None])
    return learner.TrainBatch(
        input_ids=jnp.asarray(rng.integers(0, VOCAB, size=(len(lengths), T)), jnp.int32),
        attention_mask=jnp.asarray(positions < 4 + lengths[:, None]),
        action_mask=jnp.asarray(action_mask),
        rollout_logp=jnp.zeros((len(lengths), T), jnp.float32),
        advantages=jnp.asarray(
            np.repeat(rng.normal(size=(len(lengths), 1)), T, axis=1), jnp.float32
        ),
    )


@pytest.fixture(scope="module")
def tiny():
    model = init_model(tiny_config("qwen3", vocab_size=VOCAB, num_hidden_layers=1), seed=0)
    model_def, params = learner.split_model(model)
    batch = make_batch()
    logp = compute_logprobs(model_def)(params, batch)
    noise = np.random.default_rng(1).normal(scale=0.5, size=(B, T))
    rollout = jnp.where(batch.action_mask, logp + jnp.asarray(noise, jnp.float32), 0.0)
    return model_def, params, dataclasses.replace(batch, rollout_logp=rollout)


def fresh_state(params, config):
    return learner.TrainState(
        params=jax.tree.map(jnp.copy, params),
        opt_state=learner.make_optimizer(config).init(params),
        step=jnp.zeros((), jnp.int32),
        policy_event=jnp.zeros((), jnp.int32),
    )


# One jitted step per (config, objective), shared by the tests (compiling dominates).
_STEPS = {}
# The K = 2 config that several tests share.
CONFIG = learner.LearnerConfig(action_logits_fraction=None, num_micro_batches=1,
                               learning_rate=1e-2, num_mini_batches=2, max_grad_norm=0.5)


def train_step(model_def, config, objective="policy"):
    key = (id(model_def), config, objective)
    if key not in _STEPS:
        make = learner.make_train_step if objective == "policy" else learner.make_sft_step
        _STEPS[key] = make(model_def, config)
    return _STEPS[key]


def compute_logprobs(model_def):
    key = (id(model_def), "logprobs")
    if key not in _STEPS:
        _STEPS[key] = learner.make_compute_logprobs(model_def)
    return _STEPS[key]


def rows(batch, index):
    return jax.tree.map(lambda x: x[index], batch)


def assert_trees_close(a, b, rtol, atol):
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        np.testing.assert_allclose(
            np.asarray(x), np.asarray(y), rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path)
        )


# ----------------------------------------------------------------------------- K = 1


def test_one_mini_batch_is_the_plain_step_with_one_forward(tiny, monkeypatch):
    """K = 1 == loss_and_grads + clipped AdamW composed here, same metric keys, and the
    traced step runs the model exactly once (no extra old-policy forward)."""
    model_def, params, batch = tiny
    config = learner.LearnerConfig(action_logits_fraction=None, learning_rate=1e-2, num_mini_batches=1,
                                   num_micro_batches=1)
    optimizer = learner.make_optimizer(config)

    @jax.jit
    def reference(params, opt_state, batch):
        _, grads, metrics = learner.loss_and_grads(model_def, params, batch, config, "policy")
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), {
            **metrics,
            "grad_norm": optax.global_norm(grads),
        }

    ref_params, ref_metrics = reference(params, optimizer.init(params), batch)
    calls = []
    original = learner.model_token_logprobs
    monkeypatch.setattr(
        learner, "model_token_logprobs", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    state, metrics = learner.make_train_step(model_def, config)(fresh_state(params, config), batch)
    assert len(calls) == 1
    assert set(metrics) == set(ref_metrics) | {"skipped_updates"}
    assert "grad_norm_last" not in metrics and int(metrics["skipped_updates"]) == 0
    for key in ref_metrics:
        np.testing.assert_allclose(
            float(metrics[key]), float(ref_metrics[key]), rtol=1e-6, atol=1e-7, err_msg=key
        )
    assert_trees_close(state.params, ref_params, rtol=1e-6, atol=1e-7)
    assert int(state.step) == 1


# ----------------------------------------------------------------------------- K vs K single steps


def sequential_reference(model_def, params, batch, config, objective="policy"):
    """K single (K = 1) train steps on rows k, k+K, ..., each with the fixed π_old as
    `old_logp`; returns the final state, the per-step metrics and the params after each
    step."""
    num = config.num_mini_batches
    single = dataclasses.replace(config, num_mini_batches=1)
    if objective == "policy":
        if config.old_logp_source == "rollout":
            old = batch.rollout_logp
        else:
            old = compute_logprobs(model_def)(params, batch)
        batch = dataclasses.replace(batch, old_logp=old)
    step = train_step(model_def, single, objective)
    state, per_step, after = fresh_state(params, single), [], []
    for k in range(num):
        state, metrics = step(state, rows(batch, slice(k, None, num)))
        per_step.append({key: float(v) for key, v in metrics.items()})
        after.append(jax.tree.map(jnp.copy, state.params))
    return state, per_step, after


@pytest.mark.parametrize(
    "objective, source, num_mini_batches",
    [("policy", "current", 2), ("policy", "current", 4), ("policy", "rollout", 4)],
)
def test_mini_batches_equal_sequential_single_steps(tiny, objective, source, num_mini_batches):
    """Params/moments within 1e-5 of K separate steps; metrics aggregated over the K steps
    (token-weighted loss and fractions, max ratio, mean and last grad norm)."""
    model_def, params, batch = tiny
    config = dataclasses.replace(
        CONFIG, num_mini_batches=num_mini_batches, old_logp_source=source
    )
    ref_state, per_step, _ = sequential_reference(model_def, params, batch, config, objective)
    state, metrics = train_step(model_def, config, objective)(fresh_state(params, config), batch)

    assert int(state.step) == num_mini_batches == int(ref_state.step)
    assert_trees_close(state.params, ref_state.params, rtol=1e-5, atol=1e-5)
    assert_trees_close(state.opt_state, ref_state.opt_state, rtol=1e-5, atol=1e-6)

    tokens = np.array([m["tokens"] for m in per_step])
    assert int(metrics["tokens"]) == tokens.sum() == np.sum(LENGTHS)
    weighted = lambda key: sum(m[key] * n for m, n in zip(per_step, tokens)) / tokens.sum()
    norms = [m["grad_norm"] for m in per_step]
    np.testing.assert_allclose(float(metrics["loss"]), weighted("loss"), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(metrics["grad_norm"]), np.mean(norms), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["grad_norm_last"]), norms[-1], rtol=1e-5)
    if objective == "policy":
        for key in ("clip_upper_frac", "clip_lower_frac", "dual_clip_frac", "is_truncated_frac",
                    "approx_kl", "importance_weight_mean"):
            np.testing.assert_allclose(
                float(metrics[key]), weighted(key), rtol=1e-5, atol=1e-6, err_msg=key
            )
        np.testing.assert_allclose(
            float(metrics["ratio_max"]), max(m["ratio_max"] for m in per_step), rtol=1e-5
        )
        # the policy moved between mini-batches: the later steps see r != 1
        assert per_step[-1]["approx_kl"] > 1e-6 and float(metrics["ratio_max"]) > 1.0 + 1e-4


@pytest.mark.parametrize("jit", [True, False])
@pytest.mark.parametrize("num_micro_batches", [1, 2])
def test_starting_old_logp_forwards_mini_batches_two_to_k_only(tiny, jit, num_micro_batches):
    """π_old ("current", K = 4): mini-batch 1 is flagged to take its own gradient forward's
    log-probs and is NOT forwarded here (its rows stay 0, where a forward gives log-probs
    < 0); mini-batches 2..4 hold the starting params' log-probs on the action mask, 0 off."""
    model_def, params, batch = tiny
    config = dataclasses.replace(
        CONFIG, num_mini_batches=4, num_micro_batches=num_micro_batches
    )
    minis = learner.split_mini_batches(batch, 4, num_micro_batches)

    def fn(params, minis):
        return learner._starting_old_logp(model_def, params, minis, config)

    old, current = (jax.jit(fn) if jit else fn)(params, minis)
    expected = learner.split_mini_batches(
        dataclasses.replace(batch, old_logp=compute_logprobs(model_def)(params, batch)), 4
    ).old_logp
    assert old.shape == (4, B // 4, T)
    np.testing.assert_array_equal(np.asarray(current), [True, False, False, False])
    np.testing.assert_array_equal(np.asarray(old[0]), 0.0)
    assert float(jnp.min(expected[0])) < -1.0  # a forward would have filled mini-batch 1
    np.testing.assert_allclose(np.asarray(old[1:]), np.asarray(expected[1:]), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(old[1:])[~np.asarray(minis.action_mask[1:])], 0.0)


def test_micro_batches_inside_mini_batches(tiny):
    """K = 2, M = 2 (batch rows k + 2m + 4i) == K = 2, M = 1."""
    model_def, params, batch = tiny
    results = []
    for micro in (1, 2):
        config = dataclasses.replace(CONFIG, num_micro_batches=micro)
        results.append(train_step(model_def, config)(fresh_state(params, config), batch))
    (state1, metrics1), (state2, metrics2) = results
    # atol = 1% of one AdamW step (lr 1e-2): Adam's g/sqrt(v) amplifies the summation-order
    # noise of near-zero gradient entries (seen: 2e-5 on one of 8192 head entries).
    assert_trees_close(state2.params, state1.params, rtol=1e-5, atol=1e-4)
    assert set(metrics1) == set(metrics2)
    for key in metrics1:
        np.testing.assert_allclose(
            float(metrics2[key]), float(metrics1[key]), rtol=1e-5, atol=1e-6, err_msg=key
        )


def test_empty_mini_batch_is_finite_and_still_an_adamw_step(tiny):
    """Mini-batch 2 (rows 1, 3, 5, 7) without action tokens: loss 0, zero gradient, no NaN;
    the AdamW step is still taken (= a single step on those rows alone)."""
    model_def, params, _ = tiny
    batch = make_batch(lengths=(5, 0, 3, 0, 8, 0, 2, 0))
    rollout = jnp.where(batch.action_mask, -4.0, 0.0).astype(jnp.float32)  # not weak-typed
    batch = dataclasses.replace(batch, rollout_logp=rollout)
    ref_state, per_step, after = sequential_reference(model_def, params, batch, CONFIG)
    state, metrics = train_step(model_def, CONFIG)(fresh_state(params, CONFIG), batch)
    assert per_step[1]["tokens"] == 0 and per_step[1]["loss"] == 0.0
    assert per_step[1]["grad_norm"] == 0.0 == float(metrics["grad_norm_last"])
    assert all(np.isfinite(float(v)) for v in metrics.values())
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(state.params))
    assert int(state.step) == 2
    assert_trees_close(state.params, ref_state.params, rtol=1e-5, atol=1e-5)
    # the momentum (and weight decay) still move the params in the empty step
    moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in
                zip(jax.tree.leaves(after[1]), jax.tree.leaves(after[0])))
    assert moved > 1e-4
    np.testing.assert_allclose(float(metrics["loss"]), per_step[0]["loss"], rtol=1e-6)


# ----------------------------------------------------------------------------- hand-derived clips


@pytest.fixture(scope="module")
def twin_rows(tiny):
    """Two identical rows (5 action tokens each); π_old = π_rollout = the model's log-probs
    (so w = 1), and the ratios r = π_1 / π_0 of those tokens after one step on row 0 with
    Â = +1 at lr 0.03 (a K = 1 step: by the test above, mini-batch 1 of the K = 2 step).
    One step does not raise every token of a random row (sign-like Adam updates); the row
    of seed 0 is one where all 5 ratios exceed 2, which the test asserts before using it."""
    model_def, params, _ = tiny
    row = np.random.default_rng(0).integers(0, VOCAB, size=(T,))
    positions = np.arange(T)
    action = (positions >= 4) & (positions < 9)
    batch = learner.TrainBatch(
        input_ids=jnp.asarray(np.stack([row, row]), jnp.int32),
        attention_mask=jnp.asarray(np.stack([positions < 9] * 2)),
        action_mask=jnp.asarray(np.stack([action, action])),
        rollout_logp=jnp.zeros((2, T), jnp.float32),
        advantages=jnp.ones((2, T), jnp.float32),
    )
    logp0 = compute_logprobs(model_def)(params, batch)
    batch = dataclasses.replace(batch, rollout_logp=logp0)
    config = learner.LearnerConfig(num_mini_batches=1, action_logits_fraction=None, num_micro_batches=1,
        learning_rate=0.03, weight_decay=0.0, max_grad_norm=None, old_logp_source="rollout"
    )
    state, _ = train_step(model_def, config)(fresh_state(params, config), rows(batch, slice(0, 1)))
    logp1 = compute_logprobs(model_def)(state.params, batch)
    ratio = np.exp(np.asarray(logp1[1] - logp0[1], np.float64))[action]
    return model_def, params, batch, config, ratio


@pytest.mark.parametrize("advantage_2", [1.0, -1.0])
def test_clip_and_dual_clip_bind_in_mini_batch_two(twin_rows, advantage_2):
    """K = 2 on the twin rows. Mini-batch 1: r = 1, loss −Â·w = −1 per token. Mini-batch 2
    (same tokens, r > 2 after step 1): Â = +1 -> upper clip, s = (1 + 0.28)·1, loss −1.28;
    Â = −1 -> dual clip, s = max(min(−r, −clip(r)), −2) = −2, loss = −c·Â = 2. Both are
    constants in θ: the step-2 gradient is exactly 0."""
    model_def, params, batch, config, ratio = twin_rows
    assert ratio.min() > 2.0  # the precondition of the hand derivation
    advantages = batch.advantages.at[1].set(advantage_2)
    batch = dataclasses.replace(batch, advantages=advantages)
    config = dataclasses.replace(config, num_mini_batches=2)
    _, metrics = train_step(model_def, config)(fresh_state(params, config), batch)
    loss_2 = -1.28 if advantage_2 > 0 else 2.0
    np.testing.assert_allclose(float(metrics["loss"]), (-1.0 * 5 + loss_2 * 5) / 10, rtol=1e-5)
    assert float(metrics["grad_norm_last"]) == 0.0
    assert float(metrics["grad_norm"]) > 0.0  # step 1 had a gradient
    upper, dual = (0.5, 0.0) if advantage_2 > 0 else (0.0, 0.5)
    assert float(metrics["clip_upper_frac"]) == upper
    assert float(metrics["dual_clip_frac"]) == dual
    assert float(metrics["clip_lower_frac"]) == 0.0
    np.testing.assert_allclose(float(metrics["ratio_max"]), ratio.max(), rtol=1e-4)
    np.testing.assert_allclose(float(metrics["importance_weight_mean"]), 1.0, rtol=1e-6)


# ----------------------------------------------------------------------------- validation


def test_bad_mini_batch_counts_raise_clearly(tiny):
    model_def, params, batch = tiny
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="num_mini_batches must be an int >= 1"):
            learner.LearnerConfig(num_mini_batches=bad)
    config = learner.LearnerConfig(learning_rate=1e-6, action_logits_fraction=None, num_mini_batches=3)
    with pytest.raises(ValueError, match=r"batch size 8 .*num_mini_batches=3 x num_micro"):
        learner.make_train_step(model_def, config)(fresh_state(params, config), batch)
    config = learner.LearnerConfig(learning_rate=1e-6, action_logits_fraction=None,
                                   num_mini_batches=2, num_micro_batches=3)
    with pytest.raises(ValueError, match="num_mini_batches=2 x num_micro_batches=3 = 6"):
        learner.make_train_step(model_def, config)(fresh_state(params, config), batch)


def test_split_mini_batches_nests_with_micro_batches():
    """Micro-batch m of mini-batch k holds rows k + K·m + K·M·i (= piece k + K·m of the
    K·M strided split)."""
    batch = make_batch(lengths=(1,) * 24)
    ids = batch.input_ids
    minis = learner.split_mini_batches(batch, 3, 2)
    assert minis.input_ids.shape == (3, 8, T)
    pieces = learner.split_micro_batches(batch, 6)
    for k in range(3):
        micro = learner.split_micro_batches(rows(minis, k), 2)
        for m in range(2):
            expected = ids[np.arange(k + 3 * m, 24, 6)]
            np.testing.assert_array_equal(np.asarray(micro.input_ids[m]), np.asarray(expected))
            np.testing.assert_array_equal(
                np.asarray(pieces.input_ids[k + 3 * m]), np.asarray(expected)
            )
    np.testing.assert_array_equal(
        np.asarray(learner._merge_rows(pieces.input_ids)), np.asarray(ids)
    )
