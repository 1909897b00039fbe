"""The method protocol (rollout_bridge.methods): one file per method that owns its recipe,
state in the checkpoint, SPO's divergence from the learner's log-probs, RLOO as a fourth
method, a method added in one file selectable from the command line."""

from __future__ import annotations

import ast
import dataclasses
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

from rollout_bridge import methods, state_codec
from rollout_bridge.engine.fake import run_virtual
from rollout_bridge.methods.rloo import leave_one_out_advantages
from rollout_bridge.methods.single_stream import SingleStreamMethod
from rollout_bridge.methods.spopp import SpoPlusPlus
from rollout_bridge.orchestrator import Orchestrator, OrchestratorConfig, SamplerConfig
from rollout_bridge.trajectory import DispatchStamp, Trajectory
from spopp_jax import sampling, tracker
from test_orchestrator import FakeLearner, World, chat, jeffreys, reward_table, run_orchestrator, uneven_latency  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import matched_runs  # noqa: E402  (benchmarks/matched_runs.py: the matched runs' arms and their old recipes)


def _traj(task_id, reward, n_actions, group_id=-1, request_id=0, logp=-1.0, error=None):
    stamp = DispatchStamp(request_id, task_id, 2, 0.25, 0.4, 1.5, group_id)
    ids = tuple(range(3, n_actions + 5))
    mask = (False, False) + (True,) * n_actions
    return Trajectory(stamp, ids, mask, (0.0, 0.0) + (logp,) * n_actions, 2, reward, 7.0,
                      turn_latencies=(0.5,), env_latencies=(0.1, 0.2), turn_policy_events=(2,),
                      finish_reasons=("stop",), failed=error is not None, error=error)


def _method_name_branches(path: Path, names: set[str]) -> list[str]:
    """Comparisons with a method's name and collections of several method names in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(isinstance(o, ast.Constant) and o.value in names for o in operands):
                found.append(f"{path.name}:{node.lineno}")
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            if sum(isinstance(e, ast.Constant) and e.value in names for e in node.elts) >= 2:
                found.append(f"{path.name}:{node.lineno}")
    return found


def test_no_module_branches_on_a_method_name():
    """A method's behaviour and recipe live in its own file: nowhere else in the tree does
    a method's name decide anything (no ``method == "grpo"``, no ``("grpo", "rloo")``)."""
    names = set(methods.names())
    modules = [ROOT / "train.py", *(ROOT / "rollout_bridge").rglob("*.py"), *(ROOT / "spopp_jax").rglob("*.py")]
    outside = [p for p in modules if (ROOT / "rollout_bridge" / "methods") not in p.parents]
    assert len(outside) > 50
    assert [hit for p in outside for hit in _method_name_branches(p, names)] == []


# matched_runs.RECIPE_FLAGS_BEFORE_METHODS: each matched arm's recipe as the flag list commands
# made before each method owned its recipe spelled it, on the TrainConfig defaults of that
# version (tracker.spo_d_half 0.06, spo_rho_min 0.875, spo_rho_max 0.96, rollout.group_size 8,
# advantage.measure token, loss.dual_clip 2.0).
_OLD_DEFAULTS = {"--tracker.spo_d_half": "0.06", "--tracker.spo_rho_min": "0.875", "--tracker.spo_rho_max": "0.96",
                 "--rollout.group_size": "8", "--advantage.measure": "token", "--loss.dual_clip": "2.0"}
# where each old flag now arrives (the orchestrator's or the learner's field)
_RECEIVER = {"--tracker.spo_d_half": "spo_d_half", "--tracker.spo_rho_min": "spo_rho_min",
             "--tracker.spo_rho_max": "spo_rho_max", "--rollout.group_size": "group_size",
             "--advantage.measure": "measure", "--loss.dual_clip": "dual_clip"}


