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


def tiny_qwen35_hf_config(*, full_attention_interval: int = 4, num_hidden_layers: int = 4,
                          tie_word_embeddings: bool = False, num_attention_heads: int = 4,
                          num_key_value_heads: int = 2, head_dim: int = 16,
                          linear_num_key_heads: int = 2, linear_num_value_heads: int = 4,
                          linear_key_head_dim: int = 8, linear_value_head_dim: int = 16,
                          **overrides: Any):
    """A transformers Qwen3_5TextConfig: hidden 64, vocab 128, conv kernel 4, rotary on a
    quarter of head_dim, `full_attention_interval` (every n-th layer full attention)."""
    from transformers import Qwen3_5TextConfig
    layer_types = ["full_attention" if (i + 1) % full_attention_interval == 0
                   else "linear_attention" for i in range(num_hidden_layers)]
    kwargs = dict(vocab_size=128, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                  num_key_value_heads=num_key_value_heads, head_dim=head_dim,
                  linear_conv_kernel_dim=4, linear_key_head_dim=linear_key_head_dim,
                  linear_value_head_dim=linear_value_head_dim,
                  linear_num_key_heads=linear_num_key_heads,
                  linear_num_value_heads=linear_num_value_heads, layer_types=layer_types,
                  max_position_embeddings=512, rms_norm_eps=1e-6,
                  tie_word_embeddings=tie_word_embeddings,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                   "partial_rotary_factor": 0.25})
    kwargs.update(overrides)
    config = Qwen3_5TextConfig(**kwargs)
    config._attn_implementation = "eager"
    return config


def tiny_config(model_type: str = "qwen3", **kwargs: Any) -> ModelConfig:
    """Our `ModelConfig` for `tiny_hf_config(...)`."""
    return ModelConfig.from_hf(tiny_hf_config(model_type, **kwargs))


def random_hf_model(hf_config, seed: int = 0):
    """A transformers causal LM with random weights; norm scales and biases are random too
    (HF initialises them to 1 / 0, which would hide a missing or transposed norm; Qwen3.5's
    zero-centred norms get offsets in [-0.5, 0.5])."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager")
    zero_centred = hf_config.model_type == "qwen3_5_text"
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and zero_centred and "linear_attn" not in name:
                param.uniform_(-0.5, 0.5)  # zero-centred norms: the scale is 1 + weight
            elif "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
    return model.float().eval()
