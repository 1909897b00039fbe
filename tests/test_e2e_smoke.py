"""End to end: JaxEngine -> orchestrator (SPO++) -> learner.train_step -> publish, tiny model.

A few updates on the synthetic environment with a random 2-layer model (hidden 32). Checks
the pieces agree with each other: the learner's log-probs of the first batch under the
initial weights match the engine's rollout log-probs token for token (the token stream the
agent built is exactly what the engine saw), updates run, and new weights are published.
"""

import asyncio

import jax
import jax.numpy as jnp
import numpy as np

from rollout_bridge.agent import AgentConfig, ChatFormat
from rollout_bridge.engine.base import SamplingParams
from rollout_bridge.envs.synthetic import WORDS, SyntheticEnv, make_task, render_observation
from rollout_bridge.orchestrator import LearnerOutput, Orchestrator, OrchestratorConfig
from rollout_bridge.tokenizer import build_tiny_tokenizer

from rollout_bridge.engine import jax_engine
from spopp_jax import learner as learner_lib
from spopp_jax.models import ModelConfig, init_model
from spopp_jax.priors import jeffreys_prior

NUM_TASKS, BATCH, UPDATES = 8, 8, 3


def _corpus():
    texts = [render_observation(make_task(t, max_turns=2, max_filler=4), r)
             for t in range(NUM_TASKS) for r in range(len(make_task(t, max_turns=2, max_filler=4).words))]
    return texts + list(WORDS) + ["Correct. Done.", "Wrong."]


def test_spopp_updates_end_to_end_with_jax_engine(tmp_path):
    tokenizer = build_tiny_tokenizer(_corpus() * 4, tmp_path / "tok", vocab_size=320)
    chat = ChatFormat.from_tokenizer(tokenizer)
    config = ModelConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = init_model(config, seed=0)
    learner_config = learner_lib.LearnerConfig(learning_rate=1e-3, weight_decay=0.0)
    model_def, state = learner_lib.init_train_state(model, learner_config)
    initial_params = jax.tree.map(jnp.copy, state.params)
    train_step = learner_lib.make_train_step(model_def, learner_config)
    holder = {"state": state, "first_batch": None}

    def learner(learner_input):  # sync: the orchestrator runs it in its learner thread
        if holder["first_batch"] is None:
            holder["first_batch"] = learner_input
        holder["state"], metrics = train_step(holder["state"], learner_input.batch)
        weights = model_def.merge(holder["state"].params)
        return LearnerOutput(weights=weights, metrics={k: float(v) for k, v in metrics.items()})

    # One prefill length bucket (min_prefill_len = max_len) keeps compiles few on CPU.
    engine = jax_engine.JaxEngine(model, num_slots=8, max_len=128, steps_per_call=4, seed=0, min_prefill_len=128)
    agent_config = AgentConfig(max_turns=2, max_total_tokens=128, sampling=SamplingParams(max_new_tokens=6))
    orch_config = OrchestratorConfig(batch_size=BATCH, max_in_flight=8, pad_to_multiple=128, seed=0)
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
        assert np.std(record.raw_advantages) > 0
        assert np.all(record.policy_lag >= 0)
        assert all(t.usable and set(t.turn_policy_events) == {t.policy_event} for t in record.trajectories)
    assert int(holder["state"].step) == UPDATES

    # Learner log-probs of batch 1 under the initial weights == engine rollout log-probs.
    first = holder["first_batch"]
    assert all(t.policy_event == 0 for t in first.trajectories)
    batch = first.batch
    logits = jax.jit(model_def.apply)(initial_params, jnp.asarray(batch.input_ids), jnp.asarray(batch.attention_mask))
    logp = np.asarray(learner_lib.token_logprobs(logits, jnp.asarray(batch.input_ids)))
    mask = np.asarray(batch.action_mask)
    assert mask.sum() > 0
    np.testing.assert_allclose(logp[mask], np.asarray(batch.rollout_logp)[mask], atol=2e-4)

    # The published weights moved away from the initial ones.
    moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), holder["state"].params, initial_params)
    assert max(jax.tree.leaves(moved)) > 0
