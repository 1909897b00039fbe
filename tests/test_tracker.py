"""Tests for spopp_jax.tracker (SPEC 2): event-time tracker and SPO receipt-order tracker."""

import math

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spopp_jax import tracker

RHO = 0.875
STEP = -math.log(RHO)


def _spec_baseline(prior, history, k_q):
    """SPEC 2 formula in float64 at dispatch event k_q over the visible history.

    prior = (α0, β0) at z_0 = 0; history = [(k_i, R_i)]; weight e^{−(z_q − z_i)} = ρ^{k_q−k_i}.
    To avoid overflow/underflow for large k, every weight is taken relative to the newest
    coordinate present, which cancels in the ratio (and is rescaled back for the mass).
    """
    ks = [0] + [k for k, _ in history]
    k_top = max(ks)
    a = RHO ** (k_top - 0) * prior[0]
    b = RHO ** (k_top - 0) * prior[1]
    for k, r in history:
        a += RHO ** (k_top - k) * r
        b += RHO ** (k_top - k) * (1 - r)
    return a / (a + b), (a + b) * RHO ** (k_q - k_top)


def test_policy_coordinate_hand_values(maybe_jit):
    z = maybe_jit(tracker.policy_coordinate)(jnp.array([0, 1, 7]))
    np.testing.assert_allclose(z, [0.0, STEP, 7 * STEP], rtol=1e-6)
    np.testing.assert_allclose(tracker.policy_coordinate(3, rho=0.5, z0=1.0), 1 + 3 * math.log(2), rtol=1e-6)
    # evidence k events older weighs rho^k
    z = tracker.policy_coordinate(jnp.array([10, 13]))
    np.testing.assert_allclose(jnp.exp(-(z[1] - z[0])), RHO**3, rtol=1e-5)


def test_init_and_prior_baseline():
    state = tracker.init(jnp.array([1.0, 3.0]), jnp.array([1.0, 1.0]))
    np.testing.assert_allclose(tracker.baseline(state, jnp.array([0, 1])), [0.5, 0.75])
    leaves = jax.tree.leaves(state)
    assert len(leaves) == 3 and all(isinstance(x, jax.Array) for x in leaves)


def test_hand_derived_baseline_and_mass(maybe_jit):
    """Task 0: prior (1, 1); R=1 at k=2, R=0 at k=5.  Task 1: prior (3, 1); R=1 at k=1.

    At a dispatch with k_q = 6 (z0 = 0):
      task 0: α = ρ^6·1 + ρ^4·1,  β = ρ^6·1 + ρ^1·1
      task 1: α = ρ^6·3 + ρ^5·1,  β = ρ^6·1
    """
    r = RHO
    a0, b0 = r**6 + r**4, r**6 + r
    a1, b1 = 3 * r**6 + r**5, r**6
    state = tracker.init(jnp.array([1.0, 3.0]), jnp.array([1.0, 1.0]))
    z = tracker.policy_coordinate(jnp.array([2, 5, 1]))
    observe = maybe_jit(tracker.observe)
    state = observe(state, jnp.array([0, 0, 1]), z, jnp.array([1, 0, 1]))
    v = maybe_jit(tracker.baseline)(state, jnp.array([0, 1, 0]))
    np.testing.assert_allclose(v, [a0 / (a0 + b0), a1 / (a1 + b1), a0 / (a0 + b0)], rtol=1e-6)
    z_q = tracker.policy_coordinate(6)
    np.testing.assert_allclose(
        tracker.total_mass(state, jnp.array([0, 1]), z_q), [a0 + b0, a1 + b1], rtol=1e-5
    )
    alpha, beta = tracker.alpha_beta(state, jnp.array([0, 1]), z_q)
    np.testing.assert_allclose(alpha, [a0, a1], rtol=1e-5)
    np.testing.assert_allclose(beta, [b0, b1], rtol=1e-5)
    # at its own reference (task 0: k=5, task 1: k=1) the mass is rescaled by rho^-(6-k)
    np.testing.assert_allclose(
        tracker.total_mass(state, jnp.array([0, 1])), [(a0 + b0) / r, (a1 + b1) / r**5], rtol=1e-5
    )


