"""Pack generated TextWorld game sets into assets/textworld_games/ for the checkout to ship.

    python scripts/pack_textworld_games.py artifacts/textworld_games/train_w3_o4_q3_s0_n1024 ...

Each folder must be a complete set made by `generate_game_set` (its manifest.json written);
it becomes `<folder name>.tar.xz` with its sha256 and games digest in `shipped.json`
(rollout_bridge/envs/shipped_games.py). Ship the sets the default recipe generates; a set
a run asks for that does not ship is generated as before.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rollout_bridge.envs.shipped_games import SHIPPED_DIR, archive_path, pack_game_set


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", help="complete generated game-set folders")
    parser.add_argument("--out", default=str(SHIPPED_DIR), help="where the archives and shipped.json go")
    args = parser.parse_args()
    for folder in args.folders:
        start = time.perf_counter()
        entry = pack_game_set(folder, args.out)
        size = archive_path(Path(folder).name, args.out).stat().st_size
        print(f"{folder}: {entry['num_games']} games, {size / 1e6:.1f} MB, "
              f"packed in {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
