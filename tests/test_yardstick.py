"""The common yardstick (rollout_bridge/yardstick.py, scripts/common_yardstick.py): every run's
policy at every checkpoint step played on one task mix with common random numbers; the
AUC over the evaluated steps and the arms paired by seed."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from tiny_run import tiny_train_args

from rollout_bridge import yardstick as ys
from rollout_bridge.run_errors import UserError
from spopp_jax.evaluation import area_under_curve

ROOT = Path(__file__).resolve().parents[1]
_SPEC = importlib.util.spec_from_file_location("common_yardstick", ROOT / "scripts" / "common_yardstick.py")
common_yardstick = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(common_yardstick)


# ------------------------------------------------------------------ scores
def test_auc_is_the_trapezoid_area_per_step_span():
    # steps 0, 10, 20, 40: (10 x 0.3 + 10 x 0.5 + 20 x 0.8) / 40 = 24 / 40
    assert ys.area_under_steps([0, 10, 20, 40], [0.2, 0.4, 0.6, 1.0]) == pytest.approx(0.6)
    assert ys.area_under_steps([20], [0.7]) == 0.7                       # T = 1: r_1 (SPEC 7)
    assert ys.area_under_steps([3, 5], [0.0, 1.0]) == pytest.approx(0.5)
    curve = [0.1, 0.5, 0.2, 0.9, 0.4]
    # evenly spaced steps: SPEC 7's (1/(T-1)) sum (r_t + r_{t+1})/2, whatever the spacing
    for steps in ([1, 2, 3, 4, 5], [0, 20, 40, 60, 80]):
        assert ys.area_under_steps(steps, curve) == pytest.approx(area_under_curve(curve))
    assert ys.area_under_steps([0, 10, 20], [1.0, 1.0, 1.0]) == pytest.approx(1.0)   # in [0, 1]
    for steps, rates in (([0, 0], [0.1, 0.2]), ([2, 1], [0.1, 0.2]), ([0, 1], [0.1]), ([], []),
                         ([0, 1], [0.1, float("nan")])):
        with pytest.raises(ValueError):
            ys.area_under_steps(steps, rates)


def test_auc_se_is_over_tasks():
    steps = [0, 10, 30]
    trials = np.full((3, 3), 4)
    successes = np.array([[0, 2, 4], [1, 3, 4], [2, 2, 4]])   # [T, G]
    rates = successes / trials
    per_task = [ys.area_under_steps(steps, rates[:, g]) for g in range(3)]
    estimate = ys.auc_estimate(steps, successes, trials)
    assert estimate["auc"] == pytest.approx(ys.area_under_steps(steps, rates.mean(1)))
    assert estimate["auc"] == pytest.approx(np.mean(per_task))   # equal episodes per task
    assert estimate["se"] == pytest.approx(np.std(per_task, ddof=1) / np.sqrt(3))
    assert estimate["tasks"] == 3
    trials[1, 0] = 0   # task 0 has no episode at step 10: left out of the SE, not counted a failure
    assert ys.auc_estimate(steps, successes * (trials > 0), trials)["tasks"] == 2


def test_paired_by_seed_uses_the_seeds_both_arms_hold():
    a = {0: 0.5, 1: 0.6, 2: 0.7}
    b = {0: 0.4, 1: 0.6, 2: 0.5, 3: 0.9}   # seed 3 has no partner
    p = ys.paired_by_seed(a, b)
    assert p["seeds"] == [0, 1, 2] and p["n"] == 3
    np.testing.assert_allclose(p["differences"], [0.1, 0.0, 0.2], atol=1e-12)
    assert p["mean"] == pytest.approx(0.1) and p["std"] == pytest.approx(0.1)
    assert p["se"] == pytest.approx(0.1 / np.sqrt(3))
    t = 4.302652729911275   # t_{0.975, 2}
    assert p["ci"] == pytest.approx([0.1 - t * 0.1 / np.sqrt(3), 0.1 + t * 0.1 / np.sqrt(3)])
    assert (p["improving"], p["worse"], p["equal"]) == (2, 0, 1)
    single = ys.paired_by_seed({0: 0.5}, {0: 0.25})
    assert single["mean"] == 0.25 and np.isnan(single["se"]) and np.isnan(single["ci"][0])
    with pytest.raises(ValueError, match="no seed in common"):
        ys.paired_by_seed({0: 0.5}, {1: 0.5})


def test_training_curve_is_the_mean_training_success_since_the_previous_evaluated_step():
    rows = [{"step": u, "success_rate": u / 10} for u in range(1, 9)] + [{"step": 9, "loss": 1.0}]
    assert ys.training_curve(rows, [0, 4, 8]) == pytest.approx([0.25, 0.65])   # updates 1-4, 5-8
    assert ys.training_curve(rows, [2, 8]) == pytest.approx([0.15, 0.55])      # 1-2, 3-8
    assert ys.training_curve(rows, [0, 4, 12]) is None                         # update 12 has no row
    assert ys.training_curve([], [0, 4]) is None


def test_arms_are_compared_with_the_reference_arm():
    arms = ["grpo", "receipt_token", "spo", "spopp", "grpo"]
    order = ys.known_arm_order()             # the default method, then the registry's order
    assert order[0] == "spopp" and set(order) >= set(arms)
    expected = sorted(set(arms), key=order.index)
    assert ys.arm_order(arms, None) == expected
    assert ys.arm_order(arms, "grpo") == ["grpo", *(a for a in expected if a != "grpo")]
    assert ys.arm_order(["spo", "mine"], None) == ["spo", "mine"]  # an unknown arm goes last
    with pytest.raises(UserError, match="--reference rloo"):
        ys.arm_order(arms, "rloo")


def test_the_start_policy_digest_is_the_policy_not_what_is_shipped_beside_it(tmp_path):
    """Step 0's digest (part of every cached yardstick record's key) covers the start
    folder's policy files only: an evaluation record, a README or the warm start's record
    added to a shipped warm start keep it (the cached records stay valid); a changed weight
    file changes it."""
    from rollout_bridge.run_folder import WARMSTART_RECORD_NAME

    start = tmp_path / "warmstart_model"
    start.mkdir()
    (start / "config.json").write_text('{"hidden_size": 16}')
    (start / "model.safetensors").write_bytes(bytes(64))
    run = ys.Run(tmp_path, "spopp", 0, (2,), {}, start)
    before = ys.policy_digest(run, 0)
    (start / "evaluations").mkdir()
    (start / "evaluations" / "prior-0123abcd.json").write_text('{"key": {}, "record": {}}')
    (start / "README.md").write_text("A shipped warm start.")
    (start / WARMSTART_RECORD_NAME).write_text("{}")
    assert ys.policy_digest(run, 0) == before
    (start / "model.safetensors").write_bytes(bytes([1]) + bytes(63))
    assert ys.policy_digest(run, 0) != before


def test_the_mix_digest_is_the_content_of_the_tasks_played(tmp_path):
    """tasks_digest: a set's games (name and content, in task order) or its problems in
    memory (Math-TIR), of the mix's tasks only; None for a set of neither kind."""
    from rollout_bridge.envs.math_tir.tasks import MathTask, MathTaskSet
    from rollout_bridge.evaluation_cache import tasks_digest

    problems = MathTaskSet((MathTask("1+1?", "2", "a"), MathTask("2+2?", "4", "b"), MathTask("3+3?", "6", "c")))
    before = tasks_digest(problems, (0, 1))
    assert before is not None and tasks_digest(problems, (0, 1)) == before
    edited = MathTaskSet((problems[0], MathTask("2+2?", "5", "b"), problems[2]))   # one ground truth
    assert tasks_digest(edited, (0, 1)) != before
    assert tasks_digest(edited, (0,)) == tasks_digest(problems, (0,))   # task 1 is not played
    games = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        games.append(tmp_path / name / "game.ulx")
        games[-1].write_bytes(name.encode())
    from rollout_bridge.envs.textworld_env import TextWorldTasks

    tasks = TextWorldTasks(games, tmp_path)
    first = tasks_digest(tasks, (0, 1))
    games[1].write_bytes(b"changed")                     # another game at the same path
    assert tasks_digest(tasks, (0, 1)) != first
    assert tasks_digest(tasks, (0,)) == tasks_digest(TextWorldTasks(games[:1], tmp_path), (0,))
    assert tasks_digest(object(), (0,)) is None
    # the whole set (the prior's and the evaluations' keys): all tasks in order
    assert tasks_digest(problems) == tasks_digest(problems, (0, 1, 2)) != tasks_digest(edited)
    assert tasks_digest(tasks) == tasks_digest(tasks, (0, 1))


