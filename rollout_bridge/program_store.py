"""Programs kept on disk traced and lowered, so a new process skips that work.

JAX's persistent compilation cache (`compilation_cache_dir`) keys an executable by the
program XLA compiles, so every new process still traces and lowers each program to look it
up: ~0.2 s per prefill shape of the embedded engine on 2 CPU cores (a job meets 150-300),
~2 s per batch width of the main job's learner step. `ProgramStore` keeps each program
exported (``jax.export``: StableHLO with its argument layout, a format JAX versions and
documents) under a key of what the program is made from, and a later process compiles the
stored module, which the persistent cache then finds, without tracing or lowering the
model:

* the source of every Python module of `spopp_jax` and `rollout_bridge`, and of the file
  of each class in the model's structure (a model of the user's own); any edit: new keys.
  Code outside those files that the model's classes call is not keyed: turn the store off
  (``program_store: false``) while editing it;
* the jax, jaxlib, flax and optax versions, the backend (platform, its version, the
  devices), `XLA_FLAGS` and the jax settings that change a trace (x64, matmul precision,
  PRNG);
* the model's structure: the text of its nnx GraphDef and parameter treedef (and the bytes
  of any constant state), refused (no store for that model) when the text shows an object
  only by its address, whose contents the text would not show;
* what the caller adds: the program's name and settings, the argument layout (tree,
  shapes, dtypes, shardings).

The store is a folder of ``<sha256 of the key>.stablehlo`` files, each written whole or not
at all; one that cannot be read is exported again and rewritten. It stores no executables:
XLA's serialized CPU executables, loaded outside JAX's own cache, ran wrong kernels here.
The embedded engine keeps its prefill programs in ``prefill_programs``, the RL learner its
step and log-prob programs in ``learner_programs`` (`StoredPrograms`).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import os
import re
import threading
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

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
    import optax

    client = jax.devices()[0].client
    devices = [(d.platform, d.device_kind, d.id) for d in jax.devices()]
    settings = [(name, str(getattr(jax.config, name, None))) for name in _TRACE_SETTINGS]
    return repr((jax.__version__, jaxlib.__version__, flax.__version__, optax.__version__, client.platform,
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


def store_for(structure: Any, folder: str = "prefill_programs") -> ProgramStore | None:
    """The store for programs of a model of ``structure``, in the ``folder`` folder of JAX's
    persistent compilation cache; None when that cache is off or not a local folder, or the
    structure has no trustworthy text (`structure_key`)."""
    cache = jax.config.jax_compilation_cache_dir
    if not cache or "://" in str(cache) or not jax.config.jax_enable_compilation_cache:
        return None
    text = structure_key(structure)
    if text is None:
        log.info("program store: off for this model (its structure shows an object by address only)")
        return None
    return ProgramStore(Path(cache) / folder, text)


def argument_spec(x: Any) -> jax.ShapeDtypeStruct:
    """The layout of one argument leaf (an array or a `jax.ShapeDtypeStruct`): shape,
    dtype, weak type and sharding (None for a host array)."""
    shape, dtype, weak_type, sharding = _layout(x)
    return jax.ShapeDtypeStruct(shape, dtype, weak_type=weak_type, sharding=sharding)


def _layout(x: Any) -> tuple:
    dtype = x.dtype if hasattr(x, "dtype") else np.result_type(x)
    return tuple(np.shape(x)), np.dtype(dtype), bool(getattr(x, "weak_type", False)), getattr(x, "sharding", None)


def compile_stored(store: ProgramStore, parts: Any, fn: Callable, args: tuple, donate_argnums: tuple = (),
                   like: Any = None):
    """``fn(*args)`` compiled from the store's program under ``parts`` (exported now and
    stored when missing), for arguments of the layout of ``args``; the executable takes the
    same arguments. The program is exported over the flat argument leaves, so no pytree type
    needs registering with ``jax.export``, and returns built-in trees (tuples, lists, dicts
    of arrays) only. ``like`` says which outputs have an argument's tree (returned by the
    program as the tuple of their leaves): None, none; an index j, the output is argument
    j's tree; a tuple, the output is a tuple whose item i has argument ``like[i]``'s tree
    (None: a built-in tree)."""
    specs = jax.tree.map(argument_spec, args)
    leaves, in_tree = jax.tree.flatten(specs)
    trees = lambda index: None if index is None else jax.tree.structure(specs[index])
    out_trees = tuple(map(trees, like)) if isinstance(like, tuple) else trees(like)

    def flat_fn(*flat):
        out = fn(*in_tree.unflatten(flat))
        if isinstance(like, tuple):
            return tuple(o if t is None else tuple(t.flatten_up_to(o)) for o, t in zip(out, out_trees))
        return out if out_trees is None else tuple(out_trees.flatten_up_to(out))

    exported = store.exported(parts, lambda: jax.export.export(jax.jit(flat_fn))(*leaves))

    def stored(*call_args):
        out = exported.call(*jax.tree.leaves(call_args))
        if isinstance(like, tuple):
            return tuple(o if t is None else t.unflatten(o) for o, t in zip(out, out_trees))
        return out if out_trees is None else out_trees.unflatten(out)

    return jax.jit(stored, donate_argnums=donate_argnums).lower(*specs).compile()


class StoredPrograms:
    """``fn(*args)`` (a jitted function) run by executables compiled from ``store``'s
    programs, one per argument layout (tree, shapes, dtypes, shardings), each exported under
    ``(name, settings, layout)`` the first time any process meets it (`compile_stored`;
    ``donate_argnums`` and ``like`` as there). ``store`` None, or a layout whose text shows
    an object by address only: ``fn`` itself."""

    def __init__(self, fn: Callable, store: ProgramStore | None, name: str, settings: Any,
                 donate_argnums: tuple = (), like: Any = None):
        self.fn = fn
        self._store = store
        self._parts = (name, repr(settings))
        self._donate = tuple(donate_argnums)
        self._like = like
        self._programs: dict[Any, Callable] = {}
        self._lock = threading.Lock()
        if _ADDRESS.search(self._parts[1]):
            self._store = None

    def lower(self, *args, **kwargs):
        """``fn``'s own lowering at these arguments (as ``jax.jit(...).lower``): the program the
        store exports, e.g. to read its shardings."""
        return self.fn.lower(*args, **kwargs)

    def __call__(self, *args):
        if self._store is None:
            return self.fn(*args)
        leaves, tree = jax.tree.flatten(args)
        layout = (tree, tuple(map(_layout, leaves)))
        program = self._programs.get(layout)
        if program is None:
            program = self._compile(layout, args)
        return program(*args)

    def _compile(self, layout, args):
        text = repr(layout)
        with self._lock:
            program = self._programs.get(layout)
            if program is None:
                program = next((known for seen, known in self._programs.items() if _equivalent(seen, layout)), None)
            if program is None:
                if _ADDRESS.search(text):
                    program = self.fn
                else:
                    program = compile_stored(self._store, (*self._parts, text), self.fn, args,
                                             self._donate, self._like)
            self._programs[layout] = program
        return program


def _equivalent(a: tuple, b: tuple) -> bool:
    """Two argument layouts that differ at most in how equivalent shardings are spelled
    (a mesh axis of size 1 named or not: a jitted step's outputs come back so), which one
    executable takes alike."""
    if a[0] != b[0] or len(a[1]) != len(b[1]):
        return False
    for (shape, dtype, weak, sharding), (other_shape, other_dtype, other_weak, other) in zip(a[1], b[1]):
        if (shape, dtype, weak) != (other_shape, other_dtype, other_weak) or (sharding is None) != (other is None):
            return False
        if sharding is not None and not sharding.is_equivalent_to(other, len(shape)):
            return False
    return True
