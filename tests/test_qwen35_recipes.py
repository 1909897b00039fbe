"""The paper's Qwen3.5 recipes start with a Qwen3.5-shaped random model folder (no weights
can be downloaded here): the input checks stop at the missing task data, and the model
the recipe would train loads in its dtype. The folder is written by our `save_pretrained`
from a config synthesised without transformers, and transformers reads it back."""

import numpy as np
import pytest
import torch
import jax.numpy as jnp
from transformers import Qwen3_5ForCausalLM

import train
from rollout_bridge import components
from rollout_bridge.envs.kinds import build_env
from rollout_bridge.tokenizer import build_tiny_tokenizer
from spopp_jax.models import ModelConfig, init_model, save_pretrained
from rollout_bridge.run_errors import UserError

TEXTS = ["You are in the middle of a room. Looking quickly around you, you see a desk.",
         "> go to desk 1", "On the desk 1, you see a pen and a mug.", "> take mug 1"]
RECIPES = {  # recipe -> what its missing-data message names
    "configs/alfworld_qwen35_0p8b.yaml": "env.game_dir",
    "configs/alfworld_qwen35_2b.yaml": "env.game_dir",
    "configs/math_tir_qwen35_0p8b.yaml": "env.data_dir",
}


def qwen35_shaped_config(vocab_size: int) -> ModelConfig:
    """Qwen3.5-0.8B's layout at toy width: 3 Gated DeltaNet layers per gated attention
    layer, rotary on a quarter of head_dim, tied embeddings."""
    layer_types = ("linear_attention",) * 3 + ("full_attention",)
    return ModelConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=96,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, tie_word_embeddings=True, layer_types=layer_types,
                       model_type="qwen3_5_text", attention_output_gate=True,
                       partial_rotary_factor=0.25, linear_conv_kernel_dim=4,
                       linear_key_head_dim=8, linear_value_head_dim=16,
                       linear_num_key_heads=2, linear_num_value_heads=4)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen35_random")
    tokenizer = build_tiny_tokenizer(TEXTS, folder, vocab_size=300)
    save_pretrained(init_model(qwen35_shaped_config(len(tokenizer)), seed=0), str(folder))
    return folder


@pytest.mark.parametrize("recipe,missing", list(RECIPES.items()))
def test_recipe_starts_up_to_the_missing_data_message(model_folder, recipe, missing):
    cfg = train.parse_config(["--config_path", recipe, "--model.path", str(model_folder)])
    components.check_inputs(cfg)  # the model folder is there
    with pytest.raises(UserError, match=missing):
        build_env(cfg, cfg.warmstart.enabled)
    model = components.load_policy(model_folder, cfg.model)  # an engine's: weights in the compute dtype
    assert model.dtype == jnp.dtype(cfg.model.compute_dtype) == model.param_dtype
    learner_model = components.load_policy(model_folder, cfg.model, train=True)
    assert learner_model.dtype == jnp.dtype("bfloat16") and learner_model.param_dtype == jnp.dtype("float32")
    assert learner_model.model.remat == cfg.model.remat == "block"
    assert "linear_attention" in model.config.layer_types
    assert np.isfinite(np.asarray(model(jnp.arange(12)[None] % 50))).all()


def test_random_folder_loads_in_transformers_with_equal_logits(model_folder):
    ours = components.load_policy(model_folder, train.parse_config(
        ["--config_path", "configs/alfworld_qwen35_0p8b.yaml", "--model.path",
         str(model_folder), "--model.compute_dtype", "float32"]).model)
    reference = Qwen3_5ForCausalLM.from_pretrained(str(model_folder)).float().eval()
    ids = np.arange(20)[None] % 50
    with torch.no_grad():
        expected = reference(torch.as_tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(ids))), expected, atol=1e-4)
