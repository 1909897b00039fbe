"""Tests for spopp_jax.advantages (SPEC 4)."""

import math

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spopp_jax.advantages import (
    batch_stats,
    length_advantage_cov,
    token_weighted_center,
    whiten,
    whiten_tokens,
)

A3 = [1.0, -1.0, 0.5]
L3 = [2, 1, 1]


def _np_whiten(a, lengths, measure, eps=1e-8):
    """Float64 NumPy reference written straight from SPEC 4."""
    a = np.asarray(a, np.float64)
    w = np.asarray(lengths, np.float64) if measure == "token" else np.ones_like(a)
    mu = np.sum(w * a) / np.sum(w)
    var = np.sum(w * (a - mu) ** 2) / (np.sum(w) - 1)
    return (a - mu) / (np.sqrt(var) + eps)


def test_hand_derived_trajectory_measure(maybe_jit):
    # μ = (1 − 1 + 0.5)/3 = 1/6;  σ² = ((5/6)² + (7/6)² + (1/3)²)/2 = 13/12
    sigma = math.sqrt(13 / 12)
    expected = [(5 / 6) / sigma, (-7 / 6) / sigma, (1 / 3) / sigma]
    out = maybe_jit(whiten, static_argnames="measure")(jnp.array(A3), jnp.array(L3), measure="trajectory")
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_hand_derived_token_measure(maybe_jit):
    # ΣL = 4;  μ = (2·1 − 1 + 0.5)/4 = 3/8;  σ² = (2·(5/8)² + (11/8)² + (1/8)²)/3 = 43/48
    sigma = math.sqrt(43 / 48)
    expected = [(5 / 8) / sigma, (-11 / 8) / sigma, (1 / 8) / sigma]
    out = maybe_jit(whiten, static_argnames="measure")(jnp.array(A3), jnp.array(L3), measure="token")
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_hand_derived_center_and_cov(maybe_jit):
    # Σ L A / Σ L = 1.5 / 4;  Cov_n: L̄ = 4/3, Ā = 1/6,
    # ((2/3)(5/6) + (−1/3)(−7/6) + (−1/3)(1/3)) / 3 = (15/18)/3 = 5/18
    np.testing.assert_allclose(maybe_jit(token_weighted_center)(jnp.array(A3), jnp.array(L3)), 0.375, rtol=1e-6)
    np.testing.assert_allclose(maybe_jit(length_advantage_cov)(jnp.array(L3), jnp.array(A3)), 5 / 18, rtol=1e-6)


def test_batch_stats_hand_values(maybe_jit):
    stats = maybe_jit(batch_stats)(jnp.array(A3), jnp.array(L3))
    np.testing.assert_allclose(stats["cov_n_length_advantage"], 5 / 18, rtol=1e-6)
    # trajectory-whitened Ã = (5/6, −7/6, 1/3)/σ, σ = sqrt(13/12):
    # Σ L Ã / Σ L = (10/6 − 7/6 + 2/6)/(4σ) = (5/6)/(4σ)
    np.testing.assert_allclose(
        stats["center_after_trajectory_whitening"], (5 / 6) / (4 * math.sqrt(13 / 12)), rtol=1e-6
    )
    np.testing.assert_allclose(stats["center_after_token_whitening"], 0.0, atol=1e-6)
    assert float(stats["length_q0"]) == 1 and float(stats["length_q50"]) == 1
    assert float(stats["length_q100"]) == 2
    np.testing.assert_allclose(stats["length_q90"], 1.8, rtol=1e-6)  # 1 + 0.8·(2 − 1)
    np.testing.assert_allclose(stats["length_mean"], 4 / 3, rtol=1e-6)
    assert float(stats["num_action_tokens"]) == 4 and float(stats["num_trajectories"]) == 3


@pytest.mark.parametrize("measure", ["token", "trajectory"])
@pytest.mark.parametrize("value", [0.0, 0.1, -0.7310586, 123.456])
def test_constant_advantages_give_zeros(measure, value):
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 500, 257)
    out = whiten(jnp.full(257, value, jnp.float32), jnp.asarray(lengths), measure)
    np.testing.assert_array_equal(out, 0.0)


@pytest.mark.parametrize("measure", ["token", "trajectory"])
def test_single_trajectory_and_no_action_tokens(measure):
    np.testing.assert_array_equal(whiten(jnp.array([0.3]), jnp.array([5]), measure), [0.0])
    np.testing.assert_array_equal(whiten(jnp.array([0.3]), jnp.array([0]), measure), [0.0])
    if measure == "token":
        out = whiten(jnp.array([0.3, -0.2]), jnp.array([0, 0]), measure)
        np.testing.assert_array_equal(out, [0.0, 0.0])
        out = whiten(jnp.array([0.3, -0.2]), jnp.array([1, 0]), measure)  # Σ L = 1
        np.testing.assert_array_equal(out, [0.0, 0.0])
    assert float(token_weighted_center(jnp.array([0.3, 1.0]), jnp.array([0, 0]))) == 0.0


