"""Tiny configs and random checkpoints for tests (no downloads). torch is imported lazily:
it is only needed by the helpers that build transformers models."""

from __future__ import annotations

from typing import Any

from spopp_jax.models.config import ModelConfig


def tiny_hf_config(model_type: str = "qwen3", *, rope_theta: float = 10000.0,
                   tie_word_embeddings: bool = False, num_attention_heads: int = 4,
                   num_key_value_heads: int = 2, vocab_size: int = 128, hidden_size: int = 64,
                   num_hidden_layers: int = 2, **overrides: Any):
    """A transformers Qwen3Config / Qwen2Config: hidden 64, 2 layers, GQA 4/2 by default."""
    from transformers import Qwen2Config, Qwen3Config
    config_class = {"qwen3": Qwen3Config, "qwen2": Qwen2Config}[model_type]
    kwargs = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=128,
                  num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                  num_key_value_heads=num_key_value_heads, max_position_embeddings=512,
                  rms_norm_eps=1e-6, tie_word_embeddings=tie_word_embeddings,
                  rope_parameters={"rope_type": "default", "rope_theta": rope_theta})
    if model_type == "qwen3":
        kwargs["head_dim"] = 16
    kwargs.update(overrides)
    config = config_class(**kwargs)
    config._attn_implementation = "eager"
    return config


def tiny_config(model_type: str = "qwen3", **kwargs: Any) -> ModelConfig:
    """Our `ModelConfig` for `tiny_hf_config(...)`."""
    return ModelConfig.from_hf(tiny_hf_config(model_type, **kwargs))


def random_hf_model(hf_config, seed: int = 0):
    """A transformers causal LM with random weights; norm scales and biases are random too
    (HF initialises them to 1 / 0, which would hide a missing or transposed norm)."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
    return model.float().eval()
