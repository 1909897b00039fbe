"""The fault loop (`fault_loop.py`) in small: random kill -9 / SIGINT / SIGTERM over the whole
tiny job, each followed by `--resume` (the full run sends 50 or more; its last result is in
docs/results/fault_loop.json)."""

from __future__ import annotations

import json

import pytest
from reliability_table import Row, covers

import fault_loop


@covers(Row("process crash", "kill -9 / SIGINT / SIGTERM at random moments of a whole job (imports, warm start, "
            "prior, RL, checkpoint writes, exports, evaluation), each followed by `--resume`",
            "SIGINT / SIGTERM: exit 130 / 143 and one 'interrupted (...): kept in ...; continue with: ... --resume' "
            "line; kill -9: the next start takes over the stale run lock and resumes",
            "the finished run's step, policy event, update and consumed counters equal an uninterrupted run's; "
            "metrics rows 1..S once each; no checkpoint with NaN; no user-visible traceback over 5 lines",
            kind="fault"))
@pytest.mark.slow
def test_fault_loop_small(tmp_path):
    status = fault_loop.main(["--kills", "4", "--out", str(tmp_path), "--seed", "7", "--max_chain", "2"])
    summary = json.loads((tmp_path / "fault_loop.json").read_text())
    assert status == 0, summary["failure_details"]
    assert summary["faults"] >= 4 and summary["failures"] == 0
