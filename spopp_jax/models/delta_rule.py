"""The gated delta rule (Gated DeltaNet's token mixing), two pure-JAX forms.

Per head, with k_t and q_t L2-normalised, q_t scaled by 1/sqrt(d_k), state S [d_k, d_v]:
  a_t = exp(g_t)                     (g_t <= 0: decay in log space)
  S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T
  o_t = S_t^T q_t
Runs: a token with `starts[t]` begins a new run, i.e. its S_{t-1} is 0 (a_t := 0); a packed
segment or a new request in a reused decode slot. Padding passes through with g = 0 and
beta = 0 (S unchanged, nothing written); the caller sets those.

`gated_delta_recurrent` scans token by token (decode). `gated_delta_chunked` is the
parallel form for training / prefill: a `lax.scan` over chunks of C tokens, with only
[C, C] matrices inside a chunk (memory O(T C), never [T, T]). Inside a chunk, with
G_i = sum_{m <= i} g_m (chunk-local), Gam[i, j] = exp(G_i - G_j) [j <= i, same run],
L[i, j] = beta_i k_i.k_j Gam[i, j] for j < i, and c_i = [no run starts in the chunk up
to i]:
  U = (I + L)^{-1} (beta v),   W = (I + L)^{-1} (beta k exp(G) c)   (`unit_lower_inverse`)
  V' = U - W S,   O = (q exp(G) c) S + ((q k^T) * Gam) V'
  S <- exp(G_C) c_C S + sum_j exp(G_C - G_j) [j in the last run] k_j V'_j^T
which is the recurrence above (transformers' `torch_chunk_gated_delta_rule` without runs).
All arithmetic in float32; exponents are masked to <= 0 before exp (no overflow, no
0 * inf).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

# The state recurrence compounds matmul error over the whole sequence: keep fp32 exact.
PRECISION = jax.lax.Precision.HIGHEST


def l2_normalise(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis, float32 (transformers' `l2norm`)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True) + eps)


def _check_inputs(query, key, value, decay, beta, starts, initial_state) -> None:
    batch, time, heads, key_dim = query.shape
    chex.assert_shape(key, (batch, time, heads, key_dim))
    chex.assert_shape(value, (batch, time, heads, None))
    chex.assert_shape([decay, beta], (batch, time, heads))
    chex.assert_shape(starts, (batch, time))
    chex.assert_shape(initial_state, (batch, heads, key_dim, value.shape[-1]))


def gated_delta_recurrent(query: jax.Array, key: jax.Array, value: jax.Array,
                          decay: jax.Array, beta: jax.Array, starts: jax.Array,
                          initial_state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Token-by-token form (see module docstring).

    query, key [B, T, H, Dk] (normalised and scaled), value [B, T, H, Dv], decay (g) and
    beta [B, T, H], starts [B, T] bool, initial_state [B, H, Dk, Dv].
    Returns (out [B, T, H, Dv] float32, final state [B, H, Dk, Dv] float32).
    """
    _check_inputs(query, key, value, decay, beta, starts, initial_state)
    f32 = lambda x: jnp.moveaxis(x.astype(jnp.float32), 1, 0)  # time-major

    def step(state, token):
        q, k, v, g, b, start = token
        carry = jnp.exp(g) * (1.0 - start.astype(jnp.float32))[:, None]  # [B, H]
        state = state * carry[..., None, None]
        predicted = jnp.einsum("bhkv,bhk->bhv", state, k, precision=PRECISION)
        delta = b[..., None] * (v - predicted)
        state = state + k[..., :, None] * delta[..., None, :]
        return state, jnp.einsum("bhkv,bhk->bhv", state, q, precision=PRECISION)

    final, out = jax.lax.scan(step, initial_state.astype(jnp.float32),
                              (f32(query), f32(key), f32(value), f32(decay), f32(beta),
                               jnp.moveaxis(starts, 1, 0)))
    return jnp.moveaxis(out, 0, 1), final


def unit_lower_inverse(strict_lower: jax.Array) -> jax.Array:
    """(I + L)^{-1} for strictly lower-triangular L [..., C, C], by matmuls only:
    L is nilpotent (L^C = 0), so (I + L)^{-1} = sum_m (-L)^m
    = prod_{k < K} (I + (-L)^(2^k)) with 2^K >= C (K = ceil(log2 C) squarings).

    Used instead of `lax.linalg.triangular_solve`: with it, the jitted forward+backward of
    an 8-layer hybrid at T = 512 (1 CPU device) and the 8-virtual-device forward of a
    GDN + attention model blocked forever in XLA:CPU (idle threads, jax 0.10.2, 2 cores);
    with matmuls both finish. Exact in exact arithmetic; parity with transformers'
    `solve_triangular` is tested.
    """
    size = strict_lower.shape[-1]
    identity = jnp.eye(size, dtype=strict_lower.dtype)
    power = -strict_lower
    inverse = identity + power
    span = 2
    while span < size:
        power = jnp.matmul(power, power, precision=PRECISION)
        inverse = jnp.matmul(inverse, identity + power, precision=PRECISION)
        span *= 2
    return inverse


