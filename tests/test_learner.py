"""Learner step (SPEC 5): log-prob gather, GLOBAL token-mean over micro-batches, AdamW with
global-norm clipping, old-policy sources, SFT step; references in NumPy float64 written here
from the SPEC formulas, and transformers' PyTorch Qwen3 for the gradients."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from spopp_jax import learner
from spopp_jax.models import from_pretrained, init_model
from spopp_jax.models.testing import random_hf_model, tiny_config, tiny_hf_config

VOCAB = 128
B, T = 8, 28
# Action tokens per row: with 4 strided micro-batches (rows m, m+4) the micro-batches hold
# 1+3, 5+20, 11+2, 0+7 = 4, 25, 13, 7 action tokens -- very unequal on purpose.
ACTION_LENGTHS = (1, 5, 11, 0, 3, 20, 2, 7)
TINY = dict(vocab_size=VOCAB, num_hidden_layers=1)  # 1 layer: compile time dominates the tests


def make_batch(seed=0, lengths=ACTION_LENGTHS, batch=B, length=T, vocab=VOCAB, logp_noise=0.8):
    """Rows: prompt (2-4 tokens), then `lengths[b]` action tokens interleaved with one
    observation token in the middle, then right padding. rollout_logp is filled later."""
    rng = np.random.default_rng(seed)
    input_ids = rng.integers(0, vocab, size=(batch, length)).astype(np.int32)
    attention_mask = np.zeros((batch, length), bool)
    action_mask = np.zeros((batch, length), bool)
    for b, n_act in enumerate(lengths):
        prompt = 2 + b % 3
        pos = prompt
        for i in range(n_act):
            if i == n_act // 2 and n_act > 2:
                pos += 1  # an environment observation token inside the trajectory
            action_mask[b, pos] = True
            pos += 1
        attention_mask[b, :pos] = True
    advantages = np.repeat(rng.normal(size=(batch, 1)), length, axis=1).astype(np.float32)
    noise = rng.normal(scale=logp_noise, size=(batch, length)).astype(np.float32)
    return (
        learner.TrainBatch(
            input_ids=jnp.asarray(input_ids),
            attention_mask=jnp.asarray(attention_mask),
            action_mask=jnp.asarray(action_mask),
            rollout_logp=jnp.zeros((batch, length), jnp.float32),
            advantages=jnp.asarray(advantages),
        ),
        noise,
    )


@pytest.fixture(scope="module")
def tiny():
    """(model_def, params) of a tiny random Qwen3 and a batch whose rollout log-probs are
    the current policy's log-probs plus noise (so the IS weight varies and truncates)."""
    model = init_model(tiny_config("qwen3", **TINY), seed=0)
    model_def, params = learner.split_model(model)
    batch, noise = make_batch()
    logp = learner.make_compute_logprobs(model_def)(params, batch)
    rollout = np.where(np.asarray(batch.action_mask), np.asarray(logp) + noise, 0.0)
    batch = dataclasses.replace(batch, rollout_logp=jnp.asarray(rollout, jnp.float32))
    return model_def, params, batch, np.asarray(logp, np.float64)


def copy_tree(tree):
    return jax.tree.map(jnp.copy, tree)


def assert_trees_close(a, b, rtol, atol):
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        np.testing.assert_allclose(
            np.asarray(x), np.asarray(y), rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path)
        )


def max_tree_diff(a, b):
    return max(
        float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


_LOSS_AND_GRAD_CACHE = {}


def _cached_loss_and_grad(model_def, num_micro_batches, objective="policy"):
    key = (id(model_def), num_micro_batches, objective)
    if key not in _LOSS_AND_GRAD_CACHE:
        config = learner.LearnerConfig(learning_rate=1e-6, num_mini_batches=1, action_logits_fraction=None,
                                       num_micro_batches=num_micro_batches)
        _LOSS_AND_GRAD_CACHE[key] = learner.make_loss_and_grad(model_def, config, objective)
    return _LOSS_AND_GRAD_CACHE[key]


# ----------------------------------------------------------------------------- numpy references


def np_log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def np_policy_token_loss(logp, old_logp, rollout_logp, adv, clip_low, clip_high, dual_clip, is_cap):
    """SPEC 5 per-token loss w·(−s), float64."""
    ratio = np.exp(logp - old_logp)
    surrogate = np.minimum(ratio * adv, np.clip(ratio, 1 - clip_low, 1 + clip_high) * adv)
    if dual_clip is not None:
        surrogate = np.where(adv < 0, np.maximum(surrogate, dual_clip * adv), surrogate)
    weight = np.minimum(np.exp(old_logp - rollout_logp), is_cap)
    return weight * -surrogate


# ----------------------------------------------------------------------------- token_logprobs


def test_token_logprobs_matches_float64_log_softmax(maybe_jit, np_rng):
    logits = np_rng.normal(scale=5.0, size=(3, 7, 11)).astype(np.float32)
    logits[0, 2, 4] = 1e4  # huge logit: lse must stay finite
    ids = np_rng.integers(0, 11, size=(3, 7)).astype(np.int32)
    got = np.asarray(maybe_jit(learner.token_logprobs)(jnp.asarray(logits), jnp.asarray(ids)))
    ref = np.zeros((3, 7))
    lsm = np_log_softmax(logits)
    for b in range(3):
        for t in range(1, 7):
            ref[b, t] = lsm[b, t - 1, ids[b, t]]
    assert got.dtype == np.float32 and got.shape == (3, 7)
    assert np.all(got[:, 0] == 0.0)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)


