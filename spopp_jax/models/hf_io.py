"""Hugging Face checkpoints in and out: config.json + (sharded) safetensors.

Name mapping (our nnx path -> HF tensor name):
  <prefix>.kernel    -> <prefix>.weight, transposed ([in, out] here, [out, in] in HF)
  <prefix>.embedding -> <prefix>.weight
  <prefix>.scale     -> <prefix>.weight
  <prefix>.bias      -> <prefix>.bias
  <prefix>.weight, <prefix>.dt_bias, <prefix>.A_log -> the same name, stored in HF layout
      (zero-centred norms, the Gated DeltaNet conv kernel [C, 1, K] and decay parameters)
With tied embeddings there is no `lm_head` parameter; a stored `lm_head.weight` is ignored.

A Qwen3.5 ConditionalGeneration checkpoint (the released multimodal folders) stores the text
model under `model.language_model.`; it is read from there, and its vision tower
(`model.visual.*`) and multi-token-prediction head (`mtp.*`) are skipped with one logged
line. `save_pretrained` always writes the CausalLM layout (`Qwen3_5ForCausalLM`).

Loading never materialises the model on one device: each parameter is built with
`jax.make_array_from_callback` for its target sharding, and the callback reads only the
requested slice of the tensor from disk (`safetensors.safe_open(...).get_slice`).
Saving gathers one tensor at a time to the host and writes shard by shard.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy for safetensors' numpy API)
import numpy as np
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from spopp_jax.models.attention import DEFAULT_ATTENTION_CHUNK
from spopp_jax.models.config import ARCHITECTURES, ModelConfig
from spopp_jax.models.partitioning import parameter_shardings, path_name
from spopp_jax.models.qwen3 import Qwen3ForCausalLM

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
# Tensors some checkpoints carry that the model does not use.
_IGNORABLE = re.compile(r"(rotary_emb\.inv_freq$)")
# Multimodal (ConditionalGeneration) checkpoints: the text model's prefix, and the tensors
# of other parts that the text model does not use.
LANGUAGE_MODEL_PREFIX = "model.language_model."
_NOT_TEXT_MODEL = re.compile(r"^(model\.visual\.|mtp\.|model\.mtp\.)")
_log = logging.getLogger(__name__)
# Parameters kept with their HF name and layout.
_HF_LAYOUT_LEAVES = ("weight", "dt_bias", "A_log")


def hf_tensor_name(param_name: str) -> tuple[str, bool]:
    """(HF tensor name, transposed?) for a dotted parameter name of our model."""
    prefix, _, leaf = param_name.rpartition(".")
    if leaf == "kernel":
        return f"{prefix}.weight", True
    if leaf in ("embedding", "scale"):
        return f"{prefix}.weight", False
    if leaf in ("bias",) + _HF_LAYOUT_LEAVES:
        return param_name, False
    raise ValueError(f"no HF name for parameter {param_name!r}")


def abstract_model(config: ModelConfig, dtype="float32",
                   **model_options: Any) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, state of ShapeDtypeStructs) without allocating any parameter.
    `model_options`: `remat`, `attention_chunk_size` (see `init_model`)."""
    abstract = nnx.eval_shape(
        lambda: Qwen3ForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(0), **model_options))
    return nnx.split(abstract)


def _checkpoint_files(path: str) -> dict[str, str]:
    """HF tensor name -> safetensors file path, for a single or sharded checkpoint."""
    index_path = os.path.join(path, INDEX_FILE)
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    single = os.path.join(path, SINGLE_FILE)
    if not os.path.exists(single):
        raise FileNotFoundError(f"neither {INDEX_FILE} nor {SINGLE_FILE} in {path}")
    with _open_safetensors(single) as f:
        return {name: single for name in f.keys()}


def _open_safetensors(file: str):
    """`safe_open(file)`; a truncated / corrupt file raises ValueError naming it."""
    try:
        return safe_open(file, framework="numpy")
    except SafetensorError as error:
        raise ValueError(f"{file} is not a readable safetensors file ({error}); "
                         "re-copy or re-download it") from None


def _check_float_tensor(file: str, name: str, tensor_slice) -> None:
    """Parameters are floating point; an integer / bool tensor is a corrupt checkpoint
    (it would otherwise be silently cast)."""
    stored = tensor_slice.get_dtype()
    if not (stored.startswith("F") or stored.startswith("BF")):
        raise ValueError(f"{name} in {file} has dtype {stored}, not a floating dtype")


def _read_model_config(path: str) -> ModelConfig:
    """`ModelConfig.from_hf(path)`; an unreadable / inconsistent config.json raises
    ValueError naming the file."""
    try:
        return ModelConfig.from_hf(path)
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{os.path.join(path, 'config.json')}: {type(error).__name__}: "
                         f"{error}") from error


