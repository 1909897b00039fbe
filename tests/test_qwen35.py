"""Qwen3.5 (hybrid Gated DeltaNet + output-gated attention) against references
nobody here wrote: transformers' PyTorch `Qwen3_5ForCausalLM` / `Qwen3_5ForConditionalGeneration`
(their torch fallbacks `torch_chunk_gated_delta_rule` / `torch_recurrent_gated_delta_rule`)
on tiny random configs built here, and our own full forward for cached decode.

Tolerances (float32, from the issue): logits 1e-4 absolute, gradients 1e-4 of each
tensor's largest torch gradient, cached decode vs full forward 2e-5.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hypothesis import given, settings, strategies as st
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration
from transformers.models.qwen3_5.modeling_qwen3_5 import (torch_chunk_gated_delta_rule,
                                                          torch_recurrent_gated_delta_rule)

from rollout_bridge.engine.base import SamplingParams
from rollout_bridge.engine.jax_engine import JaxEngine
from spopp_jax import learner
from spopp_jax.models import ModelConfig, from_pretrained, init_model, save_pretrained
from spopp_jax.models.cache import LinearAttentionCache
from spopp_jax.models.delta_rule import (gated_delta_chunked, gated_delta_recurrent,
                                         l2_normalise)
from spopp_jax.models.hf_io import hf_tensors, load_parameters
from spopp_jax.models.testing import random_hf_model, tiny_qwen35_hf_config

LOGITS_ATOL = 1e-4
GRAD_RTOL = 1e-4
DECODE_ATOL = 2e-5
VOCAB = 128  # tiny_qwen35_hf_config's vocabulary

# Three shapes: full_attention_interval 4 and 2, tied and untied, different head layouts.
CONFIGS = {
    "interval4-untied": dict(full_attention_interval=4, num_hidden_layers=4),
    "interval2-tied": dict(full_attention_interval=2, num_hidden_layers=4,
                           tie_word_embeddings=True, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=32, linear_num_key_heads=1,
                           linear_num_value_heads=2, linear_key_head_dim=16,
                           linear_value_head_dim=8),
    "interval2-wide": dict(full_attention_interval=2, num_hidden_layers=2,
                           num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                           linear_num_key_heads=4, linear_num_value_heads=4,
                           linear_key_head_dim=8, linear_value_head_dim=8),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (transformers model, folder it was saved to), built once per module."""
    built = {}
    for seed, (name, overrides) in enumerate(CONFIGS.items()):
        hf_model = random_hf_model(tiny_qwen35_hf_config(**overrides), seed=seed)
        folder = tmp_path_factory.mktemp(name)
        hf_model.save_pretrained(folder)
        built[name] = (hf_model, str(folder))
    return built


def load_ours(folder: str, linear_chunk_size: int | None = None, **options):
    config = ModelConfig.from_hf(folder)
    if linear_chunk_size is not None:
        config = dataclasses.replace(config, linear_chunk_size=linear_chunk_size)
    return nnx.merge(*load_parameters(folder, config, **options))


@nnx.jit
def _jitted_forward(model, ids, mask, segment_ids):
    return model(ids, attention_mask=mask, segment_ids=segment_ids)


def forward(model, ids, mask=None, segment_ids=None) -> np.ndarray:
    """float32 logits of our model, jitted (one compile instead of many eager dispatches)."""
    ids = jnp.asarray(ids, jnp.int32)
    mask = jnp.ones(ids.shape, bool) if mask is None else jnp.asarray(mask)
    segment_ids = (jnp.zeros(ids.shape, jnp.int32) if segment_ids is None
                   else jnp.asarray(segment_ids, jnp.int32))
    return np.asarray(_jitted_forward(model, ids, mask, segment_ids))


