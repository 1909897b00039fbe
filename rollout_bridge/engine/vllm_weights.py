"""Publishing learner weights to vLLM, stamped with their policy event (SPEC 2).

Two routes:

* **Filesystem** (tested here): `write_policy_folder` writes HF safetensors with
  `spopp_jax.models.save_pretrained` into ``<root>/policy-<k>`` (8 digits) through a
  temporary folder and one atomic ``os.rename``, with a ``spopp_policy.json`` marker
  holding the policy event. A server reloads it in place through the worker extension
  (`vllm_worker_ext.SpoppWorkerExtension.spopp_load_policy`), which refuses a folder whose
  marker disagrees with the event it was asked to load.
* **Direct GPU transfer** (UNTESTED: needs CUDA and a GPU build of vLLM): vLLM's trainer
  side weight-transfer engines (NCCL broadcast, CUDA IPC) fed by `JaxWeightSource`, which
  hands JAX arrays to torch through DLPack (zero-copy on the same GPU). See
  `direct_transfer_engine` and docs/VLLM.md.

JAX, torch and vLLM are imported lazily: the fleet client imports this module in
environments that have neither torch nor vLLM.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

from rollout_bridge.engine.vllm_worker_ext import POLICY_MARKER, read_policy_marker

FOLDER_PREFIX = "policy-"
_FOLDER_RE = re.compile(r"^policy-(\d{8,})$")
# Files a server needs besides the weights when it (re)starts from a published folder.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
)


def policy_folder_name(policy_event: int) -> str:
    """``policy-00000042`` for event 42 (sorts by event as text)."""
    if not isinstance(policy_event, int) or policy_event < 0:
        raise ValueError(f"policy_event must be an int >= 0, got {policy_event!r}")
    return f"{FOLDER_PREFIX}{policy_event:08d}"


def write_marker(folder: str, policy_event: int) -> None:
    """Write ``spopp_policy.json`` = {"policy_event": k} into ``folder``."""
    with open(os.path.join(folder, POLICY_MARKER), "w") as f:
        json.dump({"policy_event": int(policy_event)}, f)


def publish_folder(
    root: str | os.PathLike,
    policy_event: int,
    write_weights: Callable[[str], None],
    tokenizer_dir: str | os.PathLike | None = None,
) -> str:
    """Atomically create ``<root>/policy-<k>`` and return its path.

    ``write_weights(tmp_dir)`` fills a temporary folder inside ``root`` (same filesystem,
    so the final ``os.rename`` is atomic); tokenizer files are copied from
    ``tokenizer_dir`` when given; the marker is written last. A reader therefore sees
    either no folder or a complete one. Publishing the same event twice is an error.
    """
    root = os.fspath(root)
    final = os.path.join(root, policy_folder_name(policy_event))
    if os.path.exists(final):
        raise FileExistsError(f"policy event {policy_event} already published at {final}")
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".tmp-{policy_folder_name(policy_event)}-", dir=root)
    try:
        write_weights(tmp)
        if tokenizer_dir is not None:
            for name in TOKENIZER_FILES:
                src = os.path.join(os.fspath(tokenizer_dir), name)
                if os.path.exists(src):
                    shutil.copy2(src, os.path.join(tmp, name))
        write_marker(tmp, policy_event)
        os.chmod(tmp, 0o755)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def write_policy_folder(
    model: Any,
    root: str | os.PathLike,
    policy_event: int,
    tokenizer_dir: str | os.PathLike | None = None,
) -> str:
    """Publish an nnx ``Qwen3ForCausalLM`` (or ``(graphdef, state)``) as ``policy-<k>``."""
    from spopp_jax.models.hf_io import save_pretrained

    model = as_model(model)
    return publish_folder(root, policy_event, lambda tmp: save_pretrained(model, tmp), tokenizer_dir)


def as_model(weights: Any) -> Any:
    """An nnx model from a model or a ``(graphdef, state)`` pair (``nnx.split`` output)."""
    if isinstance(weights, tuple) and len(weights) == 2:
        from flax import nnx

        return nnx.merge(*weights)
    if hasattr(weights, "config") and hasattr(weights, "dtype"):
        return weights
    raise TypeError(
        "weights must be a published folder path, an nnx Qwen3ForCausalLM, or a "
        f"(graphdef, state) pair; got {type(weights).__name__}"
    )


def published_events(root: str | os.PathLike) -> list[int]:
    """Policy events of the complete folders under ``root``, ascending."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        return []
    events = []
    for name in os.listdir(root):
        match = _FOLDER_RE.match(name)
        if match and os.path.exists(os.path.join(root, name, POLICY_MARKER)):
            events.append(int(match.group(1)))
    return sorted(events)


