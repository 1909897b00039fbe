"""Tool-sandbox throughput and latency vs a fresh ``python -c`` subprocess per call.

    python benchmarks/tool_sandbox.py [--calls 64] [--rounds 3] [--concurrency 1 8 32]

Two workloads: a trivial ``print(1)`` and a ~20 ms pure-Python computation. For each
concurrency c in {1, 8, 32} and each round, the two systems are run back to back (order
alternating per round): the warm bubblewrap pool (``ToolSandbox`` with c workers) and a
fresh ``python -I -c CODE`` subprocess per call (no isolation at all: the cheapest thing a
trainer could do instead), each with c calls in flight. Printed per row: calls/s, p50 and
p99 latency, the ratio of calls/s, and the 1-minute load average at the row's start
(rows started above ``--busy-load`` are flagged BUSY: the machine is shared).

The goal in issue #14: the pool's calls/s >= 5x the subprocess's, p50 <= 20 ms.
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

WORKLOADS = {
    "print(1)": "print(1)",
    "20ms compute": "s = 0\nfor i in range(400_000):\n    s += i * i\nprint(s)",
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
    parser.add_argument("--busy-load", type=float, default=1.0, help="flag rows above this 1-min load")
    args = parser.parse_args()
    print(f"cpu: {cpu_model()} x {os.cpu_count()} | python {sys.version.split()[0]}")
    print(f"{'workload':14s} {'conc':>4s} {'rnd':>3s} {'system':10s} {'calls/s':>8s} {'p50 ms':>8s} "
          f"{'p99 ms':>8s} {'ratio':>6s} {'load1':>5s}")
    summary = {}
    for concurrency in args.concurrency:
        with ToolSandbox(SandboxConfig(num_workers=concurrency, wall_s=30, cpu_s=30)) as box:
            sandbox_call = lambda code: box.run_sync(code).status == "ok"  # noqa: E731
            systems = {"sandbox": sandbox_call, "subprocess": subprocess_call}
            for name, code in WORKLOADS.items():
                for rnd in range(args.rounds):
                    load = os.getloadavg()[0]
                    order = list(systems) if rnd % 2 == 0 else list(reversed(systems))
                    rows = {s: timed_calls(systems[s], code, args.calls, concurrency) for s in order}
                    ratio = rows["sandbox"][0] / rows["subprocess"][0]
                    flag = " BUSY" if load > args.busy_load else ""
                    for system in systems:
                        rate, lat = rows[system]
                        print(f"{name:14s} {concurrency:4d} {rnd:3d} {system:10s} {rate:8.1f} "
                              f"{1e3 * statistics.median(lat):8.1f} {1e3 * percentile(lat, 99):8.1f} "
                              f"{ratio if system == 'sandbox' else 1.0:6.2f} {load:5.2f}{flag}")
                    summary.setdefault((name, concurrency), []).append(
                        (ratio, 1e3 * statistics.median(rows["sandbox"][1])))
    print("\nmedian over rounds: sandbox calls/s ratio vs subprocess, sandbox p50 ms")
    for (name, concurrency), values in summary.items():
        ratios, p50s = zip(*values)
        print(f"  {name:14s} c={concurrency:<3d} ratio {statistics.median(ratios):6.2f}  "
              f"p50 {statistics.median(p50s):6.1f} ms")


if __name__ == "__main__":
    main()
