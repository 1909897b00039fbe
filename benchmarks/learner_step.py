"""Learner train-step throughput: our jitted SPO++ `train_step` against the same step in
PyTorch (transformers `Qwen3ForCausalLM` + the SPEC 5 clipped loss written in torch +
global-norm clipping + AdamW), eager and `torch.compile`, on the same weights and batch.

    python benchmarks/learner_step.py                 # model M: vocab 512, hidden 256, 4 layers
    python benchmarks/learner_step.py --breakdown     # + forward / forward+backward timings
    python benchmarks/learner_step.py --model 10m --batch 4 --seq 1024   # ~10M params, T=1024
    python benchmarks/learner_step.py --torch-micro-batches 1 16 --no-torch-eager --baseline main
        # against torch.compile at M = 1 and 16, and our step at git revision main, same rounds
    python benchmarks/learner_step.py --torch-micro-batches 1 16 --no-torch-eager \
        --xla-flag-sets "" "--xla_cpu_use_xnnpack=true" "--xla_cpu_use_onednn=true"
        # our step under each XLA_FLAGS set ("" = none) against torch.compile, same rounds
    python benchmarks/learner_step.py --probe-xla-flags   # which candidate flags jaxlib takes

Methods are timed under the benchmark protocol (benchmarks/_protocol.py): interleaved
rounds (jax, torch eager, torch.compile, jax, ...), the same thread count for all, the load
average printed per round and busy rounds left out, median and [min, max] per method, and
the same-run ratio as the headline. tokens/s counts every position of the [batch, seq] batch. MFU = achieved
FLOP/s / peak, FLOPs per step ~ 6 * matmul params * tokens + 12 * layers * batch * heads *
head_dim * seq^2 (causal attention counted densely, the usual MFU convention; ours computes
about 60% of those score FLOPs, `causal_block_attention`), and the peak is a measured fp32
1024^3 matmul (jax) in the same run, so a loaded machine lowers peak and step alike.
Each step's CPU seconds (its process's, all threads) are printed as well, with their
same-run ratios: on an oversubscribed machine they vary far less than wall time, though
threads that spin while waiting count in them.

XLA flag sets (``--xla-flag-sets``): XLA reads XLA_FLAGS once, when its client starts, so
each set runs our step in its own worker process per micro-batch count, the `--baseline`
workers' mechanism (benchmarks/learner_ab.py, this checkout's tree), timed in the same
rounds as everything else. Each worker reports the XLA_FLAGS it started with (the thread
flags of `_protocol.pin_threads` appended unless the set gives them) and its first step's
loss and gradient norm. Each set is first probed in a subprocess (a tiny jitted matmul
checked against numpy); a set this jaxlib refuses (XLA aborts on an unknown flag) or that
computes a wrong matmul is reported in one line and left out. The headline gives each
set's ratio to the torch steps and to the no-flag set at the same M ("" among the sets:
its worker; else the in-process step).

Candidate XLA:CPU flags (``--probe-xla-flags`` lists which this jaxlib accepts; the help
texts are XLA's, debug_options_flags.cc):
  --xla_cpu_use_thunk_runtime=true|false  accepted but no longer supported: XLA warns it
      will be removed; the thunk runtime is the only CPU runtime, so it changes nothing.
  --xla_cpu_multi_thread_eigen=false  run Eigen's dot / convolution kernels single-threaded
      (default true: on XLA's intra-op thread pool).
  --xla_cpu_enable_fast_math=true  unsafe fast-math LLVM optimisations in XLA's generated
      code (default false; the xla_cpu_fast_math_honor_* flags refine it).
  --xla_cpu_use_xnnpack=true  use XNNPACK for the operations it supports.
  --xla_cpu_experimental_xnn_fusion_type=dot|eltwise|reduce  XNNPACK fusion types to form
      (comma list; default empty).
  --xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY  extract
      XNNPACK-compatible subgraphs greedily from the roots (default DISABLED).
  --xla_cpu_experimental_ynn_fusion_type=dot  YNNPACK (XNNPACK's successor) fusion types
      (comma list; default empty).
  --xla_cpu_use_onednn=true  call oneDNN thunks for matmul and convolution fusions.
  --xla_cpu_experimental_onednn_fusion_type=dot  oneDNN fusion types (comma list).
  --xla_cpu_experimental_onednn_custom_call=true  call oneDNN custom-call thunks.
  --xla_cpu_prefer_vector_width=256|512  preferred vector width of XLA's LLVM code.
  --xla_cpu_enable_concurrency_optimized_scheduler=true  schedule HLO for concurrency
      (independent ops can overlap on the thread pool) rather than memory.
The intra-op thread count: `_protocol.pin_threads` appends
``intra_op_parallelism_threads=N`` to XLA_FLAGS; XLA takes a token without a leading "--"
as a positional argument and ignores it, so XLA's pool keeps its own size (the cores the
process may use); `taskset` is the way to give XLA fewer.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np


# This checkout's spopp_jax, not an editable install's (the script's folder is sys.path[0]).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _model_shapes import add_shape_arguments, resolve_shape  # noqa: E402


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(parser)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument(
        "--micro-batches",
        type=int,
        nargs="+",
        default=[1, 16],
        help="our num_micro_batches values to time (each is a separate jitted step)",
    )
    parser.add_argument(
        "--torch-micro-batches",
        type=int,
        nargs="+",
        default=[1],
        help="gradient-accumulation micro-batches of the torch reference steps",
    )
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per method")
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1,
        help="intra-op threads for every system (torch, XLA, OpenMP); default all cores",
    )
    parser.add_argument(
        "--max-load-excess", type=float, default=0.5,
        help="a round whose 1-min load exceeds cores + this is flagged BUSY and left out",
    )
    parser.add_argument(
        "--allow-busy", action="store_true",
        help="keep busy rounds (the headline then says it is not a headline figure)",
    )
    parser.add_argument(
        "--baseline", metavar="REV",
        help="also time our train step at git revision REV (e.g. main), one worker process "
             "per micro-batch count (benchmarks/learner_ab.py), in the same rounds",
    )
    parser.add_argument(
        "--xla-flag-sets", nargs="+", metavar="FLAGS", default=[],
        help='also time our train step under each XLA_FLAGS string ("" = no flags), one '
             "worker process per set and micro-batch count, in the same rounds; a set this "
             "jaxlib refuses is reported in one line and left out",
    )
    parser.add_argument(
        "--probe-xla-flags", nargs="*", metavar="FLAGS", default=None,
        help="only list which XLA flag sets this jaxlib accepts (the given sets, else the "
             "candidates in this script's docstring), a tiny jitted matmul per set, and exit",
    )
    parser.add_argument("--no-torch-compile", action="store_true")
    parser.add_argument("--no-torch-eager", action="store_true")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--breakdown", action="store_true", help="also time forward and fwd+bwd")
    # XLA flags start with "--", which argparse reads as options of its own: they are
    # passed on with a leading space, stripped again below.
    args = parser.parse_args(" " + a if a.startswith("--xla_") else a for a in sys.argv[1:])
    args.xla_flag_sets = [flags.strip() for flags in args.xla_flag_sets]
    if args.probe_xla_flags is not None:
        args.probe_xla_flags = [flags.strip() for flags in args.probe_xla_flags]
    resolve_shape(args)
    return args


# ----------------------------------------------------------------------------- XLA flags

XLA_FLAG_CANDIDATES = (
    "--xla_cpu_use_thunk_runtime=false",
    "--xla_cpu_use_thunk_runtime=true",
    "--xla_cpu_multi_thread_eigen=false",
    "--xla_cpu_enable_fast_math=true",
    "--xla_cpu_use_xnnpack=true",
    "--xla_cpu_experimental_xnn_fusion_type=dot",
    "--xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY",
    "--xla_cpu_experimental_ynn_fusion_type=dot",
    "--xla_cpu_use_onednn=true",
    "--xla_cpu_experimental_onednn_fusion_type=dot",
    "--xla_cpu_experimental_onednn_custom_call=true",
    "--xla_cpu_prefer_vector_width=512",
    "--xla_cpu_enable_concurrency_optimized_scheduler=true",
)

_PROBE = """
import jax, numpy as np
x = np.arange(96, dtype=np.float32).reshape(8, 12) / 96
y = np.asarray(jax.jit(lambda a: a @ a.T)(x))
print("PROBE_OK" if np.allclose(y, x @ x.T, rtol=1e-5, atol=1e-6) else "PROBE_WRONG")
"""


def probe_xla_flags(flags: str, timeout_s: float = 120.0) -> str | None:
    """None when this jaxlib runs a tiny jitted matmul right under XLA_FLAGS=``flags``,
    else the reason in one line. In a subprocess: XLA aborts the process on a flag it
    does not know."""
    env = dict(os.environ, XLA_FLAGS=flags)
    try:
        result = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                                text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"the probe did not finish in {timeout_s:.0f} s"
    if "PROBE_OK" in result.stdout:
        return None
    if "PROBE_WRONG" in result.stdout:
        return "accepted, but the jitted matmul is wrong"
    lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
    # XLA's fatal log line: "F1206 10:03:40.930350  4493 parse_flags_from_env.cc:234] Unknown ..."
    fatal = [line.split("] ", 1)[-1] for line in lines if line[:1] == "F" and "] " in line]
    reason = (fatal or lines or [f"exit status {result.returncode}"])[0]
    return reason[:300]


def flag_set_name(flags: str, micro_batches: int) -> str:
    """The printout's label of our step under XLA_FLAGS ``flags`` at M = ``micro_batches``."""
    return f"jax xla[{flags or 'no flags'}] M={micro_batches}"


