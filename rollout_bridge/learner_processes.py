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
from spopp_jax.learner import init_train_state, make_optimizer
from rollout_bridge.run_errors import UserError
from spopp_jax.sharding import make_mesh

DISTRIBUTED_FLAG = "--distributed"  # the learner as several processes (start_distributed)


def build_learner(cfg: TrainConfig, learner_cfg, orchestrator_cfg, policy: Path) -> PolicyLearner:
    """The RL learner on the ``mesh`` section's mesh: master weights in
    ``model.param_dtype``, every batch's rows over data x fsdp (PolicyLearner(mesh=...)).
    Logs the memory estimate of a step; refuses weights one AdamW step cannot move.
    Several learner processes: every one loads the same weights locally and keeps its
    shards."""
    mesh = build.build_mesh(cfg.mesh)
    several = jax.process_count() > 1  # each process loads a full copy on its first own device
    model = build.load_policy(policy, cfg.model, local_mesh() if several else mesh, train=True)
    log(learner_memory(cfg, model.config, mesh).summary())
    model_def, state = init_train_state(model, learner_cfg)
    check_weights_can_move(state.params, cfg.model.param_dtype, learner_cfg.learning_rate)
    return PolicyLearner(model_def, state, learner_cfg, orchestrator_cfg.pad_to_multiple,
                         snapshot_weights=orchestrator_cfg.drain == "none",  # next step runs during the install
                         mesh=mesh, program_store=cfg.program_store)


def build_sft_learner(cfg: TrainConfig, base: Path, sft_cfg):
    """(model_def, state, mesh) of the warm start: the policy at ``base`` with master weights
    in ``model.param_dtype``, its state placed on the ``mesh`` section's mesh as the RL
    learner's (one process; several learner processes: process 0 alone, no mesh)."""
    from spopp_jax.sharding import shard_train_state, train_state_sharding

    mesh = build.build_mesh(cfg.mesh) if jax.process_count() == 1 else None
    model_def, state = init_train_state(build.load_policy(base, cfg.model, mesh, train=True), sft_cfg)
    check_weights_can_move(state.params, cfg.model.param_dtype, sft_cfg.learning_rate)
    if mesh is not None:
        state = shard_train_state(state, train_state_sharding(state, mesh, make_optimizer(sft_cfg)))
    return model_def, state, mesh


def learner_memory(cfg: TrainConfig, model_config, mesh):
    """`estimate_learner_memory` of this job's RL micro-batches: batch_size / (mini-batches x
    micro-batches) rows of ``rollout.max_total_tokens`` tokens (the widest a batch can be)."""
    from spopp_jax.models.memory import estimate_learner_memory

    o = cfg.optim
    rows = max(1, cfg.rollout.batch_size // (o.num_mini_batches * o.num_micro_batches))
    return estimate_learner_memory(
        model_config, rows=rows, time=cfg.rollout.max_total_tokens, param_dtype=cfg.model.param_dtype,
        compute_dtype=cfg.model.compute_dtype, remat=cfg.model.remat, num_micro_batches=o.num_micro_batches,
        logprob_chunk_size=o.logprob_chunk_size, **{axis: mesh.shape[axis] for axis in ("data", "fsdp", "tensor")})


# A run whose AdamW steps leave more than this share of the weights unchanged is refused;
# above WARN_FROZEN_FRACTION it is warned about.
MAX_FROZEN_FRACTION = 0.5
WARN_FROZEN_FRACTION = 0.01


def check_weights_can_move(params, param_dtype: str, learning_rate: float) -> float:
    """`frozen_weight_fraction` of ``params`` at ``learning_rate``: above
    MAX_FROZEN_FRACTION a UserError (one line), above WARN_FROZEN_FRACTION one warning
    line. Returns the fraction."""
    from spopp_jax.learner import frozen_weight_fraction

    frozen = frozen_weight_fraction(params, learning_rate)
    line = (f"model.param_dtype={param_dtype} at learning_rate {learning_rate:g}: one AdamW step is below "
            f"the weights' resolution for {frozen:.1%} of them, so they would not move; keep float32 master "
            "weights (model.param_dtype float32, compute in model.compute_dtype)")
    if frozen > MAX_FROZEN_FRACTION:
        raise UserError(line)
    if frozen > WARN_FROZEN_FRACTION:
        log(f"warning: {line}")
    return frozen


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
