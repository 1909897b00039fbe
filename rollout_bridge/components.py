"""The components of a training job, each built from its own config sections.

``train.py`` only composes. A component's config fields are declared once: in the
component's own config classes, which the run config's sections are or extend
(``optim``/``loss`` = the learner's `OptimConfig`/`LossConfig`; ``tracker``, ``sampler``,
``advantage`` = the orchestrator's; ``rollout`` extends the orchestrator's
`RolloutSchedule`, the agent's `EpisodeLimits` and the engine's `Decoding`, and its
``engine`` is the chosen engine's config, which builds the engine and its servers). A field the
build sets from elsewhere says from what in its ``metadata["from"]``
(``tests/test_config_layer.py`` checks both).

Extension points (lists a later module appends to):
  * ``ARGV_PREPROCESSORS``: ``argv -> argv`` before parsing (e.g. verl-style aliases);
  * ``METRIC_SINK_FACTORIES``: ``(cfg, run_dir) -> sink``; a sink is called with every
    ``UpdateRecord`` and may have ``close()`` (e.g. wandb);
  * ``END_OF_RUN_HOOKS``: ``(cfg, run_dir, learner) -> None`` after the RL stage (e.g.
    an HF export of the final policy);
  * env kinds: a file in ``rollout_bridge/envs/kinds/`` registering its ``EnvConfig`` (its fields and build);
  * rollout engines: a file in ``rollout_bridge/engine/`` registering its ``EngineConfig``;
  * methods: a file in ``rollout_bridge/methods/`` registering its ``MethodConfig`` (its recipe).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

from rollout_bridge.agent import AgentConfig, EpisodeLimits
from rollout_bridge.engine.base import Decoding, SamplingParams
from rollout_bridge.orchestrator import OrchestratorConfig, RolloutSchedule
from spopp_jax.learner import LearnerConfig
from rollout_bridge.run_errors import UserError

# ------------------------------------------------------------------ extension points
def _verl_aliases(argv: list[str]) -> list[str]:
    """verl knob names accepted as aliases (docs/CONVENTIONS.md); a refused one is a
    config error naming the key."""
    from rollout_bridge.verl_aliases import AliasError, rewrite_verl_aliases

    try:
        return rewrite_verl_aliases(argv)
    except AliasError as error:
        raise UserError(str(error), "config error") from None


ARGV_PREPROCESSORS: list[Callable[[list[str]], list[str]]] = [_verl_aliases]
METRIC_SINK_FACTORIES: list[Callable[[Any, Path], Callable]] = []
END_OF_RUN_HOOKS: list[Callable[[Any, Path, Any], None]] = []


def fields_of(section: Any, config_class: type) -> dict[str, Any]:
    """The values of ``config_class``'s fields in ``section`` (a section that extends it)."""
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(config_class)}


# ------------------------------------------------------------------ builders
def build_learner_config(cfg) -> LearnerConfig:
    """The learner's config: the ``optim`` and ``loss`` sections (whose fields ARE the
    learner's) and the method's recipe (its dual clip)."""
    return LearnerConfig.from_sections(cfg.optim, cfg.loss, **cfg.method.learner_fields())


def build_agent_config(cfg, max_turns: int) -> AgentConfig:
    """The agent's config: the rollout section's episode limits and decoding, and the env
    kind's ``max_turns``."""
    return AgentConfig(max_turns=max_turns, sampling=SamplingParams(**fields_of(cfg.rollout, Decoding)),
                       **fields_of(cfg.rollout, EpisodeLimits))


def build_orchestrator_config(cfg, agent: AgentConfig, seed: int) -> OrchestratorConfig:
    """The orchestrator's config: the rollout section's schedule, the tracker, sampler and
    advantage sections, the method's recipe, and what the job sets (``metadata["from"]`` of
    the `OrchestratorConfig` fields)."""
    values = fields_of(cfg.rollout, RolloutSchedule)
    values["pad_to_multiple"] = values["pad_to_multiple"] or agent.max_total_tokens  # null: one width, one compile
    if values["pack_rows"]:
        values["pack_row_multiple"] = pack_row_multiple(cfg)
    return OrchestratorConfig(tracker=cfg.tracker, sampler=cfg.sampler, advantage=cfg.advantage,
                              keep_history=False, seed=seed, **values, **cfg.method.orchestrator_fields())


