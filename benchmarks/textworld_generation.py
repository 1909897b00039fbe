#!/usr/bin/env python
"""CPU seconds per TextWorld game: textworld's own path (`make_game` + `compile_game` with a
fresh `GameOptions`, what `tw-make custom` runs) against `textworld_generate.make_and_compile`,
interleaved game by game in one process, on the default job's shape (3 rooms, 4 objects,
quest length 3), each pair checked to be the same files.

    python benchmarks/textworld_generation.py --games 40

CPU time (this process and its `ni`/`inform6` children) is what a 2-core machine spends per
game whatever else runs; the wall time per game is printed too, with the load average and
the CPU model, since a busy machine stretches it.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._hardware import cpu_model  # noqa: E402
from rollout_bridge.envs import textworld_generate as generate  # noqa: E402


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def timed(make, seed: int, path: Path) -> tuple[float, float]:
    cpu, wall = cpu_seconds(), time.perf_counter()
    make(seed, 3, 4, 3, path)
    return cpu_seconds() - cpu, time.perf_counter() - wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--games", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores); load average at start {os.getloadavg()}")
    generate.make_and_compile(args.seed, 3, 4, 3, Path(tempfile.mkdtemp()) / "warm.z8")  # imports, logic files
    totals = {"textworld": [0.0, 0.0], "fast": [0.0, 0.0]}
    with tempfile.TemporaryDirectory() as folder:
        for seed in range(args.seed, args.seed + args.games):
            old, new = Path(folder) / f"old_{seed}.z8", Path(folder) / f"new_{seed}.z8"
            order = [("textworld", generate.make_and_compile_with_tw, old), ("fast", generate.make_and_compile, new)]
            for name, make, path in order if seed % 2 else order[::-1]:
                cpu, wall = timed(make, seed, path)
                totals[name][0] += cpu
                totals[name][1] += wall
            for suffix in (".json", ".ni", ".z8"):
                if not filecmp.cmp(old.with_suffix(suffix), new.with_suffix(suffix), shallow=False):
                    raise SystemExit(f"seed {seed}: the two paths wrote different {suffix} files")
    for name, (cpu, wall) in totals.items():
        print(f"{name:>9}: {cpu / args.games:.3f} CPU s/game, {wall / args.games:.3f} wall s/game")
    ratio = totals["textworld"][0] / totals["fast"][0]
    print(f"fast path: {ratio:.2f}x less CPU per game over {args.games} games (same files); "
          f"load average at end {os.getloadavg()}")


if __name__ == "__main__":
    main()
