"""Fault loop: random kill -9 / SIGINT / SIGTERM over a tiny train.py job, each followed by
``--resume``, until the job finishes; repeated until at least ``--kills`` faults landed.

    python tests/reliability/fault_loop.py --kills 50 --out /tmp/fault_loop

The job is tests/tiny_run.py's smallest real job (configs/smoke.yaml cut down): warm start,
prior, RL with a checkpoint every 2 updates and an export every 2, the final export and
evaluation, with a JAX compilation cache so that a resumed process does not recompile.
An uninterrupted run of the same job is the reference. A fault is a signal sent from
outside at a random moment of a randomly chosen target (`TARGETS`): seconds after the
start (imports, games, model), after the log shows the warm start, the prior, RL updates
or the evaluation began, or while a checkpoint step or an HF export is being written (its
temporary folder exists); the stage is also read from the process's last log line. After
each fault the job is started again with ``--resume``; a chain ends when a process
finishes. Checked:

- every fault: SIGINT / SIGTERM end with exit status 130 / 143 and our one line (no
  user-visible traceback longer than ``MAX_TRACEBACK_LINES``, no segfault); kill -9 leaves
  the run resumable (the run lock is taken over);
- every checkpoint on disk after every fault holds finite parameters;
- at the end of a chain: the final checkpoint's step, policy event, update and consumed
  counters equal the reference's (`compared`), metrics.jsonl holds each update exactly once, hf_model and summary.json exist.

Prints one JSON summary (counts per signal and stage, failures) and writes it to
``<out>/fault_loop.json``. Exit status 0 when every check held.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

MAX_TRACEBACK_LINES = 5
STEPS = 6
SIGNALS = {"kill -9": signal.SIGKILL, "SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM}
STAGES = (("warm start", "warm start"), ("prior", "prior"), ("RL", "RL:"), ("RL", "resume:"),
          ("export", "export"), ("evaluation", "evaluation"), ("done", "done in"))
RUN_TIMEOUT_S = 1200


def job_args(cache: Path, run: Path) -> list[str]:
    from tiny_run import tiny_train_args

    args = tiny_train_args(cache, STEPS)
    args[args.index("--output_dir") + 1] = str(run)
    return [sys.executable, str(ROOT / "train.py"), *args, "--progress", "false", "--tensorboard", "false",
            "--keep_checkpoints", "2", "--export_every", "2", "--compilation_cache_dir", str(cache / "xla"),
            "--prior.cache_dir", "null"]


def stage_of(log: str) -> str:
    """The stage the process was in: the last log line's stage ("start" before any)."""
    stage = "start"
    for line in log.splitlines():
        for name, marker in STAGES:
            if marker in line:
                stage = name
    return stage


def longest_traceback(text: str) -> int:
    """Lines of the longest Python traceback block in ``text`` (0 if none); a native
    crash report (faulthandler's 'Fatal Python error') counts as unbounded."""
    if "Fatal Python error" in text or "Segmentation fault" in text:
        return 10 ** 6
    longest, current = 0, None
    for line in text.splitlines():
        if line.startswith("Traceback (most recent call last)"):
            current = 1
        elif current is not None:
            if line.startswith(" ") or line.startswith("\t"):
                current += 1
            else:
                longest = max(longest, current + 1)
                current = None
    if current is not None:
        longest = max(longest, current)
    return longest


def finite_checkpoints(run: Path) -> list[str]:
    """Step folders whose parameters hold NaN/inf (they must not exist)."""
    import numpy as np

    from spopp_jax.export import read_step_params

    bad = []
    for step in sorted((run / "checkpoints").glob("[0-9]*")):
        if step.is_dir() and step.name.isdigit():
            arrays = read_step_params(step)
            if not all(np.isfinite(a).all() for a in arrays.values()):
                bad.append(str(step))
    return bad


def final_record(run: Path) -> dict:
    import orbax.checkpoint as ocp

    steps = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    manager = ocp.CheckpointManager(str(run / "checkpoints"))
    try:
        items = manager.restore(steps[-1], args=ocp.args.Composite(
            train_state=ocp.args.StandardRestore(), extra_orchestrator=ocp.args.StandardRestore()))
    finally:
        manager.close()
    state, extras = items["train_state"], items["extra_orchestrator"]["tree"]
    return {"checkpoint": steps[-1], "step": int(state["step"]), "policy_event": int(state["policy_event"]),
            "counters": {k: int(v) for k, v in extras["counters"].items()}}


