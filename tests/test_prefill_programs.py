"""Tests of the engine's prefill programs by shape (``rollout_bridge.engine.prefill_programs``):
which program a call gets while new shapes compile in the background, and that a prefill
padded to a larger compiled shape samples what the exact shape samples (the engine's
tokens, with and without background compiles, on the same seeded requests)."""

from __future__ import annotations

import asyncio
import threading

import jax
import numpy as np
import pytest
from flax import nnx

from rollout_bridge.engine import jax_engine
from rollout_bridge.engine.base import SamplingParams
from rollout_bridge.engine.prefill_programs import PrefillPrograms, covers, work
from spopp_jax.models import ModelConfig, init_model


class Jobs:
    """A background compiler whose jobs run only when the test says so."""

    def __init__(self):
        self.queued = []

    def submit(self, job):
        self.queued.append(job)

    def run_all(self):
        while self.queued:
            self.queued.pop(0)()


def programs(jobs=None, max_work_ratio=8.0, fail=()):
    compiled = []

    def compile_shape(shape):
        if shape in fail:
            raise RuntimeError(f"cannot compile {shape}")
        compiled.append(shape)
        return lambda: shape  # a "program" that says which shape it was compiled for

    submit = None if jobs is None else jobs.submit
    return PrefillPrograms(compile_shape, submit, max_work_ratio), compiled


def test_work_and_covers():
    assert work((2, 16, 64)) == 2 * 16 * 64
    assert covers((4, 32, 256), (4, 16, 256)) and not covers((4, 32, 256), (8, 16, 256))


def test_without_a_background_compiler_a_new_shape_compiles_on_the_caller_once():
    table, compiled = programs(jobs=None)
    assert table.program((1, 16, 256))[0] == (1, 16, 256)
    assert table.program((1, 16, 256))[1]() == (1, 16, 256)
    assert compiled == [(1, 16, 256)]
    assert (table.stats.compiled_inline, table.stats.exact, table.stats.padded) == (1, 1, 0)


def test_a_new_shape_with_no_compiled_cover_compiles_on_the_caller_and_its_queued_job_does_nothing():
    jobs = Jobs()
    table, compiled = programs(jobs)
    shape, program = table.program((2, 32, 256))
    assert shape == (2, 32, 256) and program() == (2, 32, 256)
    jobs.run_all()  # the job the call queued was cancelled: no second compile
    assert compiled == [(2, 32, 256)] and table.stats.compiled_background == 0


def test_a_new_shape_runs_on_the_cheapest_cover_until_its_own_program_is_compiled():
    jobs = Jobs()
    table, compiled = programs(jobs)
    for shape in [(2, 64, 256), (4, 64, 512), (16, 64, 256)]:
        table.program(shape)  # compiled on the caller: nothing covers them yet
    jobs.run_all()  # their cancelled jobs: nothing to do
    assert compiled == [(2, 64, 256), (4, 64, 512), (16, 64, 256)]
    shape, program = table.program((2, 32, 256))
    assert shape == (2, 64, 256) and program() == (2, 64, 256)  # least work among the covers
    assert table.program((2, 32, 256))[0] == (2, 64, 256)  # queued once, still padded
    assert len(jobs.queued) == 1
    jobs.run_all()
    assert table.program((2, 32, 256))[0] == (2, 32, 256)
    assert compiled[-1] == (2, 32, 256) and table.stats.compiled_background == 1
    assert table.stats.padded == 2


def test_a_cover_of_more_than_the_work_ratio_is_not_used():
    jobs = Jobs()
    table, compiled = programs(jobs, max_work_ratio=4.0)
    table.program((16, 64, 256))
    shape, _ = table.program((1, 16, 256))  # 64x the work: compiled on the caller instead
    assert shape == (1, 16, 256) and compiled == [(16, 64, 256), (1, 16, 256)]
    assert table.program((4, 64, 256))[0] == (16, 64, 256)  # 4x: padded


