"""Training methods, one file each, behind the :class:`~rollout_bridge.methods.base.Method`
protocol. A new method: a file with its class and one ``register`` line below."""

from __future__ import annotations

from typing import Callable

from rollout_bridge.methods.base import (DroppedGroup, Launch, LearnerInput, LearnerOutput, Method,
                                         PreviousResponse, Receipt)
from rollout_bridge.methods.grpo import GroupMethod
from rollout_bridge.methods.rloo import Rloo
from rollout_bridge.methods.spo import Spo
from rollout_bridge.methods.spopp import SpoPlusPlus

_REGISTRY: dict[str, Callable[..., Method]] = {}


def register(name: str, method_class) -> None:
    """Make ``method_class`` available as ``OrchestratorConfig.method == name``."""
    if name in _REGISTRY:
        raise ValueError(f"method {name!r} is already registered")
    _REGISTRY[name] = method_class


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def method_class(name: str):
    if name not in _REGISTRY:
        raise ValueError(f"method must be one of {names()}, got {name!r}")
    return _REGISTRY[name]


def build(config, num_tasks: int, prior_alpha, prior_beta) -> Method:
    """The method object named by ``config.method``."""
    return method_class(config.method)(config, num_tasks, prior_alpha, prior_beta)


register("spopp", SpoPlusPlus)
register("spo", Spo)
register("grpo", GroupMethod)
register("rloo", Rloo)

__all__ = ["DroppedGroup", "Launch", "LearnerInput", "LearnerOutput", "Method", "PreviousResponse", "Receipt",
           "register", "names", "method_class", "build"]
