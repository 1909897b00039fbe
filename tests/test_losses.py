"""Tests for spopp_jax.losses.policy_loss (SPEC 5)."""

import math

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spopp_jax.losses import (
    combine_loss_metrics,
    loss_metric_means,
    policy_loss,
)

LOW, HIGH, C, CAP = 0.2, 0.28, 2.0, 2.0


def _hand_case():
    """Seven tokens, one per regime of SPEC 5; expected values derived by hand below."""
    # columns: log r = logp - old, advantage, old - rollout, mask
    log_r = [0.1, 0.5, -0.5, 0.2, 1.0, 0.0, 0.0]
    adv = [0.5, 1.0, -1.0, -2.0, -1.0, 0.0, 1.0]
    behaviour = [0.3, 0.0, -0.2, 0.0, 0.1, 0.0, math.log(3.0)]
    mask = [1, 1, 1, 1, 1, 0, 1]
    old = np.array([-1.0, -0.7, -2.0, -0.3, -1.5, 0.0, -0.9], np.float32)
    logp = old + np.array(log_r, np.float32)
    rollout = old - np.array(behaviour, np.float32)
    # masked token 5: garbage everywhere
    logp[5], old[5], rollout[5] = -np.inf, np.nan, np.inf
    adv = np.array(adv, np.float32)
    adv[5] = np.nan
    return logp, old, rollout, adv, np.array(mask, bool)


def _hand_expected(dual_clip):
    e = math.exp
    w = [e(0.3), 1.0, e(-0.2), 1.0, e(0.1), 0.0, 2.0]  # token 6: min(3, 2) = 2
    # per-token loss -s and d(-s)/dlogp, regime by regime:
    loss = [
        -w[0] * e(0.1) * 0.5,        # A>0, r inside: -r A
        -w[1] * 1.28 * 1.0,          # A>0, r=1.65 > 1.28: -(1.28) A, no grad
        -w[2] * 0.8 * -1.0,          # A<0, r=0.61 < 0.8: -(0.8) A, no grad
        -w[3] * e(0.2) * -2.0,       # A<0, r inside: -r A
        None,                        # A<0, r=e > c: dual-clip
        0.0,                         # masked
        -w[6] * 1.0 * 1.0,           # r = 1, truncated IS weight 2
    ]
    grad = [-w[0] * e(0.1) * 0.5, 0.0, 0.0, -w[3] * e(0.2) * -2.0, None, 0.0, -w[6]]
    if dual_clip is None or e(1.0) < dual_clip:  # r = e does not reach c = 10
        loss[4], grad[4] = -w[4] * e(1.0) * -1.0, -w[4] * e(1.0) * -1.0
    else:
        loss[4], grad[4] = -w[4] * dual_clip * -1.0, 0.0
    return np.array(loss), np.array(grad)


@pytest.mark.parametrize("dual_clip", [2.0, 10.0, None])
def test_hand_derived_loss_gradient_and_metrics(dual_clip, maybe_jit):
    logp, old, rollout, adv, mask = _hand_case()
    exp_loss, exp_grad = _hand_expected(dual_clip)

    def f(lp):
        return policy_loss(lp, old, rollout, adv, mask, LOW, HIGH, dual_clip, CAP)

    (loss_sum, (count, metrics)), grad = maybe_jit(
        jax.value_and_grad(lambda lp: (lambda o: (o[0], (o[1], o[2])))(f(lp)), has_aux=True)
    )(jnp.asarray(logp))
    np.testing.assert_allclose(loss_sum, exp_loss.sum(), rtol=1e-6)
    assert int(count) == 6
    np.testing.assert_allclose(grad, exp_grad, rtol=1e-6, atol=1e-7)
    assert np.all(np.isfinite(grad))
    assert int(metrics["clip_upper_count"]) == 1  # token 1
    # token 2 (r < 0.8) and, with c = 10, nothing else; token 4 has r > 1: not lower clip
    assert int(metrics["clip_lower_count"]) == 1
    assert int(metrics["dual_clip_count"]) == (1 if dual_clip == 2.0 else 0)  # e < 10
    assert int(metrics["is_truncated_count"]) == 1  # token 6
    np.testing.assert_allclose(metrics["ratio_max"], math.e, rtol=1e-6)
    lr = np.array([0.1, 0.5, -0.5, 0.2, 1.0, 0.0])
    np.testing.assert_allclose(
        metrics["approx_kl_sum"], np.sum(np.exp(lr) - 1 - lr), rtol=1e-5
    )


def _analytic_grad(logp, old, rollout, adv, mask, dual_clip):
    """d loss_sum / d logp derived by hand (float64), away from clip boundaries.

    loss_t = -w s;  s = r A (grad r A) unless a clip binds (grad 0):
      A > 0 and r > 1+high;  A < 0 and r < 1-low;  A < 0 and r > c (dual clip).
    """
    r = np.exp(logp - old)
    w = np.minimum(np.exp(old - rollout), CAP)
    active = np.ones_like(r, bool)
    active &= ~((adv > 0) & (r > 1 + HIGH))
    active &= ~((adv < 0) & (r < 1 - LOW))
    if dual_clip is not None:
        active &= ~((adv < 0) & (r > dual_clip))
    return np.where(mask & active, -w * r * adv, 0.0)