def test_a_failed_background_compile_is_compiled_again_on_the_caller_which_raises():
    jobs = Jobs()
    table, compiled = programs(jobs, fail={(2, 32, 256)})
    table.program((4, 32, 256))
    assert table.program((2, 32, 256))[0] == (4, 32, 256)  # padded while it compiles...
    jobs.run_all()  # ... and its compile fails
    with pytest.raises(RuntimeError, match="cannot compile"):
        table.program((2, 32, 256))
    assert not jobs.queued  # not queued again


@pytest.mark.parametrize("fails", [False, True])
def test_a_caller_with_no_cover_waits_for_the_compile_of_its_shape_already_running(fails):
    entered, release = threading.Event(), threading.Event()

    def compile_shape(shape):
        entered.set()
        assert release.wait(30)
        if fails:
            raise RuntimeError("cannot compile")
        return lambda: shape

    def submit(job):  # the compile thread picks the job up before the caller looks again
        threading.Thread(target=job, daemon=True).start()
        assert entered.wait(30)
        threading.Timer(0.05, release.set).start()

    table = PrefillPrograms(compile_shape, submit)
    if fails:
        with pytest.raises(RuntimeError, match="cannot compile"):
            table.program((1, 16, 256))
    else:
        assert table.program((1, 16, 256))[1]() == (1, 16, 256)
        assert (table.stats.waited, table.stats.compiled_background, table.stats.compiled_inline) == (1, 1, 0)


def test_max_work_ratio_below_one_is_refused():
    with pytest.raises(ValueError, match="max_work_ratio"):
        PrefillPrograms(lambda shape: None, None, max_work_ratio=0.5)


# ------------------------------------------------------------------ the engine, padded prefills
VOCAB = 48


def one_layer_model():
    """A structure no other test uses, so its prefill programs are this test's alone."""
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = init_model(config, seed=3)
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: x * 6.0 if x.ndim == 2 else x, state))
    return model


def test_a_prefill_padded_to_a_larger_compiled_shape_samples_the_same_tokens(monkeypatch):
    """A 40-token prompt compiles (1, 48, 64); the later, shorter prompts' own shapes then
    never compile (their background jobs are held), so they prefill padded to it. Their
    tokens equal those of an engine that compiles every shape, and log-probs agree to
    float32 rounding."""
    held = Jobs()
    monkeypatch.setattr(jax_engine, "background_compiler", lambda: held)
    model = one_layer_model()
    prompts = [[(7 * i + j) % VOCAB for j in range(n)] for i, n in enumerate([40, 3, 9, 17, 5, 30, 2])]
    params = SamplingParams(temperature=1.0, max_new_tokens=6)

    async def play(background):
        engine = jax_engine.JaxEngine(model, num_slots=4, max_len=64, steps_per_call=4,
                                      background_compile=background)
        try:
            results = [await engine.generate(p, params, seed=11 + i) for i, p in enumerate(prompts)]
            return results, engine.prefill_compile_stats
        finally:
            await engine.close()

    padded, padded_stats = asyncio.run(play(True))
    exact, exact_stats = asyncio.run(play(False))
    assert padded_stats.padded == len(prompts) - 1 and exact_stats.padded == 0
    assert held.queued  # the shorter shapes' compiles were asked for, never run
    for a, b in zip(padded, exact):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-5)


def test_a_publish_of_the_same_layout_keeps_the_compiled_prefill_programs():
    """Publishing weights of the same shapes, dtypes and shardings must not start a new set
    of programs (every prefill shape would be traced and compiled again after each update)."""
    model, other = one_layer_model(), one_layer_model()
    params = SamplingParams(max_new_tokens=4)

    async def body():
        engine = jax_engine.JaxEngine(model, num_slots=4, max_len=64, steps_per_call=4)
        try:
            before = engine._prefill
            await engine.generate([1, 2, 3], params, seed=1)
            await engine.publish_inflight(nnx.state(other), 1)
            await engine.generate([1, 2, 3], params, seed=1)
            return before, engine._prefill
        finally:
            await engine.close()

    before, after = asyncio.run(body())
    assert after is before and after.stats.exact >= 1