def probe_main(flag_sets) -> None:
    from importlib.metadata import version

    print(f"jaxlib {version('jaxlib')}: XLA flag sets probed with a tiny jitted matmul, "
          "each in its own process", flush=True)
    for flags in flag_sets or XLA_FLAG_CANDIDATES:
        reason = probe_xla_flags(flags)
        print(f"  {'accepted' if reason is None else 'REFUSED '}  {flags!r}"
              + ("" if reason is None else f": {reason}"), flush=True)


ARGS = parse_args()
if ARGS.probe_xla_flags is not None:
    probe_main(ARGS.probe_xla_flags)
    sys.exit(0)
import _protocol  # noqa: E402

_protocol.pin_threads(ARGS.threads)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from spopp_jax import learner  # noqa: E402
from spopp_jax.models import from_pretrained  # noqa: E402
from spopp_jax.models.testing import random_hf_model  # noqa: E402
from _batches import learner_batch, learner_hf_config  # noqa: E402
from _hardware import cpu_model, measured_peak_flops  # noqa: E402

# ----------------------------------------------------------------------------- inputs


# ----------------------------------------------------------------------------- torch reference


def torch_step_fns(hf_model, batch_np, args):
    import torch

    ids_np, attention_np, action_np, rollout_np, adv_np = batch_np
    ids = torch.as_tensor(ids_np, dtype=torch.long)
    attention = torch.as_tensor(attention_np, dtype=torch.long)
    mask = torch.as_tensor(action_np[:, 1:])
    rollout = torch.as_tensor(rollout_np[:, 1:])
    adv = torch.as_tensor(adv_np[:, 1:])
    total_tokens = mask.sum().clamp(min=1)
    optimizer = torch.optim.AdamW(hf_model.parameters(), lr=1e-6, weight_decay=0.1, eps=1e-8)

    def loss_fn(model, rows=slice(None)):
        """Σ over the rows' action tokens / action tokens of the WHOLE batch."""
        ids_r, mask_r, adv_r, rollout_r = ids[rows], mask[rows], adv[rows], rollout[rows]
        logits = model(input_ids=ids_r, attention_mask=attention[rows]).logits
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        logp = logp.gather(-1, ids_r[:, 1:, None])[..., 0]
        old = logp.detach()  # old policy = the step's starting params, as ours by default
        ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
        surrogate = torch.minimum(ratio * adv_r, torch.clamp(ratio, 0.8, 1.28) * adv_r)
        surrogate = torch.where(adv_r < 0, torch.maximum(surrogate, 2.0 * adv_r), surrogate)
        weight = torch.clamp(torch.exp(torch.clamp(old - rollout_r, -20.0, 20.0)), max=2.0)
        per_token = torch.where(mask_r, weight * -surrogate, torch.zeros_like(surrogate))
        return per_token.sum() / total_tokens

    def make_step(model, micro_batches=1):
        rows = args.batch // micro_batches

        def step():
            optimizer.zero_grad(set_to_none=True)
            loss = 0.0
            for m in range(micro_batches):  # gradient accumulation, global token count
                micro_loss = loss_fn(model, slice(m * rows, (m + 1) * rows))
                micro_loss.backward()
                loss += micro_loss.detach()
            torch.nn.utils.clip_grad_norm_(hf_model.parameters(), 1.0)
            optimizer.step()
            return float(loss)

        def forward():
            with torch.no_grad():
                model(input_ids=ids, attention_mask=attention).logits.sum().item()

        def forward_backward():
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model).backward()

        return step, forward, forward_backward

    return make_step