def torch_logits(hf_model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()


# ----------------------------------------------------------------------------- delta rule


def random_delta_inputs(rng, batch=2, time=37, heads=3, key_dim=8, value_dim=16):
    q, k = (rng.normal(size=(batch, time, heads, key_dim)).astype(np.float32) for _ in "qk")
    v = rng.normal(size=(batch, time, heads, value_dim)).astype(np.float32)
    g = -rng.uniform(0.01, 2.0, size=(batch, time, heads)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, size=(batch, time, heads)).astype(np.float32)
    state = rng.normal(size=(batch, heads, key_dim, value_dim)).astype(np.float32)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("chunk_size", [8, 64])
def test_delta_rule_forms_match_transformers_torch(chunk_size):
    q, k, v, g, beta, state = random_delta_inputs(np.random.default_rng(0))
    torch_args = dict(g=torch.tensor(g), beta=torch.tensor(beta),
                      initial_state=torch.tensor(state), output_final_state=True,
                      use_qk_l2norm_in_kernel=True)
    ref_out, ref_state = torch_chunk_gated_delta_rule(
        *map(torch.tensor, (q, k, v)), chunk_size=chunk_size, **torch_args)
    rec_out, rec_state = torch_recurrent_gated_delta_rule(*map(torch.tensor, (q, k, v)),
                                                          **torch_args)
    query = l2_normalise(jnp.asarray(q)) * q.shape[-1] ** -0.5
    key = l2_normalise(jnp.asarray(k))
    no_starts = jnp.zeros(g.shape[:2], bool)
    out, final = gated_delta_chunked(query, key, v, g, beta, no_starts, state, chunk_size)
    out_rec, final_rec = gated_delta_recurrent(query, key, v, g, beta, no_starts, state)
    np.testing.assert_allclose(np.asarray(out), ref_out.numpy(), atol=1e-5)
    np.testing.assert_allclose(np.asarray(final), ref_state.numpy(), atol=1e-5)
    np.testing.assert_allclose(np.asarray(out_rec), rec_out.numpy(), atol=1e-5)
    np.testing.assert_allclose(np.asarray(final_rec), rec_state.numpy(), atol=1e-5)


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), chunk_size=st.sampled_from([1, 4, 7, 32]),
       start_rate=st.floats(0.0, 0.4))
def test_property_chunked_equals_token_by_token_with_run_starts(seed, chunk_size,
                                                                start_rate):
    """Any run starts (packed segments, reused slots) and any chunk size: the chunked form
    equals the recurrence, and each run equals its own sequence from a zero state."""
    rng = np.random.default_rng(seed)
    q, k, v, g, beta, state = random_delta_inputs(rng, time=19)
    starts = rng.uniform(size=g.shape[:2]) < start_rate
    query = l2_normalise(jnp.asarray(q)) * q.shape[-1] ** -0.5
    key = l2_normalise(jnp.asarray(k))
    out, final = gated_delta_chunked(query, key, v, g, beta, starts, state, chunk_size)
    out_rec, final_rec = gated_delta_recurrent(query, key, v, g, beta, starts, state)
    np.testing.assert_allclose(np.asarray(out), np.asarray(out_rec), atol=2e-5)
    np.testing.assert_allclose(np.asarray(final), np.asarray(final_rec), atol=2e-5)
    row_starts = np.flatnonzero(starts[0])
    if row_starts.size:  # the last run of row 0 alone, from a zero state
        first = row_starts[-1]
        alone, _ = gated_delta_recurrent(
            query[:1, first:], key[:1, first:], v[:1, first:], g[:1, first:],
            beta[:1, first:], np.zeros((1, 19 - first), bool), np.zeros_like(state[:1]))
        np.testing.assert_allclose(np.asarray(out[:1, first:]), np.asarray(alone), atol=2e-5)


# ----------------------------------------------------------------------------- model parity


# (config, T, delta-rule chunk): T a multiple of the chunk (64/16) and not (70/64, 45/16).
PARITY_CASES = [("interval4-untied", 70, 64), ("interval2-tied", 64, 16),
                ("interval2-wide", 45, 16)]
SLOW_PARITY_CASES = [(name, length, chunk) for name in CONFIGS
                     for length, chunk in ((64, 16), (70, 64), (45, 16))
                     if (name, length, chunk) not in PARITY_CASES]


@pytest.mark.parametrize("name,length,chunk", PARITY_CASES + [
    pytest.param(*case, marks=pytest.mark.slow) for case in SLOW_PARITY_CASES])
def test_logits_match_transformers(checkpoints, name, length, chunk):
    hf_model, folder = checkpoints[name]
    ids = np.random.default_rng(length).integers(0, VOCAB, size=(2, length))
    ours = forward(load_ours(folder, chunk), ids)
    np.testing.assert_allclose(ours, torch_logits(hf_model, ids), atol=LOGITS_ATOL)


