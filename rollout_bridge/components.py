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
  * methods: a file in ``rollout_bridge/methods/`` registering its ``MethodConfig`` (its recipe).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Mapping

from rollout_bridge.agent import AgentConfig
from rollout_bridge.engine.base import SamplingParams
from rollout_bridge.orchestrator import OrchestratorConfig
from spopp_jax.learner import LearnerConfig
from rollout_bridge.run_errors import UserError

# ------------------------------------------------------------------ knob maps
LEARNER_KNOBS = {
    "learning_rate": "optim.learning_rate", "weight_decay": "optim.weight_decay",
    "adam_b1": "optim.adam_b1", "adam_b2": "optim.adam_b2", "adam_eps": "optim.adam_eps",
    "max_grad_norm": "optim.max_grad_norm", "num_micro_batches": "optim.num_micro_batches",
    "num_mini_batches": "optim.num_mini_batches", "logprob_chunk_size": "optim.logprob_chunk_size",
    "action_logits_fraction": "optim.action_logits_fraction",
    "clip_low": "loss.clip_low", "clip_high": "loss.clip_high",
    "is_cap": "loss.is_cap", "old_logp_source": "loss.old_logp_source",
    "max_consecutive_skips": "optim.max_consecutive_skips",
}
METHOD_RECIPE = "the method section's recipe (MethodConfig.orchestrator_fields / learner_fields)"
LEARNER_DERIVED = {"dual_clip": METHOD_RECIPE}

ORCHESTRATOR_KNOBS = {
    "whiten_eps": "advantage.whiten_eps",
    "batch_size": "rollout.batch_size", "publish_every": "rollout.publish_every", "drain": "rollout.drain",
    "max_policy_lag": "rollout.max_policy_lag", "result_delay_s": "rollout.result_delay_s",
    "max_in_flight": "rollout.max_in_flight", "max_in_flight_per_task": "rollout.max_in_flight_per_task",
    "sibling_rule": "rollout.sibling_rule", "max_buffered_batches": "rollout.max_buffered_batches",
    "train_on_failed": "rollout.train_on_failed",
    "max_consecutive_failures": "rollout.max_consecutive_failures",
    "rho": "tracker.rho", "sampler_form": "sampler.form", "sampler_floor": "sampler.floor",
    "task_sampler": "sampler.impl",
    "pad_to_multiple": "rollout.pad_to_multiple",  # null: agent.max_total_tokens, every batch [B, max_total_tokens]
    "pack_rows": "rollout.pack_rows",
}
ORCHESTRATOR_DERIVED = {
    **{name: METHOD_RECIPE for name in ("method", "measure", "group_size", "spo_d_half", "spo_rho_min",
                                        "spo_rho_max")},
    "pack_row_multiple": "rollout.pack_rows: components.pack_row_multiple (optim mini x micro-batches)",
    "z0": "0: the prior's coordinate (SPEC 2)",
    "keep_history": "False: bounded memory, records stream to the metric sinks",
    "tune_gc": "True (the default): train.py is the whole process, so the process-wide collector tuning is its to make",
    "seed": "the job seed",
}

SAMPLING_KNOBS = {"temperature": "rollout.temperature", "top_p": "rollout.top_p", "top_k": "rollout.top_k",
                  "max_new_tokens": "rollout.max_new_tokens"}
SAMPLING_DERIVED = {"stop_token_ids": "set per request by the agent from the chat format",
                    "seed": "evaluations only: set per turn by the agent from the episode seed (common random numbers)"}

AGENT_KNOBS = {"max_total_tokens": "rollout.max_total_tokens", "env_timeout_s": "rollout.env_timeout_s"}
AGENT_DERIVED = {"max_turns": "the env kind's bundle (env.max_turns)", "sampling": "SAMPLING_KNOBS"}

ENGINE_KNOBS = {"steps_per_call": "rollout.engine_steps_per_call",
                "prefix_reuse_across_publish": "rollout.prefix_reuse_across_publish"}