# ----------------------------------------------------------------------------- helpers


def step_flops(args, matmul_params):
    tokens = args.batch * args.seq
    attention = 12 * args.layers * args.batch * args.heads * args.head_dim * args.seq**2
    return 6 * matmul_params * tokens + attention


def main(args, workers: dict):
    """``workers``: `start_workers`' worker processes by name (timed in the same rounds)."""
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    hf_config = learner_hf_config(args)
    hf_model = random_hf_model(hf_config, seed=0).train()
    hf_model.config._attn_implementation = "sdpa"
    with tempfile.TemporaryDirectory() as folder:
        hf_model.save_pretrained(folder)
        model = from_pretrained(folder, dtype="float32")

    rng = np.random.default_rng(0)
    batch_np = learner_batch(args.batch, args.seq, args.vocab, rng)
    batch = learner.TrainBatch(*(jnp.asarray(x) for x in batch_np))
    holders, jax_steps = {}, {}
    for micro_batches in args.micro_batches:
        config = learner.LearnerConfig(learning_rate=1e-6, num_mini_batches=1, action_logits_fraction=None,
                                       num_micro_batches=micro_batches)
        model_def, state = learner.init_train_state(model, config)
        # Own copies: each step donates its state, and the states would share the arrays.
        holders[micro_batches] = {"state": jax.tree.map(jnp.copy, state)}
        jax_steps[micro_batches] = make_jax_step(
            learner.make_train_step(model_def, config), holders[micro_batches], batch
        )
    holder = holders[args.micro_batches[0]]

    matmul_params = sum(
        p.numel()
        for n, p in hf_model.named_parameters()
        if "embed_tokens" not in n and "norm" not in n
    )
    tokens = args.batch * args.seq
    flops = step_flops(args, matmul_params)
    peak = measured_peak_flops()
    load = os.getloadavg()

    print(
        f"hardware: {cpu_model()}, {os.cpu_count()} cpus, "
        f"load avg {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} (shared machine), "
        f"measured fp32 matmul peak {peak / 1e9:.1f} GFLOP/s"
    )
    print(f"spopp_jax from {os.path.dirname(learner.__file__)}")
    print(
        f"versions: jax {jax.__version__} ({jax.devices()[0].platform}), torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), transformers {transformers.__version__}, "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, "
        f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}"
    )
    print(
        f"model {args.model}: Qwen3 vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers, "
        f"{args.heads}/{args.kv_heads} heads x {args.head_dim}, ffn {args.ffn}, untied, fp32, "
        f"{matmul_params / 1e6:.2f}M matmul params; batch {args.batch} x {args.seq} = {tokens} "
        f"tokens, {int(batch_np[2].sum())} action tokens, {args.micro_batches} micro-batch(es)"
    )

    fns = {}
    for micro_batches, jax_step in jax_steps.items():
        start = time.perf_counter()
        metrics = jax_step()
        print(f"jax compile + first step (M={micro_batches}): {time.perf_counter() - start:.1f} s, "
              f"loss {float(metrics['loss']):.6g}, grad_norm {float(metrics['grad_norm']):.6g}")
        fns[f"jax train_step M={micro_batches}"] = jax_step
    for name, worker in workers.items():
        try:
            first = worker.read()
        except RuntimeError as error:  # e.g. a flag XLA takes but the train step's compile not
            print(f"{name}: {error} before its first step; left out (its stderr is above)")
            continue
        seen = f", XLA_FLAGS seen {first['xla_flags']!r}" if "xla_flags" in first else ""
        print(f"{name}: compile + first step {first['compile_s']:.1f} s, loss "
              f"{first['loss']:.6g}, grad_norm {first['grad_norm']:.6g}{seen}")
        fns[name] = worker.step
    if args.breakdown:
        config = learner.LearnerConfig(learning_rate=1e-6, num_mini_batches=1, action_logits_fraction=None,
                                       num_micro_batches=args.micro_batches[0])
        forward = jax.jit(lambda p, b: model_def.apply(p, b.input_ids, b.attention_mask))
        grad = learner.make_loss_and_grad(model_def, config)
        fns["jax forward"] = lambda: forward(holder["state"].params, batch).block_until_ready()
        fns[f"jax fwd+bwd M={config.num_micro_batches}"] = lambda: jax.block_until_ready(
            grad(holder["state"].params, batch)
        )
    if not args.no_torch:
        make_step = torch_step_fns(hf_model, batch_np, args)
        compiled_model = None if args.no_torch_compile else torch.compile(hf_model)
        for micro_batches in args.torch_micro_batches:
            eager_step, eager_fwd, eager_fb = make_step(hf_model, micro_batches)
            if not args.no_torch_eager:
                fns[f"torch eager step M={micro_batches}"] = eager_step
            if args.breakdown and micro_batches == 1 and not args.no_torch_eager:
                fns["torch eager forward"] = eager_fwd
                fns["torch eager fwd+bwd M=1"] = eager_fb
            if compiled_model is not None:
                compiled_step, compiled_fwd, compiled_fb = make_step(compiled_model, micro_batches)
                start = time.perf_counter()
                compiled_step()
                compiled_step()
                print(
                    f"torch.compile compile + 2 steps (M={micro_batches}): "
                    f"{time.perf_counter() - start:.1f} s"
                )
                fns[f"torch.compile step M={micro_batches}"] = compiled_step
                if args.breakdown and micro_batches == 1:
                    fns["torch.compile forward"] = compiled_fwd
                    fns["torch.compile fwd+bwd M=1"] = compiled_fb
    for fn in fns.values():  # warm-up (compiles the breakdown functions)
        fn()
    cpu_seconds = {name: [] for name in fns}
    clocked = {name: with_cpu_seconds(name, fn, cpu_seconds, workers) for name, fn in fns.items()}
    try:
        timings = _protocol.interleaved_rounds(clocked, args.rounds,
                                               max_load_excess=args.max_load_excess)
    finally:
        for worker in workers.values():
            worker.close()
    _protocol.report(timings, tokens, "tok", args.allow_busy)
    medians = {name: timings.summary(name, args.allow_busy)[0] for name in fns}
    for name, seconds in medians.items():
        if "step" in name or name in workers:
            print(f"{name:34s} MFU {flops / seconds / peak * 100:5.1f}%")
    print("headline (same-run ratio of medians, > 1: ours faster):")
    for ours in (n for n in medians if n.startswith(OURS)):
        for theirs in (n for n in medians if n.startswith("torch") and "step" in n):
            print("  " + _protocol.headline(timings, ours, theirs, args.allow_busy))
    for micro_batches in args.micro_batches:
        if f"jax@{args.baseline} M={micro_batches}" in medians:
            print("  " + _protocol.headline(timings, f"jax train_step M={micro_batches}",
                                            f"jax@{args.baseline} M={micro_batches}",
                                            args.allow_busy))
        reference = flag_set_name("", micro_batches)  # the no-flag set
        if reference not in medians:
            reference = f"jax train_step M={micro_batches}"
        for name in (flag_set_name(flags, micro_batches) for flags in args.xla_flag_sets):
            if name in medians and name != reference:
                print("  " + _protocol.headline(timings, name, reference, args.allow_busy))
        if reference != f"jax train_step M={micro_batches}":  # in-process against worker
            print("  " + _protocol.headline(timings, f"jax train_step M={micro_batches}",
                                            reference, args.allow_busy))
    print("CPU seconds per step (all threads of the system's process; every round; steadier "
          "than wall time on an oversubscribed machine, but spin-waiting threads count):")
    for name, values in cpu_seconds.items():
        print(f"  {name:34s} {statistics.median(values) * 1e3:9.1f} ms  "
              f"[{min(values) * 1e3:.1f}, {max(values) * 1e3:.1f}]")
    for ours in (n for n in cpu_seconds if n.startswith(OURS)):
        for theirs in (n for n in cpu_seconds if n.startswith("torch") and "step" in n):
            ratios = [t / o for o, t in zip(cpu_seconds[ours], cpu_seconds[theirs])]
            ratio = statistics.median(cpu_seconds[theirs]) / statistics.median(cpu_seconds[ours])
            print(f"  {ours} vs {theirs}: {ratio:.2f}x CPU time "
                  f"(per-round ratio median {statistics.median(ratios):.2f}x)")


