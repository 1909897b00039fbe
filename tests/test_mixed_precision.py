"""Mixed precision: float32 master weights and AdamW moments, bfloat16 compute.

At the paper's lr 1e-6 AdamW's first step is ≈ lr·sign(g) per weight. A bfloat16 weight
of magnitude ~0.02 has a resolution of ~1e-4, so a bfloat16-only model keeps almost every
weight as it was; float32 master weights under bfloat16 compute must move every weight
as the float32 model does. bfloat16 compute changes the gradient a little, which flips
the sign of Adam's step only where |g| is near 0, so the updates agree except for a few
weights, each off by at most 2·lr.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from rollout_bridge import components
from rollout_bridge.learner_processes import MAX_FROZEN_FRACTION, build_learner, check_weights_can_move
from rollout_bridge.methods import LearnerInput
from spopp_jax import learner
from spopp_jax.models import ModelConfig, init_model, save_pretrained
from spopp_jax.models.testing import tiny_config, tiny_qwen35_hf_config
from rollout_bridge.run_errors import UserError

LR = 1e-6
VOCAB = 128
B, T = 4, 40
# Stated tolerance of "the mixed update equals the float32 update": per parameter, at most
# this share of the weights step the other way (a sign flip of lr·sign(g), |g| ≈ 0) ...
MAX_SIGN_FLIPS = 0.01
# ... and the mean |Δ_mixed − Δ_fp32| is at most this many learning rates plus the mean
# float32 spacing of the weights (the float32 update itself is rounded to it: 1e-6 is only
# ~4 spacings of a weight near 2, such as a Gated DeltaNet's A_log).
MAX_MEAN_UPDATE_GAP = 0.02
PRECISIONS = {"fp32": ("float32", "float32"), "mixed": ("bfloat16", "float32"),
              "bf16_only": ("bfloat16", "bfloat16")}


def model_config(kind: str) -> ModelConfig:
    if kind == "qwen3":
        return tiny_config("qwen3", vocab_size=VOCAB, num_hidden_layers=2)
    return ModelConfig.from_hf(tiny_qwen35_hf_config())  # 3 Gated DeltaNet + 1 attention


def make_batch() -> learner.TrainBatch:
    """Every token id appears (every embedding row gets a gradient); actions after t = 3."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, (B, T)).astype(np.int32)
    ids[:, :VOCAB // B] = np.arange(VOCAB).reshape(B, VOCAB // B)
    action = np.zeros((B, T), bool)
    action[:, 3:] = True
    advantages = np.repeat(rng.normal(size=(B, 1)), T, axis=1).astype(np.float32)
    return learner.TrainBatch(jnp.asarray(ids), jnp.ones((B, T), bool), jnp.asarray(action),
                              jnp.zeros((B, T), jnp.float32), jnp.asarray(advantages))


def one_step(kind: str, precision: str):
    """(params before, params after, metrics) of one train step at lr 1e-6 with the
    rollout log-probs equal to the model's own (IS weight 1)."""
    compute, stored = PRECISIONS[precision]
    config = learner.LearnerConfig(num_mini_batches=1, action_logits_fraction=None, learning_rate=LR)
    model = init_model(model_config(kind), seed=0, dtype=compute, param_dtype=stored)
    model_def, state = learner.init_train_state(model, config)
    batch = make_batch()
    logp = learner.make_compute_logprobs(model_def)(state.params, batch)
    batch = dataclasses.replace(batch, rollout_logp=jnp.where(batch.action_mask, logp, 0.0))
    before = jax.tree.map(np.asarray, state.params)
    state, metrics = learner.make_train_step(model_def, config)(state, batch)
    return before, jax.tree.map(np.asarray, state.params), metrics


@pytest.fixture(scope="module", params=["qwen3", pytest.param("qwen3_5", marks=pytest.mark.slow)])
def steps(request):
    return {name: one_step(request.param, name) for name in ("fp32", "mixed")}


@pytest.fixture(scope="module")
def bf16_only_step():
    return one_step("qwen3", "bf16_only")


def leaves(tree):
    return [(jax.tree_util.keystr(path), leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def test_mixed_precision_keeps_float32_master_weights_and_statistics(steps):
    before, after, metrics = steps["mixed"]
    assert {leaf.dtype for _, leaf in leaves(after)} == {np.dtype(np.float32)}
    assert metrics["loss"].dtype == metrics["grad_norm"].dtype == jnp.float32
    # the same float32 draws as the float32 model: only the compute differs
    for (name, a), (_, b) in zip(leaves(before), leaves(steps["fp32"][0])):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_bf16_compute_at_lr_1e6_moves_every_master_weight_as_fp32_does(steps):
    f_before, f_after, _ = steps["fp32"]
    m_before, m_after, _ = steps["mixed"]
    for (name, fb), (_, fa), (_, mb), (_, ma) in zip(leaves(f_before), leaves(f_after),
                                                    leaves(m_before), leaves(m_after)):
        assert np.all(ma != mb), f"{name}: {np.mean(ma == mb):.1%} of the master weights did not move"
        assert np.all(fa != fb), name
        fp32_update = fa.astype(np.float64) - fb
        mixed_update = ma.astype(np.float64) - mb
        flips = np.mean(np.sign(mixed_update) != np.sign(fp32_update))
        gap = np.mean(np.abs(mixed_update - fp32_update))
        allowed = MAX_MEAN_UPDATE_GAP * LR + np.mean(np.spacing(np.abs(fb)))
        assert flips <= MAX_SIGN_FLIPS, f"{name}: {flips:.2%} of the updates step the other way"
        assert gap <= allowed, f"{name}: mean |update gap| {gap / LR:.3f} lr > {allowed / LR:.3f} lr"


def test_bf16_only_weights_barely_move_and_are_refused(steps, bf16_only_step):
    """The old path (weights and moments in bfloat16): one step at lr 1e-6 leaves almost
    every weight as it was, and a run that would do this is refused in one line."""
    before, after, _ = bf16_only_step
    moved = np.mean(np.concatenate([(a != b).ravel() for (_, b), (_, a) in zip(leaves(before), leaves(after))]))
    assert moved < 0.05
    bf16_params = jax.tree.map(jnp.asarray, before)
    assert learner.frozen_weight_fraction(bf16_params, LR) > MAX_FROZEN_FRACTION
    with pytest.raises(UserError) as refused:
        check_weights_can_move(bf16_params, "bfloat16", LR)
    assert "\n" not in str(refused.value) and "model.param_dtype float32" in str(refused.value)
    fp32_params = jax.tree.map(jnp.asarray, steps["mixed"][0])
    assert check_weights_can_move(fp32_params, "float32", LR) == 0.0


def test_frozen_weight_fraction_is_the_share_of_steps_below_resolution():
    """bfloat16 keeps 8 significant bits: at 1.0 the spacing below is 2^-8, so a step of
    1e-3 (< 2^-9) rounds back and a step of 4e-3 (> 2^-9) does not; zeros are not counted."""
    params = {"w": jnp.asarray([1.0, 1.0, -1.0, 0.0], jnp.bfloat16)}
    assert learner.frozen_weight_fraction(params, 1e-3) == 1.0
    assert learner.frozen_weight_fraction(params, 4e-3) == 0.0
    assert learner.frozen_weight_fraction({"w": params["w"].astype(jnp.float32)}, 1e-3) == 0.0


@pytest.fixture(scope="module")
def policy_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("policy")
    save_pretrained(init_model(model_config("qwen3"), seed=0), str(folder))  # float32 on disk
    return folder


def job_learner(folder, *flags):
    import train

    cfg = train.parse_config(["--config_path", "configs/smoke.yaml", "--model.path", str(folder),
                              "--optim.learning_rate", str(LR), *flags])
    agent = components.build_agent_config(cfg, max_turns=1)
    orchestrator_cfg = components.build_orchestrator_config(cfg, agent, cfg.seed)
    return build_learner(cfg, components.build_learner_config(cfg), orchestrator_cfg, folder)


def test_train_py_learner_refuses_bf16_only_weights_at_lr_1e6(policy_folder):
    with pytest.raises(UserError, match="model.param_dtype=bfloat16"):
        job_learner(policy_folder, "--model.compute_dtype", "bfloat16", "--model.param_dtype", "bfloat16")


def test_train_py_learner_trains_masters_and_publishes_the_compute_dtype(policy_folder, tmp_path):
    """Master weights float32 in the state (what a checkpoint saves), the engine and the HF
    export get bfloat16 (unless told otherwise)."""
    policy = job_learner(policy_folder, "--model.compute_dtype", "bfloat16")
    assert {leaf.dtype for leaf in jax.tree.leaves(policy.state.params)} == {jnp.dtype(jnp.float32)}
    published = policy.weights()
    assert published.dtype == jnp.bfloat16
    assert {leaf.dtype for leaf in jax.tree.leaves(learner.split_model(published)[1])} == {jnp.dtype(jnp.bfloat16)}
    batch = make_batch()
    policy(LearnerInput(batch=dataclasses.replace(batch, rollout_logp=jnp.full((B, T), -4.0)), trajectories=(),
                        previous=None))
    assert {leaf.dtype for leaf in jax.tree.leaves(policy.state.params)} == {jnp.dtype(jnp.float32)}
    save_pretrained(policy.weights(), str(tmp_path / "bf16"))
    save_pretrained(policy.weights(), str(tmp_path / "fp32"), dtype="float32")
    for name, dtype in (("bf16", "BF16"), ("fp32", "F32")):
        with safe_open(str(tmp_path / name / "model.safetensors"), framework="numpy") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {dtype}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