def compared(record: dict) -> dict:
    """What must equal the uninterrupted run's: the last step, its policy event, the
    update and consumed-trajectory counters (requests in flight at a fault are dropped and
    re-dispatched, so dispatched / received counts may differ)."""
    return {"checkpoint": record["checkpoint"], "step": record["step"], "policy_event": record["policy_event"],
            "updates": record["counters"]["updates"], "consumed": record["counters"]["consumed"]}


def metric_steps(run: Path) -> list[int]:
    from rollout_bridge.metrics import read_metrics

    return [r["step"] for r in read_metrics(run / "metrics.jsonl")]


# Where a fault lands: (target, what shows it has begun, seconds after that, drawn uniformly
# up to this). A log line, or a temporary folder of a write in progress (an orbax step
# being saved, an HF folder being exported), or the time since the start.
TARGETS = (
    ("start", None, 20.0),
    ("warm start", "warm start: SFT on", 8.0),
    ("prior", "prior: ", 5.0),
    ("RL", "RL: update", 10.0),
    ("checkpoint write", "checkpoints/*.orbax-checkpoint-tmp*", 0.0),
    ("export", ".*.partial-*", 0.0),
    ("evaluation", "evaluation:", 3.0),
)


def _writes(marker: str, run: Path) -> set[Path]:
    try:    # orbax renames and deletes folders under the glob at any moment
        found = set(run.glob(marker))
        return found | set(run.glob("exports/" + marker)) if marker.startswith(".") else found
    except OSError:
        return set()


def _begun(marker: str | None, run: Path, log_path: Path, before: set[Path]) -> bool:
    """True once ``marker`` shows: a log line, or a write folder that was not there at the
    start (a killed job's leftover temporary folder does not count)."""
    if marker is None:
        return True
    if "*" in marker:
        return bool(_writes(marker, run) - before)
    return marker in log_path.read_text()