def test_split_observe_equals_one_call():
    state = tracker.init(jnp.full(3, 0.5), jnp.full(3, 0.5))
    ids = jnp.array([2, 0, 2, 1, 2])
    z = tracker.policy_coordinate(jnp.array([4, 1, 9, 3, 2]))
    rew = jnp.array([1, 0, 0, 1, 1])
    once = tracker.observe(state, ids, z, rew)
    split = state
    for i in range(5):
        split = tracker.observe(split, ids[i : i + 1], z[i : i + 1], rew[i : i + 1])
    np.testing.assert_allclose(tracker.baseline(once, jnp.arange(3)), tracker.baseline(split, jnp.arange(3)), rtol=1e-6)
    np.testing.assert_allclose(once.z_ref, split.z_ref)


_result = st.tuples(st.integers(0, 3), st.integers(0, 60), st.integers(0, 1))
# a few fixed sizes keep the number of distinct shapes (XLA compilations) small
_results = st.sampled_from([1, 6, 24]).flatmap(lambda n: st.lists(_result, min_size=n, max_size=n))
_observe_jit = jax.jit(tracker.observe)
_baseline_jit = jax.jit(tracker.baseline)


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(results=_results, perm_seed=st.integers(0, 2**31 - 1), halves=st.booleans())
def test_receipt_order_invariance(results, perm_seed, halves):
    """Same set of results received in any order / batching gives the same baseline."""
    prior_a = jnp.array([1.0, 2.0, 0.5, 4.0])
    prior_b = jnp.array([1.0, 0.5, 0.5, 4.0])
    ids = np.array([t for t, _, _ in results])
    ks = np.array([k for _, k, _ in results])
    rew = np.array([r for _, _, r in results])
    perm = np.random.default_rng(perm_seed).permutation(len(results))

    def run(parts):
        s = tracker.init(prior_a, prior_b)
        for part in parts:
            s = _observe_jit(s, ids[part], tracker.policy_coordinate(ks[part]), rew[part])
        return s

    s1 = run([np.arange(len(results))])
    # permuted: in two halves, or one result per call
    s2 = run(np.array_split(perm, 2) if halves and len(perm) > 1 else [perm[i : i + 1] for i in range(len(perm))])
    np.testing.assert_allclose(tracker.baseline(s1, jnp.arange(4)), tracker.baseline(s2, jnp.arange(4)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(tracker.total_mass(s1, jnp.arange(4), 70.0), tracker.total_mass(s2, jnp.arange(4), 70.0), rtol=1e-4)
    for x in range(4):
        hist = [(k, r) for t, k, r in results if t == x]
        expected, _ = _spec_baseline((float(prior_a[x]), float(prior_b[x])), hist, 61)
        np.testing.assert_allclose(tracker.baseline(s2, jnp.array([x]))[0], expected, rtol=1e-5)


@hypothesis.settings(max_examples=15, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**31 - 1))
def test_late_results_only_affect_later_dispatches(seed):
    """Simulate dispatch/complete with one in-flight request per task and random latency.

    Each dispatch freezes v̂ from the tracker; it must equal the SPEC formula over exactly
    the results received before that dispatch (H_q), even though older-policy results keep
    arriving later; a result received after a dispatch never changes that frozen value.
    """
    rng = np.random.default_rng(seed)
    n_tasks, n_steps = 3, 40
    prior = (jnp.full(n_tasks, 1.5), jnp.full(n_tasks, 0.5))
    state = tracker.init(*prior)
    received = {x: [] for x in range(n_tasks)}
    in_flight = {}  # task -> (k at dispatch, finish step, frozen v)
    frozen_log = []
    for step in range(n_steps):
        k_now = step // 2  # a policy event every two steps
        for x in range(n_tasks):
            if x not in in_flight and rng.random() < 0.7:
                v = float(_baseline_jit(state, jnp.array([x]))[0])
                expected, _ = _spec_baseline((1.5, 0.5), received[x], k_now)
                np.testing.assert_allclose(v, expected, rtol=1e-5)
                in_flight[x] = (k_now, step + int(rng.integers(0, 8)), v)
                frozen_log.append((x, len(received[x]), v))
        done = [x for x, (_, fin, _) in in_flight.items() if fin <= step]
        rng.shuffle(done)
        for x in done:
            k_gen, _, _ = in_flight.pop(x)
            r = int(rng.integers(0, 2))
            z_gen = tracker.policy_coordinate(jnp.array([k_gen]))
            state = _observe_jit(state, jnp.array([x]), z_gen, jnp.array([r]))
            received[x].append((k_gen, r))
    # every frozen value is still the formula over the history visible at its dispatch
    for x, n_seen, v in frozen_log:
        expected, _ = _spec_baseline((1.5, 0.5), received[x][:n_seen], 0)
        np.testing.assert_allclose(v, expected, rtol=1e-5)


def _reference_tracker_f64(n_tasks, prior_a, prior_b, ids, ks, rew, query_at):
    """Direct float64 SPEC-2 sums: weight of result i at the task's newest k is ρ^(k_top−k_i)."""
    out = {}
    for q in query_at:
        a = np.zeros(n_tasks)
        b = np.zeros(n_tasks)
        top = np.zeros(n_tasks)
        np.maximum.at(top, ids[:q], ks[:q].astype(np.float64))
        a += prior_a * np.exp(-top * STEP)
        b += prior_b * np.exp(-top * STEP)
        w = np.exp(-(top[ids[:q]] - ks[:q]) * STEP)
        np.add.at(a, ids[:q], w * rew[:q])
        np.add.at(b, ids[:q], w * (1 - rew[:q]))
        out[q] = a / (a + b)
    return out


def test_float32_survives_1e5_policy_events_and_matches_float64_reference():
    rng = np.random.default_rng(7)
    n_tasks, n_results, batch = 64, 100_000, 500
    # result i is generated by policy event ~i (so events reach 1e5), up to 30 events late
    ks = np.maximum(np.arange(n_results) - rng.integers(0, 30, n_results), 0)
    ids = rng.integers(0, n_tasks, n_results)
    p_true = rng.uniform(0.05, 0.95, n_tasks)
    rew = (rng.random(n_results) < p_true[ids]).astype(np.int32)
    prior_a = rng.uniform(0.5, 7.5, n_tasks)
    prior_b = 8.0 - prior_a

    state = tracker.init(jnp.asarray(prior_a, jnp.float32), jnp.asarray(prior_b, jnp.float32))
    observe = jax.jit(tracker.observe)
    z_all = tracker.policy_coordinate(jnp.asarray(ks, jnp.int32))
    assert z_all.dtype == jnp.float32 and float(z_all[-1]) > 1.3e4
    query_at = [batch * 10, n_results // 2, n_results]
    got = {}
    for start in range(0, n_results, batch):
        sl = slice(start, start + batch)
        state = observe(state, jnp.asarray(ids[sl]), z_all[sl], jnp.asarray(rew[sl]))
        if start + batch in query_at:
            got[start + batch] = np.asarray(tracker.baseline(state, jnp.arange(n_tasks)))
    ref = _reference_tracker_f64(n_tasks, prior_a, prior_b, ids, ks, rew, query_at)
    for q in query_at:
        assert np.all(np.isfinite(got[q]))
        np.testing.assert_allclose(got[q], ref[q], atol=5e-4)  # measured ~1e-4
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state))
    mass = np.asarray(tracker.total_mass(state, jnp.arange(n_tasks)))
    assert np.all((mass > 0.999) & (mass <= 8.5))  # newest result weighs 1; total < 1/(1-ρ)+1


