"""`layers.linear`'s hand-written gradient (one token-contracting dot for the kernel) equals
autodiff of the plain einsum, for every leading shape and dtype the models use."""

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from spopp_jax.models.layers import Linear, linear


def _reference(x, kernel):
    return jnp.einsum("...i,io->...o", x, kernel)


@pytest.mark.parametrize("leading", [(), (3,), (2, 3), (2, 1, 3)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gradients_equal_autodiff(leading, dtype):
    rng = np.random.default_rng(len(leading))
    x = jnp.asarray(rng.normal(size=leading + (5,)), dtype)
    kernel = jnp.asarray(rng.normal(size=(5, 4)), dtype)
    cotangent = jnp.asarray(rng.normal(size=leading + (4,)), dtype)

    def loss(fn):
        return lambda x, k: jnp.sum((fn(x, k) * cotangent).astype(jnp.float32))

    got = jax.jit(jax.grad(loss(linear), (0, 1)))(x, kernel)
    want = jax.jit(jax.grad(loss(_reference), (0, 1)))(x, kernel)
    np.testing.assert_array_equal(linear(x, kernel), _reference(x, kernel))
    for name, g, w in zip(("dx", "dkernel"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        tol = 1e-6 if dtype == jnp.float32 else 1e-2
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=tol, atol=tol, err_msg=name)


def test_linear_module_bias_gradient():
    from flax import nnx

    layer = Linear(5, 4, use_bias=True, dtype=jnp.float32, rngs=nnx.Rngs(params=0))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 5)), jnp.float32)
    grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(layer)
    y = x @ layer.kernel[...] + layer.bias[...]
    np.testing.assert_allclose(grads.bias[...], jnp.sum(2 * y, axis=(0, 1)), rtol=1e-5)
    np.testing.assert_allclose(grads.kernel[...], jnp.einsum("bti,bto->io", x, 2 * y),
                               rtol=1e-5, atol=1e-5)