ENGINE_DERIVED = {
    "num_slots": "orchestrator.max_in_flight", "max_len": "agent.max_total_tokens",
    "policy_event": "the orchestrator's policy event", "seed": "the job seed",
    "max_stop_tokens": "JaxEngine default", "min_prefill_len": "JaxEngine default",
    "cache_dtype": "JaxEngine default",
    "prefix_reuse": "JaxEngine default (on: a turn prefills only its new tokens; attention-only caches)",
}
ENGINE_SELECT = ("rollout.engine", "rollout.server_urls")  # which engine; the servers' URLs

# rollout.engine=vllm_server: the job's servers (rollout_bridge.engine.vllm_servers)
SERVERS_KNOBS = {"capacity": "rollout.servers.capacity", "health_interval_s": "rollout.servers.health_interval_s",
                 "outage_wait_s": "rollout.servers.outage_wait_s", "weights_transport": "rollout.servers.weights_transport"}
SERVERS_DERIVED = {"run_dir": "the run folder (output_dir)", "urls": "rollout.server_urls (ENGINE_SELECT)",
                   "launch": "SERVER_LAUNCH_KNOBS (None unless rollout.servers.launch.count >= 1)"}
SERVER_LAUNCH_KNOBS = {
    "count": "rollout.servers.launch.count", "gpus_per_server": "rollout.servers.launch.gpus_per_server",
    "first_gpu": "rollout.servers.launch.first_gpu", "extra_args": "rollout.servers.launch.extra_args",
    "max_restarts": "rollout.servers.launch.max_restarts", "ready_timeout_s": "rollout.servers.launch.ready_timeout_s",
    "max_num_seqs": "rollout.servers.launch.max_num_seqs", "cpu_threads": "rollout.servers.launch.cpu_threads",
    "kv_cache_gib": "rollout.servers.launch.kv_cache_gib", "python": "rollout.servers.python",
    "gpus": "rollout.servers.launch.gpus",
}
SERVER_LAUNCH_DERIVED = {
    "host": "127.0.0.1: the servers are local", "capacity": "rollout.servers.capacity (SERVERS_KNOBS)",
    "max_model_len": "agent.max_total_tokens", "stop_grace_s": "ServerLaunchConfig default",
}
# rollout.engine=vllm: vLLM's AsyncLLM in this process (VllmInProcessConfig)
INPROCESS_DERIVED = {
    "model": "a policy folder written from the stage's model", "weights_root": "<run>/rollout_vllm/engine-<n>",
    "tokenizer_dir": "the job's policy folder", "initial_policy_event": "the orchestrator's policy event",
    "max_model_len": "agent.max_total_tokens", "max_num_seqs": "orchestrator.max_in_flight",
    "drain": "rollout.drain (ORCHESTRATOR_KNOBS; none -> finish for the drained fallback)",
    "dtype": "VllmInProcessConfig default", "gpu_memory_utilization": "VllmInProcessConfig default",
    "logprobs_mode": "VllmInProcessConfig default (raw_logprobs)", "keep_policies": "VllmInProcessConfig default",
    "direct_transfer": "None: the filesystem publish", "engine_kwargs": "VllmInProcessConfig default",
}
VLLM_TEMPERATURE = 1.0  # the vLLM engines report raw log-probs: exact sampling log-probs only at T = 1