def test_spo_retention_hand_values(maybe_jit):
    kl = jnp.array([0.0, 0.006, 0.03, 0.06, 1.0])
    # 2^0 = 1 -> 0.96; 2^-0.1 = 0.93303; 2^-0.5 = 0.70711 -> 0.875; 2^-1 -> 0.875
    expected = [0.96, 2**-0.1, 0.875, 0.875, 0.875]
    np.testing.assert_allclose(maybe_jit(tracker.spo_retention)(kl), expected, rtol=1e-6)
    np.testing.assert_allclose(tracker.spo_retention(0.012, d_half=0.12, rho_min=0.5, rho_max=0.99), 2**-0.1, rtol=1e-6)


def test_spo_observe_sequential_hand_values(maybe_jit):
    state = tracker.init(jnp.array([2.0, 1.0]), jnp.array([2.0, 1.0]))
    ids = jnp.array([0, 1, 0])
    rew = jnp.array([1, 0, 0])
    rho = jnp.array([0.9, 0.8, 0.5])
    new = maybe_jit(tracker.spo_observe)(state, ids, rew, rho)
    # task 0: α = 0.5·(0.9·2 + 1) + 0 = 1.4;  β = 0.5·(0.9·2 + 0) + 1 = 1.9
    # task 1: α = 0.8·1 = 0.8;  β = 0.8·1 + 1 = 1.8
    np.testing.assert_allclose(new.alpha, [1.4, 0.8], rtol=1e-6)
    np.testing.assert_allclose(new.beta, [1.9, 1.8], rtol=1e-6)
    np.testing.assert_allclose(tracker.baseline(new, jnp.array([0])), [1.4 / 3.3], rtol=1e-6)
    np.testing.assert_array_equal(new.z_ref, state.z_ref)
    # receipt order matters by design: swapping the two task-0 results changes the state
    swapped = tracker.spo_observe(state, jnp.array([0, 1, 0]), jnp.array([0, 0, 1]), jnp.array([0.5, 0.8, 0.9]))
    assert not np.allclose(swapped.alpha, new.alpha)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda s: tracker.observe(s, jnp.array([0, 5]), 0.0, jnp.array([1, 0])), "`task_ids`"),
        (lambda s: tracker.observe(s, jnp.array([0, -1]), 0.0, jnp.array([1, 0])), "`task_ids`"),
        (lambda s: tracker.observe(s, jnp.array([0, 1]), 0.0, jnp.array([1.0, 0.5])), "`rewards`"),
        (lambda s: tracker.observe(s, jnp.array([0, 1]), 0.0, jnp.array([1.0, jnp.nan])), "`rewards`"),
        (lambda s: tracker.observe(s, jnp.array([0, 1]), 0.0, jnp.array([1, 0, 1])), "`rewards` has shape"),
        (lambda s: tracker.observe(s, jnp.array([0.0, 1.0]), 0.0, jnp.array([1, 0])), "`task_ids` must be an integer"),
        (lambda s: tracker.observe(s, jnp.array([0, 1]), jnp.array([0.0, jnp.inf]), jnp.array([1, 0])), "`policy_z`"),
        (lambda s: tracker.baseline(s, jnp.array([3])), "`task_ids`"),
        (lambda s: tracker.spo_observe(s, jnp.array([0]), jnp.array([1]), 1.0), "`rho`"),
        (lambda s: tracker.spo_observe(s, jnp.array([0]), jnp.array([1]), 0.0), "`rho`"),
        (lambda s: tracker.policy_coordinate(1, rho=1.5), "`rho`"),
        (lambda s: tracker.policy_coordinate(-1), "`event_index`"),
        (lambda s: tracker.spo_retention(-0.1), "`kl`"),
        (lambda s: tracker.init(jnp.array([1.0, 0.0]), jnp.array([1.0, 1.0])), "`prior_alpha`"),
        (lambda s: tracker.init(jnp.array([1.0, 1.0]), jnp.array([1.0])), "`prior_beta` has shape"),
    ],
)
def test_bad_input_raises_naming_argument(call, match):
    state = tracker.init(jnp.ones(3), jnp.ones(3))
    with pytest.raises(ValueError, match=match):
        call(state)


