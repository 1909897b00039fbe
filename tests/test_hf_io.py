"""HF checkpoint I/O: our save -> transformers load, transformers save (single and sharded)
-> our load, bf16, loud failures, and sharded loading onto an 8-device host mesh."""

import json
import textwrap

import numpy as np
import pytest
import torch
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P
from transformers import AutoModelForCausalLM

from spopp_jax.models import (ModelConfig, from_pretrained, init_model, partition_spec,
                              save_pretrained)
from spopp_jax.models.partitioning import fit_spec, parameter_specs
from spopp_jax.models.testing import random_hf_model, tiny_hf_config

TOL = 1e-4
IDS = np.random.default_rng(0).integers(0, 128, size=(2, 12))


@nnx.jit
def forward(model, ids):
    return model(ids)


def torch_logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()


def params_of(model):
    return {"/".join(map(str, k)): np.asarray(v[...])
            for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize("model_type,tied", [("qwen3", False), ("qwen3", True), ("qwen2", False)])
def test_our_save_loads_in_transformers(tmp_path, model_type, tied):
    config = ModelConfig.from_hf(tiny_hf_config(model_type, rope_theta=1e6,
                                                tie_word_embeddings=tied))
    model = init_model(config, seed=3)
    save_pretrained(model, str(tmp_path))
    with open(tmp_path / "config.json") as f:
        saved_config = json.load(f)
    assert saved_config["architectures"] == [
        {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM"}[model_type]]
    assert saved_config["dtype"] == "float32"
    hf_model = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32,
                                                    attn_implementation="eager")
    assert hf_model.config.rope_parameters["rope_theta"] == 1e6
    assert hf_model.config.tie_word_embeddings == tied
    np.testing.assert_allclose(torch_logits(hf_model), np.asarray(forward(model, jnp.asarray(IDS))),
                               atol=TOL, rtol=0)
    reloaded = from_pretrained(str(tmp_path))
    before, after = params_of(model), params_of(reloaded)
    assert before.keys() == after.keys()
    for name in before:
        np.testing.assert_array_equal(before[name], after[name], err_msg=name)


def test_our_sharded_save_loads_in_transformers(tmp_path):
    model = init_model(ModelConfig.from_hf(tiny_hf_config()), seed=4)
    save_pretrained(model, str(tmp_path), max_shard_size="40KB")
    with open(tmp_path / "model.safetensors.index.json") as f:
        index = json.load(f)
    files = set(index["weight_map"].values())
    assert len(files) > 2 and all((tmp_path / name).exists() for name in files)
    assert not (tmp_path / "model.safetensors").exists()
    hf_model = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32,
                                                    attn_implementation="eager")
    np.testing.assert_allclose(torch_logits(hf_model), np.asarray(forward(model, jnp.asarray(IDS))),
                               atol=TOL, rtol=0)


@pytest.mark.parametrize("max_shard_size", ["1GB", "40KB"])
def test_saved_weights_have_the_umask_mode_of_config_json(tmp_path, max_shard_size):
    """safetensors alone writes 0600: a vLLM server running as another user could not
    read the folder."""
    model = init_model(ModelConfig.from_hf(tiny_hf_config()), seed=4)
    save_pretrained(model, str(tmp_path), max_shard_size=max_shard_size)
    config_mode = (tmp_path / "config.json").stat().st_mode & 0o777
    weights = list(tmp_path.glob("*.safetensors"))
    assert weights and config_mode & 0o044  # the test umask lets others read
    assert {w.stat().st_mode & 0o777 for w in weights} == {config_mode}


@pytest.mark.parametrize("max_shard_size", [None, "30KB"])
def test_transformers_save_loads_here(tmp_path, max_shard_size):
    hf_model = random_hf_model(tiny_hf_config(rope_theta=1e6), seed=5)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    hf_model.save_pretrained(str(tmp_path), **kwargs)
    sharded = (tmp_path / "model.safetensors.index.json").exists()
    assert sharded == (max_shard_size is not None)
    model = from_pretrained(str(tmp_path))
    np.testing.assert_allclose(np.asarray(forward(model, jnp.asarray(IDS))), torch_logits(hf_model),
                               atol=TOL, rtol=0)


def test_bfloat16_save_and_load(tmp_path):
    hf_model = random_hf_model(tiny_hf_config(), seed=6)
    hf_model.to(torch.bfloat16).save_pretrained(str(tmp_path / "hf"))
    model = from_pretrained(str(tmp_path / "hf"), dtype="bfloat16")
    leaves = jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))
    assert {leaf.dtype for leaf in leaves} == {jnp.dtype(jnp.bfloat16)}
    as_declared = from_pretrained(str(tmp_path / "hf"), dtype=None)  # config says bfloat16
    assert as_declared.dtype == jnp.bfloat16
    as_float32 = from_pretrained(str(tmp_path / "hf"), dtype="float32")
    assert as_float32.model.norm.scale[...].dtype == jnp.float32
    # bf16 -> bf16 is exact.
    reference = {n: p.detach().float().numpy() for n, p in hf_model.named_parameters()}
    q_kernel = np.asarray(model.model.layers[0].self_attn.q_proj.kernel[...], np.float32)
    np.testing.assert_array_equal(q_kernel.T, reference["model.layers.0.self_attn.q_proj.weight"])
    save_pretrained(model, str(tmp_path / "ours"))
    with open(tmp_path / "ours" / "config.json") as f:
        assert json.load(f)["dtype"] == "bfloat16"
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours"))
    assert back.dtype == torch.bfloat16
    for name, param in back.named_parameters():
        np.testing.assert_array_equal(param.detach().float().numpy(), reference[name],
                                      err_msg=name)