def pack_row_multiple(cfg) -> int:
    """Rows of a packed learner batch are a multiple of this: the PPO mini-batches x
    micro-batches, and with several learner devices (rows sharded over data x fsdp) also
    of data x fsdp."""
    import math

    import jax

    rows = cfg.optim.num_mini_batches * cfg.optim.num_micro_batches
    if jax.device_count() > 1:
        fsdp = cfg.mesh.fsdp if cfg.mesh.fsdp > 0 else jax.device_count() // (cfg.mesh.data * cfg.mesh.tensor)
        rows = math.lcm(rows, cfg.mesh.data * fsdp)
    return rows


def check_engine_choice(cfg) -> None:
    """What this host needs to run ``rollout.engine`` (vLLM importable where it must run,
    an existing ``rollout.engine.launch.python``, well-formed ``rollout.engine.server_urls``,
    the temperature vLLM's raw log-probs are exact at), checked by the engine's config:
    UserError naming the field."""
    try:
        cfg.rollout.engine.check_runnable(cfg.rollout)
    except ValueError as error:
        raise UserError(str(error)) from None


def check_inputs(cfg) -> None:
    """Local inputs a recipe names must exist (nothing is downloaded) and the mesh must fit
    the devices: fail before any work, in one line naming the field."""
    import os

    from rollout_bridge.tiny_model import check_model_folder

    if cfg.model.path is not None:
        try:
            check_model_folder(cfg.model.path)
        except FileNotFoundError as error:
            raise UserError(f"{error}") from None
    if cfg.prior.enabled and cfg.prior.path is not None and not os.path.isfile(cfg.prior.path):
        raise UserError(f"prior.path={cfg.prior.path}: no such file (a prior.json written by an earlier run's "
                        "prior stage; null computes the prior)")
    check_mesh(cfg.mesh)
    check_engine_choice(cfg)


def check_mesh(mesh_section) -> None:
    """The (data, fsdp, tensor) mesh needs exactly the devices there are (one axis -1
    takes the rest): UserError naming the mesh and the device count."""
    import jax

    try:
        build_mesh(mesh_section)
    except ValueError as error:
        raise UserError(f"mesh.data={mesh_section.data}, mesh.fsdp={mesh_section.fsdp}, "
                        f"mesh.tensor={mesh_section.tensor} do not fit the {jax.device_count()} "
                        f"{jax.default_backend()} device(s) here: {error}") from None


def build_rollout_servers(cfg, run_dir: Path, agent: AgentConfig, launcher_factory=None):
    """The job's servers of ``rollout.engine`` (None for an engine without servers);
    ``start(policy_folder)`` launches them (a no-op for servers given by URL)."""
    return cfg.rollout.engine.servers(run_dir, agent, launcher_factory=launcher_factory)


def build_engine(cfg, model, agent: AgentConfig, orchestrator: OrchestratorConfig, policy_event: int, seed: int,
                 servers=None, policy_folder: Path | None = None, run_dir: Path | None = None):
    """The rollout engine of ``rollout.engine`` serving ``model`` as ``policy_event``, built
    by the engine's config (``servers``: the job's, from `build_rollout_servers`, started;
    ``policy_folder``: tokenizer files for vLLM weight folders; ``run_dir``: the run folder).
    Every stage (prior, evaluations, RL) builds its engine here."""
    return cfg.rollout.engine.build(model, agent, orchestrator, policy_event, seed, servers=servers,
                                    policy_folder=policy_folder, run_dir=run_dir,
                                    **({"program_store": cfg.program_store} if cfg.rollout.engine.traces_programs else {}))