def run_once(args: list[str], log_path: Path, signum: int | None, delay: float,
             target: tuple | None = None) -> dict:
    """Runs train.py; sends ``signum`` ``delay`` seconds after ``target``'s marker shows."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    run = Path(args[args.index("--output_dir") + 1])
    marker = target[1] if target is not None else None
    before = _writes(marker, run) if marker and "*" in marker else set()
    with open(log_path, "w") as log:
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.PIPE, cwd=ROOT, env=env, text=True)
        start = time.time()
        sent = False
        seen = None
        while process.poll() is None:
            if signum is not None and not sent:
                if seen is None and _begun(marker, run, log_path, before):
                    seen = time.time()
                if seen is not None and time.time() - seen >= delay:
                    os.kill(process.pid, signum)
                    sent = True
            if time.time() - start > RUN_TIMEOUT_S:
                process.kill()
                break
            time.sleep(0.01)
        stderr = process.stderr.read()
        process.wait()
    stdout = log_path.read_text()
    return {"returncode": process.returncode, "sent": sent, "stderr": stderr, "stdout": stdout,
            "wall_s": time.time() - start}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "),
                                     epilog="Exit status 0 when every check held.")
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--out", type=Path, default=Path("/tmp/fault_loop"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max_chain", type=int, default=8, help="faults per chain at most, then run to the end")
    parser.add_argument("--record", type=Path, default=None,
                        help="also write the summary here (docs/results/fault_loop.json)")
    options = parser.parse_args(argv)
    rng = random.Random(options.seed)
    out = options.out
    out.mkdir(parents=True, exist_ok=True)
    cache = out / "cache"
    cache.mkdir(exist_ok=True)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    reference_run = out / "reference"
    if not (reference_run / "summary.json").exists():
        shutil.rmtree(reference_run, ignore_errors=True)
        run_once(job_args(cache, reference_run), out / "reference_warmup.log", None, 0)  # games, cache
        shutil.rmtree(reference_run, ignore_errors=True)
        result = run_once(job_args(cache, reference_run), out / "reference.log", None, 0)
        assert result["returncode"] == 0, result["stderr"][-3000:]
        (out / "reference_wall_s").write_text(str(result["wall_s"]))
    wall = float((out / "reference_wall_s").read_text())
    reference = final_record(reference_run)
    print(f"reference: {reference} in {wall:.0f}s", flush=True)

    faults, failures, chains = [], [], 0
    while len(faults) < options.kills:
        chains += 1
        run = out / f"chain_{chains}"
        shutil.rmtree(run, ignore_errors=True)
        args = job_args(cache, run)
        for attempt in range(options.max_chain + 1):
            name, signum = rng.choice(list(SIGNALS.items())) if attempt < options.max_chain else (None, None)
            target = rng.choice(TARGETS)
            delay = rng.uniform(0.0, target[2])
            if target[0] == "start":
                delay += 1.0
            result = run_once(args + (["--resume"] if attempt else []), out / f"chain_{chains}_{attempt}.log",
                              signum, delay, target)
            text = result["stdout"] + result["stderr"]
            if not result["sent"]:     # the process finished before the fault
                if result["returncode"] != 0:
                    failures.append({"chain": chains, "attempt": attempt, "why": "a clean run failed",
                                     "stderr": result["stderr"][-2000:]})
                break
            record = {"chain": chains, "attempt": attempt, "signal": name, "target": target[0],
                      "delay_s": round(delay, 2), "stage": stage_of(result["stdout"]), "returncode": result["returncode"],
                      "traceback_lines": longest_traceback(text),
                      "stderr_tail": result["stderr"].strip().splitlines()[-1:] }
            faults.append(record)
            expected = {signal.SIGKILL: -9, signal.SIGINT: 130, signal.SIGTERM: 143}[signum]
            if result["returncode"] not in (expected, 0):
                failures.append({**record, "why": f"exit status {result['returncode']}, expected {expected}",
                                 "stderr": result["stderr"][-2000:]})
            if record["traceback_lines"] > MAX_TRACEBACK_LINES:
                failures.append({**record, "why": "traceback longer than 5 lines", "stderr": result["stderr"][-3000:]})
            if signum != signal.SIGKILL and result["returncode"] == expected:
                last = result["stderr"].strip().splitlines()[-1:] or [""]
                if not last[0].startswith("interrupted"):
                    failures.append({**record, "why": "no 'interrupted' line", "stderr": result["stderr"][-2000:]})
            if (run / "checkpoints").is_dir():
                bad = finite_checkpoints(run)
                if bad:
                    failures.append({**record, "why": f"non-finite checkpoints {bad}"})
            print(json.dumps(record), flush=True)
            if result["returncode"] == 0:   # finished before the signal took effect
                break
        else:
            pass
        if not (run / "summary.json").exists():
            failures.append({"chain": chains, "why": "the chain did not finish"})
            continue
        final = final_record(run)
        steps = metric_steps(run)
        if compared(final) != compared(reference):
            failures.append({"chain": chains, "why": f"final state {final} != reference {reference}"})
        if steps != list(range(1, STEPS + 1)):
            failures.append({"chain": chains, "why": f"metrics steps {steps}"})
        if not (run / "hf_model" / "config.json").exists():
            failures.append({"chain": chains, "why": "no hf_model"})
        print(f"chain {chains}: finished; final {final}; faults so far {len(faults)}, failures {len(failures)}",
              flush=True)
        shutil.rmtree(run, ignore_errors=True)

    summary = {"faults": len(faults), "chains": chains, "failures": len(failures),
               "by_signal": dict(Counter(f["signal"] for f in faults)),
               "by_target": dict(Counter(f["target"] for f in faults)),
               "by_stage": dict(Counter(f["stage"] for f in faults)),
               "longest_traceback": max((f["traceback_lines"] for f in faults), default=0),
               "reference": reference, "failure_details": failures, "fault_records": faults}
    (out / "fault_loop.json").write_text(json.dumps(summary, indent=1))
    if options.record:
        options.record.write_text(json.dumps({k: v for k, v in summary.items() if k != "reference"}, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k not in ("fault_records",)}, indent=1))
    return 0 if not failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