def test_token_logprobs_checks_shapes():
    with pytest.raises(ValueError, match="input_ids"):
        learner.token_logprobs(jnp.zeros((2, 5, 7)), jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ValueError, match="logits"):
        learner.token_logprobs(jnp.zeros((2, 5)), jnp.zeros((2, 5), jnp.int32))
    with pytest.raises(ValueError, match="input_ids"):
        learner.token_logprobs(jnp.zeros((2, 5, 7)), jnp.zeros((2, 5), jnp.float32))



def test_chunked_token_logprobs_checks_shapes():
    def head(params, hidden):
        return hidden

    with pytest.raises(ValueError, match="leading \\[B, T\\] must match"):
        learner.chunked_token_logprobs(head, {}, jnp.zeros((2, 5, 7)), jnp.zeros((2, 4), jnp.int32), 2)
    with pytest.raises(ValueError, match="hidden"):
        learner.chunked_token_logprobs(head, {}, jnp.zeros((2, 5)), jnp.zeros((2, 5), jnp.int32), 2)
    with pytest.raises(ValueError, match="input_ids"):
        learner.chunked_token_logprobs(head, {}, jnp.zeros((2, 5, 7)), jnp.zeros((2, 5), jnp.float32), 2)

def test_compute_logprobs_matches_transformers(tmp_path):
    """The learner's log-probs of the sampled tokens equal transformers' Qwen3 log_softmax."""
    hf_model = random_hf_model(tiny_hf_config("qwen3", vocab_size=VOCAB), seed=3)
    hf_model.save_pretrained(tmp_path)
    model_def, params = learner.split_model(from_pretrained(str(tmp_path)))
    batch, _ = make_batch(seed=4)
    got = np.asarray(learner.make_compute_logprobs(model_def)(params, batch))
    with torch.no_grad():
        logits = hf_model(
            input_ids=torch.as_tensor(np.asarray(batch.input_ids), dtype=torch.long),
            attention_mask=torch.as_tensor(np.asarray(batch.attention_mask), dtype=torch.long),
        ).logits.double()
    lsm = torch.log_softmax(logits, -1).numpy()
    ids = np.asarray(batch.input_ids)
    ref = np.zeros(ids.shape)
    ref[:, 1:] = np.take_along_axis(lsm[:, :-1], ids[:, 1:, None], -1)[..., 0]
    ref = np.where(np.asarray(batch.action_mask), ref, 0.0)
    np.testing.assert_allclose(got, ref, atol=2e-4, rtol=0)


# ----------------------------------------------------------------------------- global token-mean


def test_loss_is_global_token_mean_of_spec_formula(tiny):
    """Default config, old = current policy (r = 1): loss = −Σ w·Â / N over ALL action tokens."""
    model_def, params, batch, logp = tiny
    loss, _, metrics = _cached_loss_and_grad(model_def, 4)(params, batch)
    mask = np.asarray(batch.action_mask)
    per_token = np_policy_token_loss(
        logp,
        logp,
        np.asarray(batch.rollout_logp, np.float64),
        np.asarray(batch.advantages),
        0.2,
        0.28,
        2.0,
        2.0,
    )
    expected = per_token[mask].sum() / mask.sum()
    assert int(metrics["tokens"]) == sum(ACTION_LENGTHS)
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5, atol=1e-6)
    # IS weight metrics aggregated over the whole batch, not per micro-batch.
    weight = np.minimum(np.exp(logp - np.asarray(batch.rollout_logp, np.float64)), 2.0)[mask]
    np.testing.assert_allclose(float(metrics["importance_weight_mean"]), weight.mean(), rtol=1e-5)
    raw = np.exp(logp - np.asarray(batch.rollout_logp, np.float64))[mask]
    np.testing.assert_allclose(float(metrics["is_truncated_frac"]), (raw > 2.0).mean(), rtol=1e-6)
    assert 0 < (raw > 2.0).sum() < mask.sum()  # the batch exercises truncation


