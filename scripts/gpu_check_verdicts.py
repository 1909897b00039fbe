"""One verdict line per check of the GPU production path (scripts/gpu_check.sh's default).

    scripts/gpu_check.sh            # on a GPU machine: every check, <= 8 minutes on one H100
    scripts/gpu_check.sh --cpu      # the same checks at toy sizes on CPU (a dry run, ~1 min)

Each check prints `VERDICT <name>: PASS|FAIL|SKIP <details>` (and the numbers behind it as
one JSON line); the exit status is 1 when any check FAILs. The checks:

  mixed_precision_step  a learner step of a Qwen3 (bf16 compute, fp32 master weights, lr
                        1e-6): every master weight moves, loss finite; time per step and
                        MFU = 6 N tokens / time / the chip's dense bf16 peak (N: parameters
                        outside the embedding; attention FLOPs ignored, so it is a lower bound)
  cudnn_attention       cuDNN's fused attention (bf16) against XLA's kernel and ours: loss
                        and gradients within 2% (SKIP without a GPU: ours vs XLA only)
  engine_decode         the embedded JAX engine decodes a burst of concurrent requests; all
                        finish with the asked token count; tokens/s
  qwen35_tiny           a tiny Qwen3.5 (Gated DeltaNet + gated attention): bf16 forward within
                        bf16 tolerance of fp32, a mixed-precision step moves every weight
  memory_settings       XLA_PYTHON_CLIENT_PREALLOCATE / _MEM_FRACTION / _ALLOCATOR as set for
                        the learner (by the node layout): the device's memory limit matches
                        them (SKIP when none is set)
  vllm_inflight         scripts/gpu_check.py --engine vllm (JAX learner + vLLM on one GPU,
                        weights published after each update) when vLLM imports, else SKIP
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":  # runnable from a checkout without installing the package
    sys.path.insert(0, str(ROOT))

# Dense bf16 peak FLOP/s by `device_kind` substring (vendor data sheets, no sparsity).
BF16_PEAK = {"H200": 989e12, "H100 PCIe": 756e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12,
             "A10G": 70e12}
MEMORY_ENV = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_ALLOCATOR")
# Sizes: (GPU, --cpu). Chosen so all checks fit 8 minutes on one H100 (compiles included).
SIZES = {
    "step": ({"hidden": 1024, "layers": 8, "heads": 16, "kv": 8, "inter": 3072, "vocab": 32768,
              "rows": 8, "time": 2048, "steps": 5},
             {"hidden": 64, "layers": 2, "heads": 4, "kv": 2, "inter": 128, "vocab": 256,
              "rows": 2, "time": 64, "steps": 2}),
    "attention": ((4, 1024, 4, 4, 128), (2, 64, 2, 2, 16)),
    "decode": ((64, 128), (4, 8)),
}


def verdict(name: str, status: str, details: str, **numbers) -> str:
    print(json.dumps({"check": name, "status": status, **numbers}), flush=True)
    line = f"VERDICT {name}: {status} {details}"
    print(line, flush=True)
    return status


def peak_flops(device) -> float | None:
    kind = getattr(device, "device_kind", "")
    for name, peak in BF16_PEAK.items():
        if name in kind:
            return peak
    return None


def qwen3_config(s: dict):
    from spopp_jax.models import ModelConfig

    return ModelConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["inter"],
                       num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                       num_key_value_heads=s["kv"], head_dim=s["hidden"] // s["heads"])


def qwen35_tiny_config():
    from spopp_jax.models import ModelConfig

    return ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                       layer_types=("linear_attention",) * 3 + ("full_attention",), model_type="qwen3_5_text",
                       attention_output_gate=True, partial_rotary_factor=0.25, linear_conv_kernel_dim=4,
                       linear_key_head_dim=8, linear_value_head_dim=16, linear_num_key_heads=2,
                       linear_num_value_heads=4)


def random_batch(rows: int, time_: int, vocab: int, seed: int = 0):
    import jax.numpy as jnp
    import numpy as np

    from spopp_jax.learner import TrainBatch

    rng = np.random.default_rng(seed)
    action = np.zeros((rows, time_), bool)
    action[:, time_ // 4:] = True
    return TrainBatch(jnp.asarray(rng.integers(0, vocab, (rows, time_)), jnp.int32), jnp.ones((rows, time_), bool),
                      jnp.asarray(action), jnp.asarray(np.where(action, -3.0, 0.0), jnp.float32),
                      jnp.asarray(np.repeat(rng.normal(size=(rows, 1)), time_, 1), jnp.float32))


def step_moves_weights(config, batch, steps: int):
    """(fraction of master weights moved after one step, finite loss, seconds per step
    after the first, param count outside the embedding) of bf16 compute on fp32 masters."""
    import jax
    import numpy as np

    from spopp_jax import learner
    from spopp_jax.models import init_model

    learner_cfg = learner.LearnerConfig(num_micro_batches=1, length_bucket=None, num_mini_batches=1, action_logits_fraction=None, learning_rate=1e-6)
    model = init_model(config, seed=0, dtype="bfloat16", param_dtype="float32", remat="block")
    model_def, state = learner.init_train_state(model, learner_cfg)
    before = [np.asarray(x) for x in jax.tree.leaves(state.params)]
    train_step = learner.make_train_step(model_def, learner_cfg)
    state, metrics = train_step(state, batch)
    after = [np.asarray(x) for x in jax.tree.leaves(state.params)]
    moved = sum(int(np.sum(a != b)) for a, b in zip(after, before)) / sum(b.size for b in before)
    finite = bool(np.isfinite(float(metrics["loss"]))) and all(np.isfinite(a).all() for a in after)
    start = time.perf_counter()
    for _ in range(steps - 1):
        state, metrics = train_step(state, batch)
    jax.block_until_ready(state.params)
    seconds = (time.perf_counter() - start) / max(steps - 1, 1)
    embedding = config.vocab_size * config.hidden_size
    count = sum(b.size for b in before) - embedding * (1 if config.tie_word_embeddings else 2)
    return moved, finite, seconds, count, all(a.dtype == np.float32 for a in after)


def check_mixed_precision_step(cpu: bool) -> str:
    import jax

    s = SIZES["step"][cpu]
    config = qwen3_config(s)
    moved, finite, seconds, count, fp32 = step_moves_weights(config, random_batch(s["rows"], s["time"], s["vocab"]),
                                                            s["steps"])
    tokens = s["rows"] * s["time"]
    peak = peak_flops(jax.devices()[0])
    mfu = None if peak is None else 6 * count * tokens / seconds / peak
    ok = finite and fp32 and moved > 0.99
    mfu_text = "n/a (no bf16 peak for this device)" if mfu is None else f"{mfu:.1%}"
    return verdict("mixed_precision_step", "PASS" if ok else "FAIL",
                   f"{moved:.2%} of fp32 master weights moved at lr 1e-6, {seconds * 1e3:.1f} ms/step, "
                   f"{tokens / seconds:,.0f} tokens/s, MFU {mfu_text} on {jax.devices()[0].device_kind}",
                   moved=moved, finite=finite, ms_per_step=seconds * 1e3, tokens=tokens, params=count, mfu=mfu)


def check_cudnn_attention(cpu: bool) -> str:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from spopp_jax.models.attention import (causal_block_attention, causal_query_block, fused_attention,
                                            fused_attention_implementation)
    from spopp_jax.models.masks import sequence_layout

    batch, time_, kv, groups, dim = SIZES["attention"][cpu]
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(batch, time_, kv, groups, dim)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.normal(size=(batch, time_, kv, dim)), jnp.bfloat16) for _ in range(2))
    lengths = np.array([time_, time_ - time_ // 8, time_ // 2, 17])[:batch]
    mask = np.arange(time_)[None, :] < lengths[:, None]
    layout = sequence_layout(jnp.zeros((batch, time_), jnp.int32), jnp.asarray(mask))
    real = jnp.asarray(mask, jnp.float32)[:, :, None, None, None]
    gpu = jax.default_backend() == "gpu"
    kernels = {"xla": lambda q, k, v: fused_attention(q, k, v, layout, "xla"),
               "ours": lambda q, k, v: causal_block_attention(q, k, v, layout, causal_query_block(time_))}
    if gpu:
        kernels["cudnn"] = lambda q, k, v: fused_attention(q, k, v, layout, "cudnn")
    outs = {}
    for name, attend in kernels.items():
        step = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32) * real),
                                          argnums=(0, 1, 2)))
        outs[name] = jax.block_until_ready(step(q, k, v))
    errors = {}
    for name in kernels:
        if name == "xla":
            continue
        for label, got, want in zip(("loss", "dq", "dk", "dv"), (outs[name][0], *outs[name][1]),
                                    (outs["xla"][0], *outs["xla"][1])):
            got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
            errors[f"{name}_{label}"] = float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-6))
    ok = all(e < 2e-2 for e in errors.values())
    chosen = fused_attention_implementation(jnp.bfloat16, dim)
    if not gpu:
        return verdict("cudnn_attention", "SKIP" if ok else "FAIL",
                       f"no GPU: cuDNN not run; ours vs XLA max rel error {max(errors.values()):.2e}", **errors)
    ok = ok and chosen == "cudnn"
    return verdict("cudnn_attention", "PASS" if ok else "FAIL",
                   f"bf16 path chooses {chosen}; max rel error vs XLA {max(errors.values()):.2e}", **errors)


def check_engine_decode(cpu: bool) -> str:
    import asyncio

    import numpy as np

    from rollout_bridge.engine.base import SamplingParams
    from rollout_bridge.engine.jax_engine import JaxEngine
    from spopp_jax.models import init_model

    s = SIZES["step"][cpu]
    requests, new_tokens = SIZES["decode"][cpu]
    model = init_model(qwen3_config(s), seed=0, dtype="bfloat16")

    async def burst():
        engine = JaxEngine(model, num_slots=requests, max_len=256, steps_per_call=8, seed=0, min_prefill_len=32)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, s["vocab"], 32).tolist() for _ in range(requests)]
        params = SamplingParams(max_new_tokens=new_tokens)
        try:
            await asyncio.gather(*(engine.generate(p, params) for p in prompts))  # warm-up (compiles)
            start = time.perf_counter()
            results = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
            return results, time.perf_counter() - start
        finally:
            await engine.close()

    results, seconds = asyncio.run(burst())
    tokens = sum(len(r.token_ids) for r in results)
    ok = all(len(r.token_ids) == new_tokens and r.finish_reason == "length" for r in results)
    return verdict("engine_decode", "PASS" if ok else "FAIL",
                   f"{requests} requests x {new_tokens} tokens, {tokens / seconds:,.0f} tokens/s", tokens=tokens,
                   seconds=seconds)


def check_qwen35_tiny(cpu: bool) -> str:
    import jax.numpy as jnp
    import numpy as np

    from spopp_jax.models import init_model

    config = qwen35_tiny_config()
    ids = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (2, 48)), jnp.int32)
    full = np.asarray(init_model(config, seed=0)(ids))
    mixed = np.asarray(init_model(config, seed=0, dtype="bfloat16", param_dtype="float32")(ids))
    gap = float(np.max(np.abs(full - mixed)) / (np.max(np.abs(full)) + 1e-6))
    moved, finite, _, _, fp32 = step_moves_weights(config, random_batch(2, 48, config.vocab_size), steps=1)
    ok = finite and fp32 and moved > 0.99 and gap < 5e-2 and np.isfinite(mixed).all()
    return verdict("qwen35_tiny", "PASS" if ok else "FAIL",
                   f"bf16 logits within {gap:.1e} (relative) of fp32; a step moved {moved:.2%} of the master weights",
                   logit_gap=gap, moved=moved)


def check_memory_settings(cpu: bool) -> str:
    import jax

    settings = {name: os.environ[name] for name in MEMORY_ENV if name in os.environ}
    if not settings:
        return verdict("memory_settings", "SKIP", "no XLA_PYTHON_CLIENT_* set (no node layout in this environment)")
    stats = getattr(jax.devices()[0], "memory_stats", lambda: None)() or {}
    limit = stats.get("bytes_limit")
    fraction = settings.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    details = ", ".join(f"{k}={v}" for k, v in settings.items())
    if limit is None or fraction is None:
        return verdict("memory_settings", "PASS" if jax.device_count() else "FAIL",
                       f"{details}; device memory limit {'unknown' if limit is None else limit}", **settings)
    total = stats.get("bytes_reservable_limit") or stats.get("largest_free_block_bytes") or limit
    ok = limit <= float(fraction) * max(total, limit) * 1.05 + 1
    return verdict("memory_settings", "PASS" if ok else "FAIL",
                   f"{details}; device memory limit {limit / 2**30:.1f} GiB", bytes_limit=limit, **settings)


def check_vllm_inflight(cpu: bool) -> str:
    try:
        import vllm  # noqa: F401
    except Exception as error:  # vLLM absent or unusable here
        return verdict("vllm_inflight", "SKIP", f"vLLM not importable ({type(error).__name__}): not run")
    if cpu:
        return verdict("vllm_inflight", "SKIP", "--cpu: the vLLM check needs a GPU")
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
           "XLA_PYTHON_CLIENT_MEM_FRACTION": os.environ.get("SPOPP_JAX_GPU_FRACTION", "0.45"),
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--engine", "vllm", "--size",
                           "tiny", "--updates", "3", "--burst", "8", "--burst-tokens", "32"],
                          env=env, capture_output=True, text=True, timeout=240)
    tail = (done.stdout + done.stderr).strip().splitlines()[-1:] or [""]
    return verdict("vllm_inflight", "PASS" if done.returncode == 0 else "FAIL",
                   f"gpu_check.py --engine vllm exit {done.returncode}: {tail[0][:200]}")


CHECKS = (check_mixed_precision_step, check_cudnn_attention, check_engine_decode, check_qwen35_tiny,
          check_memory_settings, check_vllm_inflight)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="toy sizes on CPU (a dry run of every check)")
    parser.add_argument("--only", nargs="*", help="run only these checks (names as printed)")
    args = parser.parse_args(argv)
    if args.cpu:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    print(json.dumps({"devices": [str(d) for d in jax.devices()], "backend": jax.default_backend(),
                      "jax": jax.__version__}), flush=True)
    statuses = []
    for check in CHECKS:
        name = check.__name__.removeprefix("check_")
        if args.only and name not in args.only:
            continue
        start = time.perf_counter()
        try:
            statuses.append(check(args.cpu))
        except Exception as error:  # one broken check must not hide the others' verdicts
            traceback.print_exc()
            statuses.append(verdict(name, "FAIL", f"{type(error).__name__}: {error}"))
        print(json.dumps({"check": name, "seconds": round(time.perf_counter() - start, 1)}), flush=True)
    return 1 if "FAIL" in statuses else 0


if __name__ == "__main__":
    raise SystemExit(main())
