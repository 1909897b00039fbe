"""Engine programs kept on disk traced and lowered, so a new process skips that work.

JAX's persistent compilation cache (`compilation_cache_dir`) keys an executable by the
program XLA compiles, so every new process still traces and lowers each program to look it
up. For the embedded engine's prefill programs that is ~0.2 s per shape on 2 CPU cores, and
a job meets 150-300 shapes. `ProgramStore` keeps each program exported (``jax.export``:
StableHLO with its argument layout, a format JAX versions and documents) under a key of
what the program is made from, and a later process compiles the stored module, which the
persistent cache then finds, without tracing or lowering the model:

* the source of every Python module of `spopp_jax` and `rollout_bridge`, and of the file
  of each class in the model's structure (a model of the user's own); any edit: new keys.
  Code outside those files that the model's classes call is not keyed: turn the store off
  (`rollout.engine.program_store false`) while editing it;
* the jax, jaxlib and flax versions, the backend (platform, its version, the devices),
  `XLA_FLAGS` and the jax settings that change a trace (x64, matmul precision, PRNG);
* the model's structure: the text of its nnx GraphDef and parameter treedef, refused (no
  store for that model) when it shows an object only by its address, whose contents the
  text would not show;
* what the caller adds: the argument layout (shapes, dtypes, shardings) and static arguments.

The store is a folder of ``<sha256 of the key>.stablehlo`` files, each written whole or not
at all; one that cannot be read is exported again and rewritten. It stores no executables:
XLA's serialized CPU executables, loaded outside JAX's own cache, ran wrong kernels here.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import os
import re
from pathlib import Path
from typing import Any, Callable

import jax

from rollout_bridge.atomic_files import write_bytes_atomic

log = logging.getLogger(__name__)

SUFFIX = ".stablehlo"
_REPO_PACKAGES = ("spopp_jax", "rollout_bridge")
_TRACE_SETTINGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl",
                   "jax_numpy_dtype_promotion", "jax_threefry_partitionable")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


@functools.lru_cache(maxsize=1)
def source_fingerprint() -> str:
    """sha256 over the path and bytes of every ``.py`` file of the project's two packages."""
    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for package in _REPO_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def environment_key() -> str:
    """The versions, backend and settings a compiled program depends on besides its source."""
    import flax
    import jaxlib

    client = jax.devices()[0].client
    devices = [(d.platform, d.device_kind, d.id) for d in jax.devices()]
    settings = [(name, str(getattr(jax.config, name, None))) for name in _TRACE_SETTINGS]
    return repr((jax.__version__, jaxlib.__version__, flax.__version__, client.platform,
                 client.platform_version, devices, jax.process_count(),
                 os.environ.get("XLA_FLAGS", ""), settings))


def structure_key(structure: Any) -> str | None:
    """The text of a model's structure (e.g. its nnx GraphDef and parameter treedef) with
    the sha256 of each of its classes' source files, or None when the text shows an object
    by address only."""
    text = repr(structure)
    if _ADDRESS.search(text):
        return None
    files = {file for node_type in _node_types(structure) if (file := _source_file(node_type))}
    return "\n".join([text, *sorted(hashlib.sha256(Path(file).read_bytes()).hexdigest() for file in files)])


def _node_types(structure: Any) -> list[type]:
    """The classes of the nnx GraphDefs in ``structure`` (a GraphDef or a tuple holding some)."""
    parts = structure if isinstance(structure, tuple) else (structure,)
    return [node.type for part in parts for node in getattr(part, "nodes", ())
            if isinstance(getattr(node, "type", None), type)]


def _source_file(node_type: type) -> str | None:
    try:
        return inspect.getsourcefile(node_type)
    except TypeError:  # a built-in class
        return None


class ProgramStore:
    """Exported programs in ``folder`` under keys of ``context`` (the model structure and
    environment) plus each call's own parts (see the module docstring)."""

    def __init__(self, folder: str | os.PathLike, context: str):
        self.folder = Path(folder)
        self._context = f"{source_fingerprint()}\n{environment_key()}\n{context}"
        self.loaded = 0
        self.saved = 0

    def path(self, parts: Any) -> Path:
        key = hashlib.sha256(f"{self._context}\n{parts!r}".encode()).hexdigest()
        return self.folder / f"{key}{SUFFIX}"

    def exported(self, parts: Any, export_program: Callable[[], jax.export.Exported]) -> jax.export.Exported:
        """The program stored under ``parts``, else ``export_program()``, stored."""
        path = self.path(parts)
        if path.exists():
            try:
                program = jax.export.deserialize(bytearray(path.read_bytes()))
                self.loaded += 1
                return program
            except Exception as error:  # noqa: BLE001 - a torn or foreign file: export again
                log.warning("program store: %s unreadable (%s: %s); tracing again",
                            path.name, type(error).__name__, error)
        program = export_program()
        try:
            write_bytes_atomic(path, program.serialize())
            self.saved += 1
        except OSError as error:
            log.warning("program store: could not keep %s (%s: %s)", path.name, type(error).__name__, error)
        return program


def store_for(structure: Any) -> ProgramStore | None:
    """The store for programs of a model of ``structure``, in the ``prefill_programs`` folder
    of JAX's persistent compilation cache; None when that cache is off or not a local
    folder, or the structure has no trustworthy text (`structure_key`)."""
    folder = jax.config.jax_compilation_cache_dir
    if not folder or "://" in str(folder) or not jax.config.jax_enable_compilation_cache:
        return None
    text = structure_key(structure)
    if text is None:
        log.info("program store: off for this model (its structure shows an object by address only)")
        return None
    return ProgramStore(Path(folder) / "prefill_programs", text)