# sections read whole by one component (the owner named for the config test)
SECTION_OWNERS = {
    "method": "rollout_bridge.methods: the method's recipe (MethodConfig.orchestrator_fields / learner_fields)",
    "model": "rollout_bridge.components.model_folder / load_policy (model.*)",
    "mesh": "rollout_bridge.components.build_mesh (mesh.*)",
    "node": "rollout_bridge.node_layout.apply_before_jax (node.*: train.py's first statement, before JAX loads)",
    "env": "rollout_bridge.envs.kinds (env.*)",
    "math_tir": "rollout_bridge.envs.math_tir.build_math_tir (math_tir.*, env.kind=math_tir)",
    "warmstart": "rollout_bridge.warmstart_stage.run_warmstart (warmstart.*)",
    "prior": "rollout_bridge.prior_stage.run_prior (prior.*)",
    "evaluation": "rollout_bridge.evaluation (evaluate_after_rl, evaluate_policy) through EvaluationSection.rollouts (evaluation.*)",
}
JOB_FIELDS = ("stage", "seed", "steps", "output_dir", "resume", "resume_step", "checkpoint_every",
              "keep_checkpoints", "progress", "tensorboard", "export_every",
              "compilation_cache_dir")  # read by train.py's composition (resume_step: run_guard.prepare_run)
WANDB_FIELDS = ("wandb", "wandb_mode", "wandb_project")  # read by wandb_sinks

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
    return LearnerConfig(**knobs(cfg, LEARNER_KNOBS), **cfg.method.learner_fields())


def build_agent_config(cfg, max_turns: int) -> AgentConfig:
    return AgentConfig(max_turns=max_turns, sampling=SamplingParams(**knobs(cfg, SAMPLING_KNOBS)),
                       **knobs(cfg, AGENT_KNOBS))


def build_orchestrator_config(cfg, agent: AgentConfig, seed: int) -> OrchestratorConfig:
    values = {**knobs(cfg, ORCHESTRATOR_KNOBS), **cfg.method.orchestrator_fields()}
    values["pad_to_multiple"] = values["pad_to_multiple"] or agent.max_total_tokens  # null: one width, one compile
    if values["pack_rows"]:
        values["pack_row_multiple"] = pack_row_multiple(cfg)
    return OrchestratorConfig(z0=0.0, keep_history=False, seed=seed, **values)


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
    """``rollout.engine`` and its servers, before any work: vLLM importable where it must
    run, an existing ``rollout.servers.python``, well-formed ``rollout.server_urls``, the
    sampling temperature vLLM's raw log-probs are exact at (UserError naming the field).
    (``server_urls`` with ``servers.launch.count`` is refused by the config itself.)"""
    import importlib.util
    import os
    import sys

    r = cfg.rollout
    if r.engine == "jax":
        return
    if r.temperature != VLLM_TEMPERATURE:
        raise UserError(f"rollout.temperature={r.temperature}: rollout.engine={r.engine} reports vLLM's raw "
                        f"log-probs (log_softmax of the logits), the sampling log-probs only at temperature "
                        f"{VLLM_TEMPERATURE}")
    if r.engine == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise UserError("rollout.engine=vllm runs vLLM inside this process, but vllm is not importable here "
                            f"({sys.executable}); on a CPU host use rollout.engine=vllm_server with "
                            "rollout.servers.python <repo>/.venv-vllm/bin/python (scripts/setup_vllm_cpu.sh)")
        return
    if r.server_urls is not None:
        from rollout_bridge.engine.vllm_servers import parse_server_urls

        try:
            parse_server_urls(r.server_urls)
        except ValueError as error:
            raise UserError(str(error)) from None
        return
    python = r.servers.python
    if python is not None and not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise UserError(f"rollout.servers.python={python}: no such executable (the interpreter that runs "
                        "`vllm serve`, e.g. <repo>/.venv-vllm/bin/python from scripts/setup_vllm_cpu.sh)")
    if python is None and importlib.util.find_spec("vllm") is None:
        raise UserError(f"rollout.servers.launch.count={r.servers.launch.count} starts `vllm serve` with "
                        f"{sys.executable}, which has no vllm: set rollout.servers.python to an interpreter "
                        "that has it (on CPU: <repo>/.venv-vllm/bin/python, scripts/setup_vllm_cpu.sh)")


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
    """The job's vLLM servers for ``rollout.engine=vllm_server`` (None for the other
    engines); ``start(policy_folder)`` launches them (a no-op for ``server_urls``)."""
    import shlex

    from rollout_bridge.engine.vllm_launcher import ServerLaunchConfig
    from rollout_bridge.engine.vllm_servers import RolloutServers, RolloutServersConfig, parse_server_urls

    if cfg.rollout.engine != "vllm_server":
        return None
    servers = knobs(cfg, SERVERS_KNOBS)
    urls = () if cfg.rollout.server_urls is None else parse_server_urls(cfg.rollout.server_urls)
    launch = None
    if not urls:
        launch_knobs = knobs(cfg, SERVER_LAUNCH_KNOBS)
        launch_knobs["extra_args"] = tuple(shlex.split(launch_knobs["extra_args"]))
        launch = ServerLaunchConfig(host="127.0.0.1", capacity=servers["capacity"],
                                    max_model_len=agent.max_total_tokens, **launch_knobs)
    return RolloutServers(RolloutServersConfig(run_dir=str(run_dir), urls=urls, launch=launch, **servers),
                          launcher_factory=launcher_factory)


