"""The learner's device memory, estimated from the model's shape before anything is built.

    total = params + grads + adam + compute_copy + activations           (bytes per device)

    params        P · b_p                   (P parameters in `param_dtype`, b_p bytes each)
    grads         P · b_p  (+ P · 4: the float32 accumulator of several micro-batches)
    adam          2 · P · b_p               (AdamW's first and second moments, as the params)
    compute_copy  P · b_c  when b_c ≠ b_p  (the weights cast to the compute dtype; an upper
                                            bound: XLA may keep a layer's cast only while
                                            the layer runs)
    activations   what the backward pass keeps for one micro-batch of N = rows · T tokens,
                  by `remat` policy (`qwen3.REMAT_POLICIES`):
        "none" / "attention":  L layers' activations (`layer_activation_bytes`), the
                               attention score blocks (float32 scores and exponentials)
                               kept whole for "none" (unless they exceed
                               `ATTENTION_REMAT_SCORE_BYTES`), none for "attention"; plus
                               4 copies of one block's scores while its backward runs;
        "block":               L layer inputs N · hidden · b_c, plus ONE layer's
                               activations, recomputed during its backward;
      plus the LM head's logits: N · V · 4 · 3 (float32 logits, their softmax and their
      gradient), or rows · chunk · V · 4 · 3 with `logprob_chunk_size`.

Parameters and optimizer state are divided over the fsdp x tensor devices, activations
over the data x fsdp devices (rows) and the tensor devices. Intermediates of a layer are
counted from its arithmetic (projections, norms, gates, the chunked delta rule's per-chunk
states and [C, C] matrices), not measured; `benchmarks/learner_memory.py` prints the
estimate beside the measured peak of a real step.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from spopp_jax.models.attention import (ATTENTION_REMAT_SCORE_BYTES, causal_query_block,
                                        causal_scores_bytes)
from spopp_jax.models.config import ModelConfig

GB = 1e9
MB = 1e6
# The LM head keeps float32 logits, their softmax and the softmax's gradient.
LOGIT_COPIES = 3


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device of each part of a learner step (see the module docstring)."""

    params: float
    grads: float
    adam: float
    compute_copy: float
    activations: float
    logits: float
    tokens: int
    remat: str

    @property
    def total(self) -> float:
        return (self.params + self.grads + self.adam + self.compute_copy + self.activations
                + self.logits)

    def summary(self) -> str:
        """One line: each part and the total, in GB (MB below 1 GB)."""
        scale, unit = (GB, "GB") if self.total >= GB else (MB, "MB")
        parts = ", ".join(f"{name} {getattr(self, name) / scale:.2f}" for name in
                          ("params", "grads", "adam", "compute_copy", "activations", "logits"))
        return (f"learner memory estimate per device: {self.total / scale:.2f} {unit} ({parts} "
                f"{unit}; {self.tokens} tokens per micro-batch, remat {self.remat})")


def parameter_count(config: ModelConfig) -> int:
    """Parameters of `Qwen3ForCausalLM(config)`, counted from the shape."""
    hidden, inter = config.hidden_size, config.intermediate_size
    count = config.vocab_size * hidden * (1 if config.tie_word_embeddings else 2) + hidden
    for layer_type in config.layer_types:
        count += 3 * hidden * inter + 2 * hidden
        count += (_attention_params(config) if layer_type == "full_attention"
                  else _linear_attention_params(config))
    return count


def _attention_params(config: ModelConfig) -> int:
    hidden, heads, kv, dim = (config.hidden_size, config.num_attention_heads,
                              config.num_key_value_heads, config.head_dim)
    query = heads * dim * (2 if config.attention_output_gate else 1)
    count = hidden * (query + 2 * kv * dim) + heads * dim * hidden
    if config.qkv_bias:
        count += query + 2 * kv * dim
    if config.o_bias:
        count += hidden
    return count + (2 * dim if config.qk_norm else 0)


def _linear_widths(config: ModelConfig) -> tuple[int, int, int]:
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_dim = config.linear_num_value_heads * config.linear_value_head_dim
    return key_dim, value_dim, 2 * key_dim + value_dim


def _linear_attention_params(config: ModelConfig) -> int:
    hidden, heads = config.hidden_size, config.linear_num_value_heads
    key_dim, value_dim, conv_dim = _linear_widths(config)
    return (hidden * (conv_dim + value_dim + 2 * heads) + conv_dim * config.linear_conv_kernel_dim
            + 2 * heads + config.linear_value_head_dim + value_dim * hidden)


def layer_activation_bytes(config: ModelConfig, layer_type: str, rows: int, time: int,
                           compute_bytes: int, score_blocks: str) -> float:
    """Bytes one decoder layer keeps for its backward pass on [rows, time] tokens.

    score_blocks: "all" (every causal block's float32 scores and exponentials), "one"
    (rematerialised blocks: one block's at a time) or "auto" (all unless they exceed
    `ATTENTION_REMAT_SCORE_BYTES`, as `Attention` decides)."""
    tokens = rows * time
    hidden, inter = config.hidden_size, config.intermediate_size
    # two pre-norms (input, float32 statistics cast back, output) and the residual adds
    norms = tokens * hidden * (4 * compute_bytes + 2 * 4)
    mlp = tokens * inter * 4 * compute_bytes  # gate, up, silu(gate), their product
    if layer_type == "full_attention":
        mixer = _attention_activation_bytes(config, rows, time, compute_bytes, score_blocks)
    else:
        mixer = _linear_attention_activation_bytes(config, rows, time, compute_bytes)
    return norms + mlp + mixer