def _three_sequences(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=n) for n in (21, 3, 14)]


@pytest.mark.parametrize("name", ["interval2-tied",
                                  pytest.param("interval4-untied", marks=pytest.mark.slow)])
def test_padding_and_packing_equal_separate_sequences(checkpoints, name):
    """Right padding, left padding and packed segments (chunk 8, so runs cross chunk
    boundaries) against transformers on each sequence alone."""
    hf_model, folder = checkpoints[name]
    model = load_ours(folder, linear_chunk_size=8)
    sequences = _three_sequences(1)
    alone = [torch_logits(hf_model, s[None])[0] for s in sequences]
    width = 24
    for side in ("right", "left"):
        ids = np.zeros((len(sequences), width), np.int64)
        mask = np.zeros_like(ids, bool)
        for row, s in enumerate(sequences):
            span = slice(0, len(s)) if side == "right" else slice(width - len(s), width)
            ids[row, span], mask[row, span] = s, True
        logits = forward(model, ids, mask)
        for row, reference in enumerate(alone):
            np.testing.assert_allclose(logits[row][mask[row]], reference, atol=LOGITS_ATOL,
                                       err_msg=f"{side} padding, row {row}")
    packed = np.concatenate(sequences + [np.zeros(4, np.int64)])[None]
    segment_ids = np.concatenate([np.full(len(s), i + 1) for i, s in enumerate(sequences)]
                                 + [np.zeros(4, np.int64)])[None]
    logits = forward(model, packed, segment_ids > 0, segment_ids)[0]
    offset = 0
    for s, reference in zip(sequences, alone):
        np.testing.assert_allclose(logits[offset:offset + len(s)], reference,
                                   atol=LOGITS_ATOL, err_msg="packed")
        offset += len(s)


def test_gradients_match_torch_autograd(checkpoints):
    """d(token-mean cross entropy over real tokens)/d(every parameter), right padding."""
    hf_model, folder = checkpoints["interval2-tied"]
    model = load_ours(folder, linear_chunk_size=8)
    rng = np.random.default_rng(5)
    ids = rng.integers(0, VOCAB, size=(2, 27))
    mask = np.ones_like(ids, bool)
    mask[1, 19:] = False
    valid = mask[:, 1:]

    def loss_fn(state):
        logits = nnx.merge(graphdef, state)(jnp.asarray(ids), attention_mask=jnp.asarray(mask))
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        picked = jnp.take_along_axis(logp, jnp.asarray(ids[:, 1:, None]), axis=-1)[..., 0]
        return -jnp.sum(jnp.where(valid, picked, 0.0)) / valid.sum()

    graphdef, state = nnx.split(model)
    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(state)
    hf_model.zero_grad()
    logits = hf_model(torch.as_tensor(ids), attention_mask=torch.as_tensor(mask)).logits
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, torch.as_tensor(ids[:, 1:, None]))
    torch_loss = -logp[..., 0][torch.as_tensor(valid)].mean()
    torch_loss.backward()
    np.testing.assert_allclose(float(loss), float(torch_loss), rtol=1e-5)
    torch_grads = {n: p.grad.numpy() for n, p in hf_model.named_parameters()}
    ours = list(hf_tensors(nnx.merge(graphdef, grads)))
    assert {n for n, _, _ in ours} == set(torch_grads)  # every parameter compared
    for name, grad, transposed in ours:
        grad = np.asarray(grad)
        reference = torch_grads[name]
        scale = np.abs(reference).max()
        assert scale > 0, name
        np.testing.assert_allclose(grad.T if transposed else grad, reference,
                                   atol=GRAD_RTOL * scale, rtol=0, err_msg=name)


# ----------------------------------------------------------------------------- cached decode


