"""A new process's RL learner with its step programs loaded from the program store against
traced, in interleaved rounds (benchmarks/_protocol.py).

    python benchmarks/learner_programs.py --rounds 3

Each run is a fresh process, as a rerun of the job is: it builds the main job's learner
(`rollout_bridge.learner_processes.build_learner`, the shipped warm start, the default
config) with `--program_store true` or `false`, over one persistent compilation cache that
holds every executable (filled by a first run of each system before the rounds). Then
three passes of one update at each batch width in `--widths` (16 rows, the widths a job's
batches are padded to). An update at a width met for the first time traces and lowers the
step (traced) or reads the stored program (stored), then reads the executable, then steps.
The second pass counts what a changed state layout compiles again (the state comes back
from a step with its shardings spelled another way: equivalent, so nothing should), the
third is the step alone. A run's start-up is its first two passes minus twice its third:
what a rerun's learner pays before it steps at its pace. The batches are seeded
random tokens with ~7% action positions, as in the job; both systems must print the
same losses. Prints the CPU, the load per round, the host's fp32 matmul peak, medians
and the same-run ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _hardware import cpu_model, measured_peak_flops  # noqa: E402
from _protocol import process_rounds  # noqa: E402

SYSTEMS = {"stored": "true", "traced": "false"}
LOSSES: dict[str, list] = {}  # system -> the first-update losses of each of its runs


def batch_at(width: int, rows: int, vocab: int, seed: int):
    """A TrainBatch of ``rows`` x ``width``: random tokens, every row filled to a random length
    of at least half the width, ~7% of its positions actions (replies between observations)."""
    import numpy as np

    from spopp_jax.learner import TrainBatch

    rng = np.random.default_rng(seed)
    lengths = rng.integers(width // 2, width + 1, size=rows)
    positions = np.arange(width)[None, :]
    used = positions < lengths[:, None]
    action = used & (rng.random((rows, width)) < 0.07) & (positions > 0)
    return TrainBatch(input_ids=rng.integers(0, vocab, size=(rows, width)).astype(np.int32),
                      attention_mask=used, action_mask=action,
                      rollout_logp=np.where(action, rng.normal(-2.0, 0.5, (rows, width)), 0.0).astype(np.float32),
                      advantages=np.where(action, rng.normal(size=(rows, 1)), 0.0).astype(np.float32))


def one_process(program_store: str, widths: list[int]) -> dict:
    """(in the worker process) build the job's learner, time the first and second update
    at each width."""
    from rollout_bridge import components
    from rollout_bridge.config import load_config
    from rollout_bridge.learner_processes import build_learner
    from rollout_bridge.methods import LearnerInput

    cfg = load_config(["--program_store", program_store])
    agent = components.build_agent_config(cfg, cfg.env.max_turns)
    orchestrator = components.build_orchestrator_config(cfg, agent, cfg.seed)
    start = time.perf_counter()
    learner = build_learner(cfg, components.build_learner_config(cfg), orchestrator, Path(cfg.model.path))
    built = time.perf_counter() - start
    vocab = learner.model_def.merge(learner.state.params).config.vocab_size
    rows = cfg.rollout.batch_size
    passes, losses = [[], [], []], []
    for seconds in passes:
        for width in widths:
            batch = batch_at(width, rows, vocab, seed=width)
            start = time.perf_counter()
            metrics = learner(LearnerInput(batch, (), None)).metrics
            seconds.append(time.perf_counter() - start)
            if seconds is passes[0]:
                losses.append(metrics["loss"])
    return {"build_s": built, "passes_s": passes, "losses": losses}


def run_seconds(system: str, cache: str, widths: list[int]) -> float:
    """One worker process; its start-up seconds (first updates minus second ones)."""
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": cache, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    command = [sys.executable, __file__, "--worker", SYSTEMS[system], "--widths", *map(str, widths)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"worker failed ({done.returncode}):\n{done.stderr[-3000:]}")
    record = json.loads(done.stdout.strip().splitlines()[-1])
    LOSSES.setdefault(system, []).append(record["losses"])
    first, second, third = (sum(seconds) for seconds in record["passes_s"])
    start_up = first + second - 2 * third
    shown = " | ".join(" ".join(f"{s:.2f}" for s in seconds) for seconds in record["passes_s"])
    print(f"  {system}: learner built in {record['build_s']:.1f} s; passes {shown} s; start-up {start_up:.1f} s",
          flush=True)
    return start_up


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--widths", type=int, nargs="+", default=[1024, 1280, 1536, 1792, 2048],
                        help="batch widths (the job pads to multiples of 256, at most 2,048)")
    parser.add_argument("--max-load-excess", type=float, default=1.5)
    parser.add_argument("--worker", choices=sorted(SYSTEMS.values()), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        print(json.dumps(one_process(args.worker, args.widths)))
        return
    peak = [round(measured_peak_flops() / 1e9) for _ in range(3)]
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores); load {os.getloadavg()[0]:.2f} at the start; fp32 1024^3 "
          f"matmul GFLOP/s {peak}; the main job's learner, 16 rows at widths {args.widths}; "
          f"program_store compared", flush=True)
    with tempfile.TemporaryDirectory(prefix="learner_programs_cache_") as cache:
        process_rounds({system: (lambda s=system: run_seconds(s, cache, args.widths)) for system in SYSTEMS},
                       args.rounds, args.max_load_excess)
    runs = [losses for per_system in LOSSES.values() for losses in per_system]
    print(f"first-update losses of all {len(runs)} runs identical: {'yes' if all(r == runs[0] for r in runs) else 'NO'}"
          f" ({' '.join(f'{x:.6f}' for x in runs[0])})")


if __name__ == "__main__":
    main()
