"""Environment kinds: the run config's ``env`` section is a choice registry
(:class:`~rollout_bridge.envs.kinds.base.EnvConfig`); each module of this package registers
one kind (``textworld``, ``alfworld``, ``math_tir``) whose config carries its own fields
and checks and builds its task sets (:class:`EnvBundle`)."""

from rollout_bridge.envs.kinds.base import (
    CommandGameConfig,
    EnvBundle,
    EnvConfig,
    GenerationBar,
    build_env,
    default_env,
    env_kinds,
    generation_workers,
)

__all__ = ["CommandGameConfig", "EnvBundle", "EnvConfig", "GenerationBar", "build_env", "default_env", "env_kinds",
           "generation_workers"]
