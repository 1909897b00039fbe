"""Page faults of XLA:CPU's per-call buffers: our learner step under three glibc malloc
settings, with and without idle time between steps.

    python benchmarks/step_page_faults.py                      # model M, 16 x 256, M = 1
    python benchmarks/step_page_faults.py --micro-batches 16 --gaps 0 3

XLA:CPU allocates each execution's temporary buffer when the call starts and frees it when
it ends; glibc serves a block over 32 MiB (over 64 MiB from a thread's own heap) with a
fresh `mmap`, so each call faults every page of it in anew. Each setting runs in its own
process (glibc reads its tunables when a process starts, and an arena limit binds only
threads that have not allocated yet), one after another, twice in alternating order:

  glibc      glibc's defaults (what `train.py` runs with);
  hugetlb    GLIBC_TUNABLES=glibc.malloc.hugetlb=1: mmapped blocks on transparent huge pages;
  one_heap   mallopt before JAX starts: M_ARENA_MAX 1, M_MMAP_MAX 0, M_TRIM_THRESHOLD 2 GiB
             (every thread on the main heap, nothing mmapped, freed memory kept).

Each process compiles the step, warms it up, then for each gap in ``--gaps`` runs
``--steps`` steps with that many idle seconds before each, and prints the median step, the
kernel (system) CPU per step and the minor page faults per step. Settings run one after
another, not interleaved step by step (interleaving would itself put idle time between a
process's steps), so the 1-minute load is printed per process: compare a pair only where
both loads were low. Results: docs/PERFORMANCE.md, section 5.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _model_shapes import add_shape_arguments, resolve_shape  # noqa: E402

ONE_HEAP = ((-8, 1), (-4, 0), (-1, 2**31 - 1))  # mallopt: M_ARENA_MAX, M_MMAP_MAX, M_TRIM_THRESHOLD
SETTINGS = {"glibc": {}, "hugetlb": {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"},
            "one_heap": {"STEP_PAGE_FAULTS_ONE_HEAP": "1"}}
REPLY = "FAULTS_REPLY "


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(parser)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--mini-batches", type=int, default=1)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per gap")
    parser.add_argument("--gaps", type=float, nargs="+", default=[0.0, 1.0, 3.0],
                        help="idle seconds before each timed step")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    resolve_shape(args)
    return args


def worker(args) -> None:
    """Time our step in this process under the malloc setting it was started with."""
    if os.environ.get("STEP_PAGE_FAULTS_ONE_HEAP") == "1":
        import ctypes

        mallopt = ctypes.CDLL("libc.so.6").mallopt
        if not all(mallopt(parameter, value) == 1 for parameter, value in ONE_HEAP):
            raise RuntimeError("mallopt refused a one_heap setting")
    import resource
    import statistics
    import time

    import _protocol

    _protocol.pin_threads(args.threads)
    import jax

    from _batches import jitted_train_step

    step, state, batch = jitted_train_step(args)
    for _ in range(2):  # compile + warm
        state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
    for gap in args.gaps:
        seconds = []
        before = resource.getrusage(resource.RUSAGE_SELF)
        for _ in range(args.steps):
            time.sleep(gap)
            start = time.perf_counter()
            state, metrics = step(state, batch)
            jax.block_until_ready((state, metrics))
            seconds.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_SELF)
        print(REPLY + json.dumps({
            "gap_s": gap, "step_ms": 1e3 * statistics.median(seconds),
            "system_ms": 1e3 * (after.ru_stime - before.ru_stime) / args.steps,
            "faults": (after.ru_minflt - before.ru_minflt) / args.steps,
            "load": os.getloadavg()[0]}), flush=True)


def run_setting(name: str, args) -> list[dict]:
    forwarded = [a for a in sys.argv[1:] if a != "--worker"]
    env = {k: v for k, v in os.environ.items()
           if k not in ("GLIBC_TUNABLES", "STEP_PAGE_FAULTS_ONE_HEAP")}
    env.update(SETTINGS[name])
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", *forwarded],
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"setting {name}: the worker exited {done.returncode}:\n"
                         + "\n".join(done.stderr.splitlines()[-20:]))
    return [json.loads(line[len(REPLY):]) for line in done.stdout.splitlines()
            if line.startswith(REPLY)]


def main(args) -> None:
    from _hardware import cpu_model

    load = os.getloadavg()
    print(f"hardware: {cpu_model()}, {os.cpu_count()} cpus, load avg {load[0]:.1f}/{load[1]:.1f}/"
          f"{load[2]:.1f}; glibc {os.confstr('CS_GNU_LIBC_VERSION')}; model {args.model}, batch "
          f"{args.batch} x {args.seq}, M={args.micro_batches}, K={args.mini_batches}, "
          f"{args.steps} steps per gap", flush=True)
    order = list(args.settings) + list(reversed(args.settings))  # each twice, alternating
    for index, name in enumerate(order):
        for row in run_setting(name, args):
            print(f"pass {index // len(args.settings) + 1} {name:9s} gap {row['gap_s']:.0f} s: "
                  f"{row['step_ms']:7.1f} ms/step, system {row['system_ms']:6.1f} ms/step, "
                  f"{row['faults']:9.0f} minor faults/step (load {row['load']:.2f})", flush=True)


if __name__ == "__main__":
    ARGS = parse_args()
    if ARGS.worker:
        worker(ARGS)
    else:
        main(ARGS)