def buggy_per_micro_batch_mean(model_def, params, batch, num_micro_batches):
    """The verl PR #906 bug: the mean over micro-batches of each micro-batch's own
    token-mean (each micro-batch normalised by its own action-token count)."""
    micro_batches = learner.split_micro_batches(batch, num_micro_batches)
    per_micro = [
        _cached_loss_and_grad(model_def, 1)(params, jax.tree.map(lambda x: x[m], micro_batches))
        for m in range(num_micro_batches)
    ]
    loss = np.mean([float(loss) for loss, _, _ in per_micro])
    grads = jax.tree.map(lambda *g: sum(g) / num_micro_batches, *[g for _, g, _ in per_micro])
    return loss, grads


def test_micro_batches_of_unequal_token_counts_give_the_full_batch_gradient(tiny):
    """1 vs 4 micro-batches with 4/25/13/7 action tokens: same loss and gradients; the
    per-micro-batch mean (verl PR #906) gives a clearly different loss and gradient."""
    model_def, params, batch, _ = tiny
    one = _cached_loss_and_grad(model_def, 1)
    four = _cached_loss_and_grad(model_def, 4)
    loss1, grads1, m1 = one(params, batch)
    loss4, grads4, m4 = four(params, batch)
    np.testing.assert_allclose(float(loss4), float(loss1), rtol=1e-5, atol=1e-7)
    assert_trees_close(grads4, grads1, rtol=1e-4, atol=1e-7)
    for key in m1:
        np.testing.assert_allclose(
            float(m4[key]), float(m1[key]), rtol=1e-5, atol=1e-7, err_msg=key
        )

    counts = np.asarray(learner.split_micro_batches(batch, 4).action_mask).sum(axis=(1, 2))
    assert sorted(counts.tolist()) == [4, 7, 13, 25]
    bug_loss, bug_grads = buggy_per_micro_batch_mean(model_def, params, batch, 4)
    scale = max(abs(float(loss1)), 1e-3)
    assert abs(float(bug_loss) - float(loss1)) > 0.05 * scale
    grad_scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads1))
    assert max_tree_diff(bug_grads, grads1) > 0.05 * grad_scale