OURS = ("jax train_step", "jax@", "jax xla[")  # names of our steps in the printout


def make_jax_step(train_step, holder, batch):
    def jax_step():
        holder["state"], metrics = train_step(holder["state"], batch)
        jax.block_until_ready((holder["state"], metrics))
        return metrics

    return jax_step


def with_cpu_seconds(name, fn, record: dict, workers: dict):
    """``fn`` that also appends its CPU seconds to ``record[name]``: this process's
    (`time.process_time`, all threads) for an in-process step, the worker's own for a
    worker's step."""
    if name in workers:
        worker = workers[name]

        def run_worker():
            record[name].append(worker.step("cpu_seconds"))

        return run_worker

    def run():
        start = time.process_time()
        fn()
        record[name].append(time.process_time() - start)

    return run


def start_workers(args, scratch: str) -> dict:
    """name -> a `learner_ab.Worker` compiling our train step on the same model and batch,
    one per micro-batch count: at git revision ``args.baseline`` (exported into
    ``scratch``), and in this checkout under each of ``args.xla_flag_sets`` that this
    jaxlib accepts (a refused set is reported in one line and left out). The workers
    compile while this process does; their first replies are read later."""
    import argparse as _argparse

    import learner_ab
    from _model_shapes import SHAPE_FLAGS

    variants = []  # (name, tree, XLA_FLAGS)
    if args.baseline:
        folder = learner_ab.export_tree(args.baseline, os.path.join(scratch, "baseline"))
        variants += [(f"jax@{args.baseline} M={m}", folder, "") for m in args.micro_batches]
    for flags in dict.fromkeys(args.xla_flag_sets):  # each set once
        reason = probe_xla_flags(flags)
        if reason is not None:
            print(f"XLA flag set {flags!r}: refused by this jaxlib ({reason}); left out",
                  flush=True)
            continue
        variants += [(flag_set_name(flags, m), learner_ab.REPO, flags)
                     for m in args.micro_batches]
    workers = {}
    for name, tree, flags in variants:
        options = {flag: getattr(args, flag) for flag in SHAPE_FLAGS}
        options.update(batch=args.batch, seq=args.seq, mini_batches=1, threads=args.threads,
                       micro_batches=int(name.rsplit("=", 1)[1]))
        workers[name] = learner_ab.Worker(name, tree, flags, _argparse.Namespace(**options))
    return workers


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as _scratch:
        main(ARGS, start_workers(ARGS, _scratch))
