"""Records shipped beside a policy (``<policy>/evaluations``): the main job's warm start
carries its prior and its held-out evaluation before RL, so a first run reads them instead
of playing 1,024 + 2,048 episodes, but only under the very key the job computes, which
holds the content of the games they were measured on: a machine whose games came out
differently plays the episodes itself."""

from __future__ import annotations

import asyncio
import json
import shutil
import types
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("textworld")

from rollout_bridge import evaluation, prior_stage  # noqa: E402
from rollout_bridge.config import load_config  # noqa: E402
from rollout_bridge.envs.process_pool import worker_pool  # noqa: E402
from rollout_bridge.envs.textworld_env import TextWorldTasks  # noqa: E402
from rollout_bridge.envs.textworld_games import GameSetSpec, generate_game, generate_game_set  # noqa: E402
from rollout_bridge.evaluation_cache import (SHIPPED_RECORDS, find_record, policy_digest,  # noqa: E402
                                             read_cached, tasks_digest, write_cached)
from rollout_bridge.run_folder import RunPaths  # noqa: E402
from tiny_run import SMOKE_CONFIG, games_dir  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WARM_START = ROOT / "assets" / "textworld_text_warmstart"
SPEC = GameSetSpec("shipped", num_games=2, base_seed=0)   # 2 one-quest games, ~1 s each


def _shipped(kind: str) -> dict:
    files = sorted((WARM_START / SHIPPED_RECORDS).glob(f"{kind}-*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


def test_the_warm_starts_records_are_keyed_for_the_default_job():
    """The keys `python train.py` computes for its prior and its evaluation before RL find
    the shipped records, given the digests of the games they were measured on (the only
    part of the key that needs the games): a change of the default config, of a section's
    fields or of the warm start's weights makes the job play them again, and this test
    says so."""
    cfg = load_config([])
    policy = ROOT / cfg.model.path
    prior, held_out = _shipped("prior"), _shipped("evaluation")
    prior_key = prior_stage.prior_key(cfg, policy, cfg.tracker.rho, prior["key"]["tasks"])
    evaluation_key = evaluation.evaluation_key(cfg, policy, cfg.evaluation.rollouts(cfg.prior, "heldout"),
                                               held_out["key"]["tasks"])
    assert prior_key["policy"] == policy_digest(policy)
    assert find_record(None, policy, "prior", prior_key).record == prior["record"]
    assert find_record(None, policy, "evaluation", evaluation_key).record == held_out["record"]
    assert sorted(held_out["key"]["tasks"]) == ["heldout"]
    record = prior["record"]
    assert record["key"] == prior_key                      # the run folder's prior.json reuses it on a rerun
    assert record["num_tasks"] == cfg.env.num_games and sum(record["trials"]) == cfg.env.num_games
    trials = held_out["record"]["heldout"]["trials"]
    assert len(trials) == cfg.env.heldout_games and sum(trials) == 4 * cfg.env.heldout_games


def test_the_policy_digest_leaves_out_its_notes_and_shipped_records(tmp_path):
    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "model.safetensors").write_bytes(b"weights")
    before = policy_digest(policy)
    (policy / "README.md").write_text("how it was made")
    write_cached(policy / SHIPPED_RECORDS, "prior", {"a": 1}, {"success_rate": 0.5})
    assert policy_digest(policy) == before
    (policy / "model.safetensors").write_bytes(b"other weights")
    assert policy_digest(policy) != before


def test_the_games_digest_is_their_content_on_any_machine(tmp_path):
    """Two processes (each its own hash seed) make the same games of the same seeds; the
    digest leaves out where textworld is installed and the story file's compile date, and
    changes with a game's Inform 7 source or its description."""
    files = [tmp_path / "here" / "game_000003.z8", tmp_path / "spawned" / "game_000003.z8"]
    generate_game(3, SPEC, files[0])
    with worker_pool(1) as pool:
        pool.submit(generate_game, 3, SPEC, files[1]).result()
    digest = lambda path: tasks_digest(TextWorldTasks([path], path.parent))
    assert digest(files[0]) == digest(files[1])
    description = json.loads(files[1].with_suffix(".json").read_text())
    description["KB"]["text_grammars_path"] = "/elsewhere/site-packages/textworld/generator/data/text_grammars"
    files[1].with_suffix(".json").write_text(json.dumps(description))
    files[1].write_bytes(files[1].read_bytes() + b"\0")        # a .z8 compiled on another day
    assert digest(files[1]) == digest(files[0])
    source = files[1].with_suffix(".ni")
    source.write_text(source.read_text().replace("TextWorld", "TextWorId", 1))
    assert digest(files[1]) != digest(files[0])


class _Played:
    """Stands in for the rollouts: counts the episodes played, all of them won."""

    def __init__(self):
        self.calls = 0

    async def rollouts(self, engine, env, chat, agent, concurrency, n, what, progress, crn_seed=None, task_ids=None):
        self.calls += 1
        return np.full(env.num_tasks, n, np.int64), np.full(env.num_tasks, n, np.int64)

    async def extra(self, engine, env, chat, agent, concurrency, n, when, progress, seed):
        self.calls += 1
        return {name: {"success_rate": 1.0, "successes": [n] * tasks.num_tasks, "trials": [n] * tasks.num_tasks}
                for name, (tasks, _) in env.extra_evals.items()}


class _Engine:
    async def close(self):
        pass


def _setup(tmp_path, monkeypatch):
    """The smoke config, a policy folder, 2 games copied into tmp (so that they can be
    changed), and the rollouts replaced by `_Played`."""
    played = _Played()
    monkeypatch.setattr(prior_stage, "success_rollouts", played.rollouts)
    monkeypatch.setattr(evaluation, "extra_evaluations", played.extra)
    monkeypatch.setattr(prior_stage, "load_policy", lambda *_: None)
    monkeypatch.setattr(evaluation, "load_policy", lambda *_: None)
    shared = generate_game_set(SPEC, games_dir(tmp_path))
    folder = tmp_path / "games"
    shutil.copytree(shared[0].parent, folder)
    tasks = TextWorldTasks([folder / f.name for f in shared], folder)
    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "config.json").write_text("{}")
    return played, tasks, policy