@settings(max_examples=8, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 18), min_size=B, max_size=B).filter(lambda v: sum(v) > 0),
    num_micro_batches=st.sampled_from([4, 8]),
    seed=st.integers(0, 2**16),
)
def test_property_micro_batching_never_changes_loss_or_grads(
    tiny, lengths, num_micro_batches, seed
):
    model_def, params, _, _ = tiny
    batch, noise = make_batch(seed=seed, lengths=lengths)
    batch = dataclasses.replace(batch, rollout_logp=jnp.asarray(noise) * batch.action_mask)
    loss1, grads1, _ = _cached_loss_and_grad(model_def, 1)(params, batch)
    lossm, gradsm, _ = _cached_loss_and_grad(model_def, num_micro_batches)(params, batch)
    np.testing.assert_allclose(float(lossm), float(loss1), rtol=1e-5, atol=1e-6)
    assert_trees_close(gradsm, grads1, rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------- old-policy sources


def test_recomputed_old_logp_equals_current_source(tiny):
    """old_logp = compute_logprobs(params) (one extra forward) == the free "current" source."""
    model_def, params, batch, _ = tiny
    old_logp = learner.make_compute_logprobs(model_def)(params, batch)
    recomputed = dataclasses.replace(batch, old_logp=old_logp)
    loss_a, grads_a, _ = _cached_loss_and_grad(model_def, 2)(params, recomputed)
    loss_b, grads_b, _ = _cached_loss_and_grad(model_def, 2)(params, batch)
    np.testing.assert_allclose(float(loss_a), float(loss_b), rtol=1e-6)
    assert_trees_close(grads_a, grads_b, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("source", ["given", "rollout"])
def test_clip_and_dual_clip_config_reach_the_loss(tiny, source):
    """Off-policy ratios hit both clips and the dual clip; the loss equals the SPEC formula
    with the configured (non-default) constants."""
    model_def, params, batch, logp = tiny
    mask = np.asarray(batch.action_mask)
    shift = np.random.default_rng(7).uniform(-1.5, 1.5, size=mask.shape)
    old = np.where(mask, logp + shift, 0.0)
    if source == "given":
        batch = dataclasses.replace(batch, old_logp=jnp.asarray(old, jnp.float32))
        rollout = np.asarray(batch.rollout_logp, np.float64)
    else:
        batch = dataclasses.replace(batch, rollout_logp=jnp.asarray(old, jnp.float32))
        rollout = old
    config = learner.LearnerConfig(learning_rate=1e-6, num_mini_batches=1, action_logits_fraction=None,
        num_micro_batches=4,
        clip_low=0.1,
        clip_high=0.15,
        dual_clip=3.0,
        is_cap=1.5,
        old_logp_source="rollout",
    )
    loss, _, metrics = learner.make_loss_and_grad(model_def, config)(params, batch)
    per_token = np_policy_token_loss(
        logp, old, rollout, np.asarray(batch.advantages), 0.1, 0.15, 3.0, 1.5
    )
    np.testing.assert_allclose(
        float(loss), per_token[mask].sum() / mask.sum(), rtol=1e-4, atol=1e-6
    )
    ratio = np.exp(logp - old)[mask]
    adv = np.asarray(batch.advantages)[mask]
    expected_upper = ((adv > 0) & (ratio > 1.15)).mean()
    np.testing.assert_allclose(float(metrics["clip_upper_frac"]), expected_upper, rtol=1e-6)
    assert float(metrics["dual_clip_frac"]) > 0
    assert float(metrics["clip_upper_frac"]) > 0


# ----------------------------------------------------------------------------- optimizer


def test_train_step_is_clipped_adamw_of_the_gradient(tiny):
    """One step: p' = p − lr·(m̂/(√v̂+ε) + wd·p) with g scaled by min(1, c/‖g‖) (hand-derived)."""
    model_def, params, batch, _ = tiny
    config = learner.LearnerConfig(num_mini_batches=1, action_logits_fraction=None,
        learning_rate=1e-2, weight_decay=0.1, max_grad_norm=1e-3, num_micro_batches=2
    )
    _, grads, _ = learner.make_loss_and_grad(model_def, config)(params, batch)
    norm = np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(grads)))
    assert norm > 1e-3  # clipping binds
    model = init_model(tiny_config("qwen3", **TINY), seed=0)
    _, state = learner.init_train_state(model, config, policy_event=5)
    new_state, metrics = learner.make_train_step(model_def, config)(state, batch)
    np.testing.assert_allclose(float(metrics["grad_norm"]), norm, rtol=1e-5)
    assert int(new_state.step) == 1 and int(new_state.policy_event) == 5
    b1, b2, eps = config.adam_b1, config.adam_b2, config.adam_eps
    for (path, p), g, p_new in zip(
        jax.tree_util.tree_flatten_with_path(params)[0],
        jax.tree.leaves(grads),
        jax.tree.leaves(new_state.params),
    ):
        p = np.asarray(p, np.float64)
        g = np.asarray(g, np.float64) * (1e-3 / norm)
        m_hat = (1 - b1) * g / (1 - b1)
        v_hat = (1 - b2) * g**2 / (1 - b2)
        expected = p - 1e-2 * (m_hat / (np.sqrt(v_hat) + eps) + 0.1 * p)
        np.testing.assert_allclose(
            np.asarray(p_new), expected, rtol=1e-5, atol=2e-6, err_msg=jax.tree_util.keystr(path)
        )


def test_train_step_donates_state_and_keeps_training(tiny):
    model_def, _, batch, _ = tiny
    config = learner.LearnerConfig(num_mini_batches=1, action_logits_fraction=None, learning_rate=1e-3)
    _, state = learner.init_train_state(init_model(tiny_config("qwen3", **TINY)), config)
    step = learner.make_train_step(model_def, config)
    first_leaf = jax.tree.leaves(state.params)[0]
    losses = []
    for _ in range(3):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert first_leaf.is_deleted()  # the input buffers were donated
    assert int(state.step) == 3
    assert step._cache_size() == 1  # compiled once: the first state is placed as the step's outputs are
    assert losses[2] < losses[0]  # minimising the surrogate on a fixed batch


def test_a_state_from_loaded_weights_compiles_the_step_once(tmp_path):
    """Weights loaded onto a device (committed) beside the optimizer's fresh zeros and the
    step counters: the first state is committed to that device, as the step's outputs are,
    so the second call reuses the first compilation."""
    random_hf_model(tiny_hf_config(**TINY), seed=0).save_pretrained(tmp_path)
    config = learner.LearnerConfig(num_mini_batches=1, action_logits_fraction=None)
    model_def, state = learner.init_train_state(from_pretrained(str(tmp_path), dtype="float32"), config)
    assert all(leaf.committed for leaf in jax.tree.leaves(state))
    step = learner.make_train_step(model_def, config)
    batch, _ = make_batch()
    for _ in range(2):
        state, _ = step(state, batch)
    assert step._cache_size() == 1


# ----------------------------------------------------------------------------- SFT


