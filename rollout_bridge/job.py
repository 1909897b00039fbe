"""The built components every stage of a training job shares (``Job``): the run config,
the run folder, the tasks (the env kind's bundle), the agent, orchestrator and learner
configs, and the rollout servers the prior, the evaluations and RL all use."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

from rollout_bridge import components as build
from rollout_bridge.config import TrainConfig
from rollout_bridge.run_folder import RunPaths, log


@dataclasses.dataclass
class Job:
    """The built components every stage shares."""

    cfg: TrainConfig
    paths: RunPaths
    env: object
    agent: object
    orchestrator: object
    learner: object
    servers: object = None  # an engine that uses servers (vllm_server): the job's (started)
    policy_folder: Path | None = None  # the initial policy's HF folder (tokenizer of vLLM weight folders)

    def engine(self, model, seed: int, policy_event: int = 0):
        return build.build_engine(self.cfg, model, self.agent, self.orchestrator, policy_event, seed,
                                  servers=self.servers, policy_folder=self.policy_folder, run_dir=self.paths.root)

    def engine_metrics(self, engine=None) -> dict:
        """Per-update counters of the rollout servers (restarts, lost servers, publish times),
        or the embedded engine's prefill counters (run totals: prefilled and reused prompt
        tokens, requests on cache rows of an older policy event)."""
        if self.servers is not None:
            return self.servers.metrics()
        stats = getattr(engine, "prefix_stats", None)
        return {} if stats is None else {k: float(v) for k, v in dataclasses.asdict(stats).items()}



def build_job(cfg: TrainConfig, paths: RunPaths, env) -> Job:
    """The job's components from its config sections, for the tasks ``env``."""
    agent = build.build_agent_config(cfg, env.max_turns)
    return Job(cfg, paths, env, agent, build.build_orchestrator_config(cfg, agent, cfg.seed),
               build.build_learner_config(cfg))


def start_servers(job: Job, policy: Path, at_exit: contextlib.ExitStack) -> None:
    """An engine that uses servers (``rollout.engine=vllm_server``): start the job's servers on
    ``policy`` (one set for the prior, the evaluations and RL), closed by ``at_exit``; with
    another engine only the policy folder is recorded."""
    cfg, paths = job.cfg, job.paths
    job.policy_folder = policy
    job.servers = build.build_rollout_servers(cfg, paths.root, job.agent)
    if job.servers is None:
        return
    at_exit.callback(job.servers.close)
    engine = cfg.rollout.engine
    log(f"rollout servers: {engine.server_urls or f'launching {engine.launch.count}'} "
        f"(logs in {paths.root}/rollout_servers)")
    job.servers.start(policy)