def build_engine(cfg, model, agent: AgentConfig, orchestrator: OrchestratorConfig, policy_event: int, seed: int,
                 servers=None, policy_folder: Path | None = None, run_dir: Path | None = None):
    """The rollout engine of ``rollout.engine`` serving ``model`` as ``policy_event``:
    the embedded JAX engine; vLLM in this process (``vllm``: needs ``run_dir`` for its
    weight folders); a fleet over the job's servers (``vllm_server``: ``servers`` from
    `build_rollout_servers`, started). ``policy_folder``: tokenizer files for the vLLM
    weight folders. Every stage (prior, evaluations, RL) builds its engine here."""
    engine = cfg.rollout.engine
    if engine == "vllm_server":
        if servers is None:
            raise ValueError("rollout.engine=vllm_server: build_engine needs the job's servers")
        return servers.engine(model, policy_event, policy_folder, drain=orchestrator.drain)
    if engine == "vllm":
        return _inprocess_engine(model, agent, orchestrator, policy_event, policy_folder, run_dir)
    from rollout_bridge.engine.jax_engine import JaxEngine

    engine_knobs = knobs(cfg, ENGINE_KNOBS)
    steps = min(engine_knobs["steps_per_call"], agent.sampling.max_new_tokens)
    return JaxEngine(model, num_slots=orchestrator.max_in_flight, max_len=agent.max_total_tokens,
                     steps_per_call=steps, policy_event=policy_event, seed=seed,
                     prefix_reuse_across_publish=engine_knobs["prefix_reuse_across_publish"])


def _inprocess_engine(model, agent: AgentConfig, orchestrator: OrchestratorConfig, policy_event: int,
                      policy_folder: Path | None, run_dir: Path | None):
    """``rollout.engine=vllm``: the stage's model written as a policy folder, vLLM's
    AsyncLLM created on first use (``DeferredInProcessEngine``)."""
    import tempfile

    from rollout_bridge.engine.vllm_inprocess import DeferredInProcessEngine, VllmInProcessConfig
    from rollout_bridge.engine.vllm_weights import write_policy_folder

    if run_dir is None:
        raise ValueError("rollout.engine=vllm: build_engine needs run_dir (the weight folders go there)")
    parent = Path(run_dir) / "rollout_vllm"
    parent.mkdir(parents=True, exist_ok=True)
    root = tempfile.mkdtemp(prefix="engine-", dir=parent)
    tokenizer = None if policy_folder is None else str(policy_folder)
    folder = write_policy_folder(model, root, int(policy_event), tokenizer)
    config = VllmInProcessConfig(model=folder, weights_root=root, tokenizer_dir=tokenizer,
                                 initial_policy_event=int(policy_event), max_model_len=agent.max_total_tokens,
                                 max_num_seqs=orchestrator.max_in_flight,
                                 drain="abort" if orchestrator.drain == "abort" else "finish")
    return DeferredInProcessEngine(config)


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