def test_sft_step_is_token_mean_cross_entropy_over_action_tokens(tiny):
    model_def, params, batch, logp = tiny
    mask = np.asarray(batch.action_mask)
    expected = -logp[mask].sum() / mask.sum()
    config = learner.LearnerConfig(num_mini_batches=1, action_logits_fraction=None,
                                   learning_rate=1e-3, num_micro_batches=4)
    loss4, _, metrics = _cached_loss_and_grad(model_def, 4, "sft")(params, batch)
    np.testing.assert_allclose(float(loss4), expected, rtol=1e-5)
    assert int(metrics["tokens"]) == mask.sum()
    _, state = learner.init_train_state(init_model(tiny_config("qwen3", **TINY)), config)
    state, metrics = learner.make_sft_step(model_def, config)(state, batch)
    np.testing.assert_allclose(float(metrics["loss"]), expected, rtol=1e-5)
    after_loss, _, _ = _cached_loss_and_grad(model_def, 4, "sft")(state.params, batch)
    assert float(after_loss) < expected


# ----------------------------------------------------------------------------- vs transformers


def _hf_name(path):
    """Our param path -> transformers parameter name and whether it is transposed."""
    name = ".".join(path)
    if name.endswith(".kernel"):
        return name[: -len("kernel")] + "weight", True
    return name.rsplit(".", 1)[0] + ".weight", False


