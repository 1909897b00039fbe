"""Tests for spopp_jax.priors (SPEC 2, offline prior)."""

import hypothesis
import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest

from spopp_jax.priors import jeffreys_prior


def test_hand_values(maybe_jit):
    # n = 8, M = 8: α0 = 8(s + ½)/9, β0 = 8(8 − s + ½)/9;  n = 0 -> (½, ½)
    s = jnp.array([3, 0, 8, 0])
    n = jnp.array([8, 8, 8, 0])
    alpha, beta = maybe_jit(jeffreys_prior)(s, n)
    np.testing.assert_allclose(alpha, [28 / 9, 4 / 9, 68 / 9, 0.5], rtol=1e-6)
    np.testing.assert_allclose(beta, [44 / 9, 68 / 9, 4 / 9, 0.5], rtol=1e-6)
    a, b = jeffreys_prior(1, 2, mass=3.0)  # 3·1.5/3, 3·1.5/3
    np.testing.assert_allclose([a, b], [1.5, 1.5], rtol=1e-6)


@hypothesis.settings(max_examples=50, deadline=None)
@hypothesis.given(n=st.integers(1, 10_000), frac=st.floats(0, 1), mass=st.floats(0.5, 100))
def test_mass_and_mean(n, frac, mass):
    s = int(round(frac * n))
    alpha, beta = jeffreys_prior(s, n, mass)
    np.testing.assert_allclose(float(alpha + beta), mass, rtol=1e-5)
    np.testing.assert_allclose(float(alpha / (alpha + beta)), (s + 0.5) / (n + 1), rtol=1e-5)


@pytest.mark.parametrize(
    "args, match",
    [
        ((jnp.array([3]), jnp.array([2])), "`successes`"),
        ((jnp.array([-1]), jnp.array([2])), "`successes`"),
        ((jnp.array([1.5]), jnp.array([2])), "`successes`"),
        ((jnp.array([0]), jnp.array([-2])), "`trials`"),
        ((jnp.array([0, 1]), jnp.array([2, 2, 2])), "`successes` shape"),
        ((jnp.array([1]), jnp.array([2]), 0.0), "`mass`"),
    ],
)
def test_bad_input_raises_naming_argument(args, match):
    with pytest.raises(ValueError, match=match):
        jeffreys_prior(*args)