def prune_policy_folders(root: str | os.PathLike, keep: int, protect: Iterable[int] = ()) -> list[int]:
    """Delete all but the newest ``keep`` policy folders (never those in ``protect``)."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    events = published_events(root)
    protected = set(protect)
    removed = [k for k in events[:-keep] if k not in protected]
    for k in removed:
        shutil.rmtree(os.path.join(os.fspath(root), policy_folder_name(k)), ignore_errors=True)
    return removed


def folder_policy_event(folder: str | os.PathLike) -> int:
    """The policy event recorded in a published folder; ValueError when unmarked."""
    event = read_policy_marker(os.fspath(folder))
    if event < 0:
        raise ValueError(f"{folder} has no {POLICY_MARKER} marker: not a published policy folder")
    return event


# --------------------------------------------------------------------------------------
# Direct GPU transfer (NCCL / CUDA IPC). UNTESTED here: written against vLLM 0.32's
# `vllm.distributed.weight_transfer` trainer API; needs CUDA, a GPU vLLM build and a
# server / engine started with a weight-transfer config of the same backend.
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DirectTransferConfig:
    """How to reach the inference side's weight-transfer engine.

    backend: "nccl" (broadcast over an NCCL group: trainer rank 0 + every inference
      worker, same node or NCCL-connected nodes) or "ipc" (CUDA IPC handles: learner and
      inference on the SAME GPU(s), single node).
    master_address / master_port: TCP rendezvous of the NCCL group (nccl only).
    inference_world_sizes: workers of each inference engine/server (TP x PP), in order;
      the NCCL group has 1 + sum of them ranks and server i's workers start at rank
      1 + sum of the previous sizes.
    packed: ship weights through packed buffers (vLLM's default for NCCL).
    """

    backend: str = "nccl"
    master_address: str = "127.0.0.1"
    master_port: int = 29555
    inference_world_sizes: tuple[int, ...] = (1,)
    packed: bool = True

    def __post_init__(self):
        if self.backend not in ("nccl", "ipc"):
            raise ValueError(f"backend must be 'nccl' or 'ipc', got {self.backend!r}")
        if not self.inference_world_sizes or min(self.inference_world_sizes) < 1:
            raise ValueError(f"inference_world_sizes must be >= 1 each, got {self.inference_world_sizes}")


def jax_to_torch(array: Any, transpose: bool = False) -> Any:
    """A torch tensor sharing the JAX array's device memory (DLPack), HF layout.

    ``transpose`` turns our ``[in, out]`` kernels into HF ``[out, in]`` weights (a
    contiguous copy on the device; the JAX array is left untouched).
    """
    import torch

    tensor = torch.from_dlpack(array)
    return tensor.t().contiguous() if transpose else tensor


class JaxWeightSource:
    """vLLM ``WeightSource`` over a JAX model: (HF name, torch tensor) per parameter.

    ``get_model()`` returns the CURRENT nnx model each round (the learner updates it in
    place between rounds). Tensors leave JAX through DLPack; kernels are transposed to
    the HF layout. Built lazily so importing this module never needs vLLM.
    """

    def __new__(cls, get_model: Callable[[], Any]):
        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

        from spopp_jax.models.hf_io import hf_tensors

        class _Source(WeightSource):
            def metadata(self) -> list:
                import torch

                metas = []
                for name, array, transposed in hf_tensors(get_model()):
                    shape = tuple(array.shape[::-1]) if transposed else tuple(array.shape)
                    metas.append(ParamMeta(name, getattr(torch, str(array.dtype)), shape))
                return metas

            def __iter__(self) -> Iterator[tuple[str, Any]]:
                for name, array, transposed in hf_tensors(get_model()):
                    yield name, jax_to_torch(array, transpose=transposed)

        return _Source()


class FanOutSyncClient:
    """One ``VLLMWeightSyncClient`` over several inference engines/servers.

    vLLM's trainer engine talks to ONE client and gives the workers rank offset 1; with a
    fleet, server i's workers must start at ``1 + sum(world_sizes[:i])``. This client
    rewrites ``rank_offset`` per server and calls every server concurrently (each blocks
    inside the NCCL rendezvous until all ranks have joined).
    """

    def __init__(self, clients: Sequence[Any], world_sizes: Sequence[int]):
        if len(clients) != len(world_sizes):
            raise ValueError(f"clients and world_sizes differ in length: {len(clients)} vs {len(world_sizes)}")
        self.clients = list(clients)
        self.offsets = [1 + sum(world_sizes[:i]) for i in range(len(world_sizes))]

    def _all(self, fn: Callable[[int, Any], None]) -> None:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=len(self.clients)) as pool:
            for future in [pool.submit(fn, i, c) for i, c in enumerate(self.clients)]:
                future.result()

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        def init(i, client):
            info = dict(init_info)
            if "rank_offset" in info:
                info["rank_offset"] = self.offsets[i]
            client.init_weight_transfer_engine(info)

        self._all(init)

    def start_weight_update(self) -> None:
        self._all(lambda i, c: c.start_weight_update())

    def update_weights(self, update_info: Any) -> None:
        self._all(lambda i, c: c.update_weights(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all(lambda i, c: c.finish_weight_update(weight_version))


def direct_transfer_engine(config: DirectTransferConfig, client: Any, get_model: Callable[[], Any]) -> Any:
    """Rendezvous and return vLLM's trainer-side engine; call ``.send_weights()`` per round.

    ``client``: a ``VLLMWeightSyncClient`` (vLLM's ``HTTPVLLMWeightSyncClient`` for a
    server, `InProcessSyncClient` for the in-process engine, `FanOutSyncClient` for a
    fleet). Blocks until every inference worker joined (NCCL) — run it in a thread.
    """
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    source = JaxWeightSource(get_model)
    if config.backend == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        info = NCCLTrainerInitInfo(
            master_address=config.master_address,
            master_port=config.master_port,
            world_size=1 + sum(config.inference_world_sizes),
            packed=config.packed,
            rank=0,
        )
    else:
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        info = IPCTrainerInitInfo(packed=config.packed, rank=0)
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)


__all__ = [
    "DirectTransferConfig",
    "FanOutSyncClient",
    "JaxWeightSource",
    "POLICY_MARKER",
    "TOKENIZER_FILES",
    "as_model",
    "direct_transfer_engine",
    "folder_policy_event",
    "jax_to_torch",
    "policy_folder_name",
    "prune_policy_folders",
    "publish_folder",
    "published_events",
    "write_marker",
    "write_policy_folder",
]
