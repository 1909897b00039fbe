"""Rollout engines: the abstract contract and its backends (docs/DESIGN.md, engine contract)."""

from rollout_bridge.engine.base import GenerationResult, RolloutEngine, SamplingParams

__all__ = ["GenerationResult", "RolloutEngine", "SamplingParams"]
