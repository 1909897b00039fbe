"""Partition rules: every model parameter path -> a `PartitionSpec` over mesh axes
"fsdp" and "tensor" (the learner's mesh also has "data", over which params replicate).

  embed_tokens.embedding [vocab, hidden]   -> (tensor, fsdp)   vocab on tensor
  lm_head.kernel         [hidden, vocab]   -> (fsdp, tensor)
  q/k/v/gate/up kernel   [in, out]         -> (fsdp, tensor)   output dim on tensor
  q/k/v bias             [out]             -> (tensor,)
  o/down kernel          [in, out]         -> (tensor, fsdp)   input dim on tensor
  o bias, norm scales                      -> replicated
Gated DeltaNet (Qwen3.5 linear_attn):
  in_proj_qkv/z/b/a kernel [in, out]       -> (fsdp, tensor)   output dim on tensor
  out_proj kernel        [in, out]         -> (tensor, fsdp)   input dim on tensor
  conv1d.weight          [channels, 1, K]  -> (tensor,)        channels as in_proj_qkv out
  dt_bias, A_log [heads], norm weights     -> replicated
A parameter that matches no rule raises ValueError (new parameters need a rule).
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from spopp_jax import pytree_paths

FSDP, TENSOR = "fsdp", "tensor"

PARTITION_RULES: tuple[tuple[str, P], ...] = (
    (r"embed_tokens\.embedding$", P(TENSOR, FSDP)),
    (r"lm_head\.kernel$", P(FSDP, TENSOR)),
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)\.kernel$", P(FSDP, TENSOR)),
    (r"(q_proj|k_proj|v_proj)\.bias$", P(TENSOR)),
    (r"(o_proj|down_proj)\.kernel$", P(TENSOR, FSDP)),
    (r"o_proj\.bias$", P()),
    (r"(norm|layernorm)\.(scale|weight)$", P()),
    (r"in_proj_(qkv|z|b|a)\.kernel$", P(FSDP, TENSOR)),
    (r"out_proj\.kernel$", P(TENSOR, FSDP)),
    (r"conv1d\.weight$", P(TENSOR)),
    (r"\.(dt_bias|A_log)$", P()),
)


def path_name(path: Sequence[Any]) -> str:
    """'model.layers.0.self_attn.q_proj.kernel' from a pytree / nnx state path."""
    return pytree_paths.path_name(path, strip_value=True)  # nnx.Variable's array leaf dropped


def partition_spec(name: str) -> P:
    """The rule's spec for a dotted parameter name; ValueError if no rule matches."""
    for pattern, spec in PARTITION_RULES:
        if re.search(pattern, name):
            return spec
    raise ValueError(f"no partition rule for parameter {name!r}; add one to PARTITION_RULES")


def fit_spec(spec: P, shape: Sequence[int], mesh: Mesh) -> P:
    """Drops mesh axes the mesh lacks or whose size does not divide the dimension
    (that dimension is replicated instead), so any mesh shape yields a valid sharding."""
    if len(spec) > len(shape):
        raise ValueError(f"spec {spec} has more entries than shape {tuple(shape)}")
    fitted = []
    for dim, axis in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        if axis is not None and axis in mesh.shape and dim % mesh.shape[axis] == 0:
            fitted.append(axis)
        else:
            fitted.append(None)
    while fitted and fitted[-1] is None:  # P('fsdp', None) -> P('fsdp'), P(None) -> P()
        fitted.pop()
    return P(*fitted)


def parameter_specs(state) -> Any:
    """Pytree of `PartitionSpec` with the structure of `state` (an nnx.State of Params or
    any pytree of arrays / ShapeDtypeStructs keyed by parameter path)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: partition_spec(path_name(path)),
                                            state)


def parameter_shardings(state, mesh: Mesh) -> Any:
    """Pytree of `NamedSharding` for `state` on `mesh` (specs fitted to the shapes)."""
    def sharding(path, leaf):
        spec = fit_spec(partition_spec(path_name(path)), leaf.shape, mesh)
        return NamedSharding(mesh, spec)
    return jax.tree_util.tree_map_with_path(sharding, state)
