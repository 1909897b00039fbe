"""Warm-start demonstrations with the games' names replaced by fresh random words.

Why: a tiny model trained on walkthroughs of a few hundred generated games sees the same
few hundred object and room names again and again, so it predicts a reply's names from
memory ("take cuboid keycard") instead of copying them from the observation, and on an
unseen game it types commands that name things not there (a warm start trained on the
original names: 2 of 36 replies admissible). If every demonstration names its rooms and
things with words drawn afresh for that demonstration, memory cannot predict a name; only
copying it from earlier in the same row can, which is the pressure under which attention
learns to copy (induction heads form on repeated random tokens). The game logic, the commands' verbs and
the walkthrough are unchanged; only the names are rewritten, the same way in every turn of
one demonstration (observation and reply alike).

    renamed = RenamedDemonstrations(warm_tasks, names_of, fraction=1.0, seed=0)
    renamed.demonstration(i)   # the i-th walkthrough, its names rewritten

`names_of(i)` gives the names to rewrite in demonstration i (for TextWorld games:
`textworld_entity_names`, the rooms' and things' names from the game's .json).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

RENAMED_TYPES = ("r", "d", "c", "s", "o", "k", "f")   # rooms, doors, containers, supporters, objects, keys, food
CONSONANTS = "bdfgklmnprstvz"
VOWELS = "aeiou"


@functools.lru_cache(maxsize=None)
def textworld_entity_names(game_file: str) -> tuple[str, ...]:
    """The names of a tw-make game's rooms and things (its .json next to the .z8); read
    once per game and process."""
    import textworld

    path = Path(game_file).with_suffix(".json")
    if not path.is_file():
        raise FileNotFoundError(f"{path} (TextWorld's game description) is missing: names cannot be rewritten")
    infos = textworld.Game.load(str(path)).infos.values()
    return tuple(sorted({info.name for info in infos if info.type in RENAMED_TYPES and info.name}))


def random_word(rng: np.random.Generator) -> str:
    """A pronounceable non-word of 2-3 consonant-vowel syllables ("kavo", "temiru")."""
    syllables = int(rng.integers(2, 4))
    return "".join(CONSONANTS[rng.integers(len(CONSONANTS))] + VOWELS[rng.integers(len(VOWELS))]
                   for _ in range(syllables))


def random_names(names: Sequence[str], rng: np.random.Generator) -> dict[str, str]:
    """name -> a fresh random name with as many words (at most 2), all distinct."""
    taken: set[str] = set()
    mapping = {}
    for name in names:
        words = min(2, len(name.split()))
        while True:
            new = " ".join(random_word(rng) for _ in range(words))
            if new not in taken:
                break
        taken.add(new)
        mapping[name] = new
    return mapping


def renamer(mapping: dict[str, str]) -> Callable[[str], str]:
    """text -> text with every whole-word, case-insensitive occurrence of a name in
    `mapping` replaced by its new name; longer names first ("bedchamber" is not "chamber",
    "Canadian style box" is not "box"). The pattern is compiled once per mapping."""
    if not mapping:
        return lambda text: text
    lowered = {name.lower(): new for name, new in mapping.items()}
    pattern = re.compile(r"\b(" + "|".join(re.escape(n) for n in sorted(lowered, key=len, reverse=True)) + r")\b",
                         re.IGNORECASE)
    return lambda text: pattern.sub(lambda match: lowered[match.group(0).lower()], text)


def rename_text(text: str, mapping: dict[str, str]) -> str:
    """`text` with the names in `mapping` rewritten (:func:`renamer`)."""
    return renamer(mapping)(text)


class RenamedDemonstrations:
    """A warm-start task set whose demonstrations name their rooms and things with fresh
    random words: demonstration i is rewritten (with probability `fraction`, decided per
    i) by a mapping seeded by (seed, i), the same mapping in every turn. Same length and
    indices as `tasks`."""

    def __init__(self, tasks, names_of: Callable[[int], Sequence[str]], fraction: float = 1.0, seed: int = 0):
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must be in [0, 1], got {fraction}")
        self.tasks, self.names_of, self.fraction, self.seed = tasks, names_of, fraction, seed

    @property
    def num_tasks(self) -> int:
        return self.tasks.num_tasks

    def demonstration(self, index: int) -> list[tuple[str, str]]:
        pairs = self.tasks.demonstration(index)
        rng = np.random.default_rng((self.seed, index))
        if rng.random() >= self.fraction:
            return pairs
        rename = renamer(random_names(self.names_of(index), rng))
        return [(rename(observation), rename(reply)) for observation, reply in pairs]


def textworld_names_of(game_files: Sequence[str]) -> Callable[[int], tuple[str, ...]]:
    """names_of for demonstration i of a set whose item i is game i mod len(game_files)."""
    return lambda index: textworld_entity_names(str(game_files[index % len(game_files)]))