def _away_from_boundaries(log_r, dual_clip):
    r = np.exp(log_r)
    kinks = [1 + HIGH, 1 - LOW] + ([dual_clip] if dual_clip else [])
    return all(np.all(np.abs(r - k) > 1e-3) for k in kinks)


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**31 - 1), dual_clip=st.sampled_from([2.0, 10.0, None]))
def test_gradient_matches_analytic(seed, dual_clip):
    rng = np.random.default_rng(seed)
    shape = (3, 7)
    old = rng.uniform(-5, 0, shape)
    log_r = rng.normal(0, 0.6, shape)
    hypothesis.assume(_away_from_boundaries(log_r, dual_clip))
    logp = old + log_r
    rollout = old - rng.normal(0, 0.8, shape)
    adv = rng.normal(0, 1.5, shape)
    mask = rng.random(shape) < 0.7
    hypothesis.assume(mask.any())
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    grad = jax.grad(
        lambda lp: policy_loss(lp, f32(old), f32(rollout), f32(adv), mask, dual_clip=dual_clip)[0]
    )(f32(logp))
    expected = _analytic_grad(
        *(np.asarray(f32(x), np.float64) for x in (logp, old, rollout, adv)), mask, dual_clip
    )
    np.testing.assert_allclose(grad, expected, rtol=2e-5, atol=1e-5)


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(
    log_r=st.floats(-30, 30),
    adv=st.floats(-50, -1e-3),
    behaviour=st.floats(-5, 5),
    c=st.floats(1.5, 12),
)
def test_dual_clip_caps_negative_advantage_tokens(log_r, adv, behaviour, c):
    """Per-token loss of a negative-advantage token is at most -c·Â·w (SPEC 5)."""
    old = jnp.array([-1.0], jnp.float32)
    logp = old + jnp.float32(log_r)
    rollout = old - jnp.float32(behaviour)
    a = jnp.array([adv], jnp.float32)
    loss, _, _ = policy_loss(logp, old, rollout, a, jnp.array([True]), dual_clip=c)
    w = min(math.exp(float(np.float32(behaviour))), CAP)
    cap = -c * float(np.float32(adv)) * w
    assert float(loss) <= cap * (1 + 1e-5) + 1e-6
    if log_r > math.log(c) + 1e-3:
        np.testing.assert_allclose(float(loss), cap, rtol=1e-5)


def test_no_gradient_through_importance_weight_or_old_logp():
    rng = np.random.default_rng(1)
    shape = (2, 5)
    logp, old, rollout, adv = (jnp.asarray(rng.normal(size=shape) - 1, jnp.float32) for _ in range(4))
    mask = jnp.ones(shape, bool)
    g_old, g_roll = jax.grad(
        lambda o, r: policy_loss(logp, o, r, adv, mask)[0], argnums=(0, 1)
    )(old, rollout)
    np.testing.assert_array_equal(g_roll, 0.0)
    np.testing.assert_array_equal(g_old, 0.0)
    g_adv = jax.grad(lambda a: policy_loss(logp, old, rollout, a, mask)[0])(adv)
    np.testing.assert_array_equal(g_adv, 0.0)


@pytest.mark.parametrize("garbage", [-np.inf, np.inf, np.nan, 1e30, -1e30])
def test_masked_tokens_never_produce_nan(garbage, maybe_jit):
    rng = np.random.default_rng(2)
    shape = (2, 6)
    logp, old, rollout, adv = (rng.normal(size=shape).astype(np.float32) - 1 for _ in range(4))
    mask = np.ones(shape, bool)
    mask[:, -2:] = False
    clean = policy_loss(*(jnp.asarray(x) for x in (logp, old, rollout, adv)), mask)[0]
    for x in (logp, old, rollout, adv):
        x[~mask] = garbage

    def f(lp, o, r, a):
        return policy_loss(lp, o, r, a, mask)[0]

    loss, grads = maybe_jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))(logp, old, rollout, adv)
    assert np.isfinite(loss)
    np.testing.assert_allclose(loss, clean, rtol=1e-6)
    for g in grads:
        assert np.all(np.isfinite(g))
        np.testing.assert_array_equal(np.asarray(g)[~mask], 0.0)


def test_huge_log_ratio_on_action_tokens_is_clamped_not_overflowing():
    old = jnp.array([-100.0, -1.0], jnp.float32)
    logp = jnp.array([-1.0, -100.0], jnp.float32)  # log r = +99, -99
    rollout = jnp.array([-1.0, -200.0], jnp.float32)  # old - rollout = -99, +199
    adv = jnp.array([-1.0, 1.0], jnp.float32)
    for c in (2.0, None):
        loss, grad = jax.value_and_grad(
            lambda lp: policy_loss(lp, old, rollout, adv, jnp.ones(2, bool), dual_clip=c)[0]
        )(logp)
        assert np.isfinite(loss) and np.all(np.isfinite(grad))


