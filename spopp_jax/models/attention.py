"""Grouped-query self-attention with optional q/k RMSNorm (Qwen3) or qkv bias (Qwen2), and
Qwen3.5's output gate and partial rotary.

  q = RoPE(q_norm(x Wq)), k = RoPE(k_norm(x Wk)), v = x Wv
  out = softmax(q k^T / sqrt(head_dim) + mask) v, then o_proj.
Qwen3.5 (`config.attention_output_gate`): x Wq yields [query | gate] per head (2 head_dim),
out = o_proj(attended * sigmoid(gate)); RoPE rotates only the first `config.rotary_dim`
dims of each head; q/k norms are zero-centred (`OffsetRMSNorm`).
The same module serves the full forward (`__call__`) and cached decode (`decode`): decode
first writes this call's k/v at their positions, then attends over the whole cache.
The full forward of up to `chunk_size` tokens attends by cuDNN's fused kernel
(`jax.nn.dot_product_attention(implementation="cudnn")`) on a GPU with 16-bit inputs,
elsewhere by causal query blocks, each skipping the keys after it (`causal_block_attention`;
longer calls too; each block is rematerialised in the backward pass, so one block's scores
are live at a time, only when the scores all blocks would keep exceed
`ATTENTION_REMAT_SCORE_BYTES`); multi-token decode calls (prefill) attend chunk by chunk over all keys
(`chunked_attention`); a
one-token decode step attends with `single_query_attention`: the cache is read in place
(no transposed copy) and only up to the longest live context, by blocks.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from spopp_jax.models.cache import AttentionCache, write_at_positions
from spopp_jax.models.config import ModelConfig
from spopp_jax.models.layers import (MASKED_SCORE, Linear, OffsetRMSNorm, RMSNorm, apply_rope,
                                     grouped_query_attention, rope_inverse_frequencies)
from spopp_jax.models.masks import TokenLayout, mask_block

# Queries per attention block at most: a longer full forward attends by causal blocks of at
# most this many queries (rematerialised per `ATTENTION_REMAT_SCORE_BYTES`), and a longer prefill
# scans query chunks of this size, so the float32 scores are [B, H, chunk, S], not [B, H, T, S].
DEFAULT_ATTENTION_CHUNK = 1024
# Keys per block of a decode step's attention: the cache is read block by block only up
# to the longest live context (`single_query_attention`).
DECODE_KEY_BLOCK = 512
# Causal query blocks of the full forward (`causal_block_attention`): at most this many
# blocks, each of at least this many queries (T = 256: 4 blocks of 64, 62% of the dense
# scores; T = 1024: 8 blocks of 128, 56%).
CAUSAL_MAX_QUERY_BLOCKS = 8
CAUSAL_MIN_QUERY_BLOCK = 64
# A full forward's causal blocks are rematerialised in the backward pass only when the
# float32 scores of all its blocks (`causal_scores_bytes`) exceed this many bytes per layer
# call. Keeping them is faster: with the main job's PPO mini-batches (4 rows x 1,792 tokens,
# 4 heads: 115 MB) the train step took 2.80 s against 2.97 s rematerialised (docs/PERFORMANCE.md);
# a long call of a big model (16 heads x 8,192 tokens: 2.4 GB per row) is rematerialised.
ATTENTION_REMAT_SCORE_BYTES = 256 * 2**20


def causal_query_block(time: int) -> int:
    """Queries per causal block for a T-token call: max(64, ceil(T / 8))."""
    return max(CAUSAL_MIN_QUERY_BLOCK, -(-time // CAUSAL_MAX_QUERY_BLOCKS))


def causal_scores_bytes(batch: int, heads: int, time: int, block_size: int) -> int:
    """Bytes of the float32 scores [B, H, e - a, e] of all causal blocks [a, e) of a
    T-token full forward (`causal_block_attention`): 4 B H sum_blocks (e - a) e."""
    scores = 0
    for start in range(0, time, block_size):
        end = min(start + block_size, time)
        scores += (end - start) * end
    return 4 * batch * heads * scores


def causal_block_attention(query: jax.Array, key: jax.Array, value: jax.Array,
                           layout: TokenLayout, block_size: int,
                           remat: bool = False) -> jax.Array:
    """`grouped_query_attention` of a full forward, skipping the keys after each block.

    query [B, T, K, G, D], key/value [B, T, K, D] -> [B, T, K, G, D]. Requires the
    full-forward layout of `sequence_layout` (query_index[b, t] = t, key index = s), where
    key s > t is masked for every query t. The queries go in blocks [a, e) of
    `block_size`, and block [a, e) attends keys [0, e) only: the skipped keys s >= e > t
    have softmax weight exactly 0 (exp(MASKED_SCORE - max) underflows), so real tokens'
    outputs and all gradients are those of the dense [T, T] attention, at
    (n + 1) / (2 n) of its score work for n blocks. A padding query with no valid key at
    all gets the uniform average of the first e values instead of all T (its output is
    meaningless either way and nothing attends to it). ``remat``: each block is wrapped in
    `jax.checkpoint`, so the backward pass recomputes its scores instead of keeping all
    blocks' [B, K, G, block, e] scores alive (the long-call path of `Attention`).
    """
    time = query.shape[1]
    if key.shape[1] != time:
        raise ValueError(f"causal blocks need keys = queries (full forward); got key "
                         f"{key.shape}, query {query.shape}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")

    def attend_block(q, k, v, query_index, query_segment, key_valid, key_segment):
        mask = mask_block(query_index, query_segment, key_valid, key_segment)
        return grouped_query_attention(q, k, v, mask)

    if remat:
        attend_block = jax.checkpoint(attend_block)
    blocks = []
    for start in range(0, time, block_size):
        end = min(start + block_size, time)
        blocks.append(attend_block(
            query[:, start:end], key[:, :end], value[:, :end],
            layout.query_index[:, start:end], layout.query_segment[:, start:end],
            layout.key_valid[:, :end], layout.key_segment[:, :end]))
    return jnp.concatenate(blocks, axis=1)


def chunked_attention(query: jax.Array, key: jax.Array, value: jax.Array,
                      layout: TokenLayout, chunk_size: int) -> jax.Array:
    """`grouped_query_attention` with the mask of `layout`, over query chunks.

    query [B, T, K, G, D], key/value [B, S, K, D] -> [B, T, K, G, D]. T <= chunk_size: one
    block. Otherwise queries are padded to a multiple of chunk_size (padding queries
    attend to nothing) and scanned; each chunk is rematerialised in the backward pass, so
    memory holds one chunk's scores at a time.
    """
    batch, time = query.shape[:2]
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if time <= chunk_size:
        mask = mask_block(layout.query_index, layout.query_segment, layout.key_valid,
                          layout.key_segment)
        return grouped_query_attention(query, key, value, mask)
    num_chunks = -(-time // chunk_size)
    pad = num_chunks * chunk_size - time
    query_index = jnp.pad(layout.query_index, ((0, 0), (0, pad)), constant_values=-1)
    query_segment = jnp.pad(layout.query_segment, ((0, 0), (0, pad)))
    query = jnp.pad(query, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))

    def to_chunks(x):  # [B, n * C, ...] -> [n, B, C, ...]
        return jnp.moveaxis(x.reshape(batch, num_chunks, chunk_size, *x.shape[2:]), 1, 0)

    @jax.checkpoint
    def attend_chunk(_, chunk):
        q, index, segment = chunk
        mask = mask_block(index, segment, layout.key_valid, layout.key_segment)
        return None, grouped_query_attention(q, key, value, mask)

    _, out = jax.lax.scan(attend_chunk, None,
                          (to_chunks(query), to_chunks(query_index), to_chunks(query_segment)))
    out = jnp.moveaxis(out, 0, 1).reshape(batch, num_chunks * chunk_size, *out.shape[3:])
    return out[:, :time]


# cuDNN's fused attention (flash-attention-2 style) takes 16-bit q/k/v only, and head dims
# up to 128 in its backward pass on Ampere (docs.nvidia.com/cudnn, "Attention" support matrix).
FUSED_ATTENTION_DTYPES = ("bfloat16", "float16")
FUSED_ATTENTION_MAX_HEAD_DIM = 128


def fused_attention_implementation(dtype, head_dim: int, backend: str | None = None) -> str | None:
    """Which `jax.nn.dot_product_attention` kernel the full forward uses: "cudnn" on a GPU
    backend for 16-bit inputs with head_dim <= 128; None elsewhere (CPU, TPU, float32: our
    own XLA attention, `causal_block_attention` / `chunked_attention`). Decided at trace
    time (static); the float32 default never takes the fused path, `model.compute_dtype bfloat16`
    on a GPU does."""
    backend = jax.default_backend() if backend is None else backend
    if (backend == "gpu" and jnp.dtype(dtype).name in FUSED_ATTENTION_DTYPES
            and head_dim <= FUSED_ATTENTION_MAX_HEAD_DIM):
        return "cudnn"
    return None


def fused_attention(query: jax.Array, key: jax.Array, value: jax.Array, layout: TokenLayout,
                    implementation: str) -> jax.Array:
    """`grouped_query_attention` of a full forward by `jax.nn.dot_product_attention`.

    query [B, T, K, G, D], key/value [B, T, K, D] -> [B, T, K, G, D]. The query heads go
    as [B, T, K * G, D] (head h = k * G + g uses key/value head k = h // G, the grouping
    `jax.nn.dot_product_attention` applies for K < H); the layout's whole mask
    (`may_attend`: causal, valid keys, same segment) is passed as [B, 1, T, S], so packed
    and left-padded rows keep their semantics. Real tokens' outputs equal
    `causal_block_attention`'s; a padding query with no valid key is meaningless in both.
    `implementation`: "cudnn" (GPU, 16-bit) or "xla" (any backend; the CPU tests).
    """
    batch, time, kv_heads, groups, head_dim = query.shape
    if key.shape != (batch, time, kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(f"fused attention needs a full forward: query {query.shape}, "
                         f"key {key.shape}, value {value.shape}")
    mask = mask_block(layout.query_index, layout.query_segment, layout.key_valid,
                      layout.key_segment)[:, None]
    attended = jax.nn.dot_product_attention(
        query.reshape(batch, time, kv_heads * groups, head_dim), key, value, mask=mask,
        implementation=implementation)
    return attended.reshape(batch, time, kv_heads, groups, head_dim)


class SoftmaxStats(NamedTuple):
    """Unnormalised softmax-weighted sum over a set of keys (one query per row):
    top [B, K, G] = max score (MASKED_SCORE if no key is allowed), total [B, K, G] =
    sum_s p_s, weighted [B, K, G, D] = sum_s p_s v_s, with p_s = exp(score_s - top) for
    allowed keys and 0 otherwise. softmax(scores) v = weighted / total."""

    top: jax.Array
    total: jax.Array
    weighted: jax.Array


def key_block_stats(query: jax.Array, key: jax.Array, value: jax.Array,
                    allowed: jax.Array) -> SoftmaxStats:
    """`SoftmaxStats` of one block of keys, as multiply-reduces in float32:

      score[b, s, k, g] = sum_d q[b, k, g, d] key[b, s, k, d] / sqrt(D)
    query [B, K, G, D]; key, value [B, S, K, D] (the cache layout); allowed [B, S].

    Why not the einsums of `grouped_query_attention`: XLA:CPU lowers a dot_general with
    batch axes (b, k) by first transposing each operand to [B, K, ...]. For a decode step
    that copies the whole key and value cache (the value cache with S innermost) every
    layer, every step: at S = 4096 that cost ~10x a read of the cache. Written as
    broadcast-multiply-reduce, XLA fuses each product into its reduction and reads the
    cache once, in place.
    """
    head_dim = query.shape[-1]
    q = query.astype(jnp.float32) * (head_dim ** -0.5)
    scores = jnp.sum(q[:, None] * key.astype(jnp.float32)[:, :, :, None, :], axis=-1)
    allowed = allowed[:, :, None, None]  # [B, S, 1, 1] against scores [B, S, K, G]
    scores = jnp.where(allowed, scores, MASKED_SCORE)
    top = jnp.max(scores, axis=1)
    probs = jnp.where(allowed, jnp.exp(scores - top[:, None]), 0.0)  # exp of <= 0 only
    weighted = jnp.sum(probs[..., None] * value.astype(jnp.float32)[:, :, :, None, :], axis=1)
    return SoftmaxStats(top, jnp.sum(probs, axis=1), weighted)


def merge_stats(a: SoftmaxStats, b: SoftmaxStats) -> SoftmaxStats:
    """Stats of the union of two disjoint key sets: with top = max(a.top, b.top),
    each side's total and weighted sum are rescaled by exp(side.top - top) and added."""
    top = jnp.maximum(a.top, b.top)
    scale_a, scale_b = jnp.exp(a.top - top), jnp.exp(b.top - top)
    return SoftmaxStats(top, a.total * scale_a + b.total * scale_b,
                        a.weighted * scale_a[..., None] + b.weighted * scale_b[..., None])


