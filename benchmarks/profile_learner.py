"""Per-op profile of our learner train step: where the XLA:CPU op time goes.

    python benchmarks/profile_learner.py                   # model M, 16 x 256, M = 1
    python benchmarks/profile_learner.py --model 10m --batch 4 --seq 1024 --top 40

Compiles `learner.make_train_step` on the benchmark model and batch (the same as
learner_step.py), traces `--steps` steps with `jax.profiler.trace`, reads the trace back
with `jax.profiler.ProfileData` (part of jaxlib), sums each XLA op's time over the XLA
worker threads, and looks every op up in the compiled HLO text for its output shape and
`op_name` (which einsum / jvp / transpose of the Python code it came from). Prints the
share of dots (`ynn_fusion` / `dot`, with their fused epilogues), copies and transposes,
and the rest, the time per source (`op_name`), the top non-dot ops, then the top ops.
Shares are meaningful on a busy machine; milliseconds are not (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile

# This checkout's spopp_jax, not an editable install's (the script's folder is sys.path[0]).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _model_shapes import add_shape_arguments, resolve_shape  # noqa: E402

XLA_THREAD_PREFIX = "tf_XLAEigen"  # trace lines of XLA:CPU's worker threads
WRAPPER_EVENTS = ("ThunkExecutor", "SlinkyThreadPool", "$")  # not ops: executors, Python


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(parser)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--mini-batches", type=int, default=1, help="PPO mini-batches K")
    parser.add_argument("--steps", type=int, default=3, help="traced steps")
    parser.add_argument("--top", type=int, default=25, help="ops listed")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--hlo-out", help="also write the compiled HLO text here")
    args = parser.parse_args()
    resolve_shape(args)
    return args


def hlo_ops(hlo_text: str) -> dict[str, tuple[str, str]]:
    """op name -> (output shape, op_name metadata) of every instruction in the HLO text.
    A fusion whose computation holds a dot gets op_name ".../dot_general" (a `ynn_fusion`
    names its root, e.g. the reduce or multiply of a dot's epilogue)."""
    with_dot, computation = set(), None
    for line in hlo_text.splitlines():
        header = re.match(r"%([\w.\-]+) \(", line)
        if header:
            computation = header.group(1)
        elif computation and re.search(r" dot\(", line):
            with_dot.add(computation)
    ops = {}
    for line in hlo_text.splitlines():
        match = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (\S+) ", line)
        if match:
            op_name = re.search(r'op_name="([^"]*)"', line)
            op_name = op_name.group(1) if op_name else ""
            called = re.search(r"calls=%([\w.\-]+)", line)
            if called and called.group(1) in with_dot and "dot_general" not in op_name:
                op_name += "/dot_general"
            ops[match.group(1)] = (match.group(2), op_name)
    return ops


def op_kind(name: str, op_name: str) -> str:
    """'dot', 'copy/transpose' or 'other', from the XLA op (fusion) name and its op_name
    (a `ynn_fusion` is a dot or a reduction)."""
    base = re.sub(r"\.\d+$", "", name)
    if base.startswith("dot") or (base.startswith("ynn_fusion") and "dot_general" in op_name):
        return "dot"
    if base.startswith(("copy", "transpose")):
        return "copy/transpose"
    return "other"


def op_times(trace_folder: str) -> collections.Counter:
    """Summed nanoseconds per XLA op over the XLA worker threads of the trace."""
    import jax

    path = glob.glob(os.path.join(trace_folder, "**", "*.xplane.pb"), recursive=True)[0]
    totals = collections.Counter()
    for plane in jax.profiler.ProfileData.from_file(path).planes:
        for line in plane.lines:
            if not line.name.startswith(XLA_THREAD_PREFIX):
                continue
            for event in line.events:
                if not event.name.startswith(WRAPPER_EVENTS):
                    totals[event.name] += event.duration_ns
    return totals


def main(args):
    import _protocol

    _protocol.pin_threads(args.threads)
    import spopp_jax
    import jax

    from _batches import jitted_train_step

    step, state, batch = jitted_train_step(args)
    hlo = step.lower(state, batch).compile().as_text()
    if args.hlo_out:
        with open(args.hlo_out, "w") as f:
            f.write(hlo)
    state, metrics = step(state, batch)  # compile + warm
    jax.block_until_ready(metrics)
    with tempfile.TemporaryDirectory() as trace_folder:
        with jax.profiler.trace(trace_folder):
            for _ in range(args.steps):
                state, metrics = step(state, batch)
                jax.block_until_ready((state, metrics))
        totals = op_times(trace_folder)
    ops = hlo_ops(hlo)
    load = os.getloadavg()[0]
    total = sum(totals.values())
    print(f"spopp_jax from {os.path.dirname(spopp_jax.__file__)}")
    print(f"model {args.model}, batch {args.batch} x {args.seq}, M={args.micro_batches}, K={args.mini_batches}; "
          f"load avg {load:.1f} (shared machine: read shares, not ms); op time "
          f"{total / args.steps / 1e6:.1f} ms/step over {XLA_THREAD_PREFIX} threads")
    kinds = collections.Counter()
    for name, ns in totals.items():
        kinds[op_kind(name, ops.get(name, ("", ""))[1])] += ns
    for kind, ns in kinds.most_common():
        print(f"  {kind:16s} {100 * ns / total:5.1f}%")
    print("by source (op_name of the Python code; dots apart):")
    sources = collections.Counter()
    for name, ns in totals.items():
        shape, op_name = ops.get(name, ("?", ""))
        sources[(op_kind(name, op_name), source_of(op_name))] += ns
    for (kind, source), ns in sources.most_common(args.top):
        print(f"{100 * ns / total:5.1f}%  {kind:14s} {source[-90:]}")
    for want in ("other", "copy/transpose"):
        print(f"top {want} ops:")
        picked = [(n, ns) for n, ns in totals.most_common()
                  if op_kind(n, ops.get(n, ("", ""))[1]) == want][:args.top]
        for name, ns in picked:
            shape, op_name = ops.get(name, ("?", "?"))
            print(f"{100 * ns / total:5.1f}%  {name:30s} {shape:40s} {op_name[-60:]}")
    print("top ops:")
    for name, ns in totals.most_common(args.top):
        shape, op_name = ops.get(name, ("?", "?"))
        print(f"{100 * ns / total:5.1f}%  {name:30s} {shape:32s} {op_name[-70:]}")


def source_of(op_name: str) -> str:
    """The op_name without the jit(...) prefix: which einsum / jvp / transpose it came from."""
    return re.sub(r"^jit\([^)]*\)/", "", op_name) or "?"


if __name__ == "__main__":
    main(parse_args())
