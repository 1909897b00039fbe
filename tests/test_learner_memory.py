"""The learner memory estimate (spopp_jax/models/memory.py): its parameter count is the
model's, its terms follow the remat policy, and the Qwen3.5 recipes' settings fit a
16k-token Qwen3.5-0.8B micro-batch on one 80 GB GPU by it."""

import jax
import numpy as np
import pytest
from flax import nnx

from rollout_bridge.config import load_config
from spopp_jax.models import init_model
from spopp_jax.models.memory import estimate_learner_memory, parameter_count, qwen35_0p8b_config
from spopp_jax.models.testing import tiny_config
from test_mixed_precision import model_config

GPU_BYTES = 80e9
RECIPES = ["alfworld_qwen35_0p8b", "math_tir_qwen35_0p8b"]


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_parameter_count_is_the_models(kind):
    config = model_config(kind)
    model = nnx.eval_shape(lambda: init_model(config))
    assert parameter_count(config) == sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_tied_and_biased_qwen_counts():
    for config in (tiny_config("qwen3", tie_word_embeddings=True), tiny_config("qwen2")):
        model = nnx.eval_shape(lambda: init_model(config))
        assert parameter_count(config) == sum(int(np.prod(x.shape))
                                              for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_block_remat_keeps_layer_inputs_only():
    config = qwen35_0p8b_config()
    common = dict(rows=1, time=16384, param_dtype="float32", compute_dtype="bfloat16", logprob_chunk_size=1024)
    none, block = (estimate_learner_memory(config, remat=r, **common) for r in ("none", "block"))
    assert none.params == block.params and none.adam == 2 * none.params      # fp32 masters and moments
    assert block.activations < none.activations / 5
    assert block.compute_copy == none.params / 2                             # the bf16 copy
    halves = estimate_learner_memory(config, remat="block", fsdp=2, **common)
    assert halves.params == block.params / 2


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_fits_a_16k_token_micro_batch_on_one_80gb_gpu(name):
    cfg = load_config(config_path=f"configs/{name}.yaml")
    m, o = cfg.model, cfg.optim
    estimate = estimate_learner_memory(qwen35_0p8b_config(), rows=1, time=16384, param_dtype=m.param_dtype,
                                       compute_dtype=m.compute_dtype, remat=m.remat,
                                       num_micro_batches=o.num_micro_batches, logprob_chunk_size=o.logprob_chunk_size)
    assert estimate.total < GPU_BYTES, estimate.summary()
    without_remat = estimate_learner_memory(qwen35_0p8b_config(), rows=1, time=16384, param_dtype=m.param_dtype,
                                            compute_dtype=m.compute_dtype, remat="none",
                                            logprob_chunk_size=o.logprob_chunk_size)
    assert without_remat.total > GPU_BYTES  # the recipe's remat is what makes it fit