@pytest.mark.parametrize("arm", sorted(matched_runs.RECIPE_FLAGS_BEFORE_METHODS))
def test_method_flag_resolves_to_the_matched_runs_recipe(arm):
    """``--method <name>`` alone gives, field by field, what the matched run's flag list
    gave: the same Method class, tracker retention, measure, dual clip and group size."""
    from rollout_bridge.components import build_agent_config, build_learner_config, build_orchestrator_config
    from rollout_bridge.config import load_config

    old = list(matched_runs.RECIPE_FLAGS_BEFORE_METHODS[arm])
    flags = {**_OLD_DEFAULTS, **dict(zip(old[2::2], old[3::2]))}
    cfg = load_config(["--method", matched_runs.ARMS[arm]])
    orch = build_orchestrator_config(cfg, build_agent_config(cfg, max_turns=2), seed=0)
    learner = build_learner_config(cfg)
    assert methods.method_class(orch.method) is methods.method_class(old[1])
    for flag, value in flags.items():
        got = learner.dual_clip if _RECEIVER[flag] == "dual_clip" else getattr(orch, _RECEIVER[flag])
        assert str(got) == value or got == float(value), (arm, flag, got, value)


@pytest.mark.parametrize("name", ["spopp", "spo", "grpo", "rloo", "event_trajectory", "receipt_token",
                                  "receipt_trajectory"])
def test_every_recipe_field_reaches_a_component_and_a_flag_overrides_one(name):
    from rollout_bridge.config import load_config

    recipe = methods.recipe(name)
    reached = {**recipe.orchestrator_fields(), **recipe.learner_fields()}
    for field in dataclasses.fields(recipe):
        assert getattr(recipe, field.name) in reached.values(), f"{name}.{field.name} reaches nothing"
    cfg = load_config(["--method", name, "--method.dual_clip", "3.5"])
    assert type(cfg.method) is type(recipe) and cfg.method.dual_clip == 3.5
    assert dataclasses.replace(cfg.method, dual_clip=recipe.dual_clip) == recipe   # the rest: the recipe's


def test_spo_recipe_from_yaml_and_flag(tmp_path):
    from rollout_bridge.config import config_to_dict, load_config

    path = tmp_path / "c.yaml"
    path.write_text("method: spo\n")
    cfg = load_config(config_path=path)
    assert (cfg.method.measure, cfg.method.dual_clip, cfg.method.rho_max) == ("trajectory", 10.0, 0.96)
    path.write_text("method:\n  type: spo\n  rho_max: 0.9\n")
    assert load_config(["--method.measure", "token"], config_path=path).method == methods.recipe("spo").__class__(
        measure="token", rho_max=0.9)
    saved = config_to_dict(load_config(["--method", "receipt_token"]))["method"]
    assert saved["type"] == "receipt_token" and saved["rho_min"] == saved["rho_max"] == 0.875


def test_trajectory_codec_round_trips_every_field():
    trajs = [_traj(0, 1.0, 3, request_id=4), _traj(5, 0.0, 1, group_id=2, error="RuntimeError: x"),
             dataclasses.replace(_traj(1, 0.0, 2), finish_reasons=(), turn_policy_events=()),
             dataclasses.replace(_traj(2, 1.0, 2), turn_policy_events=(2, 3), turn_last_policy_events=(3, 5))]
    assert state_codec.decode_trajectories(state_codec.encode_trajectories(trajs)) == trajs
    # a checkpoint written before in-flight publishing has no last events: "same as first"
    old = state_codec.encode_trajectories(trajs[:1])
    del old["turn_last_policy_events"]
    assert state_codec.decode_trajectories(old) == trajs[:1]
    assert trajs[3].event_span == (2, 5) and trajs[0].event_span == (2, 2)
    assert state_codec.decode_trajectories(state_codec.encode_trajectories([])) == []
    encoded = state_codec.encode_trajectories([])
    assert all(leaf.size > 0 for leaf in jax.tree.leaves(encoded))  # orbax refuses empty arrays
    # a new Trajectory field must be added to the codec (or a checkpoint silently loses it)
    covered = {"stamp", "token_ids", "action_mask", "rollout_logp", "prompt_length", "reward", "finish_time",
               "turn_latencies", "env_latencies", "turn_policy_events", "turn_last_policy_events", "finish_reasons",
               "truncated", "failed", "aborted", "error"}
    assert {f.name for f in dataclasses.fields(Trajectory)} == covered