def _attention_activation_bytes(config: ModelConfig, rows: int, time: int, compute_bytes: int,
                                score_blocks: str) -> float:
    tokens = rows * time
    heads, kv, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    gate = heads * dim if config.attention_output_gate else 0
    # projections, q/k norms and rotary (float32 inside, compute dtype out), attended, gated
    widths = 3 * heads * dim + 4 * kv * dim + 2 * gate
    projections = tokens * widths * compute_bytes + tokens * (heads + kv) * dim * 4
    block = causal_query_block(time)
    every_block = causal_scores_bytes(rows, heads, time, block)
    one_block = 4 * rows * heads * block * time
    if score_blocks == "auto":
        score_blocks = "all" if every_block <= ATTENTION_REMAT_SCORE_BYTES else "one"
    # kept for the backward pass: every block's scores and exponentials, or none (remat);
    # live while one block's backward runs: its scores, exponentials and their gradients
    kept = 2 * every_block if score_blocks == "all" else 0
    return projections + kept + 4 * one_block


def _linear_attention_activation_bytes(config: ModelConfig, rows: int, time: int,
                                       compute_bytes: int) -> float:
    tokens = rows * time
    heads = config.linear_num_value_heads
    key_head, value_head = config.linear_key_head_dim, config.linear_value_head_dim
    key_dim, value_dim, conv_dim = _linear_widths(config)
    chunk = config.linear_chunk_size
    chunks = -(-time // chunk)
    # in_proj outputs, conv (float32), silu, the heads' q/k/v in float32 per chunk, z,
    # the core output (float32), the gated norm
    streams = tokens * (conv_dim * (2 * compute_bytes + 4) + 3 * heads * key_head * 4
                        + value_dim * (3 * compute_bytes + 4) + 4 * heads * 4)
    # the chunk scan keeps each chunk's starting state [H, Dk, Dv] and its [C, C] matrices
    states = rows * chunks * heads * key_head * value_head * 4
    matrices = rows * chunks * heads * chunk * chunk * 4 * 3
    return streams + states + matrices


def estimate_learner_memory(config: ModelConfig, *, rows: int, time: int,
                            param_dtype="float32", compute_dtype="float32", remat: str = "none",
                            num_micro_batches: int = 1, logprob_chunk_size: int | None = None,
                            data: int = 1, fsdp: int = 1, tensor: int = 1) -> MemoryEstimate:
    """Per-device bytes of one learner step on micro-batches of [rows, time] tokens (the
    module docstring has every term). data / fsdp / tensor: the mesh axis sizes."""
    if remat not in ("none", "attention", "block"):
        raise ValueError(f"remat must be none, attention or block, got {remat!r}")
    param_bytes = jnp.dtype(param_dtype).itemsize
    compute_bytes = jnp.dtype(compute_dtype).itemsize
    weight_shards = fsdp * tensor
    count = parameter_count(config) / weight_shards
    row_shards = data * fsdp
    local_rows = max(1, -(-rows // row_shards))
    score_blocks = {"none": "auto", "attention": "one", "block": "auto"}[remat]
    per_layer = [layer_activation_bytes(config, kind, local_rows, time, compute_bytes,
                                        score_blocks) / tensor
                 for kind in config.layer_types]
    if remat == "block":
        inputs = len(per_layer) * local_rows * time * config.hidden_size * compute_bytes
        activations = inputs + max(per_layer)
    else:
        activations = sum(per_layer)
    positions = time if logprob_chunk_size is None else min(logprob_chunk_size, time)
    logits = LOGIT_COPIES * local_rows * positions * config.vocab_size * 4
    return MemoryEstimate(
        params=count * param_bytes,
        grads=count * param_bytes + (count * 4 if num_micro_batches > 1 else 0),
        adam=2 * count * param_bytes,
        compute_copy=count * compute_bytes if compute_bytes != param_bytes else 0.0,
        activations=activations,
        logits=logits,
        tokens=local_rows * time,
        remat=remat,
    )


def qwen35_0p8b_config() -> ModelConfig:
    """Qwen3.5-0.8B's text model as its published config.json describes it: 24 layers
    (3 Gated DeltaNet per gated attention layer), hidden 1024, MLP 3584, 248,320 tokens,
    attention 8 heads x 256 (2 key/value heads), DeltaNet 16 heads x 128, tied embeddings.
    Used to size the recipes' micro-batches where the weights are not on disk."""
    layer_types = ("linear_attention",) * 3 + ("full_attention",)
    return ModelConfig(vocab_size=248_320, hidden_size=1024, intermediate_size=3584,
                       num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
                       head_dim=256, tie_word_embeddings=True, layer_types=layer_types * 6,
                       model_type="qwen3_5_text", attention_output_gate=True,
                       partial_rotary_factor=0.25, linear_conv_kernel_dim=4,
                       linear_key_head_dim=128, linear_value_head_dim=128,
                       linear_num_key_heads=16, linear_num_value_heads=16)
