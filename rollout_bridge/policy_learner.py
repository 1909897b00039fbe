"""The orchestrator's learner callable over the jitted SPO++ step (``spopp_jax.learner``).

One call = one update: the train step on the packed batch (in the orchestrator's learner
thread), the new weights for publishing and, when the method asks for a divergence
(``LearnerInput.previous`` is not None, SPO), the SPO recipe's two learner log-probs:

  * π_then of this batch: log-probs at the update's STARTING parameters (verl's
    ``compute_log_prob`` before the actor update), returned as ``trained_logp`` for the
    method to keep with each task's response; with ``old_logp_source="current"`` they are
    also the PPO ratio's π_old (``batch.old_logp``), so the step does not recompute them;
  * π_now of each task's previous response y′ after the update, and
    D_i = token-mean |π_then − π_now| over y′'s action tokens.

The engine's rollout log-probs never enter D.

In-flight publishing (``rollout.drain none``): the orchestrator starts the next update while
the engine still copies the published weights, and the jitted step DONATES its TrainState,
so ``snapshot_weights=True`` hands out an un-donated copy of the parameters
(``background_publish.snapshot_params``: one async device copy per update, the learner does
not wait for it) instead of the live buffers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from rollout_bridge import baselines
from rollout_bridge.background_publish import snapshot_params
from rollout_bridge.methods import LearnerInput, LearnerOutput
from spopp_jax.learner import (LearnerConfig, ModelDef, SkipGuard, TrainBatch, make_compute_logprobs,
                               make_train_step)


class PolicyLearner:
    """``learner(LearnerInput) -> LearnerOutput`` holding the ``TrainState`` (``.state``)."""

    def __init__(self, model_def: ModelDef, state: Any, config: LearnerConfig, pad_to_multiple: int = 64,
                 snapshot_weights: bool = False):
        self.model_def = model_def
        self.snapshot_weights = snapshot_weights
        self.state = state
        self.config = config
        self.pad_to_multiple = pad_to_multiple
        self.train_step = make_train_step(model_def, config)
        self.compute_logprobs = make_compute_logprobs(model_def, config.logprob_chunk_size)
        # a non-finite step is skipped inside train_step; max_consecutive_skips in a row stop the run
        self.skip_guard = SkipGuard.from_config(config)

    def weights(self):
        """The current policy as an NNX module (what the engine publishes); over a copy of
        the parameters with ``snapshot_weights`` (safe to install while the next step runs)."""
        params = snapshot_params(self.state.params) if self.snapshot_weights else self.state.params
        return self.model_def.merge(params)

    def __call__(self, learner_input: LearnerInput) -> LearnerOutput:
        batch = learner_input.batch
        logp_then = None
        if learner_input.previous is not None:
            logp_then = self.compute_logprobs(self.state.params, batch)
            if self.config.old_logp_source == "current":
                batch = dataclasses.replace(batch, old_logp=logp_then)
        self.state, metrics = self.train_step(self.state, batch)
        metrics = {k: float(v) for k, v in metrics.items()}
        if metrics.get("skipped_updates"):
            print(f"learner: non-finite loss/gradient, update skipped (loss {metrics['loss']}, grad_norm "
                  f"{metrics['grad_norm']}); parameters unchanged", flush=True)
        self.skip_guard.observe(metrics)
        if learner_input.previous is None:
            return LearnerOutput(self.weights(), metrics)
        logp_then = np.asarray(logp_then)
        divergence = self.previous_divergences(learner_input.previous, logp_then)
        return LearnerOutput(self.weights(), metrics, divergence, trained_logp=logp_then)

    def previous_divergences(self, previous, logp_batch: np.ndarray) -> list[float | None]:
        """D_i of each y′ under the current (updated) parameters; None on a first visit."""
        arrays, rows = baselines.pack_previous_responses(previous, logp_batch, self.pad_to_multiple,
                                                         num_rows=len(previous))
        if arrays is None:
            return [None] * len(previous)
        scored = TrainBatch(input_ids=arrays["input_ids"], attention_mask=arrays["attention_mask"],
                            action_mask=arrays["action_mask"], rollout_logp=np.zeros_like(arrays["logp_then"]),
                            advantages=np.zeros_like(arrays["logp_then"]))
        logp_now = np.asarray(self.compute_logprobs(self.state.params, scored))
        return baselines.divergences_from_logprobs(rows, arrays, logp_now)