def test_rloo_advantages_hand_numbers():
    trajs = [_traj(0, 1.0, 1, group_id=5), _traj(0, 0.0, 1, group_id=5), _traj(0, 0.0, 1, group_id=5),
             _traj(1, 1.0, 1, group_id=7), _traj(1, 1.0, 1, group_id=7), _traj(1, 0.0, 1, group_id=7)]
    # group 5: 1 − mean(0, 0) = 1, 0 − mean(1, 0) = −0.5 (x2); group 7: 1 − 0.5 (x2), 0 − 1
    np.testing.assert_allclose(leave_one_out_advantages(trajs, 3), [1, -0.5, -0.5, 0.5, 0.5, -1], atol=1e-7)
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        OrchestratorConfig(method="rloo", group_size=1, batch_size=4, max_in_flight=4, drain="finish",
                           pad_to_multiple=64)


def test_rloo_runs_in_the_orchestrator_with_grpo_groups(chat):
    world = World(chat, 6, reward_table(20), uneven_latency(20))
    config = OrchestratorConfig(method="rloo", group_size=3, batch_size=6, max_in_flight=9, pad_to_multiple=8,
                                drain="finish")
    orch = run_orchestrator(world, config, 3)
    for record in orch.records:
        np.testing.assert_allclose(record.raw_advantages, leave_one_out_advantages(record.trajectories, 3),
                                   atol=1e-7)
        assert {len([t for t in record.trajectories if t.stamp.group_id == g])
                for g in {t.stamp.group_id for t in record.trajectories}} == {3}


class ConstantBaseline(SingleStreamMethod):
    """A method defined outside the package: v̂ = 0.5 for every task, never updated."""

    def __init__(self, config, num_tasks, prior_alpha, prior_beta):
        super().__init__(config, num_tasks, np.ones(num_tasks), np.ones(num_tasks))  # v̂ = 0.5


NEW_METHOD_FILE = '''
"""A constant baseline: v̂ = 0.5 for every task, never updated."""
import dataclasses
from typing import ClassVar

from rollout_bridge.methods.base import MethodConfig
from test_methods import ConstantBaseline


@MethodConfig.register_subclass("constant")
@dataclasses.dataclass
class ConstantConfig(MethodConfig):
    method_class: ClassVar = ConstantBaseline
'''


def test_a_method_added_in_one_file_is_selectable_from_the_command_line(chat, monkeypatch, tmp_path):
    """One new file in the methods package (here a folder added to its search path) makes
    ``--method constant`` parse, and the orchestrator runs that method."""
    from rollout_bridge.components import build_agent_config, build_orchestrator_config
    from rollout_bridge.config import load_config
    from rollout_bridge.methods.base import MethodConfig

    (tmp_path / "constant_baseline.py").write_text(textwrap.dedent(NEW_METHOD_FILE))
    monkeypatch.setattr(methods, "__path__", [*methods.__path__, str(tmp_path)])
    monkeypatch.setattr(MethodConfig, "_choice_registry", dict(MethodConfig._choice_registry))
    monkeypatch.setattr(MethodConfig, "_did_discover_packages", False)
    try:
        cfg = load_config(["--method", "constant", "--rollout.batch_size", "3", "--rollout.max_in_flight", "4",
                           "--optim.num_mini_batches", "1",
                           "--optim.num_micro_batches", "1"])
    finally:
        sys.modules.pop("rollout_bridge.methods.constant_baseline", None)
    assert cfg.method.name == "constant" and "constant" in methods.names()
    config = dataclasses.replace(build_orchestrator_config(cfg, build_agent_config(cfg, 2), seed=0),
                                 pad_to_multiple=8, keep_history=True)
    world = World(chat, 4, reward_table(21), uneven_latency(21))
    orch = run_orchestrator(world, config, 2)
    rewards = np.array([t.reward for r in orch.records for t in r.trajectories])
    raw = np.concatenate([r.raw_advantages for r in orch.records])
    np.testing.assert_allclose(raw, rewards - 0.5, atol=1e-7)


