"""The run config's ``rollout.engine`` section: one registered subclass per rollout engine.

``rollout.engine`` is a choice, like ``method``: ``--rollout.engine vllm_server`` selects the
``vllm_server`` engine and ``--rollout.engine.server_urls http://a:8000`` sets one of ITS
fields (in YAML ``engine: jax`` or ``engine: {type: vllm_server, server_urls: ...}``). Each
subclass carries the fields of its engine only (a field of another engine is refused), checks
them in ``__post_init__`` (ValueError naming ``rollout.engine.<field>``), checks what this host
needs to run it (``check_runnable``), and builds the engine (``build``) and, when the engine
rolls out on servers, the job's servers (``servers``).

Adding an engine is one new module in ``rollout_bridge/engine/`` with its engine and its
registered ``EngineConfig``: the registry imports every module of the package, so
``--rollout.engine <name>`` selects it with no other edit. An engine module that also runs
inside the vLLM venv (no draccus there) keeps its config in a module beside it
(``vllm_choice.py``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, ClassVar

import draccus

from rollout_bridge.run_errors import check_setting as check

VLLM_TEMPERATURE = 1.0  # the vLLM engines report raw log-probs: exact sampling log-probs only at T = 1

# How records (priors, evaluation caches, checkpoints) written before ``rollout.engine`` was a
# choice keyed the engine: its name and these flat fields, whatever the engine. An engine's
# ``record_key`` overrides the ones it owns, so those records stay valid.
FIRST_RECORD_KEY = {"engine_steps_per_call": 8, "server_urls": None}


@dataclasses.dataclass(frozen=True)
class EngineConfig(draccus.PluginRegistry, discover_packages_path="rollout_bridge.engine"):
    """``rollout.engine``: see the module docstring. ``uses_servers``: the engine rolls out
    on the job's servers (``servers`` builds them; train.py starts them once for every
    stage). ``traces_programs``: the engine traces JAX programs, and its ``build`` takes the
    job's ``program_store`` (`rollout_bridge.program_store`) as a keyword."""

    uses_servers: ClassVar[bool] = False
    traces_programs: ClassVar[bool] = False

    @classmethod
    def default_choice_name(cls) -> str:
        return "jax"

    @property
    def name(self) -> str:
        """The name this engine is registered (and selected on the command line) under."""
        return EngineConfig.get_choice_name(type(self))

    def check_runnable(self, rollout) -> None:
        """Before any work: what this host needs to run the engine with the ``rollout``
        section's settings; ValueError naming the field."""

    def servers(self, run_dir: Path, agent, launcher_factory=None):
        """The job's servers (``start(policy_folder)``, ``engine(...)``, ``metrics()``,
        ``close()``) for an engine that ``uses_servers``; None for the others."""
        return None

    def build(self, model, agent, orchestrator, policy_event: int, seed: int, servers=None,
              policy_folder: Path | None = None, run_dir: Path | None = None):
        """The engine serving ``model`` as ``policy_event`` for the agent's and the
        orchestrator's configs; ``servers``: the job's (started) servers, ``policy_folder``:
        the tokenizer files of vLLM weight folders, ``run_dir``: the run folder."""
        raise NotImplementedError(f"rollout.engine={self.name} builds no engine")

    def record_key(self) -> dict[str, Any]:
        """The engine in a stage key, as records were first written (``FIRST_RECORD_KEY``)."""
        return {"engine": self.name, **FIRST_RECORD_KEY}

    def to_dict(self) -> dict[str, Any]:
        """The section as a YAML/JSON mapping, ``type`` first (what ``engine:`` parses back)."""
        return {"type": self.name, **dataclasses.asdict(self)}


def check_vllm_temperature(name: str, rollout) -> None:
    """The vLLM engines report vLLM's raw log-probs: the sampling log-probs only at T = 1."""
    if rollout.temperature != VLLM_TEMPERATURE:
        raise ValueError(f"rollout.temperature={rollout.temperature}: rollout.engine={name} reports vLLM's raw "
                         f"log-probs (log_softmax of the logits), the sampling log-probs only at temperature "
                         f"{VLLM_TEMPERATURE}")


def engine_names() -> tuple[str, ...]:
    """Every registered engine, sorted (each module of ``rollout_bridge.engine`` imported; import
    order would otherwise decide the order)."""
    return tuple(sorted(EngineConfig.get_known_choices()))


def engine_config(name: str) -> EngineConfig:
    """The section of engine ``name`` with every default."""
    if name not in engine_names():
        raise ValueError(f"rollout.engine must be one of {list(engine_names())}, got {name!r}")
    return EngineConfig.get_choice_class(name)()


__all__ = ["EngineConfig", "VLLM_TEMPERATURE", "check", "check_vllm_temperature", "engine_config", "engine_names"]
