"""Same-run A/B of our learner train step: code versions and/or XLA flags, one worker
process per variant, timed in interleaved rounds (benchmarks/_protocol.py).

    python benchmarks/learner_ab.py --variant base=HEAD~1 --variant new=.       # code A/B
    python benchmarks/learner_ab.py --variant default=. \\
        --variant fastmath=.:--xla_cpu_enable_fast_math=true                   # flag A/B
    python benchmarks/learner_ab.py --variant small=. --variant huge=. \\
        --variant-env huge:GLIBC_TUNABLES=glibc.malloc.hugetlb=1              # environment A/B

A variant is NAME=TREE[:XLA_FLAGS]. TREE is ``.`` (this checkout) or a git revision, which
is exported (`git archive`) to a temporary folder that the worker puts first on its
sys.path, so `spopp_jax` is imported from that revision. XLA flags (and `--variant-env`
variables such as GLIBC_TUNABLES, read when a process starts) must be set before the XLA
client starts, hence one process per variant. Every worker builds the same random
Qwen3 (model M by default), the same batch as `benchmarks/learner_step.py`, compiles
`learner.make_train_step` and then blocks on its stdin; the driver asks one worker at a
time for one timed step (at most one computes at a time, so load from other users of the
machine hits all variants alike). The worker times its own step (block_until_ready
included) for its warm-up; the rounds are timed by the driver (a pipe round trip, under
a millisecond, against steps of seconds). Each worker also reports its first step's
loss and pre-clip gradient norm, which must agree between code versions (same math).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "benchmarks")
REPLY = "AB_REPLY "
sys.path.insert(0, BENCH)
from _model_shapes import add_shape_arguments, resolve_shape  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME=TREE[:XLA_FLAGS]; TREE is '.' or a git revision")
    parser.add_argument("--variant-env", action="append", default=[],
                        help="NAME:VAR=VALUE: an environment variable of variant NAME's worker "
                             "(repeatable; VALUE may be empty)")
    add_shape_arguments(parser)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--mini-batches", type=int, default=1,
                        help="PPO mini-batches K (AdamW steps per train step; the main job: 4)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--max-load-excess", type=float, default=0.5)
    parser.add_argument("--allow-busy", action="store_true")
    parser.add_argument(
        "--clock", choices=("wall", "cpu"), default="wall",
        help="wall: seconds per step (timed by the driver); cpu: the worker's CPU seconds per "
             "step, all its threads (steadier than wall time on an oversubscribed machine)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: worker mode
    args = parser.parse_args(argv)
    resolve_shape(args)
    if not args.worker and len(args.variant) < 2:
        parser.error("give at least two --variant NAME=TREE[:XLA_FLAGS]")
    return args


def parse_variant(text: str) -> tuple[str, str, str]:
    """'name=tree[:flags]' -> (name, tree, flags)."""
    if "=" not in text:
        raise ValueError(f"--variant {text!r}: expected NAME=TREE[:XLA_FLAGS]")
    name, rest = text.split("=", 1)
    tree, _, flags = rest.partition(":")
    if not name or not tree:
        raise ValueError(f"--variant {text!r}: NAME and TREE must be non-empty")
    return name, tree, flags


def variant_environs(texts, names) -> dict[str, dict[str, str]]:
    """['name:VAR=value', ...] -> {name: {VAR: value}}, for variants in ``names``."""
    environs: dict[str, dict[str, str]] = {}
    for text in texts:
        name, _, assignment = text.partition(":")
        var, equals, value = assignment.partition("=")
        if name not in names or not var or not equals:
            raise ValueError(f"--variant-env {text!r}: expected NAME:VAR=VALUE with NAME one of "
                             f"{names}")
        environs.setdefault(name, {})[var] = value
    return environs


def export_tree(tree: str, folder: str) -> str:
    """The folder whose `spopp_jax` a worker imports: this checkout for '.', else the
    revision exported with `git archive` into `folder`."""
    if tree == ".":
        return REPO
    os.makedirs(folder)
    archive = subprocess.run(["git", "-C", REPO, "archive", tree], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    return folder


# ----------------------------------------------------------------------------- worker


def worker(args) -> None:
    tree = args.worker
    sys.path.insert(0, tree)
    sys.path.insert(1, BENCH)
    import _protocol

    _protocol.pin_threads(args.threads)
    import jax

    import spopp_jax
    from _batches import jitted_train_step

    if not os.path.abspath(spopp_jax.__file__).startswith(os.path.abspath(tree)):
        raise RuntimeError(f"worker imported spopp_jax from {spopp_jax.__file__}, not {tree}")
    step, state, batch = jitted_train_step(args)
    start = time.perf_counter()
    state, metrics = step(state, batch)
    metrics = jax.device_get(metrics)
    first = {"compile_s": time.perf_counter() - start, "loss": float(metrics["loss"]),
             "grad_norm": float(metrics["grad_norm"]),
             "xla_flags": os.environ.get("XLA_FLAGS", "")}  # what XLA was started with
    print(REPLY + json.dumps(first), flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        start, start_cpu = time.perf_counter(), time.process_time()
        state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        print(REPLY + json.dumps({"seconds": time.perf_counter() - start,
                                  "cpu_seconds": time.process_time() - start_cpu}), flush=True)


# ----------------------------------------------------------------------------- driver


class Worker:
    """One variant's process: ask it for a step, read its reply."""

    def __init__(self, name: str, tree: str, flags: str, args, environ: dict | None = None):
        self.name = name
        env = dict(os.environ, **(environ or {}))
        env["XLA_FLAGS"] = flags.replace(",", " ")
        forwarded = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                     if k not in ("variant", "variant_env", "worker", "allow_busy", "rounds",
                                  "max_load_excess", "model", "clock")]
        self.process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", tree, *forwarded],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=tree)

    def read(self) -> dict:
        for line in self.process.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY):])
        raise RuntimeError(f"variant {self.name}: worker exited ({self.process.wait()})")

    def step(self, clock: str = "seconds") -> float:
        """One timed step: its wall ``"seconds"`` or the worker's ``"cpu_seconds"``."""
        self.process.stdin.write("step\n")
        self.process.stdin.flush()
        return self.read()[clock]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=60)


