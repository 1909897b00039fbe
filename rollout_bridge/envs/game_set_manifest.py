"""What a generated game set's folder holds and how its games are identified: the manifest
(written last, so a folder with one is a complete set) and the digest of its games, which
the fixed-policy records key and the shipped archives are checked against."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Sequence

from rollout_bridge.atomic_files import write_json_atomic

MANIFEST = "manifest.json"


def load_manifest(folder: Path) -> dict | None:
    """The set's manifest, or None while the set is incomplete."""
    path = Path(folder) / MANIFEST
    if not path.exists():
        return None
    with open(path) as f:
        return json.load(f)


def write_manifest(folder: Path, manifest: dict) -> None:
    write_json_atomic(Path(folder) / MANIFEST, manifest)   # two jobs generating one set never share a temporary file


def game_files_digest(names: Sequence[str], files: Sequence[str | os.PathLike]) -> str:
    """sha1 over a task set's games in task order: each game's name, then what it is made
    of. A generated game (a `.z8` with its `.ni` and `.json` beside it) is its Inform 7
    source and its description with `KB.text_grammars_path` (where textworld is installed)
    left out, so the same seeds give the same digest on every machine; the `.z8` is not
    read (it carries its compile date). Any other game file is its own bytes."""
    digest = hashlib.sha1()
    for name, file in zip(names, files, strict=True):
        path = Path(file)
        digest.update(f"{name}\n".encode())
        source, description = path.with_suffix(".ni"), path.with_suffix(".json")
        if path.suffix == ".z8" and source.exists() and description.exists():
            game = json.loads(description.read_bytes())
            game.get("KB", {}).pop("text_grammars_path", None)
            digest.update(source.read_bytes())
            digest.update(json.dumps(game, sort_keys=True).encode())
        else:
            digest.update(path.read_bytes())
    return digest.hexdigest()
