"""Play generated ALFWorld games through alfworld's own environment and report, per task
type: games generated, draws ALFRED's sampler criteria excluded (by criterion), games whose
stored walkthrough wins, games alfworld's hand-coded expert wins.

    python scripts/alfworld_check.py [--games-per-type 8] [--max-distractors 2] \
        [--max-receptacles 6] [--splits train test] [--out docs/results/alfworld_check.json]

For each floor-plan split (`alfworld_games.split_floor_plans`: alfworld's
TRAIN_SCENE_NUMBERS / TEST_SCENE_NUMBERS) and each task type, one set of
`--games-per-type` games is generated with ALFRED's criteria on (`alfred_filter`). Then:
- excluded: the criteria of the draws re-drawn while generating (`traj_data.json`'s
  `generated.excluded`); "first draw excluded" is the share of games whose first draw an
  unfiltered generator would have kept;
- re-check: `alfred_exclusions` on each game read back from its files, and its floor plan
  in the split (both must be clean);
- played by alfworld itself: `AlfredTWEnv` (alfworld.agents.environment.alfred_tw_env)
  collects the set's games with its own rules (traj_data.json, `solvable`), then its gym
  environment (`init_env`: textworld's PddlEnv under `AlfredDemangler`, `AlfredInfos`,
  `AlfredExpert("handcoded")`, in textworld's batch env process) plays every game twice:
  once following the hand-coded expert's `expert_plan`, once replaying the game file's
  stored walkthrough (the planner's), each up to `--max-steps` commands.

Prints the CPU model and the load average (the machine may be shared), a table per split,
and writes every game's record to `--out`.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_bridge.envs import alfworld_games as games  # noqa: E402

TASK_IDS = {name: i + 1 for i, name in enumerate(games.TASK_TYPES)}   # alfworld's numbering
SPLIT_SEEDS = {"train": 300_000, "test": 400_000, "all": 500_000}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def alfworld_config(data_path: Path, max_steps: int) -> dict:
    """The keys `AlfredTWEnv` reads: train split at `data_path`, all six task types, the
    hand-coded expert for DAgger (so `init_env` adds `AlfredExpert`)."""
    return {"dataset": {"data_path": str(data_path), "num_train_games": -1},
            "env": {"task_types": list(TASK_IDS.values()), "goal_desc_human_anns_prob": 0.0,
                    "domain_randomization": False, "expert_type": "handcoded"},
            "general": {"training_method": "dagger"},
            "dagger": {"training": {"max_nb_steps_per_episode": max_steps}}}


def play_all(data_path: Path, max_steps: int) -> dict:
    """{game file: {"expert": {...}, "walkthrough": {...}}} from alfworld's own env."""
    from alfworld.agents.environment.alfred_tw_env import AlfredTWEnv

    tw_env = AlfredTWEnv(alfworld_config(data_path, max_steps), train_eval="train")
    collected = sorted(tw_env.game_files)
    env = tw_env.init_env(batch_size=1)
    env.seed(0)
    results: dict = collections.defaultdict(dict)
    try:
        for mode in ("expert", "walkthrough"):
            for _ in collected:
                obs, infos = env.reset()
                game_file = infos["extra.gamefile"][0]
                plan = json.loads(Path(game_file).read_text())["walkthrough"]
                played, won, error = [], False, None
                try:
                    for step in range(max_steps):
                        if mode == "expert":
                            command = infos["extra.expert_plan"][0][0]
                        elif step < len(plan):
                            command = plan[step]
                        else:
                            break
                        obs, _, dones, infos = env.step([command])
                        played.append(command)
                        won = bool(infos["won"][0])
                        if won or dones[0]:
                            break
                except Exception as exc:   # an expert that raises counts as not winning
                    error = f"{type(exc).__name__}: {exc}"
                results[str(Path(game_file).resolve())][mode] = {
                    "won": won, "steps": len(played), "error": error}
    finally:
        env.close()
    return {"collected": [str(Path(f).resolve()) for f in collected], "games": dict(results)}


