"""Env step and reset time: generated ALFWorld games vs tw-make games, same run.

    python benchmarks/alfworld_env_step.py [--rounds 3] [--games 6] [--data-dir artifacts/bench_games]

Each round plays every game of each system once along its walkthrough (systems
interleaved per round, one thread), timing `reset` and every `step` (ms, wall clock).
Prints the CPU, the 1-minute load average per round (a round under load > cores is
flagged BUSY: its figures overstate the cost) and the median / p90 per system.
ALFWorld: `AlfworldTasks` (textworld PddlEnv under alfworld's wrappers; a reset re-runs
the PDDL -> SAS translation). tw-make: `TextWorldTasks` over `tw-make custom` games of the
default CPU job (world 1, objects 3, quest 1) and a larger shape (world 4, objects 8,
quest 3).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from _hardware import cpu_model

from rollout_bridge.envs import alfworld_games, textworld_games
from rollout_bridge.envs.alfworld_env import AlfworldTasks
from rollout_bridge.envs.textworld_env import TextWorldTasks

MAX_TURNS = 50


def play_once(tasks, task_id: int, resets: list, steps: list) -> bool:
    """Reset and follow the walkthrough; append the times (ms); return the won flag."""
    t0 = time.perf_counter()
    episode = tasks.episode(task_id)
    episode.reset()
    resets.append(1e3 * (time.perf_counter() - t0))
    won = False
    for command in episode.walkthrough:
        t0 = time.perf_counter()
        outcome = episode.step(command)
        steps.append(1e3 * (time.perf_counter() - t0))
        won = outcome.won
        if outcome.done:
            break
    episode.close()
    return won


def summary(times: list[float]) -> str:
    ordered = sorted(times)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return f"median {statistics.median(ordered):8.2f} ms  p90 {p90:8.2f} ms  (n={len(ordered)})"


def build_systems(games: int, data_dir: str) -> dict:
    alf = alfworld_games.AlfworldSetSpec("bench", games, base_seed=500)
    alf_files = alfworld_games.generate_game_set(alf, data_dir, workers=2)
    systems = {"alfworld (generated)": AlfworldTasks(alf_files, alf_files[0].parents[2],
                                                     MAX_TURNS)}
    for label, shape in (("tw-make w1 o3 q1 (default job)", (1, 3, 1)),
                         ("tw-make w4 o8 q3", (4, 8, 3))):
        spec = textworld_games.GameSetSpec("bench", games, 500, *shape)
        files = textworld_games.generate_game_set(spec, data_dir)
        systems[label] = TextWorldTasks(files, files[0].parent, MAX_TURNS)
    return systems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--games", type=int, default=6)
    parser.add_argument("--data-dir", default="artifacts/bench_games")
    args = parser.parse_args()
    print(f"cpu: {cpu_model()} x {os.cpu_count()}")
    systems = build_systems(args.games, args.data_dir)
    resets = {name: [] for name in systems}
    steps = {name: [] for name in systems}
    for r in range(args.rounds):
        load = os.getloadavg()[0]
        flag = "  BUSY" if load > (os.cpu_count() or 1) else ""
        print(f"round {r + 1}: load average (1 min) {load:.2f}{flag}", flush=True)
        for name, tasks in systems.items():
            wins = sum(play_once(tasks, i, resets[name], steps[name])
                       for i in range(tasks.num_tasks))
            print(f"  {name:32s} walkthroughs won {wins}/{tasks.num_tasks}", flush=True)
    print(f"after: load average (1 min) {os.getloadavg()[0]:.2f}")
    for name in systems:
        print(f"{name:32s} step  {summary(steps[name])}")
        print(f"{name:32s} reset {summary(resets[name])}")
    systems["alfworld (generated)"].close()


if __name__ == "__main__":
    main()