def test_cached_decode_equals_full_forward(checkpoints):
    """Prefill (right-padded, chunked form) then one token at a time (recurrent form);
    then the same slots take new requests from position 0 (state and conv window reset),
    one of them prefilled left-padded."""
    _, folder = checkpoints["interval4-untied"]
    model = load_ours(folder, linear_chunk_size=4)
    forward_cached = nnx.jit(lambda m, ids, pos, cache: m.forward_cached(ids, pos, cache))
    cache = model.init_cache(3, 48)
    assert isinstance(cache[0], LinearAttentionCache)
    for round_index, left in enumerate((False, True)):
        sequences = [s[:n] for s, n in zip(_three_sequences(10 + round_index), (16, 3, 11))]
        prompt_lens = (9, 1, 6)
        padded = np.zeros((3, 16), np.int32)
        for row, s in enumerate(sequences):
            padded[row, :len(s)] = s
        full = forward(model, padded)  # causal: right padding is harmless
        width = max(prompt_lens)
        ids = np.zeros((3, width), np.int32)
        pos = np.full((3, width), -1, np.int32)
        for row, (s, n) in enumerate(zip(sequences, prompt_lens)):
            span = slice(width - n, width) if left else slice(0, n)
            ids[row, span], pos[row, span] = s[:n], np.arange(n)
        logits, cache = forward_cached(model, jnp.asarray(ids), jnp.asarray(pos), cache)
        logits = np.asarray(logits)
        for row, n in enumerate(prompt_lens):
            last = width - 1 if left else n - 1
            np.testing.assert_allclose(logits[row, last], full[row][n - 1], atol=DECODE_ATOL)
        for step in range(max(len(s) for s in sequences) - min(prompt_lens)):
            position = np.array([n + step for n in prompt_lens])
            live = np.array([p < len(s) for p, s in zip(position, sequences)])
            token = np.array([s[p] if ok else 0 for s, p, ok in zip(sequences, position, live)])
            step_pos = np.where(live, position, -1)
            logits, cache = forward_cached(model, jnp.asarray(token[:, None], jnp.int32),
                                           jnp.asarray(step_pos[:, None], jnp.int32), cache)
            for row in np.flatnonzero(live):
                np.testing.assert_allclose(np.asarray(logits)[row, 0],
                                           full[row][position[row]], atol=DECODE_ATOL,
                                           err_msg=f"round {round_index} row {row} "
                                                   f"position {position[row]}")


@pytest.mark.slow  # ~20 s idle (engine compiles); cached decode is tested above
def test_engine_generates_with_the_full_forward_logprobs():
    """The embedded engine, unchanged, serves the hybrid: its log-probs equal the full
    forward's at each generated token (continuous batching over 2 slots, 3 requests)."""
    config = ModelConfig.from_hf(tiny_qwen35_hf_config(full_attention_interval=2))
    model = init_model(config, seed=3)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: x * 6.0 if x.ndim == 2 else x, params))
    prompts = [[5, 9, 2, 7, 1], [3], [8, 8, 4, 4, 2, 2, 6]]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=9)

    async def generate_all():
        engine = JaxEngine(model, num_slots=2, max_len=32, steps_per_call=4)
        try:
            return await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))
        finally:
            await engine.close()

    results = asyncio.run(generate_all())
    for prompt, result in zip(prompts, results):
        ids = list(prompt) + list(result.token_ids)
        logits = forward(model, [ids])[0].astype(np.float64)
        logp = logits - logits.max(-1, keepdims=True)
        logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
        expected = [logp[len(prompt) - 1 + i, t] for i, t in enumerate(result.token_ids)]
        assert len(result.token_ids) == sampling.max_new_tokens
        np.testing.assert_allclose(result.logprobs, expected, atol=DECODE_ATOL)


# ----------------------------------------------------------------------------- HF I/O


@pytest.mark.parametrize("name", ["interval2-tied",
                                  pytest.param("interval4-untied", marks=pytest.mark.slow)])
def test_save_pretrained_loads_in_transformers(checkpoints, tmp_path, name):
    hf_model, folder = checkpoints[name]
    ids = np.random.default_rng(2).integers(0, VOCAB, size=(1, 30))
    model = from_pretrained(folder)
    save_pretrained(model, str(tmp_path / name))
    with open(tmp_path / name / "config.json") as f:
        assert json.load(f)["architectures"] == ["Qwen3_5ForCausalLM"]
    reloaded = Qwen3_5ForCausalLM.from_pretrained(str(tmp_path / name)).float().eval()
    np.testing.assert_allclose(torch_logits(reloaded, ids), torch_logits(hf_model, ids),
                               atol=1e-6)
    np.testing.assert_allclose(forward(model, ids), torch_logits(reloaded, ids),
                               atol=LOGITS_ATOL)