def _spo_orchestrator(world, learner, config):
    return Orchestrator(world.engine, world.env, world.chat, learner, world.num_tasks, config,
                        prior_alpha=jeffreys(world.num_tasks)[0], prior_beta=jeffreys(world.num_tasks)[1])


def test_resume_restores_buffered_trajectories_spo_state_and_counters(chat, tmp_path):
    from spopp_jax.checkpoint import Checkpointer

    def divergence(learner_input):
        return [None if p is None else 0.01 * (1 + p.task_id) for p in learner_input.previous]

    # two batches may be outstanding: when run() returns, finished work waits in the buffer
    config = OrchestratorConfig(method="spo", batch_size=3, max_in_flight=5, max_buffered_batches=3,
                                pad_to_multiple=8, drain="finish")
    world = World(chat, 6, reward_table(22), uneven_latency(22))
    orch = run_orchestrator(world, config, 3, learner=FakeLearner(divergence=divergence), prior=jeffreys(6))
    assert orch.ready, "the scenario must leave finished, untrained trajectories behind"
    assert orch.method.previous
    with Checkpointer(tmp_path / "ckpt") as checkpointer:
        checkpointer.save(3, {"dummy": np.zeros(2, np.float32)}, extras={"orchestrator": orch.state_dict()})
        checkpointer.wait_until_finished()
    with Checkpointer(tmp_path / "ckpt") as checkpointer:
        extras = checkpointer.restore({"dummy": np.zeros(2, np.float32)}).extras["orchestrator"]

    fresh_world = World(chat, 6, reward_table(22), uneven_latency(22))
    fresh_world.engine.policy_event = orch.policy_event
    learner = FakeLearner(divergence=divergence)
    resumed = _spo_orchestrator(fresh_world, learner, config)
    resumed.load_state_dict(extras)
    assert resumed.ready == orch.ready  # every field of every buffered trajectory
    for name in ("policy_event", "updates", "dispatched", "consumed", "failed", "aborted"):
        assert getattr(resumed, name) == getattr(orch, name)
    assert set(resumed.method.previous) == set(orch.method.previous)
    for task, prev in orch.method.previous.items():
        got = resumed.method.previous[task]
        np.testing.assert_array_equal(got.token_ids, prev.token_ids)
        np.testing.assert_array_equal(got.action_mask, prev.action_mask)
        np.testing.assert_array_equal(got.logp_then, prev.logp_then)
    np.testing.assert_array_equal(np.asarray(resumed.tracker.alpha), np.asarray(orch.tracker.alpha))

    buffered = orch.ready

    async def more():
        try:
            await resumed.run(1)
        finally:
            await resumed.close()

    run_virtual(more())
    first = learner.inputs[0]
    n = min(len(buffered), config.batch_size)
    assert first.trajectories[:n] == buffered[:n]  # the buffer is trained on first, nothing lost
    for t, prev in zip(first.trajectories, first.previous):  # y′ continue from the restored state
        if prev is not None and prev.batch_row < 0:
            np.testing.assert_array_equal(prev.logp_then, orch.method.previous[t.task_id].logp_then)


