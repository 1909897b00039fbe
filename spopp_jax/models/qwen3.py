"""Qwen3 / Qwen2 / Qwen3.5 (text) causal LM in Flax NNX (module tree mirrors transformers'
names).

  h_0 = embed(input_ids)
  h_{l+1} = h_l' + mlp(norm2(h_l')),  h_l' = h_l + mixer_l(norm1(h_l))
  logits = float32(norm(h_L) @ lm_head)   (lm_head = embed^T when tied)

`mixer_l` is chosen by `config.layer_types[l]` from `TOKEN_MIXERS`, so a hybrid model
(e.g. Gated DeltaNet + gated attention) adds a mixer class there without touching the
block. Each mixer implements `__call__(x, layout)`, `decode(x, layout, cache)` and
`init_cache(batch, max_len, dtype)`, and takes `chunk_size` (queries per block).

Precision: `dtype` is the compute dtype, `param_dtype` the stored one (default `dtype`):
fp32 master weights with bfloat16 compute are `dtype="bfloat16", param_dtype="float32"`;
each layer casts a parameter to `dtype` where it reads it (`layers.compute_value`), and the
logits are float32 either way.

Rematerialisation (`remat`, one of `REMAT_POLICIES`), what the backward pass recomputes:
  "none"       nothing of the decoder layers (an attention call's score blocks still are
               when they would exceed `ATTENTION_REMAT_SCORE_BYTES`);
  "attention"  every attention call's causal score blocks (`causal_block_attention`);
  "block"      each decoder layer: only its input is kept (O(layers x B x T x hidden)).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from spopp_jax.models.attention import (ATTENTION_REMAT_SCORE_BYTES, DEFAULT_ATTENTION_CHUNK,
                                        Attention)
from spopp_jax.models.cache import AttentionCache, KVCache
from spopp_jax.models.config import ModelConfig
from spopp_jax.models.gated_deltanet import GatedDeltaNet
from spopp_jax.models.layers import (Embed, Linear, OffsetRMSNorm, RMSNorm, SwiGLU,
                                     compute_value)
from spopp_jax.models.masks import TokenLayout, cached_layout, sequence_layout

REMAT_POLICIES = ("none", "attention", "block")
# layer type -> (HF attribute name, mixer class)
TOKEN_MIXERS = {"full_attention": ("self_attn", Attention),
                "linear_attention": ("linear_attn", GatedDeltaNet)}


def make_norm(config: ModelConfig, dim: int, dtype, param_dtype=None) -> RMSNorm | OffsetRMSNorm:
    """The decoder's RMSNorm: zero-centred (y = n(x)(1 + w)) for Qwen3.5, else n(x) w."""
    norm_class = OffsetRMSNorm if config.zero_centered_norms else RMSNorm
    return norm_class(dim, eps=config.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)


def _dtype(dtype) -> jnp.dtype:
    return jnp.dtype(dtype)


def remat_policy(remat: str | bool) -> str:
    """`remat` as one of `REMAT_POLICIES` (True = "block", False = "none")."""
    if isinstance(remat, bool):
        return "block" if remat else "none"
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat must be one of {REMAT_POLICIES}, got {remat!r}")
    return remat


def _attention_remat_bytes(policy: str) -> float:
    """Score bytes above which an attention call's blocks are rematerialised."""
    return 0 if policy == "attention" else ATTENTION_REMAT_SCORE_BYTES