def test_zero_length_trajectories_carry_no_token_weight():
    a = jnp.array([1.0, -1.0, 0.5, 7.0])
    lengths = jnp.array([2, 1, 1, 0])
    with_zero = whiten(a, lengths, "token")
    without = whiten(a[:3], lengths[:3], "token")
    np.testing.assert_allclose(with_zero[:3], without, rtol=1e-6)
    changed = whiten(a.at[3].set(-40.0), lengths, "token")
    np.testing.assert_allclose(changed[:3], without, rtol=1e-6)
    # ... but it does count under the trajectory measure
    assert not np.allclose(whiten(a, lengths, "trajectory")[:3], whiten(a[:3], lengths[:3], "trajectory"))


# a few fixed sizes keep the number of distinct shapes (and XLA compilations) small
_batch = st.sampled_from([1, 2, 5, 17, 40]).flatmap(
    lambda n: st.tuples(
        st.lists(st.floats(-3, 3, width=32), min_size=n, max_size=n),
        st.lists(st.integers(0, 300), min_size=n, max_size=n),
    )
)


def _spread(a, w):
    """True when the weighted data are clearly not constant (avoid the degenerate case)."""
    a = np.asarray(a, np.float64)
    w = np.asarray(w, np.float64)
    if w.sum() <= 1:
        return False
    mu = np.sum(w * a) / w.sum()
    return np.sqrt(np.sum(w * (a - mu) ** 2) / (w.sum() - 1)) > 1e-3


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(batch=_batch)
def test_token_whitening_centers_the_loss_and_matches_float64(batch):
    a, lengths = batch
    hypothesis.assume(_spread(a, lengths))
    out = whiten(jnp.asarray(a, jnp.float32), jnp.asarray(lengths), "token")
    l64 = np.asarray(lengths, np.float64)
    center = np.sum(l64 * np.asarray(out, np.float64)) / l64.sum()
    assert abs(center) < 1e-5
    np.testing.assert_allclose(out, _np_whiten(a, lengths, "token"), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(token_weighted_center(out, jnp.asarray(lengths)), 0.0, atol=1e-5)


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(batch=_batch)
def test_trajectory_whitening_center_is_cov_over_mean_length(batch):
    """SPEC Eq. 5: Σ L Ã / Σ L = Cov_n(L, Ã) / L̄ after trajectory whitening."""
    a, lengths = batch
    hypothesis.assume(_spread(a, np.ones(len(a))) and sum(lengths) > 0)
    out = whiten(jnp.asarray(a, jnp.float32), jnp.asarray(lengths), "trajectory")
    np.testing.assert_allclose(out, _np_whiten(a, lengths, "trajectory"), rtol=1e-4, atol=1e-4)
    l64 = np.asarray(lengths, np.float64)
    o64 = np.asarray(out, np.float64)
    cov_n = np.mean((l64 - l64.mean()) * (o64 - o64.mean()))
    center = float(token_weighted_center(out, jnp.asarray(lengths)))
    np.testing.assert_allclose(center, cov_n / l64.mean(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(length_advantage_cov(jnp.asarray(lengths), out), cov_n, rtol=1e-4, atol=1e-4)


def _pack(a, lengths, rng, row_len=64):
    """Pack trajectories into rows: prompt (non-action), then actions interleaved with
    observation tokens; segments contiguous, never split across rows; padding id -1."""
    segs = []
    for i, (ai, li) in enumerate(zip(a, lengths)):
        n_prompt = int(rng.integers(1, 4))
        mask = [0] * n_prompt + [1] * li
        obs = int(rng.integers(0, 3))
        for _ in range(obs):
            mask.insert(int(rng.integers(n_prompt, len(mask) + 1)), 0)
        segs.append((i, ai, mask))
    order = rng.permutation(len(segs))
    rows, cur = [], []
    for j in order:
        i, ai, mask = segs[j]
        if len(cur) + len(mask) > row_len and cur:
            rows.append(cur)
            cur = []
        cur += [(i, ai, m) for m in mask]
    rows.append(cur)
    n_rows = 16  # fixed shape: 40 trajectories of <= 25 tokens always fit
    assert len(rows) <= n_rows
    ids = np.full((n_rows, row_len), -1, np.int32)
    adv = np.full((n_rows, row_len), np.nan, np.float32)  # padding holds garbage
    am = np.zeros((n_rows, row_len), bool)
    for r, row in enumerate(rows):
        for t, (i, ai, m) in enumerate(row):
            ids[r, t], adv[r, t], am[r, t] = i, ai, bool(m)
    return ids, adv, am


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(batch=_batch, seed=st.integers(0, 2**31 - 1), measure=st.sampled_from(["token", "trajectory"]))
def test_whiten_tokens_equals_whiten(batch, seed, measure):
    a, lengths = batch
    lengths = [x % 20 for x in lengths]
    rng = np.random.default_rng(seed)
    ids, adv, am = _pack(a, lengths, rng)
    n_slots = 42  # >= 2 absent slots
    got = whiten_tokens(jnp.asarray(adv), jnp.asarray(ids), jnp.asarray(am), n_slots, measure)
    ref = whiten(jnp.asarray(a, jnp.float32), jnp.asarray(lengths), measure)
    expected = np.where(ids >= 0, np.asarray(ref)[np.maximum(ids, 0)], 0.0)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    assert np.all(np.asarray(am).sum() == sum(lengths))


def test_whiten_tokens_ignores_padding_garbage_under_jit():
    ids = jnp.array([[0, 0, 0, 1, 1, -1], [2, 2, 2, 2, -1, -1]])
    mask = jnp.array([[0, 1, 1, 0, 1, 0], [0, 1, 0, 1, 0, 0]], bool)
    adv = jnp.array([[1.0, 1.0, 1.0, -1.0, -1.0, jnp.nan], [0.5, 0.5, 0.5, 0.5, jnp.inf, jnp.nan]])
    f = jax.jit(whiten_tokens, static_argnames=("num_segments", "measure"))
    out = f(adv, ids, mask, num_segments=3, measure="token")
    # L = (2, 1, 2), A = (1, -1, 0.5): hand token measure, ΣL = 5, μ = (2 − 1 + 1)/5 = 0.4,
    # σ² = (2·0.36 + 1.96 + 2·0.01)/4 = 0.675
    s = math.sqrt(0.675)
    row0 = [0.6 / s] * 3 + [-1.4 / s] * 2 + [0.0]
    row1 = [0.1 / s] * 4 + [0.0, 0.0]
    np.testing.assert_allclose(out, [row0, row1], rtol=1e-6)


@pytest.mark.parametrize("fn", [whiten, token_weighted_center])
def test_jit_matches_eager(fn):
    rng = np.random.default_rng(3)
    a = jnp.asarray(rng.normal(size=1000), jnp.float32)
    lengths = jnp.asarray(rng.integers(0, 2000, 1000))
    np.testing.assert_allclose(jax.jit(fn)(a, lengths), fn(a, lengths), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: whiten(jnp.array([1.0, 2.0]), jnp.array([1, 2, 3])), "`action_lengths` has shape"),
        (lambda: whiten(jnp.array([1.0, 2.0]), jnp.array([1, -2])), "`action_lengths`"),
        (lambda: whiten(jnp.array([1.0, jnp.nan]), jnp.array([1, 2])), "`advantages`"),
        (lambda: whiten(jnp.array([1, 2]), jnp.array([1, 2])), "`advantages` must be a floating"),
        (lambda: whiten(jnp.array([1.0, 2.0]), jnp.array([1, 2]), "sequence"), "`measure`"),
        (lambda: whiten(jnp.zeros((2, 2)), jnp.ones((2, 2))), "`advantages` must have rank"),
        (lambda: whiten(jnp.zeros(0), jnp.zeros(0)), "`advantages` is empty"),
        (lambda: length_advantage_cov(jnp.array([1, -1]), jnp.array([0.0, 1.0])), "`action_lengths`"),
        (lambda: whiten_tokens(jnp.zeros(3), jnp.array([0, 1, 5]), jnp.ones(3, bool), 3), "`segment_ids`"),
        (lambda: whiten_tokens(jnp.zeros(3), jnp.array([0.0, 1, 2]), jnp.ones(3, bool), 3), "`segment_ids` must be an integer"),
        (lambda: whiten_tokens(jnp.zeros(3), jnp.array([0, 1, 2]), jnp.ones(2, bool), 3), "`action_mask` has shape"),
        (lambda: whiten_tokens(jnp.array([0.0, 1.0, 2.0]), jnp.array([0, 0, 1]), jnp.ones(3, bool), 2), "`advantages` must be constant"),
        (lambda: batch_stats(jnp.zeros(2), jnp.ones(2), quantiles=(1.5,)), "`quantiles`"),
    ],
)
def test_bad_input_raises_naming_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()
