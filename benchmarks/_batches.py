"""The model config and batch every learner benchmark uses (learner_step.py, learner_ab.py).

Import after `_protocol.pin_threads` (this imports jax through spopp_jax).
"""

from __future__ import annotations

import numpy as np

from spopp_jax.models.testing import tiny_hf_config

ROPE_THETA = 1e6
MIN_POSITIONS = 4096  # max_position_embeddings of the benchmark models (at least seq)


def learner_hf_config(args):
    """transformers Qwen3 config of the shape in ``args`` (`_model_shapes.resolve_shape`),
    untied embeddings, room for ``args.seq`` positions."""
    return tiny_hf_config(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, intermediate_size=args.ffn, tie_word_embeddings=False,
        max_position_embeddings=max(MIN_POSITIONS, args.seq), rope_theta=ROPE_THETA)

def random_trajectory(rng: np.random.Generator, index: int, action_mask: np.ndarray, prompt_length: int,
                      vocab: int, logp_mean: float):
    """A finished `Trajectory` of random tokens with this action mask, its action tokens'
    rollout log-probs ~ N(logp_mean, 0.3), reward index % 2 (packed_batches.py,
    length_buckets.py)."""
    from rollout_bridge.trajectory import DispatchStamp, Trajectory

    length = len(action_mask)
    logp = np.where(action_mask, rng.normal(logp_mean, 0.3, length), 0.0)
    return Trajectory(DispatchStamp(index, index, 0, 0.0, 0.5, 0.0), rng.integers(0, vocab, length).astype(np.int32),
                      action_mask, logp.astype(np.float32), prompt_length, float(index % 2), 0.0)


EARLY_END_FRACTION = 0.1  # rows that end at half length (right padding)
OBSERVATION_TOKENS = 8  # one observation span inside the action tokens


def learner_batch(batch: int, seq: int, vocab: int, rng: np.random.Generator):
    """(input_ids, attention_mask, action_mask, rollout_logp, advantages), each [batch, seq].

    Prompt = first quarter of each row, then action tokens with one 8-token observation
    span in the middle; 10% of rows end early (right padding).
    """
    ids = rng.integers(0, vocab, size=(batch, seq)).astype(np.int32)
    pos = np.arange(seq)[None, :]
    lengths = np.where(rng.random(batch) < EARLY_END_FRACTION, seq // 2, seq)[:, None]
    attention = pos < lengths
    observation = (pos >= seq // 2) & (pos < seq // 2 + OBSERVATION_TOKENS)
    action = attention & (pos >= seq // 4) & ~observation
    rollout = np.where(action, rng.normal(-6.2, 0.3, size=(batch, seq)), 0.0).astype(np.float32)
    advantages = np.repeat(rng.normal(size=(batch, 1)), seq, axis=1).astype(np.float32)
    return ids, attention, action, rollout, advantages


def jitted_train_step(args):
    """(step, state, batch) of our jitted SPO++ train step on the random benchmark model of
    ``args`` (shape, batch, seq, micro_batches, optional mini_batches = PPO K) and
    `learner_batch` (seed 0)."""
    import tempfile

    import jax.numpy as jnp

    from spopp_jax import learner
    from spopp_jax.models import from_pretrained
    from spopp_jax.models.testing import random_hf_model

    with tempfile.TemporaryDirectory() as folder:
        random_hf_model(learner_hf_config(args), seed=0).save_pretrained(folder)
        model = from_pretrained(folder, dtype="float32")
    batch_np = learner_batch(args.batch, args.seq, args.vocab, np.random.default_rng(0))
    batch = learner.TrainBatch(*(jnp.asarray(x) for x in batch_np))
    config = learner.LearnerConfig(learning_rate=1e-6, action_logits_fraction=None,
                                   num_micro_batches=args.micro_batches,
                                   num_mini_batches=getattr(args, "mini_batches", 1))
    model_def, state = learner.init_train_state(model, config)
    return learner.make_train_step(model_def, config), state, batch
