"""The components of a training job, each built from its own config sections.

``train.py`` only composes. A component's config fields are declared once: in the
component's own config classes, which the run config's sections are or extend
(``optim``/``loss`` = the learner's `OptimConfig`/`LossConfig`; ``tracker``, ``sampler``,
``advantage`` = the orchestrator's; ``rollout`` extends the orchestrator's
`RolloutSchedule`, the agent's `EpisodeLimits` and the engine's `Decoding`). A field the
build sets from elsewhere says from what in its ``metadata["from"]``
(``tests/test_config_layer.py`` checks both).

Extension points (lists a later module appends to):
  * ``ARGV_PREPROCESSORS``: ``argv -> argv`` before parsing (e.g. verl-style aliases);
  * ``METRIC_SINK_FACTORIES``: ``(cfg, run_dir) -> sink``; a sink is called with every
    ``UpdateRecord`` and may have ``close()`` (e.g. wandb);
  * ``END_OF_RUN_HOOKS``: ``(cfg, run_dir, learner) -> None`` after the RL stage (e.g.
    an HF export of the final policy);
  * env kinds: a file in ``rollout_bridge/envs/kinds/`` registering its ``EnvConfig`` (its fields and build);
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

VLLM_TEMPERATURE = 1.0  # the vLLM engines report raw log-probs: exact sampling log-probs only at T = 1


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
    s = cfg.rollout.servers
    servers = dict(capacity=s.capacity, health_interval_s=s.health_interval_s, outage_wait_s=s.outage_wait_s,
                   weights_transport=s.weights_transport)
    urls = () if cfg.rollout.server_urls is None else parse_server_urls(cfg.rollout.server_urls)
    launch = None
    if not urls:
        n = s.launch
        launch = ServerLaunchConfig(host="127.0.0.1", capacity=s.capacity, max_model_len=agent.max_total_tokens,
                                    count=n.count, gpus_per_server=n.gpus_per_server, first_gpu=n.first_gpu,
                                    extra_args=tuple(shlex.split(n.extra_args)), max_restarts=n.max_restarts,
                                    ready_timeout_s=n.ready_timeout_s, max_num_seqs=n.max_num_seqs,
                                    cpu_threads=n.cpu_threads, kv_cache_gib=n.kv_cache_gib, python=s.python,
                                    gpus=n.gpus)
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

    steps = min(cfg.rollout.engine_steps_per_call, agent.sampling.max_new_tokens)
    return JaxEngine(model, num_slots=orchestrator.max_in_flight, max_len=agent.max_total_tokens,
                     steps_per_call=steps, policy_event=policy_event, seed=seed,
                     prefix_reuse_across_publish=cfg.rollout.prefix_reuse_across_publish)


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