class DecoderLayer(nnx.Module):
    """Pre-norm block: token mixer then SwiGLU MLP, each with a residual."""

    def __init__(self, config: ModelConfig, layer_index: int, *, dtype, rngs: nnx.Rngs,
                 attention_chunk_size: int = DEFAULT_ATTENTION_CHUNK, param_dtype=None,
                 remat: str = "none"):
        layer_type = config.layer_types[layer_index]
        if layer_type not in TOKEN_MIXERS:
            raise NotImplementedError(f"layer_types[{layer_index}] = {layer_type!r}")
        self.mixer_name, mixer_class = TOKEN_MIXERS[layer_type]
        options = ({"remat_score_bytes": _attention_remat_bytes(remat)}
                   if mixer_class is Attention else {})
        setattr(self, self.mixer_name, mixer_class(config, dtype=dtype, rngs=rngs,
                                                   chunk_size=attention_chunk_size,
                                                   param_dtype=param_dtype, **options))
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, dtype=dtype, rngs=rngs,
                          param_dtype=param_dtype)
        self.input_layernorm = make_norm(config, config.hidden_size, dtype, param_dtype)
        self.post_attention_layernorm = make_norm(config, config.hidden_size, dtype, param_dtype)

    @property
    def mixer(self):
        return getattr(self, self.mixer_name)

    def __call__(self, x: jax.Array, layout: TokenLayout) -> jax.Array:
        x = x + self.mixer(self.input_layernorm(x), layout)
        return x + self.mlp(self.post_attention_layernorm(x))

    def decode(self, x: jax.Array, layout: TokenLayout, cache):
        mixed, cache = self.mixer.decode(self.input_layernorm(x), layout, cache)
        x = x + mixed
        return x + self.mlp(self.post_attention_layernorm(x)), cache


def _layer_forward(layer: DecoderLayer, x: jax.Array, layout: TokenLayout) -> jax.Array:
    return layer(x, layout)


# Rematerialised layer: only the layer inputs are kept for the backward pass.
_remat_layer_forward = nnx.remat(_layer_forward)


class Qwen3Model(nnx.Module):
    """The backbone (HF `model.`): embeddings, decoder layers, final norm.

    `remat` (module docstring): "block" recomputes each layer's activations in the backward
    pass (memory O(layers x B x T x hidden) instead of keeping attention scores and MLP
    activations); "attention" only the attention score blocks.
    """

    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs, remat: str | bool = "none",
                 attention_chunk_size: int = DEFAULT_ATTENTION_CHUNK, param_dtype=None):
        self.remat = remat_policy(remat)
        self.embed_tokens = Embed(config.vocab_size, config.hidden_size, dtype=dtype, rngs=rngs,
                                  param_dtype=param_dtype)
        self.layers = nnx.List([
            DecoderLayer(config, i, dtype=dtype, rngs=rngs, param_dtype=param_dtype,
                         attention_chunk_size=attention_chunk_size, remat=self.remat)
            for i in range(config.num_hidden_layers)])
        self.norm = make_norm(config, config.hidden_size, dtype, param_dtype)

    def __call__(self, input_ids: jax.Array, layout: TokenLayout) -> jax.Array:
        x = self.embed_tokens(input_ids)
        layer_forward = _remat_layer_forward if self.remat == "block" else _layer_forward
        for layer in self.layers:
            x = layer_forward(layer, x, layout)
        return self.norm(x)

    def decode(self, input_ids: jax.Array, layout: TokenLayout, cache: KVCache):
        x = self.embed_tokens(input_ids)
        new_cache = []
        for layer, layer_cache in zip(self.layers, cache):
            x, layer_cache = layer.decode(x, layout, layer_cache)
            new_cache.append(layer_cache)
        return self.norm(x), tuple(new_cache)


