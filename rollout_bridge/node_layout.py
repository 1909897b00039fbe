"""Which GPUs of a node the learner and each launched vLLM server use, and JAX's memory
settings, fixed BEFORE JAX initialises.

``python train.py`` calls `apply_before_jax(argv)` first thing, before anything imports
JAX: it reads the few settings below from ``--config_path`` (YAML) and the command line
(``--a.b value`` / ``--a.b=value``; the full config is parsed later, as always), checks the
layout, and sets the learner's environment:

* server GPUs: ``rollout.engine.launch.gpus`` ("1,2;3,4": server 0 gets 1 and 2, server 1
  gets 3 and 4; tensor parallel over its group), else ``first_gpu + i*gpus_per_server ...``
  (none when ``gpus_per_server`` is 0);
* learner GPUs: ``node.learner_gpus`` ("0" or "0,1"), else, when launched servers use GPUs
  placed by ``first_gpu`` >= 1, the GPUs below ``first_gpu``; else every GPU;
* disjoint: a GPU in two servers, or in a server and the learner (every GPU counts for a
  learner whose GPUs are not given), is refused in one line (exit 2), naming the GPUs;
* ``CUDA_VISIBLE_DEVICES`` = the learner's GPUs; ``XLA_PYTHON_CLIENT_PREALLOCATE`` =
  ``node.jax_preallocate``, by default ``false`` when vLLM shares the node
  (``rollout.engine`` vllm, or servers launched here: JAX would otherwise take 75% of
  every GPU it sees before they start), else left as it is;
  ``XLA_PYTHON_CLIENT_MEM_FRACTION`` = ``node.jax_mem_fraction`` when set.

GPU ids are positions among the node's GPUs as train.py received them: when
``CUDA_VISIBLE_DEVICES`` was already set (a scheduler's "4,5,6,7"), id 0 is its first
entry. The node's list is kept in ``SPOPP_NODE_GPUS`` ("all" when it was unset), so the
launcher (`vllm_launcher`) gives each server exactly its own GPUs after the learner's
``CUDA_VISIBLE_DEVICES`` has been narrowed (`visible_devices`).

Standard library and PyYAML only: importing this module must not import JAX.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Mapping, MutableMapping, Sequence

NODE_GPUS_ENV = "SPOPP_NODE_GPUS"
ALL_GPUS = "all"
LAUNCH = "rollout.engine.launch."   # the launched servers' settings (rollout.engine=vllm_server only)
LAYOUT_KEYS = (
    "rollout.engine", "rollout.engine.server_urls", LAUNCH + "count", LAUNCH + "gpus_per_server",
    LAUNCH + "first_gpu", LAUNCH + "gpus", "node.learner_gpus", "node.jax_preallocate", "node.jax_mem_fraction",
)
DEFAULTS = {"rollout.engine": "jax", "rollout.engine.server_urls": None, LAUNCH + "count": 0,
            LAUNCH + "gpus_per_server": 1, LAUNCH + "first_gpu": 0, LAUNCH + "gpus": None,
            "node.learner_gpus": None, "node.jax_preallocate": None, "node.jax_mem_fraction": None}
ENGINE_TYPE = "rollout.engine.type"
# The engines that put vLLM on this node: in train.py's process, or as servers it launches.
# This module reads the raw settings before JAX loads, so it cannot ask the engine configs
# (rollout_bridge/engine/, whose registry imports JAX), which are where these names live.
IN_PROCESS_VLLM_ENGINE = "vllm"
LAUNCHING_ENGINE = "vllm_server"


class NodeLayoutError(ValueError):
    """A layout that cannot run (overlapping GPUs, a malformed list); one line."""


@dataclasses.dataclass(frozen=True)
class NodeLayout:
    """learner_gpus: None = every GPU of the node. server_gpus: one tuple per launched
    server (empty: a CPU server). preallocate / mem_fraction: None = leave JAX's own."""

    learner_gpus: tuple[int, ...] | None
    server_gpus: tuple[tuple[int, ...], ...]
    preallocate: bool | None
    mem_fraction: float | None


# ------------------------------------------------------------------ parsing


def parse_gpu_list(text: Any, field: str) -> tuple[int, ...]:
    """ "0,1" -> (0, 1): distinct non-negative integers."""
    words = [w.strip() for w in str(text).split(",") if w.strip()]
    try:
        ids = tuple(int(w) for w in words)
    except ValueError:
        raise NodeLayoutError(f"{field}={text!r}: GPU ids are integers separated by ','") from None
    if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
        raise NodeLayoutError(f"{field}={text!r}: needs distinct GPU ids >= 0")
    return ids


def parse_gpu_groups(text: Any, field: str = LAUNCH + "gpus") -> tuple[tuple[int, ...], ...]:
    """ "1,2;3,4" -> ((1, 2), (3, 4)): one group per server."""
    return tuple(parse_gpu_list(group, field) for group in str(text).split(";"))


