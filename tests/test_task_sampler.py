"""The incremental host sampler (sum tree) has exactly SPEC 3's law: tested against the
exact successive-sampling probabilities and against the dense Gumbel top-k sampler."""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest
from scipy import stats

from rollout_bridge.methods.single_stream import SingleStreamMethod, sample_dispatch_tasks, uncertainty_weight
from rollout_bridge.orchestrator import OrchestratorConfig, SamplerConfig
from rollout_bridge.sum_tree import SumTree
from rollout_bridge.trajectory import DispatchStamp
from spopp_jax import sampling

DRAWS = 4000
P_MIN = 1e-4  # a correct sampler fails this by chance once in 10^4 runs


def test_sum_tree_totals_and_updates_match_a_plain_sum(np_rng):
    for n in (1, 2, 3, 7, 64, 1000):
        weights = np_rng.random(n)
        tree = SumTree(weights)
        for _ in range(50):
            i = int(np_rng.integers(n))
            weights[i] = float(np_rng.random()) * (np_rng.random() > 0.3)
            tree.update(i, weights[i])
        assert tree.total == pytest.approx(weights.sum(), rel=1e-12, abs=1e-12)
        if weights.sum() > 0:
            drawn = {tree.draw(np_rng) for _ in range(200)}
            assert all(weights[i] > 0 for i in drawn)
    with pytest.raises(ValueError, match="total weight 0"):
        SumTree(np.zeros(3)).draw(np_rng)
    with pytest.raises(ValueError, match="finite and >= 0"):
        SumTree(np.array([1.0, -1.0]))


def test_host_weights_equal_the_spec_weights():
    v = np.linspace(0, 1, 101, dtype=np.float32)
    for form in ("inside_sqrt", "outside_sqrt"):
        np.testing.assert_allclose(uncertainty_weight(v, 0.05, form),
                                   np.asarray(sampling.uncertainty_weights(v, 0.05, form)), rtol=1e-6)


V_HAT = np.array([0.05, 0.5, 0.9, 0.3, 0.99, 0.6], np.float32)
BUSY = np.array([0, 0, 1, 0, 0, 0])  # task 2 in flight: never drawn


def _exact_pair_probabilities(weights):
    """P(first = i, second = j) of successive sampling without replacement ∝ w."""
    total = weights.sum()
    return {(i, j): weights[i] / total * weights[j] / (total - weights[i])
            for i, j in itertools.permutations(np.flatnonzero(weights > 0), 2)}


def _chi_square_p(counts, probabilities):
    keys = sorted(probabilities)
    observed = np.array([counts.get(k, 0) for k in keys], np.float64)
    expected = np.array([probabilities[k] for k in keys]) * observed.sum()
    assert sum(counts.values()) == observed.sum(), "a draw outside the support"
    return stats.chisquare(observed, expected).pvalue


def _tree_method(seed, rule="balanced", m=1):
    config = OrchestratorConfig(batch_size=2, max_in_flight=6, max_in_flight_per_task=m, sibling_rule=rule,
                                seed=seed, drain="finish", pad_to_multiple=64)
    alpha = V_HAT * 8
    method = SingleStreamMethod(config, V_HAT.size, alpha, 8 - alpha)
    for x in np.flatnonzero(BUSY):
        for _ in range(BUSY[x]):
            method._count(int(x), +1)
    return method


def test_sum_tree_sampler_has_the_exact_successive_sampling_law():
    weights = uncertainty_weight(V_HAT, 0.05, "inside_sqrt").astype(np.float64) * (BUSY == 0)
    exact = _exact_pair_probabilities(weights)
    method = _tree_method(seed=0)
    counts = {}
    for _ in range(DRAWS):
        launches = method.plan_dispatch(None, 2, None)
        pair = (launches[0].task_id, launches[1].task_id)
        counts[pair] = counts.get(pair, 0) + 1
        for launch in launches:  # back to the same state: both return with no evidence
            method.receive(DispatchStamp(0, launch.task_id, 0, 0.0, 0.5, 0.0), None, "aborted")
    assert _chi_square_p(counts, exact) > P_MIN


def test_dense_gumbel_sampler_has_the_same_law():
    """The reference: the SPEC-3 Gumbel top-k sampler, same exact probabilities."""
    weights = uncertainty_weight(V_HAT, 0.05, "inside_sqrt").astype(np.float64) * (BUSY == 0)
    exact = _exact_pair_probabilities(weights)
    draw = jax.jit(lambda key: jax.vmap(lambda k: sampling.sample_idle_tasks(k, V_HAT, BUSY > 0, k=2))(
        jax.random.split(key, DRAWS)))
    pairs = np.asarray(draw(jax.random.key(0)))
    counts = {}
    for i, j in pairs.tolist():
        counts[(i, j)] = counts.get((i, j), 0) + 1
    assert _chi_square_p(counts, exact) > P_MIN
    one = sample_dispatch_tasks(jax.random.key(1), V_HAT, BUSY, 1, 2)
    assert set(one.tolist()) <= set(np.flatnonzero(BUSY == 0).tolist())


def test_proportional_siblings_law_with_two_slots_per_task():
    """m = 2, rule proportional: each draw picks x ∝ u(v̂_x)·(m − in_flight_x)."""
    method = _tree_method(seed=1, rule="proportional", m=2)
    u = uncertainty_weight(V_HAT, 0.05, "inside_sqrt").astype(np.float64)
    free = 2 - BUSY
    probabilities = {(x,): u[x] * free[x] / (u * free).sum() for x in range(V_HAT.size)}
    counts = {}
    for _ in range(DRAWS):
        (launch,) = method.plan_dispatch(None, 1, None)
        counts[(launch.task_id,)] = counts.get((launch.task_id,), 0) + 1
        method.receive(DispatchStamp(0, launch.task_id, 0, 0.0, 0.5, 0.0), None, "aborted")
    assert _chi_square_p(counts, probabilities) > P_MIN


def test_zero_weight_tasks_come_after_positive_ones():
    config = OrchestratorConfig(batch_size=2, max_in_flight=3, sampler=SamplerConfig(floor=0.0), seed=0,
                                drain="finish", pad_to_multiple=64)
    method = SingleStreamMethod(config, 3, np.array([1e-30, 4.0, 1e30], np.float32), np.array([4.0, 4.0, 1e-30],
                                                                                              np.float32))
    # v̂ ≈ (0, 0.5, 1): only task 1 has weight; it must come first every time
    launches = method.plan_dispatch(None, 3, None)
    assert launches[0].task_id == 1 and method.free_slots == 0