def _prior(cfg, tmp_path, run: str, policy, tasks):
    env = types.SimpleNamespace(train=tasks, num_tasks=tasks.num_tasks)
    (tmp_path / run).mkdir(exist_ok=True)
    return prior_stage.run_prior(cfg, RunPaths(tmp_path / run), policy, None, env, None,
                                 lambda *_: _Engine(), 0.875, 2)


def _evaluation(cfg, tmp_path, policy, tasks):
    env = types.SimpleNamespace(extra_evals={"heldout": (tasks, None)})
    job = types.SimpleNamespace(cfg=cfg, env=env, agent=None, orchestrator=types.SimpleNamespace(max_in_flight=2),
                                engine=lambda *_, **__: _Engine())
    return asyncio.run(evaluation.evaluate_policy(job, policy, None))


def _ship(cache: Path, policy: Path, kind: str) -> None:
    """Move the record the job left in the cache beside the policy."""
    (policy / SHIPPED_RECORDS).mkdir(exist_ok=True)
    for path in cache.glob(f"{kind}-*.json"):
        shutil.move(path, policy / SHIPPED_RECORDS / path.name)


def test_a_changed_game_set_is_not_served_the_shipped_records(tmp_path, monkeypatch, capsys):
    """The prior and the evaluation before RL of a policy that ships them are read back
    on the same games (no episode played, one line saying so); after one game's Inform 7
    source changed (a generator or textworld that makes other games) they are played again,
    with a line naming the tasks as what differs."""
    played, tasks, policy = _setup(tmp_path, monkeypatch)
    cache = tmp_path / "cache"
    cfg = load_config(["--config_path", str(SMOKE_CONFIG), "--prior.cache_dir", str(cache)])
    first = _prior(cfg, tmp_path, "a", policy, tasks)[2]
    measured = _evaluation(cfg, tmp_path, policy, tasks)
    assert played.calls == 2
    _ship(cache, policy, "prior")
    _ship(cache, policy, "evaluation")
    capsys.readouterr()

    again = _prior(cfg, tmp_path, "b", policy, tasks)[2]
    assert _evaluation(cfg, tmp_path, policy, tasks) == measured and again == first and played.calls == 2
    printed = capsys.readouterr().out
    assert printed.count("shipped with the policy") == 2 and "prior: reusing" in printed

    source = Path(tasks.game_files[1]).with_suffix(".ni")
    source.write_text(source.read_text() + "\n")
    _prior(cfg, tmp_path, "c", policy, tasks)
    _evaluation(cfg, tmp_path, policy, tasks)
    assert played.calls == 4
    printed = capsys.readouterr().out
    assert "shipped with the policy" not in printed
    assert printed.count(f"not reusing the record shipped in {policy / SHIPPED_RECORDS}: "
                         "it was measured with other tasks") == 2
    assert read_cached(cache, "prior", json.loads((tmp_path / "c" / "prior.json").read_text())["key"]) is not None