def test_a_step_record_is_reused_only_for_the_tasks_it_was_played_on():
    """A record whose key is ours is reused; one holding another task digest (or None where
    the tasks now have one) is played again; a record written before keys held the tasks'
    digest (no ``tasks`` field, the archived form) is reused when the rest of its key matches."""
    key = {"env": {"max_turns": 2}, "tasks": "d1", "mix": {"tasks": 2}, "policy": "p", "seed": 0}
    archived = {k: v for k, v in key.items() if k != "tasks"}
    assert ys.reusable({"key": dict(key)}, key)
    assert not ys.reusable({"key": {**key, "tasks": "d2"}}, key)
    assert not ys.reusable({"key": {**key, "tasks": None}}, key)
    assert ys.reusable({"key": archived}, key)
    assert not ys.reusable({"key": {**archived, "policy": "q"}}, key)
    assert not ys.reusable({}, key) and not ys.reusable({"key": None}, key)


def _mix(tasks_digest: str | None = "d1") -> ys.TaskMix:
    return ys.TaskMix("train", (0, 1), 2, 7, tasks_digest)


def _earlier(key: dict | None, unchecked=None) -> dict:
    """A yardstick.json's fields as carried_runs reads them: two runs at steps 0 and 2."""
    settings = {"argv": []} if unchecked is None else {"argv": [], "unchecked": unchecked}
    record = {"mix": _mix().record(), "steps": [0, 2], "settings": settings,
              "runs": [{"label": "spopp_seed0"}, {"label": "spo_seed0"}]}
    return record if key is None else {**record, "key": key}