def _slice_reader(tensor_slice, transposed: bool, dtype: np.dtype):
    """Callback for make_array_from_callback: index (of our layout) -> host numpy block."""
    def read(index: tuple[slice, ...]) -> np.ndarray:
        if transposed:
            block = tensor_slice[index[1], index[0]].T
        else:
            block = tensor_slice[index]
        return np.ascontiguousarray(block.astype(dtype))
    return read


def load_parameters(path: str, config: ModelConfig, dtype="float32", mesh: Mesh | None = None,
                    **model_options: Any) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, parameter state) read from an HF checkpoint folder.

    Each array gets the partition rules' sharding on `mesh` (default: first device).
    Raises KeyError for a parameter missing from the checkpoint, ValueError for a shape
    mismatch or an unexpected checkpoint tensor.
    """
    graphdef, abstract_state = abstract_model(config, dtype, **model_options)
    files = _checkpoint_files(path)
    stored_name = _stored_name_function(files)
    shardings = (parameter_shardings(abstract_state, mesh) if mesh is not None else
                 jax.tree_util.tree_map(lambda _: SingleDeviceSharding(jax.devices()[0]),
                                        abstract_state))
    used: set[str] = set()
    with contextlib.ExitStack() as stack:
        handles: dict[str, Any] = {}

        def load(key_path, leaf, sharding):
            name, transposed = hf_tensor_name(path_name(key_path))
            name = stored_name(name)
            if name not in files:
                raise KeyError(f"checkpoint {path} has no tensor {name!r}")
            file = files[name]
            if file not in handles:
                handles[file] = stack.enter_context(_open_safetensors(file))
            tensor_slice = handles[file].get_slice(name)
            _check_float_tensor(file, name, tensor_slice)
            stored_shape = tuple(tensor_slice.get_shape())
            expected = tuple(reversed(leaf.shape)) if transposed else tuple(leaf.shape)
            if stored_shape != expected:
                raise ValueError(f"{name}: checkpoint shape {stored_shape}, model expects "
                                 f"{expected}")
            used.add(name)
            return jax.make_array_from_callback(
                leaf.shape, sharding, _slice_reader(tensor_slice, transposed, leaf.dtype))

        state = jax.tree_util.tree_map_with_path(load, abstract_state, shardings)
    _log_skipped(path, [n for n in files if _NOT_TEXT_MODEL.match(n)])
    unexpected = [n for n in files if n not in used and not _ignorable(n, config)
                  and not _NOT_TEXT_MODEL.match(n)]
    if unexpected:
        raise ValueError(f"checkpoint tensors with no model parameter: {sorted(unexpected)[:8]}")
    return graphdef, state


def _stored_name_function(files: dict[str, str]):
    """HF CausalLM name -> name in this checkpoint: `model.X` is stored as
    `model.language_model.X` in a ConditionalGeneration checkpoint (lm_head unchanged)."""
    if not any(name.startswith(LANGUAGE_MODEL_PREFIX) for name in files):
        return lambda name: name
    return lambda name: (LANGUAGE_MODEL_PREFIX + name[len("model."):]
                         if name.startswith("model.") else name)


def _log_skipped(path: str, skipped: list[str]) -> None:
    if not skipped:
        return
    groups = sorted({".".join(name.split(".")[:2 if name.startswith("model.") else 1])
                     for name in skipped})
    _log.info("%s: skipped %d tensors outside the text model (%s)", path, len(skipped),
              ", ".join(f"{group}.*" for group in groups))


def _ignorable(name: str, config: ModelConfig) -> bool:
    return bool(_IGNORABLE.search(name)) or (config.tie_word_embeddings
                                             and name == "lm_head.weight")


def from_pretrained(path: str, dtype="float32", mesh: Mesh | None = None,
                    remat: str | bool = "none",
                    attention_chunk_size: int = DEFAULT_ATTENTION_CHUNK,
                    param_dtype=None) -> Qwen3ForCausalLM:
    """The model of a local HF checkpoint folder (config.json + safetensors), computing in
    `dtype` ("float32" / "bfloat16"; None: the config's `dtype` / `torch_dtype`) with
    parameters stored in `param_dtype` (None: `dtype`; "float32" under bfloat16 compute =
    fp32 master weights, a bfloat16 checkpoint is widened exactly) and, given `mesh` (Auto
    axis types, axes "fsdp" / "tensor"), sharded by the partition rules. `remat`: one of
    `REMAT_POLICIES`; `attention_chunk_size` queries per attention block."""
    config = _read_model_config(path)
    if dtype is None:
        dtype = checkpoint_dtype(config)
    graphdef, state = load_parameters(path, config, dtype, mesh, remat=remat,
                                      attention_chunk_size=attention_chunk_size,
                                      param_dtype=param_dtype)
    return nnx.merge(graphdef, state)


def checkpoint_dtype(config: ModelConfig) -> str:
    """The parameter dtype a HF config declares ("dtype", else "torch_dtype"; "float32"
    when neither is set)."""
    hf = config.hf_config
    declared = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    if declared not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"config dtype {declared!r} is not a floating parameter dtype")
    return declared


def _dtype_name(dtype: np.dtype) -> str:
    return {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}[str(dtype)]


def _to_host(array: jax.Array) -> np.ndarray:
    if not array.is_fully_addressable:
        from jax.experimental import multihost_utils
        array = multihost_utils.process_allgather(array, tiled=True)
    return np.asarray(jax.device_get(array))


def hf_tensors(model: Qwen3ForCausalLM) -> Iterator[tuple[str, Any, bool]]:
    """(HF name, array in our layout, transposed?) for every parameter, in state order."""
    state = nnx.state(model, nnx.Param)
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        name, transposed = hf_tensor_name(path_name(key_path))
        yield name, leaf, transposed


def _plan_shards(tensors: list[tuple[str, Any, bool]], max_shard_bytes: int,
                 dtype) -> list[list[int]]:
    shards: list[list[int]] = [[]]
    size = 0
    for i, (_, array, _) in enumerate(tensors):
        nbytes = int(np.prod(array.shape)) * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes
    return shards


def save_pretrained(model: Qwen3ForCausalLM, path: str,
                    max_shard_size: int | str = DEFAULT_MAX_SHARD_BYTES, dtype=None) -> None:
    """Writes config.json and safetensors in HF layout (sharded with an index file when
    larger than `max_shard_size`, bytes or e.g. "2GB"), loadable by transformers / vLLM.
    Tensors are written in `dtype`, by default the model's compute dtype (fp32 master
    weights of a bfloat16 model are written as bfloat16, what it serves with).
    On multi-host runs every process must call it; only process 0 writes."""
    max_bytes = _parse_size(max_shard_size)
    out_dtype = jnp.dtype(model.dtype if dtype is None else dtype)
    tensors = list(hf_tensors(model))
    dtype = _dtype_name(out_dtype)
    writer = jax.process_index() == 0
    if writer:
        os.makedirs(path, exist_ok=True)
        config = {k: v for k, v in model.config.hf_config.items() if not k.startswith("_")}
        config["dtype"] = dtype
        if "torch_dtype" in config:
            config["torch_dtype"] = dtype
        config["tie_word_embeddings"] = model.config.tie_word_embeddings
        if not config.get("architectures"):  # vLLM resolves the model class from this
            config["architectures"] = [ARCHITECTURES[model.config.model_type]]
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
    shards = _plan_shards(tensors, max_bytes, out_dtype)
    weight_map, total_size = {}, 0
    for shard_number, members in enumerate(shards, start=1):
        file = (SINGLE_FILE if len(shards) == 1 else
                f"model-{shard_number:05d}-of-{len(shards):05d}.safetensors")
        block = {}
        for i in members:
            name, array, transposed = tensors[i]
            host = _to_host(array).astype(out_dtype)
            block[name] = np.ascontiguousarray(host.T if transposed else host)
            weight_map[name] = file
            total_size += block[name].nbytes
        if writer:
            save_file(block, os.path.join(path, file), metadata={"format": "pt"})
        del block
    if not writer:
        return
    _match_config_mode(path, [SINGLE_FILE] if len(shards) == 1 else set(weight_map.values()))
    if len(shards) > 1:
        with open(os.path.join(path, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total_size}, "weight_map": weight_map}, f,
                      indent=2, sort_keys=True)
    # A stale file of the other layout would shadow (or contradict) the one just written.
    stale = INDEX_FILE if len(shards) == 1 else SINGLE_FILE
    if os.path.exists(os.path.join(path, stale)):
        os.remove(os.path.join(path, stale))


def _match_config_mode(path: str, files) -> None:
    """safetensors writes its files owner-only (0600); give them the mode config.json got
    from the umask, so a vLLM server running as another user can read the folder."""
    mode = os.stat(os.path.join(path, "config.json")).st_mode & 0o777
    for file in files:
        os.chmod(os.path.join(path, file), mode)


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B)\s*", size.upper())
    if not match:
        raise ValueError(f"max_shard_size: cannot parse {size!r} (e.g. 5GB, 200MB, 1024)")
    scale = {"B": 1, "KB": 1024, "MB": 1024**2, "GB": 1024**3}[match.group(2)]
    return int(float(match.group(1)) * scale)


def param_count(model: Qwen3ForCausalLM) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(
        nnx.state(model, nnx.Param)))


__all__ = ["from_pretrained", "save_pretrained", "load_parameters", "hf_tensor_name",
           "checkpoint_dtype",
           "abstract_model", "hf_tensors", "param_count"]
