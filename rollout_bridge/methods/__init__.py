"""Training methods, one file each: a :class:`~rollout_bridge.methods.base.Method` and its
recipe, a :class:`~rollout_bridge.methods.base.MethodConfig` registered under the method's
name. Every module of this package is imported when the registry is first read, so a new
file is a new ``--method`` with no other edit."""

from __future__ import annotations

from rollout_bridge.methods.base import (DroppedGroup, Launch, LearnerInput, LearnerOutput, Method, MethodConfig,
                                         PreviousResponse, Receipt, method_names, recipe)


def names() -> tuple[str, ...]:
    return method_names()


def method_class(name: str):
    """The ``Method`` class of the method registered as ``name``."""
    return type(recipe(name)).method_class


def build(config, num_tasks: int, prior_alpha, prior_beta) -> Method:
    """The method object named by ``config.method`` (an ``OrchestratorConfig``)."""
    return method_class(config.method)(config, num_tasks, prior_alpha, prior_beta)


__all__ = ["DroppedGroup", "Launch", "LearnerInput", "LearnerOutput", "Method", "MethodConfig", "PreviousResponse",
           "Receipt", "names", "method_class", "build", "recipe"]
