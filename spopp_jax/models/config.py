"""`ModelConfig`: the static description of a Qwen3 / Qwen2 / Qwen3.5 decoder, read from a
HF config.

Qwen3.5 (model_type "qwen3_5_text"; a "qwen3_5" ConditionalGeneration config is read through
its `text_config`) is a hybrid: `layer_types` mixes "linear_attention" (Gated DeltaNet, the
`linear_*` fields) and "full_attention" (output-gated attention with rotary on the first
`partial_rotary_factor * head_dim` dims); its RMSNorms are zero-centred (y = n(x)(1 + w)).

The config is a frozen (hashable) dataclass so that it can live as static metadata on the
NNX module and inside `jax.jit` closures. `hf_config` keeps the original HF `config.json`
dict so that `save_pretrained` writes back exactly what was read.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

QWEN3_5 = "qwen3_5_text"
# The multimodal (ConditionalGeneration) config type: its language model is `text_config`.
QWEN3_5_MULTIMODAL = "qwen3_5"
SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", QWEN3_5)
SUPPORTED_ROPE_TYPES = ("default", "linear")
SUPPORTED_LAYER_TYPES = ("full_attention", "linear_attention")
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 QWEN3_5: "Qwen3_5ForCausalLM"}
# Gated DeltaNet tokens per chunk of the parallel (training / prefill) form, as transformers.
DEFAULT_LINEAR_CHUNK = 64
_LINEAR_FIELDS = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                  "linear_num_key_heads", "linear_num_value_heads")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static hyper-parameters of the decoder (names follow transformers' Qwen3Config)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_factor: float = 1.0
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = True
    hidden_act: str = "silu"
    layer_types: tuple[str, ...] = ()
    model_type: str = "qwen3"
    # Qwen3.5 full attention: q_proj also yields a per-channel output gate, o = a * sigmoid(g).
    attention_output_gate: bool = False
    partial_rotary_factor: float = 1.0  # rotary on the first factor * head_dim dims
    # Gated DeltaNet ("linear_attention" layers); 0 when the model has none.
    linear_conv_kernel_dim: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    # Computation setting, not an HF field: chunk length of the chunked delta rule.
    linear_chunk_size: int = DEFAULT_LINEAR_CHUNK
    # Original HF config as a sorted tuple of (key, json string) pairs: hashable and exact.
    hf_config_items: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_hidden_layers)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries, num_hidden_layers is "
                f"{self.num_hidden_layers}")
        for layer_type in self.layer_types:
            if layer_type not in SUPPORTED_LAYER_TYPES:
                raise NotImplementedError(f"layer type {layer_type!r} is not implemented "
                                          f"(supported: {SUPPORTED_LAYER_TYPES})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a "
                             f"multiple of num_key_value_heads={self.num_key_value_heads}")
        if self.rotary_dim % 2 or self.rotary_dim < 2:
            raise ValueError(f"rotary dims = head_dim * partial_rotary_factor = "
                             f"{self.head_dim} * {self.partial_rotary_factor} must be even >= 2")
        if "linear_attention" in self.layer_types:
            self._check_linear_attention()
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise NotImplementedError(f"rope_type {self.rope_type!r} is not implemented "
                                      f"(supported: {SUPPORTED_ROPE_TYPES})")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise NotImplementedError(
                f"model_type {self.model_type!r} (supported: {SUPPORTED_MODEL_TYPES})")
        if self.model_type == "qwen2" and (self.qk_norm or not self.qkv_bias or self.o_bias):
            raise ValueError("model_type 'qwen2' means qkv_bias=True, o_bias=False, "
                             "qk_norm=False (as transformers' Qwen2)")
        if self.hidden_act != "silu":
            raise NotImplementedError(f"hidden_act {self.hidden_act!r} (only 'silu')")

    @property
    def rotary_dim(self) -> int:
        """Leading head dims that get rotary embeddings (transformers: int(D * factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def zero_centered_norms(self) -> bool:
        """Qwen3.5 RMSNorm weights are offsets: y = normalise(x) * (1 + weight)."""
        return self.model_type == QWEN3_5

    def _check_linear_attention(self) -> None:
        if self.linear_conv_kernel_dim < 2:
            raise ValueError(f"linear_conv_kernel_dim must be >= 2 (a causal conv window), "
                             f"got {self.linear_conv_kernel_dim}")
        for field in _LINEAR_FIELDS:
            if getattr(self, field) < 1:
                raise ValueError(f"layer_types has linear_attention layers, so {field} must be "
                                 f">= 1 (got {getattr(self, field)})")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads={self.linear_num_value_heads} is not a "
                             f"multiple of linear_num_key_heads={self.linear_num_key_heads}")
        if self.linear_chunk_size < 1:
            raise ValueError(f"linear_chunk_size must be >= 1, got {self.linear_chunk_size}")

    @property
    def hf_config(self) -> dict[str, Any]:
        """The HF config.json contents (a fresh dict)."""
        if self.hf_config_items:
            return {k: json.loads(v) for k, v in self.hf_config_items}
        return self._synthesized_hf_config()

    @classmethod
    def from_hf(cls, path_or_hf_config: Any) -> "ModelConfig":
        """Builds the config from a checkpoint folder, a `config.json` path, a dict, or a
        transformers `PretrainedConfig` (Qwen3Config / Qwen2Config)."""
        hf = _text_config(_as_config_dict(path_or_hf_config))
        model_type = hf.get("model_type", "qwen3")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise NotImplementedError(
                f"model_type {model_type!r} (supported: {SUPPORTED_MODEL_TYPES})")
        is_qwen3 = model_type in ("qwen3", QWEN3_5)
        is_qwen3_5 = model_type == QWEN3_5
        num_heads = int(hf["num_attention_heads"])
        num_kv_heads = int(hf.get("num_key_value_heads") or num_heads)
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        rope_theta, rope_type, rope_factor = _rope_settings(hf)
        if hf.get("use_sliding_window", False):
            raise NotImplementedError("use_sliding_window=True is not implemented")
        attention_bias = bool(hf.get("attention_bias", False))
        layer_types = tuple(hf.get("layer_types") or _interval_layer_types(hf, model_type))
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_type=rope_type,
            rope_factor=rope_factor,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias if is_qwen3 else True,
            o_bias=attention_bias if is_qwen3 else False,
            qk_norm=is_qwen3,
            hidden_act=hf.get("hidden_act", "silu"),
            layer_types=layer_types,
            model_type=model_type,
            attention_output_gate=is_qwen3_5,
            partial_rotary_factor=_partial_rotary_factor(hf, is_qwen3_5),
            **{field: int(hf.get(field, 0)) for field in _LINEAR_FIELDS if is_qwen3_5},
            hf_config_items=tuple(sorted((k, json.dumps(v)) for k, v in hf.items())),
        )

    def _synthesized_hf_config(self) -> dict[str, Any]:
        return {
            "architectures": [ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": _rope_parameters(self),
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.qkv_bias if self.model_type == "qwen3" else False,
            "hidden_act": self.hidden_act,
            "layer_types": list(self.layer_types),
            **self._synthesized_qwen3_5_fields(),
        }

    def _synthesized_qwen3_5_fields(self) -> dict[str, Any]:
        if self.model_type != QWEN3_5:
            return {}
        fields = {field: getattr(self, field) for field in _LINEAR_FIELDS}
        fields["rope_parameters"] = {**_rope_parameters(self),
                                     "partial_rotary_factor": self.partial_rotary_factor}
        return fields


def _rope_parameters(config: ModelConfig) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_type": config.rope_type, "rope_theta": config.rope_theta}
    if config.rope_type == "linear":
        params["factor"] = config.rope_factor
    return params


def _rope_settings(hf: Mapping[str, Any]) -> tuple[float, str, float]:
    """(rope_theta, rope_type, factor). transformers 5 keeps them in `rope_parameters`;
    older config.json files have `rope_theta` and `rope_scaling` at the top level."""
    params = dict(hf.get("rope_parameters") or {})
    legacy_scaling = dict(hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = (params.get("rope_type") or params.get("type")
                 or legacy_scaling.get("rope_type") or legacy_scaling.get("type") or "default")
    factor = params.get("factor", legacy_scaling.get("factor", 1.0))
    return float(theta), str(rope_type), float(factor)


def _text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: a Qwen3.5 ConditionalGeneration config's `text_config`
    (its top-level `tie_word_embeddings` wins, as transformers ties at the top level and
    the loader writes the CausalLM layout); any other config as is."""
    if hf.get("model_type") != QWEN3_5_MULTIMODAL:
        return hf
    if not isinstance(hf.get("text_config"), Mapping):
        raise ValueError("a 'qwen3_5' config needs a 'text_config' mapping")
    text = dict(hf["text_config"])
    text.setdefault("model_type", QWEN3_5)
    if "tie_word_embeddings" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    for key in ("dtype", "torch_dtype"):  # the checkpoint's dtype, for from_pretrained(None)
        if hf.get(key) and not text.get(key):
            text[key] = hf[key]
    text["architectures"] = [ARCHITECTURES[QWEN3_5]]
    return text


def _interval_layer_types(hf: Mapping[str, Any], model_type: str) -> tuple[str, ...]:
    """Qwen3.5 without `layer_types`: every `full_attention_interval`-th layer (default 4)
    is full attention, the others linear (as transformers' Qwen3_5TextConfig)."""
    if model_type != QWEN3_5:
        return ()
    interval = int(hf.get("full_attention_interval", 4))
    return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(int(hf["num_hidden_layers"])))


def _partial_rotary_factor(hf: Mapping[str, Any], is_qwen3_5: bool) -> float:
    """transformers reads it from rope_parameters (Qwen3.5 default 0.25), else 1.0."""
    params = dict(hf.get("rope_parameters") or {})
    default = 0.25 if is_qwen3_5 else 1.0
    return float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", default)))


def _as_config_dict(source: Any) -> dict[str, Any]:
    if isinstance(source, Mapping):
        return dict(source)
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            return json.load(f)
    if hasattr(source, "to_dict"):  # transformers PretrainedConfig
        return source.to_dict()
    raise TypeError(f"path_or_hf_config: cannot read a config from {type(source).__name__}")
