"""Non-blocking publish (rollout_bridge/background_publish.py): the learner's next jitted
step donates its state while the previous weights are still being installed.

Install is a test double that blocks on a ``threading.Event``, so "the learner did not
wait" is checked by ordering (the step ran and donated while the install was still
blocked), not by timing.
"""

from __future__ import annotations

import asyncio
import threading

import jax
import numpy as np
import pytest
from flax import nnx

from rollout_bridge.background_publish import (
    BackgroundPublisher,
    PublishError,
    PublisherConfig,
    engine_installer,
    snapshot_params,
    tree_nbytes,
)
from rollout_bridge.engine.base import SamplingParams
from rollout_bridge.engine.jax_engine import JaxEngine
from spopp_jax import learner
from test_sharding import build_case

GATE_TIMEOUT_S = 60.0
BLOCKED_PROBE_S = 0.2  # a submit that must wait is still waiting after this long


def host_copy(tree):
    return jax.tree.map(lambda x: np.array(x, copy=True), jax.device_get(tree))


def assert_trees_equal(a, b):
    jax.tree.map(np.testing.assert_array_equal, a, b)


class GatedInstall:
    """Records (event, host copy of the snapshot); each install waits for ``gate``."""

    def __init__(self):
        self.gate = threading.Event()
        self.installed: list[tuple[int, dict]] = []

    def __call__(self, snapshot, policy_event):
        assert self.gate.wait(GATE_TIMEOUT_S), "gate never opened"
        self.installed.append((policy_event, host_copy(snapshot)))


def run_in_thread(fn, *args):
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", fn(*args)), daemon=True)
    thread.start()
    return thread, result


@pytest.mark.parametrize("kind", ["device", "host"])
def test_snapshot_survives_donation_by_the_next_train_step(kind):
    model_def, state, batch, config = build_case()
    step = learner.make_train_step(model_def, config)
    published = host_copy(state.params)
    install = GatedInstall()
    publisher = BackgroundPublisher(install, PublisherConfig(snapshot=kind))
    try:
        publisher.submit(state.params, policy_event=1)
        donated_leaf = jax.tree.leaves(state.params)[0]
        state, _ = step(state, batch)  # runs while the install is still blocked
        jax.block_until_ready(state)
        assert donated_leaf.is_deleted(), "the step must donate (else this test proves nothing)"
        assert not install.installed
        install.gate.set()
        publisher.wait()
    finally:
        install.gate.set()
        publisher.close()
    assert [event for event, _ in install.installed] == [1]
    assert_trees_equal(install.installed[0][1], published)
    changed = jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(a - b).max(), host_copy(state.params), published))
    assert max(changed) > 0  # the learner moved on; the publish kept the old weights
    assert publisher.times.installs == 1
    assert publisher.times.snapshot_bytes == tree_nbytes(published) > 0


def test_submit_waits_only_for_back_pressure():
    """max_pending = 1: the first submit returns while its install blocks; the second
    waits (learner idle on publish) until the first is installed; order is kept."""
    _, state, _, _ = build_case()
    install = GatedInstall()
    publisher = BackgroundPublisher(install, PublisherConfig(max_pending=1))
    try:
        first, _ = run_in_thread(publisher.submit, state.params, 1)
        first.join(GATE_TIMEOUT_S)
        assert not first.is_alive(), "submit waited for an install with nothing pending"
        second, idle = run_in_thread(publisher.submit, state.params, 2)
        second.join(BLOCKED_PROBE_S)
        assert second.is_alive(), "the second submit must wait for the first install"
        install.gate.set()
        second.join(GATE_TIMEOUT_S)
        assert not second.is_alive()
        publisher.wait()
    finally:
        install.gate.set()
        publisher.close()
    assert [event for event, _ in install.installed] == [1, 2]
    assert idle["value"] >= BLOCKED_PROBE_S
    assert publisher.times.total_idle_s >= idle["value"]


