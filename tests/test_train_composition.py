"""train.py is a flat composition: the stages in order, each one call into one module, in
under 200 lines; docs/DESIGN.md lists the files a reader opens to follow one update."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_train_py_is_short_and_flat():
    source = (ROOT / "train.py").read_text()
    assert len(source.splitlines()) < 200
    functions = [node.name for node in ast.parse(source).body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    assert functions == ["parse_config", "main"]   # no run levels between main and the stages
    stages = ["build_env", "run_warmstart", "run_prior", "evaluate_policy", "run_rl", "write_summary"]
    positions = [source.index(f"{name}(", source.index("def main")) for name in stages]
    assert positions == sorted(positions)           # in the order the job runs them


def test_design_lists_the_files_of_one_update_with_their_line_counts():
    design = (ROOT / "docs" / "DESIGN.md").read_text()
    section = design[design.index("## Following one update"):]
    rows = re.findall(r"^\| \d+ \| `([^`]+)` \| (\d+) \|", section, re.M)
    assert rows[0][0] == "train.py" and len(rows) < 17
    total = int(re.search(r"(\d+) files, ([\d,]+) lines", section).group(2).replace(",", ""))
    assert total == sum(int(lines) for _, lines in rows)
    for path, _ in rows:
        assert (ROOT / path).is_file(), path
