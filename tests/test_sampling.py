"""Tests for spopp_jax.sampling (SPEC 3)."""

import math

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spopp_jax.sampling import sample_idle_tasks, uncertainty_weights


def test_uncertainty_weights_hand_values(maybe_jit):
    v = jnp.array([0.0, 0.1, 0.5, 1.0])
    inside = maybe_jit(uncertainty_weights, static_argnames="form")(v)
    np.testing.assert_allclose(
        inside, [math.sqrt(0.05), math.sqrt(0.09 + 0.05), math.sqrt(0.3), math.sqrt(0.05)], rtol=1e-6
    )
    outside = maybe_jit(uncertainty_weights, static_argnames="form")(v, form="outside_sqrt")
    np.testing.assert_allclose(outside, [0.05, 0.3 + 0.05, 0.55, 0.05], rtol=1e-6)
    np.testing.assert_allclose(uncertainty_weights(v, floor=0.0), [0.0, 0.3, 0.5, 0.0], rtol=1e-6, atol=1e-7)


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**31 - 1), k=st.integers(0, 6))
def test_never_returns_in_flight_and_no_repeats(seed, k):
    rng = np.random.default_rng(seed)
    n = 12
    v = rng.uniform(0, 1, n).astype(np.float32)
    in_flight = rng.random(n) < 0.4
    hypothesis.assume((~in_flight).sum() >= k)
    ids = np.asarray(sample_idle_tasks(jax.random.key(seed), v, in_flight, k))
    assert ids.shape == (k,) and ids.dtype == np.int32
    assert len(set(ids.tolist())) == k
    assert not in_flight[ids].any()


def test_too_few_idle_tasks_raises_eagerly_and_pads_with_minus_one_under_jit():
    v = jnp.full(5, 0.5)
    in_flight = jnp.array([True, False, True, False, True])
    with pytest.raises(ValueError, match="fewer than k=3 idle tasks"):
        sample_idle_tasks(jax.random.key(0), v, in_flight, 3)
    ids = jax.jit(sample_idle_tasks, static_argnames="k")(jax.random.key(0), v, in_flight, k=3)
    ids = np.asarray(ids)
    assert sorted(ids[:2].tolist()) == [1, 3] and ids[2] == -1


def test_single_draw_frequencies_match_weights():
    """k = 1: P(x) = u_x / Σ_{idle} u (SPEC 3 weights), checked within 5 binomial sigmas."""
    v = jnp.array([0.0, 0.2, 0.5, 0.9, 0.5])
    in_flight = jnp.array([False, False, False, False, True])
    n_draws = 20_000
    keys = jax.random.split(jax.random.key(1), n_draws)
    draws = jax.jit(jax.vmap(lambda kk: sample_idle_tasks(kk, v, in_flight, 1)[0]))(keys)
    counts = np.bincount(np.asarray(draws), minlength=5)
    u = np.sqrt(np.array([0.0, 0.16, 0.25, 0.09]) + 0.05)
    p = u / u.sum()
    assert counts[4] == 0
    sigma = np.sqrt(n_draws * p * (1 - p))
    assert np.all(np.abs(counts[:4] - n_draws * p) < 5 * sigma), (counts, n_draws * p)


def test_two_draws_follow_successive_sampling_without_replacement():
    """k = 2 over 3 tasks: P(first = i, second = j) = u_i/U · u_j/(U − u_i)."""
    v = jnp.array([0.05, 0.5, 0.3])
    n_draws = 20_000
    keys = jax.random.split(jax.random.key(2), n_draws)
    draws = np.asarray(
        jax.jit(jax.vmap(lambda kk: sample_idle_tasks(kk, v, jnp.zeros(3, bool), 2, form="outside_sqrt")))(keys)
    )
    u = np.sqrt(np.array([0.05 * 0.95, 0.25, 0.21])) + 0.05
    total = u.sum()
    for i in range(3):
        for j in range(3):
            if i == j:
                continue
            p = u[i] / total * u[j] / (total - u[i])
            got = np.mean((draws[:, 0] == i) & (draws[:, 1] == j))
            assert abs(got - p) < 5 * math.sqrt(p * (1 - p) / n_draws), (i, j, got, p)


def test_zero_weight_idle_tasks_come_after_positive_ones():
    v = jnp.array([0.0, 0.5, 1.0, 0.5])
    ids = np.asarray(sample_idle_tasks(jax.random.key(3), v, jnp.array([0, 0, 0, 1]), 3, floor=0.0))
    assert ids[0] == 1 and sorted(ids[1:].tolist()) == [0, 2]


def test_jit_matches_eager_and_k_zero():
    v = jnp.linspace(0.0, 1.0, 9)
    mask = jnp.arange(9) % 3 == 0
    key = jax.random.key(4)
    eager = sample_idle_tasks(key, v, mask, 4)
    jitted = jax.jit(sample_idle_tasks, static_argnames=("k", "form"))(key, v, mask, k=4)
    np.testing.assert_array_equal(eager, jitted)
    assert sample_idle_tasks(key, v, mask, 0).shape == (0,)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: uncertainty_weights(jnp.array([0.5, 1.2])), "`v_hat`"),
        (lambda: uncertainty_weights(jnp.array([0.5, jnp.nan])), "`v_hat`"),
        (lambda: uncertainty_weights(jnp.array([0.5]), form="sqrt"), "`form`"),
        (lambda: uncertainty_weights(jnp.array([0.5]), floor=-0.1), "`floor`"),
        (lambda: sample_idle_tasks(jax.random.key(0), jnp.full(3, 0.5), jnp.zeros(4, bool), 1), "`in_flight_mask` has shape"),
        (lambda: sample_idle_tasks(jax.random.key(0), jnp.full(3, 0.5), jnp.zeros(3, bool), 4), "`k`"),
        (lambda: sample_idle_tasks(jax.random.key(0), jnp.full((3, 1), 0.5), jnp.zeros((3, 1), bool), 1), "`v_hat` must have rank"),
    ],
)
def test_bad_input_raises_naming_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()
