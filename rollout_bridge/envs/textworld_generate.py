"""Make and compile one TextWorld game as `tw-make custom` would, at about half its cost.

`tw-make custom --seed S` (and `textworld.generator.make_game` + `compile_game` with a fresh
`GameOptions`) spends its time in three places per game: parsing TextWorld's logic files
into a `KnowledgeBase` (every `GameOptions` loads its own), Inform 7's `ni` compiling the
story to Inform 6 (and writing ~100 HTML pages of the story's Index), and `inform6` making
the `.z8`. Here the knowledge base is loaded once per process (`KnowledgeBase.default()`,
the same files; nothing in a game's generation writes to it) and `ni` runs with
`-noindex`, which skips the Index and leaves the Inform 6 code it writes unchanged. The
game's `.json` (its description and walkthrough), the `.ni` source and the `.z8` story
file are the same as `compile_game`'s, byte for byte (tests/test_textworld_generate.py
compares them; a `.z8` carries its compile date, so the two are compared on one day).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path


def game_options(seed: int, world_size: int, nb_objects: int, quest_length: int, path: str | os.PathLike,
                 shared_kb: bool = True):
    """`GameOptions` of `tw-make custom --world-size W --nb-objects O --quest-length Q
    --seed S --output path`; `shared_kb`: the process's loaded knowledge base instead of a
    fresh parse of the same logic files."""
    from textworld import GameOptions
    from textworld.generator.data import KnowledgeBase

    options = GameOptions()
    if shared_kb:
        options.kb = KnowledgeBase.default()
    options.seeds = seed
    options.nb_rooms = world_size
    options.nb_objects = nb_objects
    options.quest_length = quest_length
    options.path = str(path)
    options.force_recompile = True
    return options


def _inform7_home() -> Path:
    from textworld.generator.inform7.world2inform7 import I7_DEFAULT_PATH

    return Path(os.environ.get("INFORM_HOME", I7_DEFAULT_PATH)) / "share" / "inform7"


def compile_story(source: str, output: str | os.PathLike) -> None:
    """Inform 7 `source` -> the z-machine story file `output` (.z8), its source saved next to
    it as `.ni`: `ni -noindex` then `inform6 -E2wSv8F0`, the commands of textworld's
    `compile_inform7_game` but without the Index pages."""
    from textworld.generator.inform7.world2inform7 import CouldNotCompileGameError

    output = Path(output)
    if output.suffix != ".z8":
        raise ValueError(f"output must be a .z8 file, got {str(output)!r}")
    output.with_suffix(".ni").write_text(source)
    home = _inform7_home()
    with tempfile.TemporaryDirectory(prefix="tmp_inform") as project:
        (Path(project) / "Source").mkdir()
        (Path(project) / "Source" / "story.ni").write_text(source)
        (Path(project) / "uuid.txt").touch()
        steps = (("ni", [str(home / "Compilers" / "ni"), "--internal", str(home / "Internal"), "--format=.z8",
                         "-noindex", "--project", project]),
                 ("i6", [str(home / "Compilers" / "inform6"), "-E2wSv8F0",
                         str(Path(project) / "Build" / "auto.inf"), str(output)]))
        for name, command in steps:
            done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            if done.returncode != 0:
                raise CouldNotCompileGameError(f"{name} failed ({done.returncode}) on {output.with_suffix('.ni')}:\n"
                                               f"{done.stdout.decode(errors='replace')[-2000:]}")


def make_and_compile(seed: int, world_size: int, nb_objects: int, quest_length: int, path: str | os.PathLike):
    """Generate the game of `seed`, write its `.json`, `.ni` and `.z8` at `path` (.z8);
    return the `textworld.Game`."""
    from textworld.generator import make_game
    from textworld.generator.inform7 import generate_inform7_source

    options = game_options(seed, world_size, nb_objects, quest_length, path)
    game = make_game(options)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    game.save(str(Path(path).with_suffix(".json")))
    compile_story(generate_inform7_source(game), path)
    return game


def make_and_compile_with_tw(seed: int, world_size: int, nb_objects: int, quest_length: int,
                             path: str | os.PathLike):
    """The same game through textworld's own path (a fresh knowledge base, `compile_game`
    with the Index): the reference the fast path is checked and timed against."""
    from textworld.generator import compile_game, make_game

    options = game_options(seed, world_size, nb_objects, quest_length, path, shared_kb=False)
    game = make_game(options)
    compile_game(game, options)
    return game