@pytest.mark.slow
def test_bfloat16_round_trip_is_exact(checkpoints, tmp_path):
    _, folder = checkpoints["interval2-wide"]
    model = from_pretrained(folder, dtype="bfloat16")
    save_pretrained(model, str(tmp_path))
    again = from_pretrained(str(tmp_path), dtype=None)
    assert again.dtype == jnp.bfloat16
    for (n1, a, _), (n2, b, _) in zip(hf_tensors(model), hf_tensors(again)):
        assert n1 == n2 and a.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, size=(1, 20)))
    assert np.isfinite(np.asarray(again(ids))).all()


def test_conditional_generation_checkpoint_loads_text_model(tmp_path, caplog):
    """The released folders' layout: text model under model.language_model., a vision
    tower and MTP weights (added here by hand) skipped with one logged line."""
    text = tiny_qwen35_hf_config(full_attention_interval=2)
    config = Qwen3_5Config(text_config=text.to_dict(), tie_word_embeddings=True,
                           vision_config=dict(depth=1, hidden_size=32, intermediate_size=32,
                                              num_heads=2, out_hidden_size=64))
    torch.manual_seed(0)
    hf_model = Qwen3_5ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if "language_model" in name and "norm" in name and "linear_attn" not in name:
                param.uniform_(-0.5, 0.5)
    hf_model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    assert not any(n.startswith("model.layers.") for n in tensors)
    tensors["mtp.fc.weight"] = torch.zeros(64, 128)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="spopp_jax.models.hf_io"):
        model = from_pretrained(str(tmp_path))
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 1 and "model.visual.*" in skipped[0] and "mtp.*" in skipped[0]
    assert model.config.tie_word_embeddings and model.lm_head is None
    ids = np.random.default_rng(4).integers(0, VOCAB, size=(1, 33))
    with torch.no_grad():
        reference = hf_model(input_ids=torch.as_tensor(ids)).logits.numpy()
    np.testing.assert_allclose(forward(model, ids), reference, atol=LOGITS_ATOL)


# ----------------------------------------------------------------------------- learner


@pytest.mark.slow  # ~15 s idle: two learner compiles
def test_learner_chunked_logprobs_and_remat_work_with_the_hybrid(checkpoints):
    _, folder = checkpoints["interval2-tied"]
    rng = np.random.default_rng(6)
    ids = rng.integers(0, VOCAB, size=(4, 24)).astype(np.int32)
    attention = np.arange(24)[None, :] < np.array([24, 17, 9, 20])[:, None]
    action = attention & (np.arange(24)[None, :] >= 4)
    batch = learner.TrainBatch(
        input_ids=jnp.asarray(ids), attention_mask=jnp.asarray(attention),
        action_mask=jnp.asarray(action),
        rollout_logp=jnp.asarray(np.where(action, -4.0, 0.0), jnp.float32),
        advantages=jnp.asarray(np.repeat(rng.normal(size=(4, 1)), 24, 1), jnp.float32))
    results = []
    for remat, chunk in ((False, None), (True, 8)):
        model_def, params = learner.split_model(load_ours(folder, remat=remat))
        config = learner.LearnerConfig(learning_rate=1e-6, num_mini_batches=1, action_logits_fraction=None,
                                       num_micro_batches=2, logprob_chunk_size=chunk)
        results.append(learner.make_loss_and_grad(model_def, config)(params, batch))
    (loss, grads, _), (c_loss, c_grads, _) = results
    np.testing.assert_allclose(float(c_loss), float(loss), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(c_grads)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)
    assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads)) > 1e-4


# ----------------------------------------------------------------------------- config


def test_config_reads_interval_and_rejects_bad_linear_fields():
    hf = tiny_qwen35_hf_config(full_attention_interval=2).to_dict()
    del hf["layer_types"]
    hf["full_attention_interval"] = 2
    config = ModelConfig.from_hf(hf)
    assert config.layer_types == ("linear_attention", "full_attention") * 2
    assert config.rotary_dim == 4 and config.attention_output_gate
    with pytest.raises(ValueError, match="linear_num_value_heads"):
        dataclasses.replace(config, linear_num_value_heads=3)
    with pytest.raises(ValueError, match="linear_conv_kernel_dim"):
        dataclasses.replace(config, linear_conv_kernel_dim=1)
    with pytest.raises(ValueError, match="text_config"):
        ModelConfig.from_hf({"model_type": "qwen3_5"})