def server_gpu_groups(count: int, gpus_per_server: int, first_gpu: int,
                      gpus: str | Sequence[Sequence[int]] | None = None) -> tuple[tuple[int, ...], ...]:
    """Each launched server's GPUs: ``gpus`` when given (one group per server), else
    contiguous blocks of ``gpus_per_server`` from ``first_gpu``."""
    if gpus is not None:
        groups = parse_gpu_groups(gpus) if isinstance(gpus, str) else tuple(tuple(int(g) for g in x) for x in gpus)
        if len(groups) != count:
            raise NodeLayoutError(f"{LAUNCH}gpus={_text(groups)!r} lists {len(groups)} GPU groups "
                                  f"for {LAUNCH}count={count} servers (';' between servers)")
        return groups
    return tuple(tuple(range(first_gpu + i * gpus_per_server, first_gpu + (i + 1) * gpus_per_server))
                 for i in range(count))


def _text(groups) -> str:
    return ";".join(",".join(str(g) for g in group) for group in groups)


def _bool(value: Any, field: str) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("null", "none", "~", ""):
        return None
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise NodeLayoutError(f"{field}={value!r}: true, false or null")


def _none(value: Any) -> Any:
    return None if value is None or str(value).strip().lower() in ("null", "none", "~") else value


def node_layout(values: Mapping[str, Any]) -> NodeLayout:
    """The layout of ``values`` (dotted keys of `LAYOUT_KEYS`; missing ones take the
    config's defaults), checked: raises `NodeLayoutError` (one line) when GPUs overlap."""
    v = {**DEFAULTS, **{k: values[k] for k in LAYOUT_KEYS if k in values}}
    try:
        count = int(v[LAUNCH + "count"])
        per_server = int(v[LAUNCH + "gpus_per_server"])
        first = int(v[LAUNCH + "first_gpu"])
    except (TypeError, ValueError) as error:
        raise NodeLayoutError(f"{LAUNCH[:-1]}: {error}") from None
    launching = _launching(v)
    explicit = _none(v[LAUNCH + "gpus"])
    servers = server_gpu_groups(count, per_server, first, explicit) if launching else ()
    learner_text = _none(v["node.learner_gpus"])
    if learner_text is not None:
        learner = parse_gpu_list(learner_text, "node.learner_gpus")
    elif explicit is None and first > 0 and any(servers):
        learner = tuple(range(first))
    else:
        learner = None
    check_disjoint(learner, servers)
    fraction = _none(v["node.jax_mem_fraction"])
    if fraction is not None:
        try:
            fraction = float(fraction)
        except ValueError:
            raise NodeLayoutError(f"node.jax_mem_fraction={fraction!r}: a number in (0, 1]") from None
        if not 0.0 < fraction <= 1.0:
            raise NodeLayoutError(f"node.jax_mem_fraction={fraction}: must be in (0, 1]")
    preallocate = _bool(v["node.jax_preallocate"], "node.jax_preallocate")
    return NodeLayout(learner, servers, preallocate, fraction)


def check_disjoint(learner: tuple[int, ...] | None, servers: Sequence[Sequence[int]]) -> None:
    """No GPU in two servers, nor in a server and the learner (None: every GPU)."""
    owner: dict[int, int] = {}
    for index, group in enumerate(servers):
        for gpu in group:
            if gpu in owner:
                raise NodeLayoutError(f"node layout: GPU {gpu} is given to server {owner[gpu]} and server {index} "
                                      f"({LAUNCH}gpus / first_gpu / gpus_per_server)")
            owner[gpu] = index
    if not owner:
        return
    if learner is None:
        raise NodeLayoutError(f"node layout: the learner would see every GPU, the servers' {sorted(owner)} "
                              f"included: set node.learner_gpus (e.g. 0) or {LAUNCH}first_gpu >= 1 "
                              "(the learner then uses the GPUs below it); on a CPU host "
                              f"{LAUNCH}gpus_per_server 0")
    shared = sorted(set(learner) & set(owner))
    if shared:
        raise NodeLayoutError(f"node layout: GPU {', '.join(map(str, shared))} is given to the learner "
                              f"(node.learner_gpus={','.join(map(str, learner))}) and to server {owner[shared[0]]}")


# ------------------------------------------------------------------ environment


def visible_devices(gpus: Sequence[int], environ: Mapping[str, str]) -> str:
    """``CUDA_VISIBLE_DEVICES`` for ``gpus`` (positions among the node's GPUs, see the
    module docstring); "" for none."""
    node = environ.get(NODE_GPUS_ENV, environ.get("CUDA_VISIBLE_DEVICES", ALL_GPUS))
    if node.strip() == ALL_GPUS:
        return ",".join(str(g) for g in gpus)
    entries = [e.strip() for e in node.split(",") if e.strip()]
    missing = [g for g in gpus if g >= len(entries)]
    if missing:
        raise NodeLayoutError(f"node layout: GPU {missing[0]} does not exist: this node has {len(entries)} "
                              f"(CUDA_VISIBLE_DEVICES={node!r} when train.py started)")
    return ",".join(entries[g] for g in gpus)