def test_old_logp_none_is_on_policy():
    """old_logp=None: r = 1 with gradient d r/d logp = 1, so loss = -Σ w Â, grad = -w Â."""
    logp = jnp.array([-1.0, -2.0, -0.5], jnp.float32)
    rollout = jnp.array([-1.0, -2.5, -0.5], jnp.float32)  # w = 1, min(e^0.5, 2), 1
    adv = jnp.array([0.5, -1.0, 2.0], jnp.float32)
    mask = jnp.array([True, True, False])
    loss, grad = jax.value_and_grad(lambda lp: policy_loss(lp, None, rollout, adv, mask)[0])(logp)
    w = np.array([1.0, math.exp(0.5), 1.0])
    np.testing.assert_allclose(loss, -(0.5 * 1.0 + -1.0 * w[1]), rtol=1e-6)
    np.testing.assert_allclose(grad, [-0.5, w[1] * 1.0, 0.0], rtol=1e-6)


def test_micro_batch_metrics_aggregate_to_full_batch():
    rng = np.random.default_rng(3)
    shape = (4, 9)
    old = rng.uniform(-4, 0, shape).astype(np.float32)
    logp = (old + rng.normal(0, 0.7, shape)).astype(np.float32)
    rollout = (old - rng.normal(0, 1, shape)).astype(np.float32)
    adv = rng.normal(0, 1, shape).astype(np.float32)
    mask = rng.random(shape) < 0.6
    full = policy_loss(logp, old, rollout, adv, mask)
    a = policy_loss(logp[:2], old[:2], rollout[:2], adv[:2], mask[:2])
    b = policy_loss(logp[2:], old[2:], rollout[2:], adv[2:], mask[2:])
    np.testing.assert_allclose(a[0] + b[0], full[0], rtol=1e-5)
    assert int(a[1] + b[1]) == int(full[1]) == int(mask.sum())
    combined = combine_loss_metrics(a[2], b[2])
    for k, v in full[2].items():
        np.testing.assert_allclose(combined[k], v, rtol=1e-5, err_msg=k)
    means = loss_metric_means(combined, a[1] + b[1])
    np.testing.assert_allclose(
        means["clip_upper_frac"], int(full[2]["clip_upper_count"]) / mask.sum(), rtol=1e-6
    )
    zero = loss_metric_means(combined, 0)
    assert all(np.isfinite(v) for v in zero.values())


def test_bfloat16_inputs_compute_in_float32():
    x = jnp.array([-1.0, -2.0], jnp.bfloat16)
    loss, count, _ = policy_loss(x, x, x, jnp.ones(2, jnp.bfloat16), jnp.ones(2, bool))
    assert loss.dtype == jnp.float32 and count.dtype == jnp.int32
    np.testing.assert_allclose(loss, -2.0)


def test_jit_matches_eager_exactly():
    rng = np.random.default_rng(4)
    args = [jnp.asarray(rng.normal(size=(3, 5)) - 1, jnp.float32) for _ in range(4)]
    mask = jnp.asarray(rng.random((3, 5)) < 0.5)
    eager = policy_loss(*args, mask)
    jitted = jax.jit(policy_loss, static_argnames=("dual_clip",))(*args, mask)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
        np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(logp=np.zeros((2, 3), np.float32)), "`logp` has shape"),
        (dict(action_mask=np.ones((2, 3), bool)), "`action_mask` has shape"),
        (dict(advantages=np.zeros((2, 2), np.int32)), "`advantages` must be a floating"),
        (dict(logp=np.array([[0.0, np.nan], [0.0, 0.0]], np.float32)), "`logp` is not finite"),
        (dict(rollout_logp=np.array([[0.0, -np.inf], [0, 0]], np.float32)), "`rollout_logp`"),
        (dict(clip_low=1.5), "`clip_low`"),
        (dict(dual_clip=0.5), "`dual_clip`"),
        (dict(is_cap=0.0), "`is_cap`"),
    ],
)
def test_bad_input_raises_naming_argument(kwargs, match):
    base = dict(
        logp=np.zeros((2, 2), np.float32),
        old_logp=np.zeros((2, 2), np.float32),
        rollout_logp=np.zeros((2, 2), np.float32),
        advantages=np.ones((2, 2), np.float32),
        action_mask=np.ones((2, 2), bool),
    )
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        policy_loss(**base)


def test_all_zero_mask_raises_eagerly_and_is_zero_under_jit():
    z = np.zeros((2, 2), np.float32)
    mask = np.zeros((2, 2), bool)
    with pytest.raises(ValueError, match="`action_mask`"):
        policy_loss(z, z, z, z, mask)
    loss, count, metrics = jax.jit(policy_loss)(z, z, z, z, mask)
    assert float(loss) == 0.0 and int(count) == 0
    assert all(np.isfinite(v) for v in jax.tree.leaves(metrics))
