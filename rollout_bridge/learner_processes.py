"""The RL learner of a job: built on the ``mesh`` section's mesh, in one process or as
several learner processes (``train.py --distributed``). Only process 0 runs the job
(env, engine, orchestrator); the others follow its learner calls. Data path:
rollout_bridge/distributed_learner.py and docs/FLEET.md."""

from __future__ import annotations

from pathlib import Path

import jax

from rollout_bridge import components as build
from rollout_bridge import distributed_learner as distributed
from rollout_bridge.run_folder import RunPaths, log
from rollout_bridge.policy_learner import PolicyLearner
from spopp_jax.checkpoint import Checkpointer
from rollout_bridge.config import TrainConfig
from spopp_jax.learner import init_train_state
from rollout_bridge.run_errors import UserError
from spopp_jax.sharding import make_mesh

DISTRIBUTED_FLAG = "--distributed"  # the learner as several processes (start_distributed)


def build_learner(cfg: TrainConfig, learner_cfg, orchestrator_cfg, policy: Path) -> PolicyLearner:
    """The RL learner on the ``mesh`` section's mesh. Several learner processes: every one
    loads the same weights locally and keeps its shards (PolicyLearner(mesh=...))."""
    mesh = build.build_mesh(cfg.mesh)
    several = jax.process_count() > 1  # each process loads a full copy on its first own device
    model = build.load_policy(policy, cfg.model, local_mesh() if several else mesh)
    return PolicyLearner(*init_train_state(model, learner_cfg), learner_cfg, orchestrator_cfg.pad_to_multiple,
                         snapshot_weights=orchestrator_cfg.drain == "none",  # next step runs during the install
                         mesh=mesh)


def local_mesh():
    """A one-device mesh on this process's first device (jax's default device may be
    another process's)."""
    return make_mesh(data=1, fsdp=1, tensor=1, devices=jax.local_devices()[:1])


def start_distributed(cfg: TrainConfig) -> None:
    """``--distributed``: join the learner processes (``jax.distributed.initialize`` from
    JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, or a cluster jax
    detects). Data path: rollout_bridge/distributed_learner.py and docs/FLEET.md."""
    try:
        settings = distributed.settings_from_env()
    except ValueError as error:
        raise UserError(str(error)) from None
    settings = distributed.initialize(settings)
    log(f"learner process {settings.process_id} of {settings.num_processes}")


def follow_process_0(cfg: TrainConfig) -> dict:
    """A learner process other than 0: no env, engine or orchestrator; load the policy
    process 0 names, then run its learner commands until it stops."""
    policy = distributed.share_from_process_0()
    if policy is None:  # process 0 ran no RL stage
        log(f"learner process {jax.process_index()}: process 0 ran no RL stage")
        return {}
    log(f"learner process {jax.process_index()}: following process 0's updates of {policy}")
    agent = build.build_agent_config(cfg, max_turns=1)  # only its padding length matters here
    orchestrator_cfg = build.build_orchestrator_config(cfg, agent, cfg.seed)
    with Checkpointer(RunPaths(Path(cfg.output_dir)).checkpoints, max_to_keep=cfg.keep_checkpoints) as checkpointer:
        learner = build_learner(cfg, build.build_learner_config(cfg), orchestrator_cfg, Path(policy))
        calls = distributed.follow(learner, checkpointer)
    log(f"learner process {jax.process_index()}: {calls} updates with process 0")
    return {"learner_updates": calls}