def test_two_pending_publishes_do_not_wait():
    _, state, _, _ = build_case()
    install = GatedInstall()
    publisher = BackgroundPublisher(install, PublisherConfig(max_pending=2))
    try:
        submits, _ = run_in_thread(lambda: [publisher.submit(state.params, e) for e in (1, 2)])
        submits.join(GATE_TIMEOUT_S)
        assert not submits.is_alive(), "two submits must fit in max_pending=2"
        install.gate.set()
        publisher.wait()
    finally:
        install.gate.set()
        publisher.close()
    assert [event for event, _ in install.installed] == [1, 2]


def test_failed_install_is_raised_by_the_next_call():
    _, state, _, _ = build_case()

    def failing_install(snapshot, policy_event):
        raise OSError("disk full")

    publisher = BackgroundPublisher(failing_install)
    publisher.submit(state.params, policy_event=4)
    with pytest.raises(PublishError, match="policy event 4.*disk full"):
        publisher.wait()
    with pytest.raises(PublishError, match="disk full"):
        publisher.submit(state.params, policy_event=5)
    with pytest.raises(PublishError):
        publisher.close()


def test_config_and_snapshot_kind_are_checked():
    with pytest.raises(ValueError, match="PublisherConfig.snapshot"):
        PublisherConfig(snapshot="disk")
    with pytest.raises(ValueError, match="PublisherConfig.max_pending"):
        PublisherConfig(max_pending=0)
    with pytest.raises(ValueError, match="snapshot kind"):
        snapshot_params({}, "disk")


def test_engine_installer_publishes_inflight_into_the_jax_engine():
    """The learner thread submits pure-dict params; the engine (on the event loop) gets
    them through ``publish_inflight`` and later requests carry the new event."""
    from test_jax_engine import replay, tiny_model, LOGP_ATOL

    model_a, model_b = tiny_model(0), tiny_model(1)
    params_b = nnx.to_pure_dict(nnx.state(model_b))

    async def body():
        engine = JaxEngine(model_a, num_slots=2, max_len=64, steps_per_call=2)
        publisher = BackgroundPublisher(engine_installer(engine, asyncio.get_running_loop()))
        try:
            await asyncio.to_thread(publisher.submit, params_b, 1)
            await asyncio.to_thread(publisher.wait)
            result = await engine.generate([3, 17, 5], SamplingParams(max_new_tokens=5), seed=2)
            return result, engine.publish_stats
        finally:
            await asyncio.to_thread(publisher.close)
            await engine.close()

    result, publish_stats = asyncio.run(body())
    assert publish_stats.inflight_publishes == 1
    assert result.events_per_token() == (1,) * 5
    _, expected, _ = replay(model_b, [3, 17, 5], result.token_ids)
    np.testing.assert_allclose(result.logprobs, expected, atol=LOGP_ATOL)


@pytest.mark.parametrize("snapshot_weights", [False, True])
def test_policy_learner_snapshot_weights_survive_the_next_donating_step(snapshot_weights):
    """Drain "none" starts update t+1 while the engine still copies update t's weights:
    only the snapshot keeps them alive through the donating step."""
    from rollout_bridge.methods import LearnerInput
    from rollout_bridge.policy_learner import PolicyLearner

    model_def, state, batch, config = build_case()
    policy_learner = PolicyLearner(model_def, state, config, snapshot_weights=snapshot_weights)
    published = host_copy(state.params)
    weights = policy_learner.weights()
    policy_learner(LearnerInput(batch, (), None))  # donates the live parameters
    jax.block_until_ready(policy_learner.state)
    leaves = jax.tree.leaves(nnx.state(weights))
    if not snapshot_weights:
        assert any(leaf.is_deleted() for leaf in leaves)  # the hazard the snapshot removes
        return
    assert not any(leaf.is_deleted() for leaf in leaves)
    for kept, before in zip(leaves, jax.tree.leaves(published), strict=True):
        np.testing.assert_array_equal(np.asarray(kept), before)  # update t's weights, not t+1's
