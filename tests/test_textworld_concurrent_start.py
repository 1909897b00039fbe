"""TextWorld games started from many threads at once in a fresh interpreter all load.

TextWorld parses its game grammar (tatsu) on first use, and that parser is not thread-safe:
without `textworld_env.start_game`'s lock, the first concurrent resets of a run (the prior's
16 in-flight episodes when nothing warmed the games up, e.g. with `model.path`) fail with
FailedParse / IndexError. The check runs in a subprocess so the grammar is really cold.
Also: an episode aborted while its game steps in a worker thread closes the game only
after the step (a crash would kill the test process, hence a subprocess too).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from rollout_bridge.envs.textworld_games import GameSetSpec, generate_game_set

GAMES = GameSetSpec("concurrent", num_games=2, base_seed=0, world_size=1, nb_objects=3,
                    quest_length=1)

SCRIPT = textwrap.dedent("""
    import sys
    from concurrent.futures import ThreadPoolExecutor
    from rollout_bridge.envs.textworld_env import start_game

    paths = sys.argv[1:]

    def load(i):
        env = start_game(paths[i % len(paths)])
        try:
            state = env.reset()
            return bool(state["admissible_commands"])
        finally:
            env.close()

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(load, range(16)))
    print(sum(results))
""")


@pytest.fixture(scope="module")
def game_files(tmp_path_factory):
    return generate_game_set(GAMES, tmp_path_factory.mktemp("tw_concurrent"))


def test_cold_concurrent_starts_all_load(game_files):
    done = subprocess.run([sys.executable, "-c", SCRIPT, *map(str, game_files)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "16"


ABORT_DURING_STEP = textwrap.dedent("""
    import asyncio, faulthandler, sys
    from rollout_bridge.envs.base import Environment, StepResult, as_async
    from rollout_bridge.envs.textworld_env import start_game

    faulthandler.enable()

    class ManyLooks(Environment):  # one call = 50 real interpreter steps: a wide window
        num_tasks = 1

        def __init__(self, path):
            self.game = start_game(path)
            self.game.reset()

        def reset(self, task_id):
            return ""

        def step(self, text):
            for _ in range(50):
                self.game.step("look")
            return StepResult("", 0.0, False)

        def close(self):
            self.game.close()

    async def abort_during_step(path):
        env = as_async(ManyLooks(path))
        step = asyncio.ensure_future(env.step("look"))
        await asyncio.sleep(0.005)
        step.cancel()     # what the orchestrator's abort does; the step's thread goes on
        await env.close()  # what the aborted episode's cancellation handler then asks for
        await asyncio.sleep(0.05)

    for i in range(10):
        asyncio.run(abort_during_step(sys.argv[1 + i % (len(sys.argv) - 1)]))
    print("survived", 10)
""")


def test_an_episode_aborted_during_a_real_step_closes_its_game_after_the_step(game_files):
    """Through `as_async` (what `run_episode` uses), closing a game whose step is still
    running in its thread waits for that step; unserialized, the close unloads jericho's
    interpreter under it and the process dies with SIGSEGV (train.py aborts episodes this
    way at the end of RL; without the lock this script crashes on its first abort)."""
    done = subprocess.run([sys.executable, "-c", ABORT_DURING_STEP, *map(str, game_files)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "survived 10"
