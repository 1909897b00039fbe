"""The learner batch every learner benchmark times (learner_step.py, learner_ab.py)."""

from __future__ import annotations

import numpy as np

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
