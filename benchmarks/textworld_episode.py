"""A TextWorld episode's CPU cost: ours against TextWorld's own per-turn room description.

    python benchmarks/textworld_episode.py [--folder artifacts/textworld_games/heldout_...]
        [--games 128] [--rounds 5]

The main job's episodes show the room description at reset only. TextWorld's
`description` info gets it by switching on a game option that plays "look" after every
command; `rollout_bridge.envs.textworld_env` instead reads it once at reset
(`read_description`). This plays the same episodes both ways, one thread: each game of
`--folder` (default: the main job's held-out set, made by `python train.py`) once along its
walkthrough (a win) and once with random shown numbers (12 turns, the job's observation
style), checks that the two ways give the same observations, and times whole episodes
(reset and steps) in interleaved rounds. Prints the CPU, the load per round (BUSY rounds
are left out), ms per episode and the same-run ratio.
"""

from __future__ import annotations

import argparse
import glob
import os

import numpy as np
from _hardware import cpu_model
from _protocol import headline, interleaved_rounds

from rollout_bridge.envs import textworld_env
from rollout_bridge.envs.textworld_env import ObservationStyle, TextWorldEpisode, start_game

STYLE = ObservationStyle(max_feedback_chars=300, numbered_actions=True, shuffle_actions=True, free_text=False)
MAX_TURNS = 12


def textworld_description_infos():
    """What an episode asked TextWorld for before, with the per-turn description."""
    import textworld

    return textworld.EnvInfos(admissible_commands=True, objective=True, description=True, won=True, lost=True,
                              score=True, max_score=True, extras=["walkthrough"])


class PerTurnDescriptionEpisode(TextWorldEpisode):
    """Our episode with TextWorld's per-turn `description` info (the reset shows it)."""

    def _start(self):
        return start_game(self.path, textworld_description_infos())

    def _description(self, state) -> str:
        return state["description"]


def play(episode_class, path: str, index: int, walkthrough: bool) -> list:
    """One episode: the walkthrough's numbers, or random shown numbers (and one past the
    list) seeded by `index`; returns every observation and outcome."""
    rng = np.random.default_rng(index)
    episode = episode_class(path, MAX_TURNS, STYLE, (0, index))
    trace = [episode.reset()]
    turn = 0
    try:
        while not episode.done:
            due = episode.walkthrough[turn] if walkthrough and turn < len(episode.walkthrough) else None
            if due in episode.admissible:
                reply = str(episode.admissible.index(due) + 1)
            else:
                reply = str(rng.integers(1, len(episode.admissible) + 2))
            outcome = episode.step(reply)
            trace.append((outcome.observation, outcome.reward, outcome.done, outcome.won))
            turn += 1
    finally:
        episode.close()
    return trace


def play_all(episode_class, games: list[str]) -> list:
    return [play(episode_class, path, i, walkthrough) for i, path in enumerate(games)
            for walkthrough in (True, False)]


def default_folder() -> str:
    found = sorted(glob.glob("artifacts/textworld_games/heldout_*"))
    if not found:
        raise SystemExit("no --folder given and no artifacts/textworld_games/heldout_* here: "
                         "run `python train.py` once (it makes the held-out games) or pass --folder")
    return found[0]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", default=None, help="a folder of TextWorld .z8 games")
    parser.add_argument("--games", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    games = [str(p) for p in textworld_env.list_game_files(args.folder or default_folder())][:args.games]
    print(f"CPU: {cpu_model()}; {len(games)} games x 2 episodes (walkthrough, random) per round")
    ours, theirs = play_all(TextWorldEpisode, games), play_all(PerTurnDescriptionEpisode, games)
    if ours != theirs:
        raise SystemExit("the two ways gave different observations")
    wins = sum(trace[-1][3] for trace in ours)
    turns = sum(len(trace) - 1 for trace in ours)
    print(f"same observations both ways: {len(ours)} episodes, {turns} turns, {wins} won")
    timings = interleaved_rounds({"description at reset (ours)": lambda: play_all(TextWorldEpisode, games),
                                  "description every turn": lambda: play_all(PerTurnDescriptionEpisode, games)},
                                 args.rounds)
    for name in timings.rounds[0].seconds:
        median, low, high = timings.summary(name)
        print(f"{name:30s} {1e3 * median / len(ours):6.2f} ms per episode  "
              f"[{1e3 * low / len(ours):.2f}, {1e3 * high / len(ours):.2f}]")
    print(headline(timings, "description at reset (ours)", "description every turn"))
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
