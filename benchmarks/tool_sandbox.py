"""Tool-sandbox throughput and latency vs a fresh ``python -c`` subprocess per call.

    python benchmarks/tool_sandbox.py [--calls 64] [--rounds 3] [--concurrency 1 8 32]
                                      [--before DIR] [--paired N]

Two workloads: a trivial ``print(1)`` and a ~50 ms pure-Python computation. For each
concurrency c and each round, the systems are run back to back (order rotating per round):
the warm bubblewrap pool (``ToolSandbox`` with c workers), with ``--before DIR`` the same
pool from another copy of the sandbox files (a folder with ``sandbox.py``,
``_worker_main.py``, ``jsonl_process.py``, ``env_sections.py``, ``__init__.py``: e.g. the
files before a change, to price it), and a fresh ``python -I -c CODE`` subprocess per call
(no isolation at all: the cheapest thing a trainer could do instead), each with c calls in
flight. Printed per row: calls/s, p50, p95 and p99 latency, the ratio of calls/s against
the subprocess, and the 1-minute load average at the row's start (rows started above
``--busy-load`` are flagged BUSY: the machine is shared); at the end, per workload, the
medians over rounds, and the p50 cost of this checkout against ``--before``. ``--paired N``
adds a run that interleaves the systems call by call (one call at a time), the fairer
comparison on a machine whose load drifts: p50, p95 and the median per-call difference.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._hardware import cpu_model  # noqa: E402
from rollout_bridge.tools import SandboxConfig, ToolSandbox  # noqa: E402


def load_before(folder: str):
    """ToolSandbox and SandboxConfig of another copy of the sandbox files."""
    import importlib
    import importlib.util

    spec = importlib.util.spec_from_file_location("sandbox_before", os.path.join(folder, "__init__.py"),
                                                  submodule_search_locations=[folder])
    package = importlib.util.module_from_spec(spec)
    sys.modules["sandbox_before"] = package
    spec.loader.exec_module(package)
    module = importlib.import_module("sandbox_before.sandbox")
    return module.ToolSandbox, module.SandboxConfig

WORKLOADS = {
    "print(1)": "print(1)",
    "50ms compute": "s = 0\nfor i in range(1_000_000):\n    s += i * i\nprint(s)",
}


def percentile(values, q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty sequence."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[rank]


def timed_calls(call, code: str, num_calls: int, concurrency: int) -> tuple[float, list[float]]:
    """Run ``call(code)`` ``num_calls`` times, ``concurrency`` at once; return (calls/s, latencies)."""

    def one(_):
        start = time.perf_counter()
        ok = call(code)
        if not ok:
            raise RuntimeError(f"benchmark call failed: {code!r}")
        return time.perf_counter() - start

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        latencies = list(pool.map(one, range(num_calls)))
    return num_calls / (time.perf_counter() - start), latencies


def subprocess_call(code: str) -> bool:
    done = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, timeout=60)
    return done.returncode == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=64, help="calls per system per row")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--before", help="folder of another copy of the sandbox files to compare with")
    parser.add_argument("--busy-load", type=float, default=1.0, help="flag rows above this 1-min load")
    parser.add_argument("--paired", type=int, default=0, metavar="N",
                        help="also N calls per system interleaved call by call, one at a time")
    args = parser.parse_args()
    print(f"cpu: {cpu_model()} x {os.cpu_count()} | python {sys.version.split()[0]} | "
          f"load at start {os.getloadavg()[0]:.2f}")
    print(f"{'workload':14s} {'conc':>4s} {'rnd':>3s} {'system':10s} {'calls/s':>8s} {'p50 ms':>8s} "
          f"{'p95 ms':>8s} {'p99 ms':>8s} {'ratio':>6s} {'load1':>5s}")
    kinds = {"sandbox": (ToolSandbox, SandboxConfig)}
    if args.before:
        kinds["before"] = load_before(args.before)
    summary = {}
    for concurrency in args.concurrency:
        boxes = {name: cls(config_cls(num_workers=concurrency, wall_s=30, cpu_s=30)) for name, (cls, config_cls) in kinds.items()}
        try:
            systems = {name: (lambda code, box=box: box.run_sync(code).status == "ok") for name, box in boxes.items()}
            systems["subprocess"] = subprocess_call
            for name, code in WORKLOADS.items():
                for rnd in range(args.rounds):
                    load = os.getloadavg()[0]
                    names = list(systems)
                    order = names[rnd % len(names):] + names[:rnd % len(names)]
                    rows = {s: timed_calls(systems[s], code, args.calls, concurrency) for s in order}
                    flag = " BUSY" if load > args.busy_load else ""
                    for system in systems:
                        rate, lat = rows[system]
                        ratio = rate / rows["subprocess"][0]
                        print(f"{name:14s} {concurrency:4d} {rnd:3d} {system:10s} {rate:8.1f} "
                              f"{1e3 * statistics.median(lat):8.1f} {1e3 * percentile(lat, 95):8.1f} "
                              f"{1e3 * percentile(lat, 99):8.1f} {ratio:6.2f} {load:5.2f}{flag}")
                        summary.setdefault((name, concurrency, system), []).append(
                            (ratio, 1e3 * statistics.median(lat), 1e3 * percentile(lat, 95)))
        finally:
            for box in boxes.values():
                box.close()
    print(f"\nmedian over rounds (load at end {os.getloadavg()[0]:.2f}): calls/s ratio vs subprocess, p50, p95")
    for (name, concurrency, system), values in summary.items():
        ratios, p50s, p95s = zip(*values)
        print(f"  {name:14s} c={concurrency:<3d} {system:10s} ratio {statistics.median(ratios):6.2f}  "
              f"p50 {statistics.median(p50s):6.1f} ms  p95 {statistics.median(p95s):6.1f} ms")
    if args.before:
        print("\nthis checkout's p50 minus --before's p50 (median over rounds; same run):")
        for name in WORKLOADS:
            for concurrency in args.concurrency:
                now = statistics.median(v[1] for v in summary[(name, concurrency, "sandbox")])
                then = statistics.median(v[1] for v in summary[(name, concurrency, "before")])
                print(f"  {name:14s} c={concurrency:<3d} {now - then:+6.1f} ms")
    if args.paired:
        paired(args.paired, kinds)


def paired(calls: int, kinds: dict) -> None:
    """One call at a time, the systems interleaved call by call (order rotating), so a
    shared machine's load drifts over all of them alike: p50/p95 per system and the median
    of the per-call differences against the sandbox."""
    boxes = {name: cls(config_cls(num_workers=1, wall_s=30, cpu_s=30)) for name, (cls, config_cls) in kinds.items()}
    try:
        systems = {name: (lambda code, box=box: box.run_sync(code).status == "ok") for name, box in boxes.items()}
        systems["subprocess"] = subprocess_call
        for workload, code in WORKLOADS.items():
            load = os.getloadavg()[0]
            latencies = {name: [] for name in systems}
            names = list(systems)
            for i in range(calls):
                for name in names[i % len(names):] + names[:i % len(names)]:
                    start = time.perf_counter()
                    if not systems[name](code):
                        raise RuntimeError(f"benchmark call failed: {name} {code!r}")
                    latencies[name].append(time.perf_counter() - start)
            print(f"\npaired, {workload}, {calls} calls per system, load1 {load:.2f} -> {os.getloadavg()[0]:.2f}")
            for name, lat in latencies.items():
                diffs = [a - b for a, b in zip(lat, latencies["sandbox"])]
                print(f"  {name:10s} p50 {1e3 * statistics.median(lat):7.1f} ms  p95 {1e3 * percentile(lat, 95):7.1f} ms"
                      f"  median(this - sandbox) {1e3 * statistics.median(diffs):+7.1f} ms")
    finally:
        for box in boxes.values():
            box.close()


if __name__ == "__main__":
    main()
