"""Degenerate input to the library's jitted entry points (`spopp_jax.advantages.whiten`,
`whiten_tokens`, `spopp_jax.losses.policy_loss`): what each does eagerly and under jit,
where value checks cannot look at the numbers. The rule: a setting that would silently
disable or invert learning (a negative or infinite eps) is refused whenever it is a
Python number; a non-finite value or a negative length under jit poisons the result
(NaN), so the learner's guard skips the update and counts it, never a silent all-zero or
sign-flipped batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reliability_table import Row, covers

from spopp_jax.advantages import whiten, whiten_tokens
from spopp_jax.losses import policy_loss

ADV = np.array([1.0, -0.5, 2.0, 0.25], np.float32)
LENGTHS = np.array([3, 1, 2, 4], np.int32)


@covers(
    Row("library input", "`whiten(..., eps=-1)` / `eps=inf` / `eps=nan` (and `--advantage.whiten_eps` reaching it)",
        "ValueError: '`eps` must be finite and >= 0, got -1.0 (a negative eps flips the advantages' signs, an "
        "infinite one makes them all 0)', eagerly and under jit (eps is a Python number)",
        "no sign-flipped or all-zero advantages reach the loss"),
    Row("library input", "`whiten_tokens` with a negative or infinite eps",
        "the same ValueError", "as above"),
)
@pytest.mark.parametrize("eps", [-1.0, float("inf"), float("nan")])
def test_bad_eps_is_refused(maybe_jit, eps):
    with pytest.raises(ValueError, match="`eps` must be finite and >= 0"):
        maybe_jit(lambda a, n: whiten(a, n, "token", eps))(ADV, LENGTHS)
    ids = np.repeat(np.arange(4), 2).astype(np.int32)
    with pytest.raises(ValueError, match="`eps` must be finite and >= 0"):
        maybe_jit(lambda a, s, m: whiten_tokens(a, s, m, 4, "token", eps))(
            np.repeat(ADV, 2), ids, np.ones(8, bool))


@covers(Row("library input", "one NaN advantage among n under jit (eager: ValueError)",
            "every whitened advantage is NaN, never a silently all-zero batch; the learner's guard then skips "
            "the update with `skipped_updates`=1",
            "eager calls still raise '`advantages` must be finite'; under jit the batch is visibly poisoned",
            kind="fault"))
def test_one_nan_advantage_poisons_the_batch_under_jit():
    poisoned = ADV.copy()
    poisoned[1] = np.nan
    for measure in ("token", "trajectory"):
        out = jax.jit(lambda a, n: whiten(a, n, measure))(poisoned, LENGTHS)
        assert np.isnan(np.asarray(out)).all()
        with pytest.raises(ValueError, match="must be finite"):
            whiten(poisoned, LENGTHS, measure)
        clean = jax.jit(lambda a, n: whiten(a, n, measure))(ADV, LENGTHS)
        assert np.isfinite(np.asarray(clean)).all() and np.abs(np.asarray(clean)).sum() > 0


@covers(Row("library input", "a negative action length under jit (eager: ValueError)",
            "every whitened advantage is NaN (a negative token weight would otherwise give a finite, wrong "
            "mean and σ)", "eager calls raise '`action_lengths` must be finite and >= 0'"))
def test_negative_length_poisons_under_jit():
    lengths = LENGTHS.copy()
    lengths[2] = -2
    out = jax.jit(lambda a, n: whiten(a, n, "token"))(ADV, lengths)
    assert np.isnan(np.asarray(out)).all()
    with pytest.raises(ValueError, match="action_lengths"):
        whiten(ADV, lengths, "token")


@covers(
    Row("library input", "an empty batch (n = 0) to `whiten`",
        "ValueError '`advantages` is empty: need at least one trajectory' (a shape: raised under jit too)",
        "nothing computed"),
    Row("library input", "every action length 0 (all masked) under the token measure",
        "Ã = 0 for every trajectory (Σ L = 0), eagerly and under jit", "no NaN from 0/0"),
)
def test_empty_and_all_masked(maybe_jit):
    with pytest.raises(ValueError, match="empty"):
        maybe_jit(lambda a, n: whiten(a, n))(np.zeros(0, np.float32), np.zeros(0, np.int32))
    out = maybe_jit(lambda a, n: whiten(a, n, "token"))(ADV, np.zeros(4, np.int32))
    np.testing.assert_array_equal(np.asarray(out), np.zeros(4, np.float32))


def _loss_inputs(advantage=1.0, mask_value=True):
    logp = jnp.full((2, 5), -1.0)
    mask = jnp.full((2, 5), mask_value)
    return logp, logp, jnp.full((2, 5), advantage, jnp.float32), mask


@covers(
    Row("library input", "`policy_loss` with no action token (all masked, or an empty [0, T] batch) under jit "
        "(eager: ValueError)",
        "loss_sum = 0 and token_count = 0 (the caller divides by the global token count)",
        "no NaN from 0/0 inside the loss"),
    Row("library input", "`policy_loss` with a NaN advantage on an action token under jit (eager: ValueError)",
        "loss_sum is NaN, so the learner's update guard skips the step (`skipped_updates`=1)",
        "the NaN is never masked into a finite, wrong loss"),
)
def test_policy_loss_degenerate_input_under_jit():
    loss = jax.jit(lambda l, o, a, m: policy_loss(l, None, o, a, m)[:2])
    logp, rollout, adv, mask = _loss_inputs(mask_value=False)
    total, count = loss(logp, rollout, adv, mask)
    assert float(total) == 0.0 and int(count) == 0
    with pytest.raises(ValueError, match="no action token"):
        policy_loss(logp, None, rollout, adv, mask)
    empty = jnp.zeros((0, 5))
    total, count = loss(empty, empty, empty, empty > 0)
    assert float(total) == 0.0 and int(count) == 0
    logp, rollout, adv, mask = _loss_inputs()
    adv = adv.at[0, 2].set(jnp.nan)
    total, count = loss(logp, rollout, adv, mask)
    assert np.isnan(float(total)) and int(count) == 10