def test_carry_refuses_a_record_made_with_other_settings_or_tasks(tmp_path, capsys):
    """--carry compares the earlier record's settings key (env, decoding, model and the tasks'
    digest) with ours: another max_new_tokens or other task content is refused naming the
    field; the same key carries silently; a record written before records held a key is
    carried with a warning line naming its runs, and so are the runs a keyed record lists
    as unchecked (its ``settings.unchecked``)."""
    import train

    flags = tiny_train_args(tmp_path)
    ours = ys.settings_key(train.parse_config(flags), _mix())
    assert ours["tasks"] == "d1" and ours["rollout"]["max_new_tokens"] == 4
    longer = ys.settings_key(train.parse_config(flags + ["--rollout.max_new_tokens", "8"]), _mix())
    with pytest.raises(UserError, match=r"rollout.max_new_tokens: saved 8, expected 4"):
        ys.carried_runs(_earlier(longer), _mix(), [0, 2], [], ours)
    other_tasks = ys.settings_key(train.parse_config(flags), _mix("d2"))
    with pytest.raises(UserError, match=r"tasks: saved 'd2', expected 'd1'"):
        ys.carried_runs(_earlier(other_tasks), _mix(), [0, 2], [], ours)
    capsys.readouterr()
    same = ys.carried_runs(_earlier(dict(ours)), _mix(), [0, 2], ["spo_seed0"], ours)
    assert [r["label"] for r in same] == ["spopp_seed0"] and "warning" not in capsys.readouterr().out
    old = ys.carried_runs(_earlier(None), _mix(), [0, 2], [], ours)
    assert [r["label"] for r in old] == ["spopp_seed0", "spo_seed0"]
    line = capsys.readouterr().out
    assert "warning: --carry: 2 carried runs" in line and "not checked: spopp_seed0, spo_seed0" in line
    assert ys.unchecked_runs(_earlier(None), old) == ["spopp_seed0", "spo_seed0"]
    chained = _earlier(dict(ours), unchecked=["spo_seed0"])
    ys.carried_runs(chained, _mix(), [0, 2], [], ours)
    assert "not checked: spo_seed0\n" in capsys.readouterr().out
    assert ys.unchecked_runs(chained, old) == ["spo_seed0"]


# ------------------------------------------------------------------ tiny runs
ARGS = ["--rollout.max_in_flight", "4", "--progress", "false", "--tensorboard", "false"]


