"""Environments: the interface (``base``) and the synthetic multi-turn task (``synthetic``)."""

from rollout_bridge.envs.base import (
    AsyncEnvironment,
    EnvFactory,
    Environment,
    StepResult,
    ThreadedEnvironment,
    as_async,
    check_task_id,
)

__all__ = [
    "AsyncEnvironment",
    "EnvFactory",
    "Environment",
    "StepResult",
    "ThreadedEnvironment",
    "as_async",
    "check_task_id",
]