def test_missing_and_misshapen_tensors_fail_loudly(tmp_path):
    from safetensors.numpy import load_file, save_file
    model = init_model(ModelConfig.from_hf(tiny_hf_config()), seed=0)
    save_pretrained(model, str(tmp_path))
    path = str(tmp_path / "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(KeyError, match="up_proj"):
        from_pretrained(str(tmp_path))
    tensors["model.layers.1.mlp.up_proj.weight"] = np.zeros((64, 128), np.float32)  # transposed
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="shape"):
        from_pretrained(str(tmp_path))


def test_every_parameter_has_a_partition_rule():
    for model_type in ("qwen3", "qwen2"):
        model = init_model(ModelConfig.from_hf(tiny_hf_config(model_type)))
        specs = parameter_specs(nnx.state(model, nnx.Param))
        assert len(jax.tree_util.tree_leaves(specs)) == len(
            jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))
    assert partition_spec("model.layers.3.self_attn.q_proj.kernel") == P("fsdp", "tensor")
    assert partition_spec("model.layers.3.mlp.down_proj.kernel") == P("tensor", "fsdp")
    assert partition_spec("model.embed_tokens.embedding") == P("tensor", "fsdp")
    assert partition_spec("lm_head.kernel") == P("fsdp", "tensor")
    assert partition_spec("model.layers.0.self_attn.k_norm.scale") == P()
    with pytest.raises(ValueError, match="no partition rule"):
        partition_spec("model.layers.0.linear_attn.unknown_parameter")


def test_fit_spec_drops_axes_that_do_not_divide():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tensor"))
    assert fit_spec(P("fsdp", "tensor"), (64, 32), mesh) == P("fsdp", "tensor")
    fake_mesh = type("FakeMesh", (), {"shape": {"fsdp": 2, "tensor": 4}})()
    assert fit_spec(P("fsdp", "tensor"), (64, 30), fake_mesh) == P("fsdp")
    assert fit_spec(P("tensor", "data"), (8, 8), fake_mesh) == P("tensor")


_MESH_SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jax.sharding import PartitionSpec as P
    from spopp_jax.models import from_pretrained, save_pretrained
    assert jax.device_count() == 8, jax.device_count()
    path = sys.argv[1]
    mesh = jax.make_mesh((1, 2, 4), ("data", "fsdp", "tensor"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)  # as spopp_jax.sharding
    model = from_pretrained(path, mesh=mesh)
    reference = from_pretrained(path)
    attn = model.model.layers[0].self_attn
    expected = {
        "q": (attn.q_proj.kernel[...], P("fsdp", "tensor"), (32, 16)),
        "o": (attn.o_proj.kernel[...], P("tensor", "fsdp"), (16, 32)),
        "down": (model.model.layers[1].mlp.down_proj.kernel[...], P("tensor", "fsdp"), (32, 32)),
        "embed": (model.model.embed_tokens.embedding[...], P("tensor", "fsdp"), (32, 32)),
        "lm_head": (model.lm_head.kernel[...], P("fsdp", "tensor"), (32, 32)),
        "norm": (model.model.norm.scale[...], P(), (64,)),
    }
    for name, (array, spec, shard_shape) in expected.items():
        assert array.sharding.spec == spec, (name, array.sharding.spec)
        shapes = {s.data.shape for s in array.addressable_shards}
        assert shapes == {shard_shape}, (name, shapes)
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    ref_flat = dict(nnx.to_flat_state(nnx.state(reference, nnx.Param)))
    for key, value in flat:
        assert len(value[...].sharding.device_set) == 8, key
        np.testing.assert_array_equal(np.asarray(value[...]), np.asarray(ref_flat[key][...]))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, size=(2, 12)))
    np.testing.assert_allclose(np.asarray(nnx.jit(lambda m, x: m(x))(model, ids)),
                               np.asarray(reference(ids)), atol=1e-4)
    # Saving gathers the sharded parameters: the saved folder reloads to the same values.
    save_pretrained(model, sys.argv[2], max_shard_size="40KB")
    saved = dict(nnx.to_flat_state(nnx.state(from_pretrained(sys.argv[2]), nnx.Param)))
    for key, value in flat:
        np.testing.assert_array_equal(np.asarray(saved[key][...]), np.asarray(value[...]))
    print("MESH_OK")
""")


def test_sharded_load_on_8_device_mesh(tmp_path, run_on_8_devices):
    hf_model = random_hf_model(tiny_hf_config(rope_theta=1e6), seed=7)
    hf_model.save_pretrained(str(tmp_path), max_shard_size="30KB")
    result = run_on_8_devices(["-c", _MESH_SCRIPT, tmp_path, tmp_path / "saved"])
    assert result.returncode == 0 and "MESH_OK" in result.stdout, result.stderr[-3000:]


def test_directly_built_config_saves_a_loadable_checkpoint(tmp_path):
    """A ModelConfig made in code (no HF config.json behind it) writes a config that
    transformers reads back with the same hyper-parameters and logits."""
    config = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, rope_theta=5e5, tie_word_embeddings=True)
    model = init_model(config, seed=9)
    save_pretrained(model, str(tmp_path))
    hf_model = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32,
                                                    attn_implementation="eager")
    assert hf_model.config.model_type == "qwen3"
    assert hf_model.config.rope_parameters["rope_theta"] == 5e5
    assert hf_model.config.num_key_value_heads == 2 and hf_model.config.head_dim == 16
    ids = IDS % 96
    np.testing.assert_allclose(torch_logits(hf_model, ids),
                               np.asarray(forward(model, jnp.asarray(ids))), atol=TOL, rtol=0)
    assert ModelConfig.from_hf(str(tmp_path)).rope_theta == 5e5