@dataclasses.dataclass
class Setup:
    tmp: Path
    flags: list
    cfg: object
    env: object
    base: Path       # the start folder every run shares (a random tiny model)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import train
    from rollout_bridge import components as build
    from rollout_bridge.envs.kinds import build_env

    tmp = tmp_path_factory.mktemp("yardstick")
    flags = tiny_train_args(tmp) + ARGS
    cfg = train.parse_config(flags)
    env = build_env(cfg, False, lambda _: None)
    base = build.model_folder(cfg.model, env.corpus, lambda _: None)
    yield Setup(tmp, flags, cfg, env, base)
    env.close()


def make_run(setup: Setup, name: str, arm: str, seed: int, noise: dict[int, int], trained: float) -> Path:
    """A train.py-shaped run folder: warmstart_model (the shared start), one checkpoint per
    step (train_state params = the start's plus noise drawn with seed ``noise[step]``, the
    run's real checkpoint key as config) and metrics.jsonl (training success ``trained``)."""
    import jax
    import train

    from rollout_bridge.run_folder import checkpoint_key
    from spopp_jax.checkpoint import Checkpointer
    from spopp_jax.learner import LearnerConfig, init_train_state
    from spopp_jax.models import from_pretrained

    root = setup.tmp / name
    shutil.copytree(setup.base, root / "warmstart_model")
    key = checkpoint_key(train.parse_config(setup.flags + ["--method", arm, "--seed", str(seed)]))
    model = from_pretrained(str(setup.base))
    with Checkpointer(root / "checkpoints", max_to_keep=10) as checkpointer:
        for step, noise_seed in noise.items():
            _, state = init_train_state(model, LearnerConfig())
            rng = np.random.default_rng(noise_seed)
            params = jax.tree.map(lambda x: x + 0.5 * rng.standard_normal(x.shape).astype(x.dtype), state.params)
            checkpointer.save(step, dataclasses.replace(state, params=params), {}, config=key)
    rows = [{"step": u, "success_rate": trained} for u in range(1, max(noise) + 1)]
    (root / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root


@pytest.fixture(scope="module")
def runs(setup):
    """spopp and spo of seed 0 with the SAME policies at steps 2 and 4 (but other training
    success); spopp seed 1 with other policies."""
    return {"a": make_run(setup, "spopp_0", "spopp", 0, {2: 11, 4: 12}, trained=0.75),
            "b": make_run(setup, "spo_0", "spo", 0, {2: 11, 4: 12}, trained=0.25),
            "c": make_run(setup, "spopp_1", "spopp", 1, {2: 21, 4: 22}, trained=0.5)}


def _job(setup, out: Path):
    from rollout_bridge.job import build_job
    from rollout_bridge.run_folder import RunPaths

    return build_job(setup.cfg, RunPaths(out), setup.env)


class RecordingEngine:
    """The job's engine, recording (prompt, per-turn seed, reply tokens) of every request."""

    def __init__(self, inner, calls: list):
        self.inner, self.calls = inner, calls

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def generate(self, prompt_ids, params):
        result = await self.inner.generate(prompt_ids, params)
        self.calls.append((params.seed, tuple(prompt_ids), tuple(result.token_ids)))
        return result


def _recorded(job, model, mix, chat) -> tuple[tuple, list]:
    """(successes, trials), and the requests sorted by seed, of one evaluation of ``model``."""
    calls: list = []
    build = job.engine
    job.engine = lambda model, seed: RecordingEngine(build(model, seed), calls)
    try:
        counts = asyncio.run(ys.evaluate_on_mix(job, model, chat, mix))
    finally:
        job.engine = build
    return counts, sorted(calls)


def _first_turns(calls, chat) -> list:
    """(seed, prompt) of each episode's first request (the fewest closed turns)."""
    closes = [prompt.count(chat.turn_close_ids[0]) for _, prompt, _ in calls]
    return sorted((seed, prompt) for (seed, prompt, _), n in zip(calls, closes) if n == min(closes))


def test_every_policy_plays_the_same_episodes_on_the_real_engine(setup, runs, tmp_path):
    """Real checkpoints restored into the JAX engine: a policy evaluated twice and the same
    policy saved by another arm play token for token the same episodes; another policy
    meets the same per-turn seeds on the same first prompts but replies otherwise."""
    from rollout_bridge.components import load_chat

    job = _job(setup, tmp_path)
    mix = ys.TaskMix.build(setup.env, "train", 3, 2, seed=5)
    assert mix.task_ids == (0, 1, 2) and mix.rollouts == 2
    a, b, c = (ys.read_run(runs[k]) for k in "abc")
    chat = load_chat(a.start_folder)
    first = _recorded(job, ys.load_step_policy(a, 2, setup.cfg.model), mix, chat)
    again = _recorded(job, ys.load_step_policy(a, 2, setup.cfg.model), mix, chat)
    other_arm = _recorded(job, ys.load_step_policy(b, 2, setup.cfg.model), mix, chat)
    other = _recorded(job, ys.load_step_policy(c, 2, setup.cfg.model), mix, chat)
    assert first == again == other_arm
    assert sum(first[0][1]) == 6                              # 3 tasks x 2 episodes
    assert _first_turns(first[1], chat) == _first_turns(other[1], chat)   # the same openings, seeded alike
    seeds = {seed for seed, _, _ in first[1]}
    assert len(seeds) >= 6 and None not in seeds             # every turn seeded, per episode
    assert [reply for *_, reply in first[1]] != [reply for *_, reply in other[1]]
    # another CRN seed: other episodes
    moved = dataclasses.replace(mix, crn_seed=mix.crn_seed + 1)
    assert {s for s, _, _ in _recorded(job, ys.load_step_policy(a, 2, setup.cfg.model), moved, chat)[1]}.isdisjoint(seeds)


def test_the_same_episode_seeds_for_every_arm_and_step(setup, runs, tmp_path):
    """evaluate_run over runs and steps with a scripted engine that wins an episode when its
    turn seed and a number drawn from the policy's weights agree: identical policies (two
    arms) give identical curves, another policy another one, and every (run, step) opens
    the same episodes: the same tasks with the same first-turn seeds."""
    from rollout_bridge.engine.fake import FakeEngine, ScriptedReply

    train = setup.env.train
    demos = [[reply for _, reply in train.demonstration(t)] for t in range(train.num_tasks)]
    firsts = [train.episode(t).reset().split("\n")[0] for t in range(train.num_tasks)]
    job = _job(setup, tmp_path)
    seen: list[set] = []   # (task, first-turn seed) of each episode, one set per engine (run and step)

    def scripted(model, seed):
        import jax
        from flax import nnx

        leaf = jax.tree.leaves(nnx.state(model, nnx.Param))[0]
        salt = int(abs(float(np.asarray(leaf).sum())) * 1e4) % 5   # a number per policy
        seeds: set = set()
        seen.append(seeds)

        def script(request):
            text = chat.tokenizer.decode(list(request.prompt_ids))
            task = next(t for t, first in enumerate(firsts) if first in text)
            turn = text.count("<|im_start|>assistant") - 1
            if turn == 0:   # an episode's later turns depend on its replies (a win ends it)
                seeds.add((task, request.params.seed))
            good = (request.params.seed + salt) % 5 < 2
            reply = demos[task][min(turn, len(demos[task]) - 1)] if good else "xyzzy"
            return ScriptedReply(tuple(chat.encode(reply)) + (chat.turn_close_ids[0],))

        return FakeEngine(script)

    from rollout_bridge.components import load_chat

    chat = load_chat(setup.base)
    job.engine = scripted
    mix = ys.TaskMix.build(setup.env, "train", None, 4, seed=0)
    records = {k: asyncio.run(ys.evaluate_run(job, ys.read_run(runs[k]), [0, 2, 4], mix, tmp_path / "ev"))
               for k in "abc"}
    curves = {k: [r["successes"] for r in records[k]] for k in "abc"}
    assert curves["a"] == curves["b"]                          # the same policies: the same curve
    assert curves["a"][0] == curves["c"][0]                    # step 0: the shared start
    assert curves["a"][1:] != curves["c"][1:]                  # other policies, another curve
    assert 0 < sum(map(sum, curves["a"])) < sum(map(sum, (r["trials"] for r in records["a"])))
    # played: 3 runs x steps 2 and 4, and step 0 once (the shared start: b's and c's step 0
    # record is a's, copied), each opening the same 16 episodes (4 tasks x 4) with the same seeds
    assert len(seen) == 7 and len({frozenset(s) for s in seen}) == 1 and len(seen[0]) == 16
    assert records["b"][0] == records["c"][0] == records["a"][0]   # wall_s too: copied, not played
    # written as they finish, reused when asked again with the same settings
    assert sorted(p.name for p in (tmp_path / "ev" / "spopp_seed0").iterdir()) == \
        ["step_0.json", "step_2.json", "step_4.json"]
    again = asyncio.run(ys.evaluate_run(job, ys.read_run(runs["a"]), [0, 2, 4], mix, tmp_path / "ev"))
    assert again == records["a"] and len(seen) == 7


def test_step_records_are_played_again_when_the_games_at_their_path_change(setup, runs, tmp_path, capsys):
    """evaluate_run's step records hold the played tasks' digest: the same games reuse
    them; a game of the mix changed at the same path plays the step again (a game outside
    the mix does not); a record without the digest (written before records held it) is
    reused with a line saying so; a record holding another digest is played again."""
    from rollout_bridge.components import load_chat
    from rollout_bridge.engine.fake import FakeEngine, ScriptedReply
    from rollout_bridge.envs.textworld_env import TextWorldTasks

    chat = load_chat(setup.base)
    requests = []

    def engine(model, seed):
        def script(request):
            requests.append(request)
            return ScriptedReply(tuple(chat.encode("xyzzy")) + (chat.turn_close_ids[0],))
        return FakeEngine(script)

    job = _job(setup, tmp_path)
    job.engine = engine
    train = setup.env.train
    games = tmp_path / "games"   # a copy of the games, as a game folder keyed by its path only
    shutil.copytree(train.root, games)
    copied = TextWorldTasks.from_folder(games, train.max_turns)
    assert copied.task_names == train.task_names

    def play(expect_played: bool) -> dict:
        mix = ys.TaskMix.build(dataclasses.replace(setup.env, train=copied), "train", 2, 1, seed=0)
        before = len(requests)
        (record,) = asyncio.run(ys.evaluate_run(job, ys.read_run(runs["a"]), [2], mix, tmp_path / "ev"))
        assert (len(requests) > before) == expect_played
        assert record["key"].get("tasks", mix.tasks_digest) == mix.tasks_digest   # absent: reused, archived
        return record

    path = tmp_path / "ev" / "spopp_seed0" / "step_2.json"
    first = play(True)
    assert first["key"]["tasks"] is not None and sum(first["trials"]) == 2 and ys.unchecked_steps([first]) == []
    play(False)                                              # the same games: reused
    source = Path(copied.game_files[3]).with_suffix(".ni")
    source.write_text(source.read_text() + "\n")            # a game the mix does not play
    play(False)
    source = Path(copied.game_files[1]).with_suffix(".ni")
    source.write_text(source.read_text() + "\n")            # a played game, at the same path
    second = play(True)
    assert second["key"]["tasks"] != first["key"]["tasks"]
    archived = json.loads(path.read_text())
    del archived["key"]["tasks"]                             # the form written before the digest
    path.write_text(json.dumps(archived))
    capsys.readouterr()
    assert ys.unchecked_steps([play(False)]) == [2]
    assert "content not checked" in capsys.readouterr().out
    path.write_text(json.dumps({**archived, "key": {**archived["key"], "tasks": "0" * 40}}))
    play(True)


def test_a_run_named_by_a_relative_path_loads_its_checkpoints(setup, runs, monkeypatch):
    """``--runs runs/<arm>/seed<k>`` as a user types it: checkpoints restore by absolute path."""
    monkeypatch.chdir(runs["a"].parent)
    run = ys.read_run(Path(runs["a"].name))
    assert run.folder.is_absolute() and run.start_folder.is_absolute()
    ys.load_step_policy(run, 2, setup.cfg.model)


def test_runs_made_on_other_tasks_and_missing_steps_are_refused(setup, runs):
    import train

    a, b = ys.read_run(runs["a"]), ys.read_run(runs["b"])
    assert (a.arm, a.seed, a.steps, b.arm) == ("spopp", 0, (2, 4), "spo")
    assert a.start_folder == runs["a"] / "warmstart_model"
    ys.check_runs(setup.cfg, [a, b])
    other = train.parse_config(setup.flags + ["--env.max_turns", "3", "--rollout.temperature", "0.5"])
    with pytest.raises(UserError, match=r"env.max_turns: saved 2, expected 3.*rollout.temperature"):
        ys.check_runs(other, [a, b])
    with pytest.raises(UserError, match="two runs of one arm and seed"):
        ys.check_runs(setup.cfg, [a, a])
    assert ys.common_steps([a, b], None, start=True) == [0, 2, 4]
    assert ys.common_steps([a, b], [4], start=False) == [4]
    with pytest.raises(UserError, match=r"spopp_seed0.*\[6\]"):
        ys.common_steps([a, b], [4, 6], start=True)
    with pytest.raises(UserError, match="no checkpoint step"):
        ys.read_run(setup.tmp)


def test_the_command_writes_curves_auc_and_paired_differences(setup, runs, tmp_path, capsys):
    """scripts/common_yardstick.py on two arms (identical policies) and a second seed:
    the record, the tables and the figure; the identical arms differ by exactly 0."""
    out = tmp_path / "out"
    record = common_yardstick.main(["--runs", *map(str, runs.values()), "--out", str(out), "--rollouts", "2",
                                    "--tasks", "2", *setup.flags])
    assert record["steps"] == [0, 2, 4] and record["arms"] == ["spopp", "spo"]
    assert record["mix"]["task_ids"] == [0, 1] and record["mix"]["rollouts"] == 2
    by_label = {r["label"]: r for r in record["runs"]}
    assert sorted(by_label) == ["spo_seed0", "spopp_seed0", "spopp_seed1"]
    assert by_label["spopp_seed0"]["curve"] == by_label["spo_seed0"]["curve"]
    for r in record["runs"]:
        rates = [p["success_rate"] for p in r["curve"]]
        assert r["auc"]["auc"] == pytest.approx(ys.area_under_steps([0, 2, 4], rates))
        assert [p["episodes"] for p in r["curve"]] == [4, 4, 4]
    (row,) = record["comparisons"]
    assert (row["a"], row["b"]) == ("spopp", "spo")
    assert row["auc"]["seeds"] == [0] and row["auc"]["mean"] == 0.0 and row["first"]["mean"] == 0.0
    # their own training rollouts said otherwise (metrics.jsonl: 0.75 vs 0.25)
    assert by_label["spopp_seed0"]["training_curve"] == [0.75, 0.75]
    assert row["training_auc"]["mean"] == pytest.approx(0.5)
    assert json.loads((out / "yardstick.json").read_text())["steps"] == [0, 2, 4]
    # the settings it was made with: env, decoding and model, and the played games' content
    mix = ys.TaskMix.build(setup.env, "train", 2, 2, setup.cfg.seed)
    assert record["key"] == ys.settings_key(setup.cfg, mix) and record["key"]["tasks"] is not None
    table = (out / "yardstick.md").read_text()
    assert "| spopp − spo | AUC | 1 |" in table and "| spopp_seed1 |" in table
    assert (out / "yardstick.png").stat().st_size > 0
    assert "Common yardstick" in capsys.readouterr().out


def test_carry_keeps_an_earlier_records_runs_and_plays_only_the_new_ones(setup, runs, tmp_path, capsys):
    """--carry: a run added later is played alone; the earlier record's runs enter the new
    record as recorded, in its tables and paired differences; an earlier record of another
    mix, other steps or other settings is refused before anything is played; one written
    before records held their settings is carried with a warning."""
    flags = ["--rollouts", "2", "--tasks", "2", *setup.flags]
    first = common_yardstick.main(["--runs", str(runs["a"]), str(runs["b"]), "--out", str(tmp_path / "first"), *flags])
    earlier = tmp_path / "first" / "yardstick.json"
    out = tmp_path / "second"
    record = common_yardstick.main(["--runs", str(runs["c"]), "--out", str(out), "--carry", str(earlier), *flags])
    assert sorted(p.name for p in (out / "evaluations").iterdir()) == ["spopp_seed1"]   # played: only the new run
    by_label = {r["label"]: r for r in record["runs"]}
    assert sorted(by_label) == ["spo_seed0", "spopp_seed0", "spopp_seed1"]
    for r in first["runs"]:
        assert by_label[r["label"]] == r
    assert record["settings"]["carried"]["runs"] == ["spopp_seed0", "spo_seed0"]
    (row,) = record["comparisons"]
    assert (row["a"], row["b"], row["auc"]["seeds"]) == ("spopp", "spo", [0])
    assert "| spopp_seed0 |" in (out / "yardstick.md").read_text()
    # a run named in --runs is played, not carried
    again = common_yardstick.main(["--runs", str(runs["a"]), "--out", str(tmp_path / "third"), "--carry",
                                   str(out / "yardstick.json"), *flags])
    assert sorted(r["label"] for r in again["runs"]) == ["spo_seed0", "spopp_seed0", "spopp_seed1"]
    assert again["settings"]["carried"]["runs"] == ["spo_seed0", "spopp_seed1"]
    assert record["settings"]["unchecked"] == []
    # made with other settings (here: its key says 8 new tokens): refused, naming the field
    made = json.loads(earlier.read_text())
    made["key"]["rollout"]["max_new_tokens"] = 8
    (tmp_path / "other_settings.json").write_text(json.dumps(made))
    with pytest.raises(UserError, match=r"other settings or tasks.*rollout.max_new_tokens: saved 8, expected 4"):
        common_yardstick.main(["--runs", str(runs["c"]), "--out", str(tmp_path / "refused"), "--carry",
                               str(tmp_path / "other_settings.json"), *flags])
    assert not (tmp_path / "refused" / "evaluations").exists()
    # written before records held their settings: carried, with a warning (spopp_seed1's steps reused)
    del made["key"]
    (tmp_path / "older.json").write_text(json.dumps(made))
    capsys.readouterr()
    older = common_yardstick.main(["--runs", str(runs["c"]), "--out", str(out), "--carry",
                                   str(tmp_path / "older.json"), *flags])
    assert "warning: --carry: 2 carried runs" in capsys.readouterr().out
    assert older["settings"]["unchecked"] == ["spopp_seed0", "spo_seed0"] and "key" in older
    # carried on from there: the runs it holds unchecked are named again, the one it played is not
    chained = common_yardstick.main(["--runs", str(runs["a"]), "--out", str(tmp_path / "third"), "--carry",
                                     str(out / "yardstick.json"), *flags])
    assert "not checked: spo_seed0\n" in capsys.readouterr().out
    assert chained["settings"]["unchecked"] == ["spo_seed0"]
    for other, match in ((["--rollouts", "3"], "task mix"), (["--eval_steps", "2"], "steps")):
        with pytest.raises(UserError, match=match):
            common_yardstick.main(["--runs", str(runs["c"]), "--out", str(tmp_path / "refused"), "--carry",
                                   str(earlier), *flags, *other])
        assert not (tmp_path / "refused" / "evaluations").exists()
    (tmp_path / "not_a_record.json").write_text("[1, 2]")
    for bad, match in ((tmp_path / "missing.json", "not a readable yardstick.json"),
                       (tmp_path / "not_a_record.json", "not a yardstick record")):
        with pytest.raises(UserError, match=match):
            common_yardstick.main(["--runs", str(runs["c"]), "--out", str(tmp_path / "refused"), "--carry", str(bad),
                                   *flags])
        assert not (tmp_path / "refused" / "evaluations").exists()


@pytest.mark.slow
def test_the_command_on_real_train_py_runs(tmp_path):
    """Two real tiny jobs (`python train.py`, SPO++ and SPO, seed 3, 4 updates, a checkpoint
    every 2) from one tiny model: the yardstick reads their folders as train.py leaves them;
    their warm starts are made alike, so step 0 scores the same for both."""
    import subprocess
    import sys

    common = tiny_train_args(tmp_path, steps=4) + ["--model.tiny_dir", str(tmp_path / "tiny"), *ARGS,
                                                   "--keep_checkpoints", "3"]
    folders = []
    for arm in ("spopp", "spo"):
        folder = tmp_path / arm
        result = subprocess.run([sys.executable, str(ROOT / "train.py"), *common, "--method", arm,
                                 "--output_dir", str(folder)], cwd=ROOT, capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, result.stderr[-3000:]
        folders.append(str(folder))
    out = tmp_path / "yardstick"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "common_yardstick.py"), "--runs", *folders,
                             "--out", str(out), "--rollouts", "2", *common], cwd=ROOT, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((out / "yardstick.json").read_text())
    assert record["steps"] == [0, 2, 4] and record["arms"] == ["spopp", "spo"]
    assert [len(r["training_curve"]) for r in record["runs"]] == [2, 2]
    (row,) = record["comparisons"]
    assert row["first"]["mean"] == 0.0          # the same start, the same episodes
    assert "| spopp − spo | AUC | 1 |" in result.stdout