def build_mesh(mesh_section):
    """The learner's (data, fsdp, tensor) mesh; ValueError naming the device count."""
    from spopp_jax.sharding import make_mesh

    return make_mesh(data=mesh_section.data, fsdp=mesh_section.fsdp, tensor=mesh_section.tensor)


def tiny_model_shape(model_section):
    from rollout_bridge.tiny_model import TinyModelShape

    m = model_section
    return TinyModelShape(m.tiny_vocab_size, m.tiny_hidden_size, m.tiny_intermediate_size, m.tiny_num_layers,
                          m.tiny_num_heads, m.tiny_num_kv_heads, m.tiny_head_dim, m.seed)


def model_folder(model_section, corpus: Callable[[], Any], log: Callable[[str], None] = print) -> Path:
    """``model.path`` (checked, never downloaded) or the tiny local model for this corpus."""
    from rollout_bridge.tiny_model import check_model_folder, ensure_tiny_model

    if model_section.path is not None:
        try:
            return check_model_folder(model_section.path)
        except FileNotFoundError as error:
            raise UserError(f"{error}") from None
    folder = ensure_tiny_model(model_section.tiny_dir, corpus(), tiny_model_shape(model_section))
    log(f"tiny model: {folder}")
    return folder


def load_policy(folder: Path, model_section, mesh=None, train: bool = False):
    """The policy at ``folder`` computing in ``model.compute_dtype`` (sharded on ``mesh``
    when given); its weights in ``model.param_dtype`` for training (``train``: the master
    weights, with ``model.remat``), else in the compute dtype (rollout engines)."""
    from spopp_jax.models import from_pretrained

    m = model_section
    return from_pretrained(str(folder), dtype=m.compute_dtype, mesh=mesh,
                           param_dtype=m.param_dtype if train else m.compute_dtype,
                           remat=m.remat if train else "none", attention_chunk_size=m.attention_chunk_size)


def load_chat(folder: Path, tools=None):
    """The chat format of the tokenizer at ``folder`` (``tools``: tool schemas handed to
    its chat template, e.g. Math-TIR's Python tool for Qwen)."""
    from rollout_bridge.agent import ChatFormat
    from rollout_bridge.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(folder)
    if tools:
        return ChatFormat.from_tokenizer(tokenizer, tools=list(tools))
    return ChatFormat.from_tokenizer(tokenizer)


def metric_sinks(cfg, run_dir: Path) -> list[Callable]:
    return [factory(cfg, run_dir) for factory in METRIC_SINK_FACTORIES]


def wandb_sinks(cfg, run_dir: Path, log: Callable[[str], None] = print) -> list:
    """Row sinks for ``MetricsWriter(sinks=...)``: a wandb run when ``cfg.wandb`` (same
    metric names as metrics.jsonl / TensorBoard; offline by default)."""
    if not cfg.wandb:
        return []
    from rollout_bridge.metrics import WandbSink
    from rollout_bridge.config import config_to_dict

    sink = WandbSink(run_dir, cfg.wandb_project, cfg.wandb_mode, config=config_to_dict(cfg))
    log(f"wandb ({cfg.wandb_mode}): {sink.location}")
    return [sink]


def export_policy(cfg, learner, policy: Path, out: Path, log: Callable[[str], None] = print) -> None:
    """The learner's current policy as a HF folder (config, safetensors, the tokenizer of
    ``policy``, a generation config with the rollout sampling settings)."""
    from spopp_jax.export import SamplingDefaults, export_model

    r = cfg.rollout
    export_model(learner.weights(), policy, out, SamplingDefaults(r.temperature, r.top_p, r.top_k, r.max_new_tokens))
    log(f"exported the policy to {out}")


def preprocess_argv(argv: list[str]) -> list[str]:
    for preprocess in ARGV_PREPROCESSORS:
        argv = preprocess(list(argv))
    return argv