def test_policy_and_sft_gradients_match_transformers_torch(tmp_path):
    """Our loss/grads vs the SPEC 5 loss written in torch on transformers' Qwen3 (same weights)."""
    hf_model = random_hf_model(tiny_hf_config("qwen3", vocab_size=VOCAB), seed=1)
    hf_model.save_pretrained(tmp_path)
    model_def, params = learner.split_model(from_pretrained(str(tmp_path)))
    batch, noise = make_batch(seed=2)
    mask_np = np.asarray(batch.action_mask)
    shift = np.random.default_rng(3).uniform(-0.6, 0.6, size=mask_np.shape)
    logp0 = np.asarray(learner.make_compute_logprobs(model_def)(params, batch), np.float64)
    old = np.where(mask_np, logp0 + shift, 0.0).astype(np.float32)
    rollout = np.where(mask_np, old + noise, 0.0).astype(np.float32)
    batch = dataclasses.replace(batch, old_logp=jnp.asarray(old), rollout_logp=jnp.asarray(rollout))
    config = learner.LearnerConfig(learning_rate=1e-6, num_mini_batches=1, action_logits_fraction=None,
                                   num_micro_batches=2)
    loss, grads, _ = learner.make_loss_and_grad(model_def, config)(params, batch)
    sft_loss, sft_grads, _ = learner.make_loss_and_grad(model_def, config, "sft")(params, batch)

    ids = torch.as_tensor(np.asarray(batch.input_ids), dtype=torch.long)
    logits = hf_model(
        input_ids=ids,
        attention_mask=torch.as_tensor(np.asarray(batch.attention_mask), dtype=torch.long),
    ).logits
    logp = torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    mask = torch.as_tensor(mask_np[:, 1:])
    old_t, roll_t = torch.as_tensor(old[:, 1:]).double(), torch.as_tensor(rollout[:, 1:]).double()
    adv = torch.as_tensor(np.asarray(batch.advantages)[:, 1:]).double()
    ratio = torch.exp(logp - old_t)
    surr = torch.minimum(ratio * adv, torch.clamp(ratio, 0.8, 1.28) * adv)
    surr = torch.where(adv < 0, torch.maximum(surr, 2.0 * adv), surr)
    weight = torch.clamp(torch.exp(old_t - roll_t), max=2.0)
    torch_loss = (weight * -surr)[mask].sum() / mask.sum()
    torch_sft = -logp[mask].sum() / mask.sum()
    named = dict(hf_model.named_parameters())
    torch_grads = torch.autograd.grad(torch_loss, list(named.values()), retain_graph=True)
    torch_sft_grads = torch.autograd.grad(torch_sft, list(named.values()))
    by_name = dict(zip(named, torch_grads))
    sft_by_name = dict(zip(named, torch_sft_grads))

    np.testing.assert_allclose(float(loss), float(torch_loss), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(float(sft_loss), float(torch_sft), rtol=1e-5)
    flat = learner._flatten_pure(grads)
    sft_flat = dict(learner._flatten_pure(sft_grads))
    assert len(flat) == len(named)
    for path, g in flat:
        name, transposed = _hf_name(path)
        for ours, ref in ((g, by_name[name]), (sft_flat[path], sft_by_name[name])):
            ref = ref.numpy().T if transposed else ref.numpy()
            scale = np.abs(ref).max() + 1e-12
            np.testing.assert_allclose(
                np.asarray(ours), ref, atol=2e-4 * scale, rtol=0, err_msg=name
            )


# ----------------------------------------------------------------------------- validation


def test_config_and_batch_validation(tiny):
    model_def, params, batch, _ = tiny
    with pytest.raises(ValueError, match="num_micro_batches"):
        learner.LearnerConfig(num_micro_batches=0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        learner.LearnerConfig(max_grad_norm=0.0)
    with pytest.raises(ValueError, match="old_logp_source"):
        learner.LearnerConfig(old_logp_source="engine")
    with pytest.raises(ValueError, match="num_micro_batches=3"):
        learner.make_loss_and_grad(model_def, learner.LearnerConfig(num_mini_batches=1, num_micro_batches=3))(
            params, batch
        )
    bad = dataclasses.replace(batch, advantages=batch.advantages[:, :-1])
    with pytest.raises(ValueError, match="advantages"):
        learner.make_loss_and_grad(model_def, learner.LearnerConfig())(params, bad)
    bad = dataclasses.replace(batch, rollout_logp=batch.action_mask)
    with pytest.raises(ValueError, match="rollout_logp"):
        learner.make_loss_and_grad(model_def, learner.LearnerConfig())(params, bad)
    with pytest.raises(ValueError, match="objective"):
        learner.make_loss_and_grad(model_def, learner.LearnerConfig(), "dpo")(params, batch)


# ----------------------------------------------------------------------------- chunked head

CHUNK = 5  # T - 1 = 27 shifted positions: 6 chunks, the last one padded by 3


@pytest.mark.parametrize("chunk_size", [1, 4, 27, 40])
def test_chunked_token_logprobs_matches_float64_log_softmax(maybe_jit, np_rng, chunk_size):
    batch, length, width, vocab = 3, 28, 6, 11
    hidden = np_rng.normal(size=(batch, length, width)).astype(np.float32)
    kernel = np_rng.normal(scale=3.0, size=(width, vocab)).astype(np.float32)
    ids = np_rng.integers(0, vocab, size=(batch, length)).astype(np.int32)
    logits = hidden.astype(np.float64) @ kernel.astype(np.float64)
    expected = np.zeros((batch, length))
    for b in range(batch):
        for t in range(1, length):  # position t reads the logits of position t-1
            expected[b, t] = np_log_softmax(logits[b, t - 1])[ids[b, t]]

    def head(p, h):
        return jnp.einsum("...h,hv->...v", h, p["kernel"])

    fn = maybe_jit(
        lambda p, h, i: learner.chunked_token_logprobs(head, p, h, i, chunk_size)
    )
    got = fn({"kernel": jnp.asarray(kernel)}, jnp.asarray(hidden), jnp.asarray(ids))
    assert got.shape == (batch, length) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)


def _check_chunking_keeps_logprobs_and_gradient(length, chunk_size, seed, transform):
    """Chunked token log-probs and the gradient of a weighted sum of them equal the
    unchunked ones (values, d/dkernel, d/dhidden), with every function under `transform`."""
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.normal(size=(2, length, 4)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(4, 9)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 9, size=(2, length)), jnp.int32)
    weights = jnp.asarray(rng.normal(size=(2, length)), jnp.float32)

    def head(p, h):
        return h @ p

    def full(p, h):
        return jnp.sum(weights * learner.token_logprobs(head(p, h), ids))

    def chunked(p, h):
        return jnp.sum(weights * learner.chunked_token_logprobs(head, p, h, ids, chunk_size))

    np.testing.assert_allclose(
        np.asarray(transform(lambda k, h: learner.chunked_token_logprobs(head, k, h, ids, chunk_size))(kernel, hidden)),
        np.asarray(transform(lambda k, h: learner.token_logprobs(head(k, h), ids))(kernel, hidden)),
        rtol=1e-5,
        atol=1e-5,
    )
    for want, got in zip(
        transform(jax.grad(full, argnums=(0, 1)))(kernel, hidden),
        transform(jax.grad(chunked, argnums=(0, 1)))(kernel, hidden),
    ):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


@settings(max_examples=10, deadline=None)
@given(
    length=st.integers(1, 13),
    chunk_size=st.integers(1, 15),
    seed=st.integers(0, 2**16),
)
def test_property_chunking_never_changes_token_logprobs_or_their_gradient(
    length, chunk_size, seed
):
    """Jitted: each example has new shapes, and one compile of the whole function is ~6x
    cheaper than op-by-op dispatch (the eager path is the fixed case below)."""
    _check_chunking_keeps_logprobs_and_gradient(length, chunk_size, seed, jax.jit)


