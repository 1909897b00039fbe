"""End to end: JaxEngine -> orchestrator -> learner.train_step -> publish, tiny model.

A few updates on the synthetic environment with a random 2-layer model (hidden 32), for
SPO++ and the two matched baselines (SPO with learner-side D, GRPO with its group
barrier). Checks the pieces agree with each other: the learner's log-probs of the first
batch under the initial weights match the engine's rollout log-probs token for token (the
token stream the agent built is exactly what the engine saw), updates run, and new
weights are published.
"""

import asyncio

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollout_bridge.agent import AgentConfig, ChatFormat
from rollout_bridge.engine import jax_engine
from rollout_bridge.engine.base import SamplingParams
from rollout_bridge.envs.synthetic import WORDS, SyntheticEnv, make_task, render_observation
from rollout_bridge.orchestrator import Orchestrator, OrchestratorConfig
from rollout_bridge.policy_learner import PolicyLearner
from rollout_bridge.tokenizer import build_tiny_tokenizer
from spopp_jax import learner as learner_lib
from spopp_jax.models import ModelConfig, init_model
from spopp_jax.priors import jeffreys_prior

NUM_TASKS, BATCH, UPDATES, MAX_LEN = 8, 8, 3, 128


def _corpus():
    tasks = [make_task(t, max_turns=2, max_filler=4) for t in range(NUM_TASKS)]
    texts = [render_observation(task, r) for task in tasks for r in range(len(task.words))]
    return texts + list(WORDS) + ["Correct. Done.", "Wrong."]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tiny_tokenizer(_corpus() * 4, tmp_path_factory.mktemp("tok"), vocab_size=320)


class JaxLearner(PolicyLearner):
    """The library learner (train_step, then for SPO D of each y′ under the new weights),
    recording what it saw."""

    def __init__(self, model, config, snapshot_weights=False):
        model_def, state = learner_lib.init_train_state(model, config)
        super().__init__(model_def, state, config, pad_to_multiple=MAX_LEN, snapshot_weights=snapshot_weights)
        self.initial_params = jax.tree.map(jnp.copy, self.state.params)
        self.inputs, self.divergences = [], []

    def __call__(self, learner_input):
        self.inputs.append(learner_input)
        output = super().__call__(learner_input)
        self.divergences.append(output.divergence or [])
        return output


@pytest.mark.parametrize("method,drain,pack", [("spopp", "finish", False), ("spo", "finish", False),
                                               ("grpo", "finish", False), ("rloo", "finish", False),
                                               ("spopp", "none", False), ("spo", "none", True)])
def test_updates_end_to_end_with_jax_engine(tokenizer, method, drain, pack):
    chat = ChatFormat.from_tokenizer(tokenizer)
    config = ModelConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = init_model(config, seed=0)
    learner = JaxLearner(model, learner_lib.LearnerConfig(num_mini_batches=1, action_logits_fraction=None,
                                                          learning_rate=1e-3, weight_decay=0.0),
                         snapshot_weights=drain == "none")
    # One prefill length bucket (min_prefill_len = max_len) keeps compiles few on CPU.
    engine = jax_engine.JaxEngine(model, num_slots=8, max_len=MAX_LEN, steps_per_call=4, seed=0,
                                  min_prefill_len=MAX_LEN)
    agent_config = AgentConfig(max_turns=2, max_total_tokens=MAX_LEN, sampling=SamplingParams(max_new_tokens=6))
    orch_config = OrchestratorConfig(method=method, group_size=4, batch_size=BATCH, max_in_flight=8,
                                     drain=drain, pad_to_multiple=MAX_LEN // 4 if pack else MAX_LEN,
                                     pack_rows=pack, pack_row_multiple=2, seed=0)
    # An offline prior with different success counts per task: baselines (and so the
    # advantages) differ across tasks even when the random model never succeeds.
    prior_alpha, prior_beta = jeffreys_prior(np.arange(NUM_TASKS) % 9, np.full(NUM_TASKS, 8))
    env_factory = lambda: SyntheticEnv(num_tasks=NUM_TASKS, max_turns=2, max_filler=4)

    async def main():
        orch = Orchestrator(engine, env_factory, chat, learner, NUM_TASKS, orch_config, agent_config,
                            prior_alpha=prior_alpha, prior_beta=prior_beta)
        try:
            await orch.run(UPDATES)
        finally:
            await orch.close()
            await engine.close()
        return orch

    orch = asyncio.run(main())
    assert orch.updates == UPDATES and orch.policy_event == UPDATES and engine.policy_event == UPDATES
    for record in orch.records:
        assert np.isfinite(record.learner_metrics["loss"]) and record.learner_metrics["tokens"] > 0
        rows, width = record.diagnostics["learner_rows"], record.diagnostics["learner_width"]
        real = sum(len(t.token_ids) for t in record.trajectories)
        assert record.diagnostics["learner_pad_fraction"] == pytest.approx(1 - real / (rows * width))
        assert rows == BATCH or (pack and rows < BATCH)
        assert np.all(record.policy_lag >= 0)
        assert all(t.usable for t in record.trajectories)
        for t in record.trajectories:  # drain none: tokens of newer events only, never older
            first, last = t.event_span
            assert (first, last) == (t.policy_event, t.policy_event) or (drain == "none" and t.policy_event <= first
                                                                         <= last <= orch.policy_event)
    assert int(learner.state.step) == UPDATES

    # Learner log-probs of batch 1 under the initial weights == engine rollout log-probs.
    first = learner.inputs[0]
    assert all(t.policy_event == 0 for t in first.trajectories)
    batch = first.batch
    # packed: several trajectories per row (segment ids), fewer rows than trajectories
    assert (batch.segment_ids is not None and batch.input_ids.shape[0] < BATCH) == pack
    logits = jax.jit(learner.model_def.apply)(learner.initial_params, jnp.asarray(batch.input_ids),
                                              jnp.asarray(batch.attention_mask), batch.segment_ids)
    logp = np.asarray(learner_lib.token_logprobs(logits, jnp.asarray(batch.input_ids)))
    mask = np.asarray(batch.action_mask)
    assert mask.sum() > 0
    np.testing.assert_allclose(logp[mask], np.asarray(batch.rollout_logp)[mask], atol=2e-4)

    if method == "spo":  # later batches revisit tasks: D > 0 after a real update
        later = [d for ds in learner.divergences[1:] for d in ds if d is not None]
        assert later and all(d > 0 for d in later)
    if method in ("grpo", "rloo"):
        for record in orch.records:
            groups = [t.stamp.group_id for t in record.trajectories]
            assert all(groups.count(g) == 4 for g in groups)
    else:
        assert any(np.std(r.raw_advantages) > 0 for r in orch.records)
        # The published weights moved away from the initial ones.
        moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), learner.state.params,
                             learner.initial_params)
        assert max(jax.tree.leaves(moved)) > 0
