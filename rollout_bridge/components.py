"""The components of a training job, each built from its own config section.

``train.py`` only composes. Every knob of a component's config is either read from one
``TrainConfig`` path (the ``*_KNOBS`` maps: component field -> config path) or derived
from an already built component (the ``*_DERIVED`` maps say from what); every TrainConfig
field is read by exactly one component (``tests/test_config.py`` checks both ways).

Extension points (lists a later module appends to):
  * ``ARGV_PREPROCESSORS``: ``argv -> argv`` before parsing (e.g. verl-style aliases);
  * ``METRIC_SINK_FACTORIES``: ``(cfg, run_dir) -> sink``; a sink is called with every
    ``UpdateRecord`` and may have ``close()`` (e.g. wandb);
  * ``END_OF_RUN_HOOKS``: ``(cfg, run_dir, learner) -> None`` after the RL stage (e.g.
    an HF export of the final policy);
  * env kinds: ``rollout_bridge.envs.kinds.register_env_kind``;
  * methods: ``rollout_bridge.methods.register``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Mapping

from rollout_bridge.agent import AgentConfig
from rollout_bridge.engine.base import SamplingParams
from rollout_bridge.orchestrator import OrchestratorConfig
from spopp_jax.learner import LearnerConfig
from spopp_jax.run_errors import UserError

# ------------------------------------------------------------------ knob maps
LEARNER_KNOBS = {
    "learning_rate": "optim.learning_rate", "weight_decay": "optim.weight_decay",
    "adam_b1": "optim.adam_b1", "adam_b2": "optim.adam_b2", "adam_eps": "optim.adam_eps",
    "max_grad_norm": "optim.max_grad_norm", "num_micro_batches": "optim.num_micro_batches",
    "num_mini_batches": "optim.num_mini_batches", "logprob_chunk_size": "optim.logprob_chunk_size",
    "clip_low": "loss.clip_low", "clip_high": "loss.clip_high", "dual_clip": "loss.dual_clip",
    "is_cap": "loss.is_cap", "old_logp_source": "loss.old_logp_source",
    "max_consecutive_skips": "optim.max_consecutive_skips",
}
LEARNER_DERIVED: dict[str, str] = {}

ORCHESTRATOR_KNOBS = {
    "method": "method", "measure": "advantage.measure", "whiten_eps": "advantage.eps",
    "batch_size": "rollout.batch_size", "publish_every": "rollout.publish_every", "drain": "rollout.drain",
    "max_policy_lag": "rollout.max_policy_lag",
    "max_in_flight": "rollout.max_inflight", "max_in_flight_per_task": "rollout.max_in_flight_per_task",
    "sibling_rule": "rollout.sibling_rule", "max_buffered_batches": "rollout.max_buffered_batches",
    "group_size": "rollout.group_size", "train_on_failed": "rollout.train_on_failed",
    "max_consecutive_failures": "rollout.max_consecutive_failures",
    "rho": "tracker.rho", "spo_d_half": "tracker.spo_d_half", "spo_rho_min": "tracker.spo_rho_min",
    "spo_rho_max": "tracker.spo_rho_max", "sampler_form": "sampler.form", "sampler_floor": "sampler.floor",
    "task_sampler": "sampler.impl",
}
ORCHESTRATOR_DERIVED = {
    "z0": "0: the prior's coordinate (SPEC 2)",
    "pad_to_multiple": "agent.max_total_tokens: every batch [B, max_seq_len], one compile",
    "keep_history": "False: bounded memory, records stream to the metric sinks",
    "seed": "the job seed",
}

SAMPLING_KNOBS = {"temperature": "rollout.temperature", "top_p": "rollout.top_p", "top_k": "rollout.top_k",
                  "max_new_tokens": "rollout.max_new_tokens"}
SAMPLING_DERIVED = {"stop_token_ids": "set per request by the agent from the chat format"}

AGENT_KNOBS = {"max_total_tokens": "rollout.max_seq_len", "env_timeout_s": "rollout.env_timeout_s"}
AGENT_DERIVED = {"max_turns": "the env kind's bundle (env.max_turns)", "sampling": "SAMPLING_KNOBS"}

ENGINE_KNOBS = {"steps_per_call": "rollout.engine_steps_per_call"}
ENGINE_DERIVED = {
    "num_slots": "orchestrator.max_in_flight", "max_len": "agent.max_total_tokens",
    "policy_event": "the orchestrator's policy event", "seed": "the job seed",
    "max_stop_tokens": "JaxEngine default", "min_prefill_len": "JaxEngine default",
    "cache_dtype": "JaxEngine default",
}
ENGINE_SELECT = ("rollout.engine", "rollout.server_urls")  # which engine (train.py: jax only)

# sections read whole by one component (the owner named for the config test)
SECTION_OWNERS = {
    "model": "rollout_bridge.components.model_folder / load_policy (model.*)",
    "mesh": "rollout_bridge.components.build_mesh (mesh.*)",
    "env": "rollout_bridge.envs.kinds (env.*)",
    "math_tir": "rollout_bridge.envs.math_tir.build_math_tir (math_tir.*, env.kind=math_tir)",
    "warmstart": "rollout_bridge.job.run_warmstart (warmstart.*)",
    "prior": "rollout_bridge.job.run_prior (prior.*)",
}
JOB_FIELDS = ("stage", "seed", "steps", "output_dir", "resume", "checkpoint_every", "keep_checkpoints",
              "progress", "tensorboard", "export_every")  # read by train.py's composition itself
WANDB_FIELDS = ("wandb", "wandb_mode", "wandb_project")  # read by wandb_sinks

# ------------------------------------------------------------------ extension points
def _verl_aliases(argv: list[str]) -> list[str]:
    """verl knob names accepted as aliases (docs/CONVENTIONS.md); a refused one is a
    config error naming the key."""
    from spopp_jax.verl_aliases import AliasError, rewrite_verl_aliases

    try:
        return rewrite_verl_aliases(argv)
    except AliasError as error:
        raise UserError(str(error), "config error") from None


ARGV_PREPROCESSORS: list[Callable[[list[str]], list[str]]] = [_verl_aliases]
METRIC_SINK_FACTORIES: list[Callable[[Any, Path], Callable]] = []
END_OF_RUN_HOOKS: list[Callable[[Any, Path, Any], None]] = []


def config_value(cfg: Any, path: str) -> Any:
    """``cfg`` attribute at dotted ``path`` ("rollout.batch_size")."""
    value = cfg
    for name in path.split("."):
        value = getattr(value, name)
    return value


def knobs(cfg: Any, knob_map: Mapping[str, str]) -> dict[str, Any]:
    return {field: config_value(cfg, path) for field, path in knob_map.items()}


# ------------------------------------------------------------------ builders
def build_learner_config(cfg) -> LearnerConfig:
    return LearnerConfig(**knobs(cfg, LEARNER_KNOBS))


def build_agent_config(cfg, max_turns: int) -> AgentConfig:
    return AgentConfig(max_turns=max_turns, sampling=SamplingParams(**knobs(cfg, SAMPLING_KNOBS)),
                       **knobs(cfg, AGENT_KNOBS))


def build_orchestrator_config(cfg, agent: AgentConfig, seed: int) -> OrchestratorConfig:
    return OrchestratorConfig(z0=0.0, pad_to_multiple=agent.max_total_tokens, keep_history=False, seed=seed,
                              **knobs(cfg, ORCHESTRATOR_KNOBS))


def check_engine_choice(cfg) -> None:
    """``rollout.engine`` / ``rollout.server_urls``: this build drives the JAX engine only."""
    if cfg.rollout.engine != "jax" or cfg.rollout.server_urls is not None:
        raise UserError(f"rollout.engine={cfg.rollout.engine!r}: train.py drives the embedded "
                         "JAX engine only in this build")


def check_inputs(cfg) -> None:
    """Local inputs a recipe names must exist (nothing is downloaded): fail early, clearly."""
    from rollout_bridge.tiny_model import check_model_folder

    if cfg.model.path is not None:
        try:
            check_model_folder(cfg.model.path)
        except FileNotFoundError as error:
            raise UserError(f"{error}") from None
    check_engine_choice(cfg)


def build_engine(cfg, model, agent: AgentConfig, orchestrator: OrchestratorConfig, policy_event: int, seed: int):
    """The rollout engine of ``rollout.engine`` (this build: the embedded JAX engine)."""
    from rollout_bridge.engine.jax_engine import JaxEngine

    check_engine_choice(cfg)
    steps = min(knobs(cfg, ENGINE_KNOBS)["steps_per_call"], agent.sampling.max_new_tokens)
    return JaxEngine(model, num_slots=orchestrator.max_in_flight, max_len=agent.max_total_tokens,
                     steps_per_call=steps, policy_event=policy_event, seed=seed)


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


def load_policy(folder: Path, model_section, mesh=None):
    """The policy at ``folder`` in ``model.dtype`` (sharded on ``mesh`` when given)."""
    from spopp_jax.models import from_pretrained

    return from_pretrained(str(folder), dtype=model_section.dtype, mesh=mesh)


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
    from spopp_jax.config import config_to_dict

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


def leaf_paths(config_class) -> list[str]:
    """Dotted paths of every leaf field of a config dataclass (sections expanded)."""
    import typing

    out = []
    hints = typing.get_type_hints(config_class)
    for f in dataclasses.fields(config_class):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            out += [f"{f.name}.{leaf}" for leaf in leaf_paths(hint)]
        else:
            out.append(f.name)
    return out
