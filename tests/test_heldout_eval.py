"""scripts/heldout_eval.py: paired held-out evaluation of several policies with K episodes
per game (the job's evaluation code, the job's paired-gain formula)."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from tiny_run import games_dir

ROOT = Path(__file__).resolve().parents[1]
_SPEC = importlib.util.spec_from_file_location("heldout_eval", ROOT / "scripts" / "heldout_eval.py")
heldout_eval = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(heldout_eval)


def _policy_folder(tmp_path: Path, name: str) -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return str(folder)


def test_bad_arguments_are_refused_before_any_work(tmp_path, capsys):
    policy = _policy_folder(tmp_path, "a")
    with pytest.raises(SystemExit):
        heldout_eval.parse_args(["--policy", policy])                       # one policy: nothing to pair
    assert "at least two --policy" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        heldout_eval.parse_args(["--policy", policy, "--policy", str(tmp_path / "missing")])
    assert "not an HF model folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        heldout_eval.parse_args(["--policy", policy, "--policy", policy, "--rollouts", "0"])
    args, rest = heldout_eval.parse_args(["--policy", policy, "--policy", policy, "--steps", "3"])
    assert args.rollouts == 16 and rest == ["--steps", "3"]   # train.py flags pass through


def test_two_policies_on_tiny_held_out_games(tmp_path, capsys, monkeypatch):
    """The tiny smoke model, played on 2 generated held-out games, 3 episodes each, as both
    the reference and the compared policy: every game gets 3 trials per policy and the
    printed gain is the job's paired gain of the two records. The copy has the same
    content, so with `prior.cache_dir` its evaluation is the first one's, read back; a
    run with another seed plays again. The job's compilation cache is turned on (its
    `compilation_cache_dir`), as `train.py` does."""
    from rollout_bridge import components, run_folder
    from rollout_bridge.envs.kinds import build_env
    from rollout_bridge.job_report import paired_gain
    from rollout_bridge.config import load_config

    flags = ["--config_path", str(ROOT / "configs" / "smoke.yaml"), "--env.data_dir", str(games_dir(tmp_path)),
             "--env.num_games", "2", "--env.heldout_games", "2", "--env.warmstart_games", "0",
             "--rollout.max_in_flight", "2", "--model.tiny_dir", str(tmp_path / "tiny"),
             "--output_dir", str(tmp_path / "run"), "--progress", "false", "--prior.cache_dir", str(tmp_path / "cache")]
    cfg = load_config(flags)
    env = build_env(cfg, False, log=lambda _: None)
    try:
        policy = str(components.model_folder(cfg.model, env.corpus, lambda _: None))
    finally:
        env.close()
    same = shutil.copytree(policy, tmp_path / "same_weights")
    out = tmp_path / "heldout.json"
    cache_dirs, enable = [], run_folder.enable_compilation_cache

    def recording(directory):
        cache_dirs.append(directory)
        return enable(directory)

    monkeypatch.setattr(run_folder, "enable_compilation_cache", recording)
    records = heldout_eval.main(["--policy", policy, "--policy", str(same), "--rollouts", "3", "--out", str(out),
                                 *flags, "--compilation_cache_dir", str(tmp_path / "xla")])
    assert cache_dirs == [str(tmp_path / "xla")]
    assert [r["policy"] for r in records] == [policy, str(same)]
    for record in records:
        assert record["trials"] == [3, 3] and all(0 <= s <= 3 for s in record["successes"])
    gain = records[1]["gain_over_reference"]
    assert gain == paired_gain(records[0], records[1]) and np.isfinite(gain["gain"])
    assert "gain_over_reference" not in records[0]
    saved = json.loads(out.read_text())
    assert saved["rollouts"] == 3 and [r["policy"] for r in saved["policies"]] == [policy, str(same)]
    printed = capsys.readouterr().out
    assert printed.count("2 games, 6 episodes") == 2 and "paired by game" in printed
    assert re.search(r"held-out games: 2 \(\S+\), 3 episodes per game", printed)   # the count, then the set's folder
    assert printed.count("reusing") == 1 and f"evaluation of {same} (heldout): reusing" in printed
    assert records[1]["successes"] == records[0]["successes"] and gain["gain"] == 0.0
    assert len(list((tmp_path / "cache").glob("evaluation-*.json"))) == 1
    heldout_eval.main(["--policy", policy, "--policy", str(same), "--rollouts", "1", *flags, "--seed", "1"])
    assert capsys.readouterr().out.count("reusing") == 1   # the copy again, not seed 0's record
    assert len(list((tmp_path / "cache").glob("evaluation-*.json"))) == 2


def test_a_job_without_held_out_games_is_refused(tmp_path):
    policy = _policy_folder(tmp_path, "a")
    flags = ["--config_path", str(ROOT / "configs" / "smoke.yaml"), "--env.data_dir", str(games_dir(tmp_path)),
             "--env.num_games", "2", "--env.heldout_games", "0", "--env.warmstart_games", "0",
             "--rollout.max_in_flight", "2",
             "--output_dir", str(tmp_path / "run"), "--progress", "false"]
    with pytest.raises(SystemExit, match="has no held-out games"):
        heldout_eval.main(["--policy", policy, "--policy", policy, *flags])
