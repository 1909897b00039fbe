"""TextWorld games started from many threads at once in a fresh interpreter all load.

TextWorld parses its game grammar (tatsu) on first use, and that parser is not thread-safe:
without `textworld_env.start_game`'s lock, the first concurrent resets of a run (the prior's
16 in-flight episodes when nothing warmed the games up, e.g. with `model.path`) fail with
FailedParse / IndexError. The check runs in a subprocess so the grammar is really cold.
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