def _chunk_step(state: jax.Array, chunk) -> tuple[jax.Array, jax.Array]:
    """One chunk of the parallel form. state [B, H, Dk, Dv]; chunk tensors head-major:
    q, k [B, H, C, Dk], v [B, H, C, Dv], g, beta [B, H, C], run [B, C] (chunk-local run
    index: number of run starts at or before each token within the chunk)."""
    q, k, v, g, beta, run = chunk
    size = g.shape[-1]
    cum = jnp.cumsum(g, axis=-1)  # G_i
    index = jnp.arange(size)
    same_run = run[:, None, :, None] == run[:, None, None, :]  # [B, 1, C, C]
    lower = same_run & (index[:, None] >= index[None, :])
    strict = lower & (index[:, None] > index[None, :])
    exponent = jnp.where(lower, cum[..., :, None] - cum[..., None, :], 0.0)
    pair_decay = jnp.where(lower, jnp.exp(exponent), 0.0)  # Gam
    continues = (run == 0).astype(jnp.float32)[:, None, :]  # c_i, [B, 1, C]
    in_last_run = (run == run[:, -1:]).astype(jnp.float32)[:, None, :]

    einsum = lambda spec, a, b: jnp.einsum(spec, a, b, precision=PRECISION)
    key_products = einsum("bhid,bhjd->bhij", k, k)
    lower_system = jnp.where(strict, beta[..., :, None] * key_products * pair_decay, 0.0)
    rhs = jnp.concatenate([beta[..., None] * v,
                           (beta * jnp.exp(cum) * continues)[..., None] * k], axis=-1)
    solved = einsum("bhij,bhjd->bhid", unit_lower_inverse(lower_system), rhs)
    new_values, state_weights = jnp.split(solved, [v.shape[-1]], axis=-1)  # U, W
    corrected = new_values - einsum("bhik,bhkv->bhiv", state_weights, state)  # V'
    intra = einsum("bhid,bhjd->bhij", q, k) * pair_decay
    out = (einsum("bhik,bhkv->bhiv", q * (jnp.exp(cum) * continues)[..., None], state)
           + einsum("bhij,bhjv->bhiv", intra, corrected))
    to_end = jnp.exp(jnp.minimum(cum[..., -1:] - cum, 0.0)) * in_last_run  # [B, H, C]
    chunk_decay = jnp.exp(cum[..., -1]) * continues[..., -1]  # [B, H]
    state = (state * chunk_decay[..., None, None]
             + einsum("bhik,bhiv->bhkv", k * to_end[..., None], corrected))
    return state, out


def gated_delta_chunked(query: jax.Array, key: jax.Array, value: jax.Array,
                        decay: jax.Array, beta: jax.Array, starts: jax.Array,
                        initial_state: jax.Array, chunk_size: int
                        ) -> tuple[jax.Array, jax.Array]:
    """Chunked parallel form (see module docstring); same arguments and results as
    `gated_delta_recurrent`, plus `chunk_size` (C). T is padded to a multiple of C with
    pass-through tokens (g = 0, beta = 0), which leave the final state unchanged."""
    _check_inputs(query, key, value, decay, beta, starts, initial_state)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    batch, time = starts.shape
    num_chunks = -(-time // chunk_size)
    pad = num_chunks * chunk_size - time

    def chunks(x: jax.Array, head_major: bool) -> jax.Array:
        """[B, T, (H, ...)] -> [n, B, (H), C, ...] float32, zero-padded in time."""
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(batch, num_chunks, chunk_size, *x.shape[2:])
        x = jnp.moveaxis(x, 1, 0)
        return jnp.moveaxis(x, 3, 2) if head_major else x

    run = jnp.cumsum(chunks(starts.astype(jnp.int32), head_major=False), axis=-1)
    inputs = tuple(chunks(x.astype(jnp.float32), head_major=True)
                   for x in (query, key, value, decay, beta)) + (run,)
    final, out = jax.lax.scan(_chunk_step, initial_state.astype(jnp.float32), inputs)
    heads, value_dim = out.shape[2], out.shape[-1]
    out = jnp.transpose(out, (1, 0, 3, 2, 4))  # [n, B, H, C, Dv] -> [B, n, C, H, Dv]
    out = out.reshape(batch, num_chunks * chunk_size, heads, value_dim)
    return out[:, :time], final