def check_split(split: str, args) -> dict:
    """Generate one set per task type on `split`'s floor plans, check and play them."""
    allowed = set(games.split_floor_plans(split))
    rows = {}
    for task_type in games.TASK_TYPES:
        spec = games.AlfworldSetSpec(f"check_{split}", args.games_per_type,
                                     SPLIT_SEEDS[split] + 1000 * TASK_IDS[task_type],
                                     (task_type,), args.max_distractors, args.max_receptacles,
                                     floor_plans=split, alfred_filter=True)
        start = time.perf_counter()
        files = games.generate_game_set(spec, args.data_dir, workers=args.workers)
        generation_s = time.perf_counter() - start
        folder = Path(args.data_dir) / spec.folder_name
        played = play_all(folder, args.max_steps)
        excluded: collections.Counter = collections.Counter()
        records = []
        for path in files:
            traj = json.loads((path.parent / games.TRAJ_DATA).read_text())
            counts = dict(traj["generated"]["excluded"])
            draw, objects = games.game_start_state(path)
            record = {"game": str(path), "floor_plan": draw.scene,
                      "excluded_draws": counts,
                      "recheck": [e.criterion for e in games.alfred_exclusions(draw, objects)],
                      "in_split": draw.scene in allowed,
                      "collected_by_alfworld": str(path.resolve()) in played["collected"],
                      **played["games"].get(str(path.resolve()), {})}
            excluded.update({k: v for k, v in counts.items() if k != "draws"})
            excluded["draws"] += counts["draws"]
            excluded["first draw excluded"] += counts["draws"] > 0
            records.append(record)
        rows[task_type] = {
            "generated": len(files), "generation_s": round(generation_s, 1),
            "excluded": dict(excluded),
            "recheck_clean": sum(not r["recheck"] for r in records),
            "in_split": sum(r["in_split"] for r in records),
            "collected_by_alfworld": sum(r["collected_by_alfworld"] for r in records),
            "walkthrough_wins": sum(r.get("walkthrough", {}).get("won", False) for r in records),
            "expert_wins": sum(r.get("expert", {}).get("won", False) for r in records),
            "games": records}
        row = rows[task_type]
        print(f"  {split:5s} {task_type:32s} generated {row['generated']}, excluded "
              f"{row['excluded']}, alfworld collected {row['collected_by_alfworld']}, "
              f"walkthrough wins {row['walkthrough_wins']}, expert wins {row['expert_wins']} "
              f"(load {os.getloadavg()[0]:.1f})", flush=True)
    return rows


def table(split: str, rows: dict) -> str:
    lines = [f"floor plans: {split}", "",
             "| task type | generated | first draw excluded | excluded draws by criterion "
             "| re-check clean / in split | collected by AlfredTWEnv | stored walkthrough wins "
             "| hand-coded expert wins |", "|---|---|---|---|---|---|---|---|"]
    for task_type, row in rows.items():
        ex = row["excluded"]
        criteria = ", ".join(f"{k} {v}" for k, v in sorted(ex.items())
                             if k not in ("draws", "first draw excluded")) or "none"
        n = row["generated"]
        lines.append(f"| {task_type} | {n} | {ex.get('first draw excluded', 0)}/{n} | {criteria} "
                     f"| {row['recheck_clean']}/{n}, {row['in_split']}/{n} "
                     f"| {row['collected_by_alfworld']}/{n} | {row['walkthrough_wins']}/{n} "
                     f"| {row['expert_wins']}/{n} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--games-per-type", type=int, default=8)
    parser.add_argument("--max-distractors", type=int, default=2)
    parser.add_argument("--max-receptacles", type=int, default=6)
    parser.add_argument("--max-steps", type=int, default=50)
    parser.add_argument("--splits", nargs="+", default=["train", "test"],
                        choices=games.FLOOR_PLAN_SPLITS)
    parser.add_argument("--data-dir", default="artifacts/alfworld_check")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default=None, help="JSON file for every game's record")
    args = parser.parse_args()
    if args.games_per_type < 1:
        parser.error(f"--games-per-type must be >= 1, got {args.games_per_type}")
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; load average {os.getloadavg()}")
    start = time.perf_counter()
    report = {"args": vars(args), "cpu": cpu_model(), "splits": {}}
    for split in args.splits:
        report["splits"][split] = check_split(split, args)
    print()
    for split, rows in report["splits"].items():
        print(table(split, rows) + "\n")
    report["wall_s"] = round(time.perf_counter() - start, 1)
    report["load_average_end"] = os.getloadavg()
    print(f"wall {report['wall_s']} s; load average at the end {report['load_average_end']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