def test_value_checks_skipped_under_jit_shape_checks_not():
    state = tracker.init(jnp.ones(3), jnp.ones(3))
    # ids out of range: dropped by segment ops under jit, no crash, state finite
    out = jax.jit(tracker.observe)(state, jnp.array([0, 7]), 0.5, jnp.array([1, 1]))
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(out))
    with pytest.raises(ValueError, match="`rewards` has shape"):
        jax.jit(tracker.observe)(state, jnp.array([0, 1]), 0.5, jnp.array([1]))


def test_state_is_a_plain_pytree_that_survives_orbax(tmp_path):
    import orbax.checkpoint as ocp

    state = tracker.observe(
        tracker.init(jnp.array([1.0, 2.0]), jnp.array([3.0, 0.5])),
        jnp.array([1, 1]), tracker.policy_coordinate(jnp.array([4, 2])), jnp.array([1, 0]),
    )
    leaves, treedef = jax.tree.flatten(state)
    assert len(leaves) == 3 and isinstance(jax.tree.unflatten(treedef, leaves), tracker.TrackerState)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "tracker", state)
        ckptr.wait_until_finished()
        restored = ckptr.restore(tmp_path / "tracker", state)
    assert isinstance(restored, tracker.TrackerState)
    for a, b in zip(jax.tree.leaves(restored), leaves):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(tracker.baseline(restored, jnp.arange(2)), tracker.baseline(state, jnp.arange(2)))