def _launching(v: Mapping[str, Any]) -> bool:
    """Servers are launched here: the engine that launches them, a launch count and no URLs."""
    return (v["rollout.engine"] == LAUNCHING_ENGINE and int(v[LAUNCH + "count"]) > 0
            and _none(v["rollout.engine.server_urls"]) is None)


def shares_node_with_vllm(values: Mapping[str, Any]) -> bool:
    v = {**DEFAULTS, **values}
    return v["rollout.engine"] == IN_PROCESS_VLLM_ENGINE or _launching(v)


def learner_environment(layout: NodeLayout, environ: Mapping[str, str], vllm_here: bool) -> dict[str, str]:
    """The variables to set in the learner's process (see the module docstring)."""
    out: dict[str, str] = {}
    if layout.learner_gpus is not None:
        if NODE_GPUS_ENV not in environ:
            out[NODE_GPUS_ENV] = environ.get("CUDA_VISIBLE_DEVICES", ALL_GPUS)
        out["CUDA_VISIBLE_DEVICES"] = visible_devices(layout.learner_gpus, {**environ, **out})
    if layout.preallocate is not None:
        out["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true" if layout.preallocate else "false"
    elif vllm_here and "XLA_PYTHON_CLIENT_PREALLOCATE" not in environ:
        out["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    if layout.mem_fraction is not None:
        out["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{layout.mem_fraction:g}"
    return out


# ------------------------------------------------------------------ the pre-parse


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    out = {}
    if isinstance(tree, dict):
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
    elif prefix:
        out[prefix[:-1]] = tree
    return out


def read_layout_values(argv: Sequence[str], default_config: str | None = None) -> dict[str, Any]:
    """The `LAYOUT_KEYS` set by ``--config_path``'s YAML (else ``default_config``) and the
    command line (later flags win; an engine the command line names other than the file's
    leaves none of the file's engine settings, as in the full parse). An unreadable file
    gives nothing here: the full parse reports it."""
    import yaml

    args = list(argv)
    flags: dict[str, str] = {}
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        name, eq, value = arg[2:].partition("=")
        if not eq:
            value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else ""
        flags[name] = value
    path = flags.get("config_path", default_config)
    values: dict[str, Any] = {}
    if path:
        try:
            with open(path) as f:
                values = _flatten(yaml.safe_load(f) or {})
        except (OSError, yaml.YAMLError):
            values = {}
    values, flags = _engine_named(values), _engine_named(flags)
    if "rollout.engine" in flags and flags["rollout.engine"] != values.get("rollout.engine", DEFAULTS["rollout.engine"]):
        values = {k: v for k, v in values.items() if not k.startswith("rollout.engine")}
    values.update(flags)
    return {k: v for k, v in values.items() if k in LAYOUT_KEYS}


def _engine_named(values: dict[str, Any]) -> dict[str, Any]:
    """``rollout.engine.type`` (YAML ``engine: {type: X}``, ``--rollout.engine.type X``) as
    ``rollout.engine``."""
    out = dict(values)
    if ENGINE_TYPE in out:
        out["rollout.engine"] = out.pop(ENGINE_TYPE)
    return out


def apply_before_jax(argv: Sequence[str], default_config: str | None = None,
                     environ: MutableMapping[str, str] | None = None) -> NodeLayout:
    """Read, check and apply the node layout (see the module docstring) to ``environ``
    (default: this process's). A bad layout prints one ``config error:`` line and exits 2.
    JAX already imported (by whatever ran train.py) gets a warning: the variables still
    apply if no JAX backend has started yet, which this module cannot see without JAX."""
    if "jax" in sys.modules:
        print("warning: JAX was imported before the node layout was applied; its GPU and memory settings "
              "apply only if no JAX backend has started yet", file=sys.stderr)
    environ = os.environ if environ is None else environ
    values = read_layout_values(argv, default_config)
    try:
        layout = node_layout(values)
        changes = learner_environment(layout, environ, shares_node_with_vllm(values))
    except NodeLayoutError as error:
        print(f"config error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    environ.update(changes)
    if changes:
        shown = ", ".join(f"{k}={v}" for k, v in changes.items() if k != NODE_GPUS_ENV)
        servers = "; ".join(f"server {i}: GPUs {','.join(map(str, g)) or 'none'}"
                            for i, g in enumerate(layout.server_gpus))
        print(f"node layout: {shown}" + (f"; {servers}" if servers else ""), flush=True)
    return layout


__all__ = [
    "NODE_GPUS_ENV",
    "NodeLayout",
    "NodeLayoutError",
    "apply_before_jax",
    "check_disjoint",
    "learner_environment",
    "node_layout",
    "parse_gpu_groups",
    "parse_gpu_list",
    "read_layout_values",
    "server_gpu_groups",
    "visible_devices",
]