def test_spo_divergence_ignores_the_engine_vs_learner_mismatch():
    """D uses the learner's log-probs only: rollout log-probs 0.7 off the learner's (a
    bf16 engine) leave D ≈ 0 when the update barely moves the policy; the old engine-based
    π_then would have given D ≈ 0.7 and ρ = ρ_min."""
    from rollout_bridge.methods.spo import Spo
    from rollout_bridge.policy_learner import PolicyLearner
    from rollout_bridge.trajectory import pack_train_batch
    from spopp_jax.learner import LearnerConfig, init_train_state
    from spopp_jax.models import ModelConfig, init_model

    model = init_model(ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=8), seed=0)
    learner_cfg = LearnerConfig(num_mini_batches=1, action_logits_fraction=None,
                                learning_rate=1e-9, weight_decay=0.0)
    learner = PolicyLearner(*init_train_state(model, learner_cfg), learner_cfg, pad_to_multiple=16)
    config = OrchestratorConfig(method="spo", batch_size=4, max_in_flight=4, drain="finish", pad_to_multiple=64)
    method = Spo(config, 3, np.full(3, 0.5, np.float32), np.full(3, 0.5, np.float32))
    rng = np.random.default_rng(0)

    def batch_of(tasks):
        trajs = []
        for i, task in enumerate(tasks):
            ids = tuple(int(x) for x in rng.integers(1, 64, size=9))
            mask = (False,) * 4 + (True,) * 5
            engine_logp = (0.0,) * 4 + (-3.0,) * 5  # far from the random model's log-probs
            trajs.append(Trajectory(DispatchStamp(i, task, 0, 0.0, 0.5, 0.0), ids, mask, engine_logp, 4,
                                    float(i % 2), 0.0))
        return tuple(trajs)

    from rollout_bridge.methods import LearnerInput

    divergences = []
    for tasks in ([0, 1, 2, 0], [1, 2, 0, 1]):
        trajs = batch_of(tasks)
        batch = pack_train_batch(trajs, np.array([1.0, -1.0, 1.0, -1.0], np.float32), pad_to_multiple=16)
        output = learner(LearnerInput(batch, trajs, method.learner_extras(trajs)))
        method.after_update(trajs, output)
        divergences += [d for d in output.divergence if d is not None]
        learner_logp = np.asarray(output.trained_logp)[np.asarray(batch.action_mask)]
        assert np.abs(learner_logp - (-3.0)).mean() > 0.5  # a real engine-vs-learner gap
    assert len(divergences) == 5  # task 0 repeats in batch 1, all revisit in batch 2
    assert max(divergences) < 1e-4


def test_spo_with_a_fixed_retention_asks_the_learner_for_nothing_extra():
    """ρ_min = ρ_max (the 2x2's receipt-order cells): no y′ is sent, no π_then is needed,
    and the tracker moves in arrival order with ρ = 0.875, by hand:
    task 0 (R = 1, then 1): α = (0.5·0.875 + 1)·0.875 + 1 = 2.2578125, β = 0.5·0.875² = 0.3828125;
    task 1 (R = 0): α = 0.4375, β = 1.4375; task 2 untouched."""
    from rollout_bridge.methods.base import LearnerOutput
    from rollout_bridge.methods.spo import Spo

    config = OrchestratorConfig(method="spo", batch_size=3, max_in_flight=3, spo_rho_min=0.875, spo_rho_max=0.875,
                                drain="finish", pad_to_multiple=64)
    method = Spo(config, 3, np.full(3, 0.5, np.float32), np.full(3, 0.5, np.float32))
    trajs = tuple(Trajectory(DispatchStamp(i, task, 0, 0.0, 0.5, 0.0), (1, 2, 3), (False, True, True), (0.0,) * 3, 1,
                             reward, 0.0) for i, (task, reward) in enumerate([(0, 1.0), (1, 0.0), (0, 1.0)]))
    assert not method.needs_divergence and method.learner_extras(trajs) is None
    method.after_update(trajs, LearnerOutput(None, {}))  # no trained_logp, no divergence
    np.testing.assert_allclose(np.asarray(method.tracker.alpha), [2.2578125, 0.4375, 0.5], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(method.tracker.beta), [0.3828125, 1.4375, 0.5], rtol=1e-6)
    assert method.previous == {}
    restored = Spo(config, 3, np.full(3, 0.5, np.float32), np.full(3, 0.5, np.float32))
    restored.load_state_dict(method.state_dict())  # a checkpoint with no y′ round-trips
    np.testing.assert_array_equal(np.asarray(restored.tracker.alpha), np.asarray(method.tracker.alpha))
    assert restored.previous == {}
    interval = Spo(dataclasses.replace(config, spo_rho_max=0.96), 3, np.full(3, 0.5, np.float32),
                   np.full(3, 0.5, np.float32))
    assert interval.needs_divergence and len(interval.learner_extras(trajs)) == 3
    with pytest.raises(ValueError, match="needs LearnerOutput.trained_logp"):
        interval.after_update(trajs, LearnerOutput(None, {}))


