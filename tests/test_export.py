"""`python -m spopp_jax.export`: checkpoint step -> HF folder that transformers loads with
the same logits (float32, 1e-5) as our model on the checkpoint's parameters; partial or
mismatched checkpoints are refused with one line and exit status 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from spopp_jax import export
from tiny_run import RUN_CONFIG, make_model_folder, make_tiny_run

ROOT = Path(__file__).resolve().parents[1]
LOGIT_ATOL = 1e-5
IDS = np.array([[5, 17, 3, 99, 42, 7, 8, 250], [1, 2, 3, 4, 5, 6, 7, 8]], np.int32)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{tied_embeddings: TinyRun}"""
    return {tied: make_tiny_run(tmp_path_factory.mktemp("run"), tied=tied)
            for tied in (True, False)}


@pytest.fixture
def run(runs):
    return runs[True]


def _our_logits(params: dict, model_folder: Path) -> np.ndarray:
    model = export.model_from_params(params, model_folder)
    return np.asarray(model(IDS))


def _torch_logits(folder: Path) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.as_tensor(IDS, dtype=torch.long)).logits.numpy()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_export_loads_in_transformers_with_equal_logits(runs, tied, tmp_path):
    run = runs[tied]
    out = export.export_checkpoint(run.step_dir, tmp_path / "hf")
    ours = _our_logits(run.params, run.model_folder)
    theirs = _torch_logits(out)
    np.testing.assert_allclose(theirs, ours, atol=LOGIT_ATOL, rtol=0)
    # the trained parameters were exported, not the start folder's
    start = np.asarray(export.model_from_params(
        {k: v for k, v in _start_params(run.model_folder).items()}, run.model_folder)(IDS))
    assert np.abs(theirs - start).max() > 100 * LOGIT_ATOL


def _start_params(folder: Path) -> dict:
    import jax
    from flax import nnx

    from spopp_jax.models import from_pretrained
    from spopp_jax.models.partitioning import path_name

    state = nnx.state(from_pretrained(str(folder)), nnx.Param)
    return {path_name(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}


def test_export_folder_has_tokenizer_and_generation_config(run, tmp_path):
    from transformers import AutoTokenizer, GenerationConfig

    out = export.export_checkpoint(run.step_dir, tmp_path / "hf")
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    source = AutoTokenizer.from_pretrained(str(run.model_folder))
    text = "take the key and go north"
    assert tokenizer(text)["input_ids"] == source(text)["input_ids"]
    assert tokenizer.chat_template == source.chat_template
    generation = GenerationConfig.from_pretrained(str(out))
    sampling = RUN_CONFIG["rollout"]
    assert generation.do_sample is True
    assert generation.temperature == pytest.approx(sampling["temperature"])
    assert generation.top_p == pytest.approx(sampling["top_p"])
    assert generation.top_k == export.HF_TOP_K_OFF          # our -1 = off
    assert generation.max_new_tokens == sampling["max_new_tokens"]
    assert generation.eos_token_id == tokenizer.eos_token_id
    assert generation.pad_token_id == tokenizer.pad_token_id
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spopp_jax.export", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def _assert_refused(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == export.EXIT_USAGE, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines and lines[0].startswith("export error: "), result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


def test_cli_exports_and_refuses_to_overwrite(run, tmp_path):
    out = tmp_path / "hf"
    result = _cli("--checkpoint", str(run.step_dir), "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    _assert_refused(_cli("--checkpoint", str(run.step_dir), "--out", str(out)), "--overwrite")
    again = _cli("--checkpoint", str(run.step_dir), "--out", str(out), "--overwrite")
    assert again.returncode == 0, again.stderr


def _damaged_copy(run, tmp_path, damage) -> Path:
    root = tmp_path / "copy"
    shutil.copytree(run.root, root)
    step_dir = root / "checkpoints" / str(run.step)
    return damage(step_dir)


def _drop(relative: str):
    def damage(step_dir: Path) -> Path:
        target = step_dir / relative
        shutil.rmtree(target) if target.is_dir() else target.unlink()
        return step_dir
    return damage


def _interrupted(step_dir: Path) -> Path:
    tmp = step_dir.with_name(f"{step_dir.name}.orbax-checkpoint-tmp-123")
    step_dir.rename(tmp)
    return tmp


def _truncated_arrays(step_dir: Path) -> Path:
    for data in (step_dir / "train_state").rglob("*"):
        if data.is_file() and data.parent.name == "d":
            data.write_bytes(data.read_bytes()[:7])
    return step_dir


@pytest.mark.parametrize("damage, fragment", [
    (_drop("_CHECKPOINT_METADATA"), "incomplete"),
    (_drop("train_state"), "train_state/_METADATA"),
    (_drop("config"), "config/metadata"),
    (_interrupted, "interrupted"),
], ids=["unfinalized", "no-train-state", "no-config", "tmp-folder"])
def test_main_refuses_partial_checkpoint(run, tmp_path, capsys, damage, fragment):
    step_dir = _damaged_copy(run, tmp_path, damage)
    out = tmp_path / "hf"
    status = export.main(["--checkpoint", str(step_dir), "--out", str(out)])
    captured = capsys.readouterr()
    _assert_refused(subprocess.CompletedProcess([], status, captured.out, captured.err),
                    fragment, str(step_dir))
    assert not out.exists()


def test_cli_refuses_damaged_array_data_in_one_message(run, tmp_path):
    """orbax/tensorstore print tracebacks from other threads on damaged data: the command
    line shows only our message (their output goes to a log file it names)."""
    step_dir = _damaged_copy(run, tmp_path, _truncated_arrays)
    out = tmp_path / "hf"
    _assert_refused(_cli("--checkpoint", str(step_dir), "--out", str(out)),
                    "is damaged", str(step_dir))
    assert not out.exists()


def test_cli_refuses_mismatched_model(run, tmp_path):
    other = tmp_path / "other_model"
    make_model_folder(other, tied=True, hidden_size=48)
    result = _cli("--checkpoint", str(run.step_dir), "--out", str(tmp_path / "hf"),
                  "--model", str(other))
    _assert_refused(result, "does not match", "model.embed_tokens.embedding",
                    "checkpoint shape")


def test_cli_refuses_missing_model_folder(run, tmp_path):
    root = tmp_path / "copy"
    shutil.copytree(run.root, root)
    shutil.rmtree(root / "warmstart_model")
    result = _cli("--checkpoint", str(root / "checkpoints" / str(run.step)),
                  "--out", str(tmp_path / "hf"))
    _assert_refused(result, "--model")


def test_sampling_defaults_map_top_k_off():
    config = export.generation_config(Path("/nonexistent"), export.SamplingDefaults(top_k=-1))
    assert config["top_k"] == export.HF_TOP_K_OFF
    assert export.generation_config(Path("/nonexistent"),
                                    export.SamplingDefaults(top_k=20))["top_k"] == 20
    assert export.SamplingDefaults.from_run_config({}) == export.SamplingDefaults()
    saved = json.loads(json.dumps(RUN_CONFIG))
    assert export.SamplingDefaults.from_run_config(saved).temperature == pytest.approx(0.7)


def test_export_has_the_usual_file_modes(run, tmp_path):
    import os

    umask = os.umask(0o022)
    try:
        out = export.export_checkpoint(run.step_dir, tmp_path / "hf")
    finally:
        os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o755
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == \
        {p.name: 0o644 for p in out.iterdir()}