def test_chunking_keeps_logprobs_and_gradient_eager_and_jitted(maybe_jit):
    _check_chunking_keeps_logprobs_and_gradient(13, 4, 7, maybe_jit)   # 4 chunks, the last one ragged


def test_chunked_compute_logprobs_equals_full_logits(tiny):
    model_def, params, batch, logp = tiny
    chunked = learner.make_compute_logprobs(model_def, logprob_chunk_size=CHUNK)(params, batch)
    full = learner.make_compute_logprobs(model_def)(params, batch)
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(full), rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(chunked)).sum() > 0  # not vacuous: real action tokens


@pytest.mark.parametrize("objective", ["policy", "sft"])
@pytest.mark.parametrize("num_micro_batches", [1, 4])
def test_chunked_loss_and_grads_equal_full_logits(tiny, objective, num_micro_batches):
    """Chunked (and chunked x micro-batched) == the unchunked single micro-batch."""
    model_def, params, batch, _ = tiny
    loss, grads, metrics = _cached_loss_and_grad(model_def, 1, objective)(params, batch)
    config = learner.LearnerConfig(learning_rate=1e-6, num_mini_batches=1, action_logits_fraction=None,
        num_micro_batches=num_micro_batches, logprob_chunk_size=CHUNK
    )
    c_loss, c_grads, c_metrics = learner.make_loss_and_grad(model_def, config, objective)(
        params, batch
    )
    np.testing.assert_allclose(float(c_loss), float(loss), rtol=1e-5)
    assert int(c_metrics["tokens"]) == int(metrics["tokens"])
    assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads)) > 1e-4
    assert_trees_close(c_grads, grads, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("objective", ["policy", "sft"])
def test_chunked_train_step_equals_full_logits_step(tiny, objective):
    model_def, params, batch, _ = tiny
    make = learner.make_train_step if objective == "policy" else learner.make_sft_step
    results = []
    for chunk in (None, CHUNK):
        config = learner.LearnerConfig(num_mini_batches=1, action_logits_fraction=None,
                                       learning_rate=1e-3, logprob_chunk_size=chunk)
        state = learner.TrainState(
            params=copy_tree(params),
            opt_state=learner.make_optimizer(config).init(params),
            step=jnp.zeros((), jnp.int32),
            policy_event=jnp.zeros((), jnp.int32),
        )
        results.append(make(model_def, config)(state, batch))
    (full_state, full_metrics), (chunk_state, chunk_metrics) = results
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(
            float(chunk_metrics[key]), float(full_metrics[key]), rtol=1e-5, err_msg=key
        )
    assert_trees_close(chunk_state.params, full_state.params, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- action-only head


def _check_action_head_keeps_logprobs_and_gradient(length, capacity, seed, transform):
    """`action_token_logprobs` == the full head's log-probs on the action mask (0 off it),
    and the gradient of a weighted sum of them too (d/dkernel, d/dhidden), whether the
    gathered path runs (every row has <= capacity action tokens) or the full one."""
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.normal(size=(3, length, 4)), jnp.float32)
    kernel = jnp.asarray(rng.normal(scale=2.0, size=(4, 9)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 9, size=(3, length)), jnp.int32)
    mask = jnp.asarray(rng.random((3, length)) < 0.4)
    weights = jnp.asarray(rng.normal(size=(3, length)), jnp.float32)

    def head(p, h):
        return h @ p

    def full(p, h):
        return jnp.where(mask, learner.token_logprobs(head(p, h), ids), 0.0).at[:, 0].set(0.0)

    def gathered(p, h):
        return learner.action_token_logprobs(head, p, h, ids, mask, capacity)

    np.testing.assert_allclose(np.asarray(transform(gathered)(kernel, hidden)),
                               np.asarray(transform(full)(kernel, hidden)), rtol=1e-6, atol=1e-6)
    for want, got in zip(transform(jax.grad(lambda p, h: jnp.sum(weights * full(p, h)), argnums=(0, 1)))(kernel, hidden),
                         transform(jax.grad(lambda p, h: jnp.sum(weights * gathered(p, h)), argnums=(0, 1)))(kernel, hidden)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


@settings(max_examples=12, deadline=None)
@given(length=st.integers(2, 16), capacity_share=st.floats(0.05, 1.0), seed=st.integers(0, 2**16))
def test_property_action_head_never_changes_action_logprobs_or_their_gradient(length, capacity_share, seed):
    """Capacities below and above the rows' action counts: the full-path fallback included."""
    _check_action_head_keeps_logprobs_and_gradient(length, max(1, int(capacity_share * length)), seed, jax.jit)


@pytest.mark.parametrize("capacity", [2, 16])   # 16 positions: gathered; 2: some row has more (full path)
def test_action_head_keeps_logprobs_and_gradient_eager_and_jitted(maybe_jit, capacity):
    _check_action_head_keeps_logprobs_and_gradient(16, capacity, 3, maybe_jit)


def test_action_head_checks_capacity_and_shapes():
    hidden, ids, mask = jnp.zeros((2, 5, 3)), jnp.zeros((2, 5), jnp.int32), jnp.zeros((2, 5), bool)
    for capacity in (0, 6, 2.5):
        with pytest.raises(ValueError, match="capacity"):
            learner.action_token_logprobs(lambda p, h: h, None, hidden, ids, mask, capacity)
    with pytest.raises(ValueError, match="hidden"):
        learner.action_token_logprobs(lambda p, h: h, None, hidden[:, :4], ids, mask, 2)
    assert [learner.action_capacity(t, 0.25) for t in (1, 8, 28, 1536)] == [1, 8, 8, 384]
    with pytest.raises(ValueError, match="action_logits_fraction"):
        learner.LearnerConfig(action_logits_fraction=0.0)


def test_action_head_compute_logprobs_equals_full_logits(tiny):
    """The tiny batch's longest row has 20 action tokens: fraction 0.75 (capacity 24 of 28)
    gathers, 0.25 (8) falls back to the full head; both equal the full logits."""
    model_def, params, batch, _ = tiny
    full = learner.make_compute_logprobs(model_def)(params, batch)
    for fraction in (0.75, 0.25):
        got = learner.make_compute_logprobs(model_def, action_logits_fraction=fraction)(params, batch)
        np.testing.assert_allclose(np.asarray(got), np.asarray(full), rtol=1e-5, atol=1e-6)
    assert np.abs(np.asarray(full)).sum() > 0


@pytest.mark.parametrize("num_mini_batches", [1, 4])
def test_action_head_train_step_equals_full_logits_step(tiny, num_mini_batches):
    """The policy train step (K = 1 and K = 4 PPO mini-batches) with the action-only head
    gives the full head's loss, gradient norm and new parameters."""
    model_def, params, batch, _ = tiny
    results = []
    for fraction in (None, 0.75):
        config = learner.LearnerConfig(learning_rate=1e-3, num_mini_batches=num_mini_batches,
                                       action_logits_fraction=fraction, num_micro_batches=1)
        state = learner.TrainState(
            params=copy_tree(params),
            opt_state=learner.make_optimizer(config).init(params),
            step=jnp.zeros((), jnp.int32),
            policy_event=jnp.zeros((), jnp.int32),
        )
        results.append(learner.make_train_step(model_def, config)(state, batch))
    (full_state, full_metrics), (state, metrics) = results
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(float(metrics[key]), float(full_metrics[key]), rtol=1e-5, err_msg=key)
    assert float(full_metrics["grad_norm"]) > 1e-4
    assert_trees_close(state.params, full_state.params, rtol=1e-5, atol=1e-6)


def _array_shapes(jaxpr):
    """Shapes of every value in a jaxpr, its sub-jaxprs (scan/remat bodies) included."""
    shapes = set()
    for eqn in jaxpr.eqns:
        shapes.update(tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
        for sub in jax.core.jaxprs_in_params(eqn.params):
            shapes |= _array_shapes(sub)
    return shapes


def test_chunked_gradient_never_builds_full_logits():
    """No value of the chunked loss-and-gradient jaxpr (remat/scan bodies included) has a
    vocabulary axis with more than one chunk of positions in front of it."""
    vocab = 97  # a size no other axis of the tiny model has
    model_def, params = learner.split_model(
        init_model(tiny_config("qwen3", vocab_size=vocab, num_hidden_layers=1))
    )
    batch, _ = make_batch(vocab=vocab)

    def shapes(chunk):
        config = learner.LearnerConfig(learning_rate=1e-6, num_mini_batches=1, action_logits_fraction=None,
                                       logprob_chunk_size=chunk, num_micro_batches=1)
        fn = lambda p, b: learner.loss_and_grads(model_def, p, b, config, "policy")
        found = _array_shapes(jax.make_jaxpr(fn)(params, batch).jaxpr)
        return {s for s in found if len(s) == 3 and s[-1] == vocab}

    assert (B, T - 1, vocab) in shapes(None)  # the check can fail
    assert shapes(CHUNK) == {(B, CHUNK, vocab)}


def test_logprob_chunk_size_validation():
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="logprob_chunk_size"):
            learner.LearnerConfig(logprob_chunk_size=bad)
    assert learner.LearnerConfig(logprob_chunk_size=1).logprob_chunk_size == 1