class Qwen3ForCausalLM(nnx.Module):
    """Causal LM head over `Qwen3Model`; also serves Qwen2 (config.model_type == "qwen2")."""

    def __init__(self, config: ModelConfig, *, dtype="float32", rngs: nnx.Rngs,
                 remat: str | bool = "none", attention_chunk_size: int = DEFAULT_ATTENTION_CHUNK,
                 param_dtype=None):
        self.config = config
        self.dtype = _dtype(dtype)  # compute
        self.param_dtype = self.dtype if param_dtype is None else _dtype(param_dtype)
        self.model = Qwen3Model(config, dtype=self.dtype, rngs=rngs, remat=remat,
                                attention_chunk_size=attention_chunk_size,
                                param_dtype=self.param_dtype)
        self.lm_head = (None if config.tie_word_embeddings else
                        Linear(config.hidden_size, config.vocab_size, use_bias=False,
                               dtype=self.dtype, rngs=rngs, param_dtype=self.param_dtype))

    def logits_from_hidden(self, hidden: jax.Array) -> jax.Array:
        """float32 logits [..., V] from final hidden states [..., hidden_size]."""
        if self.lm_head is None:
            return self.model.embed_tokens.attend(hidden)
        kernel = compute_value(self.lm_head.kernel, self.dtype)
        return jnp.einsum("...h,hv->...v", hidden.astype(kernel.dtype), kernel,
                          preferred_element_type=jnp.float32)

    def hidden_states(self, input_ids: jax.Array, attention_mask: jax.Array | None = None,
                      positions: jax.Array | None = None,
                      segment_ids: jax.Array | None = None) -> jax.Array:
        """Final-norm hidden states [B, T, hidden_size] (see `__call__`)."""
        layout = sequence_layout(input_ids, attention_mask, positions, segment_ids)
        return self.model(input_ids, layout)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None,
                 positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """float32 logits [B, T, V] for input_ids [B, T].

        attention_mask [B, T]: real tokens (padding rows' outputs are finite but meaningless);
        segment_ids [B, T]: packed sequences attend only within their segment;
        positions [B, T]: rotary positions, default = index among the real tokens of the
        same segment (left padding and packed segments start at 0).
        """
        return self.logits_from_hidden(
            self.hidden_states(input_ids, attention_mask, positions, segment_ids))

    def init_cache(self, batch_size: int, max_len: int, dtype=None) -> KVCache:
        """Empty per-layer cache for `batch_size` slots of `max_len` positions."""
        dtype = self.dtype if dtype is None else _dtype(dtype)
        return tuple(layer.mixer.init_cache(batch_size, max_len, dtype)
                     for layer in self.model.layers)

    def forward_cached(self, input_ids: jax.Array, positions: jax.Array,
                       cache: KVCache) -> tuple[jax.Array, KVCache]:
        """Decode / prefill with a cache: (float32 logits [B, T, V], updated cache).

        Row b writes its K/V at cache index positions[b, t] and attends to cache indices
        <= positions[b, t]; positions < 0 are padding (nothing written, logits ignored).
        Rows are independent, so engine slots may sit at different positions.
        """
        if input_ids.shape != positions.shape or input_ids.ndim != 2:
            raise ValueError(f"input_ids and positions must both be [B, T]; got "
                             f"{input_ids.shape}, {positions.shape}")
        if len(cache) != len(self.model.layers):
            raise ValueError(f"cache has {len(cache)} layers, model {len(self.model.layers)}")
        layout = cached_layout(positions, _attention_cache_len(cache))
        hidden, cache = self.model.decode(input_ids, layout, cache)
        return self.logits_from_hidden(hidden), cache


def _attention_cache_len(cache: KVCache) -> int:
    """Cache length of the attention layers (other layer types keep no positions)."""
    for layer_cache in cache:
        if isinstance(layer_cache, AttentionCache):
            return layer_cache.max_len
    raise ValueError("the cache has no attention layer")


def init_model(config: ModelConfig, seed: int = 0, dtype="float32", remat: str | bool = "none",
               attention_chunk_size: int = DEFAULT_ATTENTION_CHUNK,
               param_dtype=None) -> Qwen3ForCausalLM:
    """A randomly initialised model (normal(0, 0.02) matrices, unit norm scales).

    dtype: compute dtype; param_dtype: stored dtype (None: dtype). The initial values are
    drawn in float32 and cast to param_dtype, so a model differs from another of the same
    seed and param_dtype only in its compute.
    remat: one of `REMAT_POLICIES` (module docstring; True = "block").
    attention_chunk_size: queries per attention block (longer calls are scanned by chunks).
    """
    return Qwen3ForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(params=seed), remat=remat,
                            attention_chunk_size=attention_chunk_size, param_dtype=param_dtype)