def single_query_attention(query: jax.Array, key: jax.Array, value: jax.Array,
                           mask: jax.Array, key_limit: jax.Array | None = None,
                           block_size: int = DECODE_KEY_BLOCK) -> jax.Array:
    """`grouped_query_attention` for one query per row (a decode step):

      out[b, 0, k, g] = sum_s softmax_s(score[b, s, k, g] | mask[b, 0, s]) value[b, s, k]
    query [B, 1, K, G, D], key/value [B, S, K, D], mask [B, 1, S] -> [B, 1, K, G, D] in
    value.dtype (float32 scores and sums, `key_block_stats`). A row with no allowed key
    gets 0.

    key_limit (int scalar, may be traced): no row attends to a cache index >= key_limit
    (in decode: the largest position + 1). The cache is then read only up to key_limit,
    in blocks of `block_size` keys (a `fori_loop` with a data-dependent trip count,
    merged with `merge_stats`), so a step costs O(longest live context), not O(cache
    length). None: all S keys in one block.
    """
    batch, time, kv_heads, groups, head_dim = query.shape
    cache_len = key.shape[1]
    if time != 1 or key.shape != value.shape or key.shape[0] != batch:
        raise ValueError(f"query [B,1,K,G,D], key/value [B,S,K,D]; got {query.shape}, "
                         f"{key.shape}, {value.shape}")
    if key.shape[2:] != (kv_heads, head_dim) or mask.shape != (batch, 1, cache_len):
        raise ValueError(f"key {key.shape} / mask {mask.shape} do not match query "
                         f"{query.shape}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    query, mask = query[:, 0], mask[:, 0]
    if key_limit is None or cache_len <= block_size:
        stats = key_block_stats(query, key, value, mask)
    else:
        stats = _blockwise_stats(query, key, value, mask, key_limit, block_size)
    out = stats.weighted / jnp.maximum(stats.total, jnp.finfo(jnp.float32).tiny)[..., None]
    return out[:, None].astype(value.dtype)


def _blockwise_stats(query: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array,
                     key_limit: jax.Array, block_size: int) -> SoftmaxStats:
    """Stats over keys [0, key_limit) by blocks [i * block_size, (i + 1) * block_size).
    The last block's slice is moved back to end at the cache end (a slice cannot run
    past it); keys it re-reads from the previous block are masked out."""
    batch, cache_len = mask.shape
    num_blocks = (jnp.clip(key_limit, 0, cache_len) + block_size - 1) // block_size
    offsets = jnp.arange(block_size)

    def add_block(index, stats):
        nominal = index * block_size
        start = jnp.minimum(nominal, cache_len - block_size)

        def block(x):
            return jax.lax.dynamic_slice_in_dim(x, start, block_size, axis=1)

        allowed = block(mask) & (start + offsets >= nominal)[None, :]
        return merge_stats(stats, key_block_stats(query, block(key), block(value), allowed))

    kv_heads, groups, head_dim = query.shape[1:]
    empty = SoftmaxStats(jnp.full((batch, kv_heads, groups), MASKED_SCORE, jnp.float32),
                         jnp.zeros((batch, kv_heads, groups), jnp.float32),
                         jnp.zeros((batch, kv_heads, groups, head_dim), jnp.float32))
    return jax.lax.fori_loop(0, num_blocks, add_block, empty)


class Attention(nnx.Module):
    """Qwen3 / Qwen2 attention token mixer (HF name: `self_attn`)."""

    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs,
                 chunk_size: int = DEFAULT_ATTENTION_CHUNK,
                 remat_score_bytes: float = ATTENTION_REMAT_SCORE_BYTES, param_dtype=None):
        self.chunk_size = chunk_size
        self.remat_score_bytes = remat_score_bytes
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.output_gate = config.attention_output_gate
        hidden, head_dim = config.hidden_size, config.head_dim
        query_width = self.num_heads * head_dim * (2 if self.output_gate else 1)
        self.q_proj = Linear(hidden, query_width, use_bias=config.qkv_bias, dtype=dtype,
                             rngs=rngs, param_dtype=param_dtype)
        self.k_proj = Linear(hidden, self.num_kv_heads * head_dim, use_bias=config.qkv_bias,
                             dtype=dtype, rngs=rngs, param_dtype=param_dtype)
        self.v_proj = Linear(hidden, self.num_kv_heads * head_dim, use_bias=config.qkv_bias,
                             dtype=dtype, rngs=rngs, param_dtype=param_dtype)
        self.o_proj = Linear(self.num_heads * head_dim, hidden, use_bias=config.o_bias,
                             dtype=dtype, rngs=rngs, param_dtype=param_dtype)
        if config.qk_norm:
            norm_class = OffsetRMSNorm if config.zero_centered_norms else RMSNorm
            self.q_norm = norm_class(head_dim, eps=config.rms_norm_eps, dtype=dtype,
                                     param_dtype=param_dtype)
            self.k_norm = norm_class(head_dim, eps=config.rms_norm_eps, dtype=dtype,
                                     param_dtype=param_dtype)
        else:
            self.q_norm = self.k_norm = None
        self.rope = (config.rotary_dim, config.rope_theta, config.rope_type,
                     config.rope_factor)

    def init_cache(self, batch_size: int, max_len: int, dtype) -> AttentionCache:
        return AttentionCache.zeros(batch_size, max_len, self.num_kv_heads, self.head_dim, dtype)

    def _project(self, x: jax.Array, positions: jax.Array):
        """q [B, T, K, G, D], k and v [B, T, K, D] (rotary applied at `positions`), and the
        output gate [B, T, H * D] (None without `output_gate`)."""
        batch, time, _ = x.shape
        q = self.q_proj(x).reshape(batch, time, self.num_heads, -1)
        gate = None
        if self.output_gate:
            q, gate = jnp.split(q, 2, axis=-1)
            gate = gate.reshape(batch, time, self.num_heads * self.head_dim)
        k = self.k_proj(x).reshape(batch, time, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(batch, time, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = rope_inverse_frequencies(*self.rope)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        groups = self.num_heads // self.num_kv_heads
        q = q.reshape(batch, time, self.num_kv_heads, groups, self.head_dim)
        return q, k, v, gate

    def _output(self, attended: jax.Array, gate: jax.Array | None) -> jax.Array:
        batch, time = attended.shape[:2]
        attended = attended.reshape(batch, time, self.num_heads * self.head_dim)
        if gate is not None:
            attended = attended * jax.nn.sigmoid(gate).astype(attended.dtype)
        return self.o_proj(attended)

    def __call__(self, x: jax.Array, layout: TokenLayout) -> jax.Array:
        """Full forward over `layout` = `sequence_layout(...)` (query_index = t): up to
        `chunk_size` tokens by cuDNN's fused kernel on a GPU with 16-bit inputs
        (`fused_attention_implementation`), else by causal query blocks of
        min(`chunk_size`, `causal_query_block`) queries (`causal_block_attention`), each
        rematerialised in the backward pass when the scores of all blocks
        (`causal_scores_bytes`) exceed `remat_score_bytes`. Skipping the keys after each
        block matters most for long calls: at T = 1536 dense
        query chunks compute ~2.4x the scores of causal blocks."""
        q, k, v, gate = self._project(x, layout.positions)
        time = q.shape[1]
        implementation = fused_attention_implementation(q.dtype, self.head_dim)
        if implementation is not None and time <= self.chunk_size:
            attended = fused_attention(q, k, v, layout, implementation)
        else:
            block = min(self.chunk_size, causal_query_block(time))
            scores_bytes = causal_scores_bytes(q.shape[0], self.num_heads, time, block)
            attended = causal_block_attention(q, k, v, layout, block,
                                              remat=scores_bytes > self.remat_score_bytes)
        return self._output(attended, gate)

    def decode(self, x: jax.Array, layout: TokenLayout,
               cache: AttentionCache) -> tuple[jax.Array, AttentionCache]:
        q, k, v, gate = self._project(x, layout.positions)
        cache = AttentionCache(key=write_at_positions(cache.key, k, layout.positions),
                               value=write_at_positions(cache.value, v, layout.positions))
        q = q.astype(cache.key.dtype)
        if x.shape[1] == 1:
            mask = mask_block(layout.query_index, layout.query_segment, layout.key_valid,
                              layout.key_segment)
            key_limit = jnp.max(layout.query_index) + 1  # the longest live context
            attended = single_query_attention(q, cache.key, cache.value, mask, key_limit)
        else:
            attended = chunked_attention(q, cache.key, cache.value, layout, self.chunk_size)
        return self._output(attended.astype(x.dtype), gate), cache
