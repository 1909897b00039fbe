"""The embedded engine's prefill programs on the main job's held-out evaluation: compiled on
a background thread (calls padded to a compiled larger shape meanwhile) against on the
scheduler thread (`--compare background`), or loaded from the program store against traced
and lowered in every process (`--compare program_store`).

    python benchmarks/prefill_compile.py --rounds 2            # cold: an empty compilation cache per run
    python benchmarks/prefill_compile.py --rounds 2 --warm     # the cache already holds every executable
    python benchmarks/prefill_compile.py --rounds 2 --warm --compare program_store

Each run is `scripts/heldout_eval.py` in its own process (configs/default.yaml, the shipped
warm start, `--rollouts` episodes per held-out game, a fresh evaluation cache so it plays),
with the compared `--rollout.engine` setting true or false; the time is the evaluation's own
(`wall_s`: engine, games and compiles, not the process start). Cold: every run gets an
empty JAX compilation cache, as a first run of a fresh clone does (the engine compiles
every prefill shape it meets; with the program store it also writes each one there). Warm:
a shared cache filled by one run of each system first; the executables are read back, but
without the program store each new shape is still traced and lowered.
Systems alternate within a round (interleaved rounds, `_protocol`); the 1-minute load is
printed per round; the engine's own threads keep it near the core count, so rounds are
kept up to `--max-load-excess` above it (default 1.5).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _hardware import cpu_model  # noqa: E402
from _protocol import process_rounds  # noqa: E402

COMPARISONS = {  # --compare: the setting, and its systems (ours first) by value
    "background": ("rollout.engine.background_compile", {"background": "true", "inline": "false"}),
    "program_store": ("program_store", {"stored": "true", "traced": "false"}),
}


OUTCOMES: dict[str, list] = {}  # system -> the per-game successes of each of its runs


def evaluation_seconds(setting: str, value: str, cache_dir: str, rollouts: int, policy: str) -> float:
    """One held-out evaluation in its own process; its own wall time (s). Its per-game
    successes are kept in OUTCOMES."""
    with tempfile.TemporaryDirectory(prefix="prefill_compile_") as scratch:
        out = Path(scratch) / "eval.json"
        env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": cache_dir,
               "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
        command = [sys.executable, str(ROOT / "scripts" / "heldout_eval.py"), "--rollouts", str(rollouts),
                   "--policy", policy, "--policy", policy, "--out", str(out), "--progress", "false",
                   "--prior.cache_dir", str(Path(scratch) / "evaluations"),
                   f"--{setting}", value]
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"heldout_eval failed ({done.returncode}):\n{done.stderr[-3000:]}")
        record = json.loads(out.read_text())["policies"][0]
        OUTCOMES.setdefault(value, []).append(record["successes"])
        return float(record["wall_s"])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warm", action="store_true", help="a compilation cache that holds every executable")
    parser.add_argument("--rollouts", type=int, default=1, help="episodes per held-out game (512 games)")
    parser.add_argument("--policy", default=str(ROOT / "assets" / "textworld_text_warmstart"))
    parser.add_argument("--compare", choices=sorted(COMPARISONS), default="background")
    parser.add_argument("--max-load-excess", type=float, default=1.5)
    args = parser.parse_args(argv)
    setting, systems = COMPARISONS[args.compare]
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores); load {os.getloadavg()[0]:.2f} at the start; "
          f"{'warm' if args.warm else 'cold'} compilation cache; {args.rollouts} x 512 held-out episodes per run; "
          f"{setting} compared",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="prefill_compile_cache_") as shared:
        def cache() -> str:
            return shared if args.warm else tempfile.mkdtemp(prefix="cold_", dir=shared)

        process_rounds({name: (lambda flag=flag: evaluation_seconds(setting, flag, cache(), args.rollouts, args.policy))
                        for name, flag in systems.items()}, args.rounds, args.max_load_excess, warm=args.warm)
    runs = [successes for per_system in OUTCOMES.values() for successes in per_system]
    same = all(successes == runs[0] for successes in runs)
    print(f"per-game successes of all {len(runs)} runs identical: {'yes' if same else 'NO'} "
          f"(success {sum(runs[0]) / (len(runs[0]) * args.rollouts):.3f} in the first)")


if __name__ == "__main__":
    main()
