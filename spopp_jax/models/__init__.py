"""Qwen3 / Qwen2 policy model in Flax NNX with HF config/safetensors I/O and a KV cache."""

from spopp_jax.models.cache import AttentionCache, KVCache
from spopp_jax.models.config import ModelConfig
from spopp_jax.models.hf_io import from_pretrained, save_pretrained
from spopp_jax.models.partitioning import parameter_shardings, parameter_specs, partition_spec
from spopp_jax.models.qwen3 import DecoderLayer, Qwen3ForCausalLM, Qwen3Model, init_model

__all__ = [
    "AttentionCache",
    "DecoderLayer",
    "KVCache",
    "ModelConfig",
    "Qwen3ForCausalLM",
    "Qwen3Model",
    "from_pretrained",
    "init_model",
    "parameter_shardings",
    "parameter_specs",
    "partition_spec",
    "save_pretrained",
]