class HostEqualsJax(SpoPlusPlus):
    """SPO++ whose host bookkeeping is checked against the JAX functions at every step: after
    each receipt the NumPy tracker equals ``spopp_jax.tracker.observe`` replayed on the same
    results, and before each dispatch every task's weight (the per-request float path, the
    vector path and the sum-tree leaf) equals ``spopp_jax.sampling.uncertainty_weights`` of
    the JAX baselines times the free slots."""

    receipts = dispatches = 0

    def __init__(self, config, num_tasks, prior_alpha, prior_beta):
        super().__init__(config, num_tasks, prior_alpha, prior_beta)
        self.shadow = tracker.init(prior_alpha, prior_beta, z0=config.z0)

    def receive(self, stamp, traj, spoil):
        receipt = super().receive(stamp, traj, spoil)
        if traj is not None:
            self.shadow = tracker.observe(self.shadow, np.array([traj.task_id]), np.array([traj.z], np.float32),
                                          np.array([traj.reward], np.float32))
            for name in ("alpha", "beta", "z_ref"):
                np.testing.assert_allclose(getattr(self, name), getattr(self.shadow, name), rtol=2e-6)
            HostEqualsJax.receipts += 1
        return receipt

    def plan_dispatch(self, next_key, capacity, in_flight):
        tasks = np.arange(self.num_tasks)
        free = self.per_task_limit - self.in_flight
        v_hat = tracker.baseline(self.shadow, tasks)
        expected = np.asarray(sampling.uncertainty_weights(v_hat, self.config.sampler.floor,
                                                           self.config.sampler.form)) * free
        np.testing.assert_allclose(self._weights(tasks), expected, rtol=2e-6)
        np.testing.assert_allclose([self._weight_of(int(x)) for x in tasks], expected, rtol=2e-6)
        if self.tree is not None:
            np.testing.assert_allclose([self.tree.weight(int(x)) for x in tasks], expected, rtol=2e-6)
        HostEqualsJax.dispatches += 1
        return super().plan_dispatch(next_key, capacity, in_flight)


@pytest.mark.parametrize("sampler, per_task, rule", [("sum_tree", 1, "balanced"), ("sum_tree", 2, "proportional"),
                                                     ("dense", 1, "balanced")])
def test_host_tracker_and_sampler_equal_jax_on_every_receipt_and_dispatch(chat, monkeypatch, sampler, per_task, rule):
    from rollout_bridge.methods.spopp import SpoPlusPlusConfig

    monkeypatch.setattr(SpoPlusPlusConfig, "method_class", HostEqualsJax)
    HostEqualsJax.receipts = HostEqualsJax.dispatches = 0
    world = World(chat, 8, reward_table(5), uneven_latency(5))
    config = OrchestratorConfig(method="spopp", batch_size=4, max_in_flight=6, max_in_flight_per_task=per_task,
                                sibling_rule=rule, sampler=SamplerConfig(impl=sampler), drain="none", pad_to_multiple=8)
    run_orchestrator(world, config, 6, prior=jeffreys(8))
    assert HostEqualsJax.receipts >= 24 and HostEqualsJax.dispatches >= 6