def main(args) -> None:
    sys.path.insert(0, BENCH)
    import _protocol
    from _hardware import cpu_model

    variants = [parse_variant(v) for v in args.variant]
    environs = variant_environs(args.variant_env, [name for name, _, _ in variants])
    load = os.getloadavg()
    print(f"clock: {args.clock}; hardware: {cpu_model()}, {os.cpu_count()} cpus, load avg {load[0]:.1f}/"
          f"{load[1]:.1f}/{load[2]:.1f} (shared machine); {args.threads} threads; model "
          f"{args.model}: hidden {args.hidden} x {args.layers} layers, vocab {args.vocab}, batch "
          f"{args.batch} x {args.seq}, M={args.micro_batches}, K={args.mini_batches}", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        workers = []
        try:
            for index, (name, tree, flags) in enumerate(variants):
                folder = export_tree(tree, os.path.join(scratch, f"tree{index}"))
                workers.append(Worker(name, folder, flags, args, environs.get(name)))
            for w, (name, tree, flags) in zip(workers, variants):  # compile one at a time
                first = w.read()
                print(f"{name}: tree {tree}, XLA_FLAGS {flags!r}, environment "
                      f"{environs.get(name, {})}: compile + first step "
                      f"{first['compile_s']:.1f} s, loss {first['loss']:.6g}, grad_norm "
                      f"{first['grad_norm']:.6g}", flush=True)
            for w in workers:  # one warm step each
                w.step()
            # The wall clock includes the pipe round trip (< 1 ms against seconds).
            if args.clock == "cpu":
                fns = {w.name: (lambda w=w: w.step("cpu_seconds")) for w in workers}
            else:
                fns = {w.name: w.step for w in workers}
            timings = _protocol.interleaved_rounds(fns, args.rounds, self_timed=args.clock == "cpu",
                                                   max_load_excess=args.max_load_excess)
        finally:
            for w in workers:
                w.close()
    tokens = args.batch * args.seq
    _protocol.report(timings, tokens, "tok", args.allow_busy)
    base = workers[0].name
    for w in workers[1:]:
        print("headline: " + _protocol.headline(timings, w.name, base, args.allow_busy))


if __name__ == "__main__":
    ARGS = parse_args()
    if ARGS.worker:
        worker(ARGS)
    else:
        main(ARGS)
