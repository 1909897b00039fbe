"""Tests of the programs kept on disk (``rollout_bridge.program_store``): a new store
loads what an earlier one exported without tracing it, keys change with what the program
is made from, an unreadable file is exported again, a structure shown by address has no
store, a new engine compiles its prefill programs without tracing the model and samples
what the engine that stored them, and one without the store, sampled, and a new learner
steps with the stored program, on one device and on a mesh, as the first one did."""

from __future__ import annotations

import asyncio
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rollout_bridge import program_store
from rollout_bridge.engine import jax_engine, slot_decode
from rollout_bridge.engine.base import SamplingParams
from rollout_bridge.program_store import ProgramStore, store_for, structure_key
from spopp_jax.models import ModelConfig, init_model


def scaled_sum(x, y):
    return jnp.sum(x * y) + 1.0


class Exports:
    """export_program for ``scaled_sum`` at the shape of ``x``, counting its calls."""

    def __init__(self, x):
        self.x, self.count = x, 0

    def __call__(self):
        self.count += 1
        return jax.export.export(jax.jit(scaled_sum))(self.x, 2.0)


def test_a_new_store_loads_what_an_earlier_one_exported_without_tracing(tmp_path):
    x = jnp.arange(6.0)
    exports = Exports(x)
    first = ProgramStore(tmp_path, "context")
    exported = first.exported(("scaled_sum", 6), exports)
    second = ProgramStore(tmp_path, "context")
    loaded = second.exported(("scaled_sum", 6), exports)
    assert exports.count == 1 and (first.saved, first.loaded) == (1, 0) and (second.saved, second.loaded) == (0, 1)
    assert float(jax.jit(loaded.call)(x, 3.0)) == float(exported.call(x, 3.0)) == float(scaled_sum(x, 3.0))
    assert [p.suffix for p in tmp_path.iterdir()] == [program_store.SUFFIX]  # no temporary left


def test_keys_differ_by_the_call_parts_the_context_and_the_source(tmp_path, monkeypatch):
    store = ProgramStore(tmp_path, "context")
    paths = {store.path(("f", 6)), store.path(("f", 7)), ProgramStore(tmp_path, "other").path(("f", 6))}
    monkeypatch.setattr(program_store, "source_fingerprint", lambda: "an edited checkout")
    paths.add(ProgramStore(tmp_path, "context").path(("f", 6)))
    assert len(paths) == 4


def test_an_unreadable_file_is_exported_again_and_rewritten(tmp_path):
    x = jnp.arange(3.0)
    exports = Exports(x)
    store = ProgramStore(tmp_path, "context")
    store.path(("g", 3)).write_bytes(b"half a file")
    program = store.exported(("g", 3), exports)
    assert exports.count == 1 and float(program.call(x, 1.0)) == float(scaled_sum(x, 1.0))
    again = ProgramStore(tmp_path, "context")
    again.exported(("g", 3), exports)
    assert exports.count == 1 and again.loaded == 1


def test_a_store_that_cannot_write_still_returns_the_program(tmp_path):
    """A folder that cannot be made (a file in its place): the program is exported, used and
    not kept; nothing else in the way is touched."""
    blocker = tmp_path / "prefill_programs"
    blocker.write_text("not a folder")
    x = jnp.arange(4.0)
    exports = Exports(x)
    store = ProgramStore(blocker, "context")
    program = store.exported(("h", 4), exports)
    assert float(program.call(x, 1.0)) == float(scaled_sum(x, 1.0))
    assert (exports.count, store.saved) == (1, 0) and blocker.read_text() == "not a folder"


def test_a_structure_shown_by_address_has_no_key():
    assert structure_key(("layer", object())) is None
    assert structure_key(("layer", 3, "silu")) == "('layer', 3, 'silu')"


def test_no_store_without_a_local_persistent_cache_folder(tmp_path):
    structure = ("layer", 3)
    assert jax.config.jax_compilation_cache_dir is None  # pytest's own process (conftest)
    assert store_for(structure) is None
    with compilation_cache_dir("gs://bucket/cache"):
        assert store_for(structure) is None
    with compilation_cache_dir(str(tmp_path)):
        assert store_for(structure).folder == tmp_path / "prefill_programs"
        jax.config.update("jax_enable_compilation_cache", False)
        try:
            assert store_for(structure) is None
        finally:
            jax.config.update("jax_enable_compilation_cache", True)


class compilation_cache_dir:
    """jax_compilation_cache_dir set for a block (this process's persistent cache stays as it was)."""

    def __init__(self, folder):
        self.folder = folder

    def __enter__(self):
        self.before = jax.config.jax_compilation_cache_dir
        jax.config.update("jax_compilation_cache_dir", self.folder)

    def __exit__(self, *exc):
        jax.config.update("jax_compilation_cache_dir", self.before)


# ------------------------------------------------------------------ the engine's prefill programs
VOCAB = 40


def two_layer_model():
    """A structure no other test uses."""
    config = ModelConfig(vocab_size=VOCAB, hidden_size=24, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=3, num_key_value_heads=1, head_dim=8)
    return init_model(config, seed=5)


def test_the_model_structure_has_a_key():
    graphdef, params = nnx.split(two_layer_model())
    assert structure_key((graphdef, jax.tree.structure(params))) is not None


def test_a_new_engine_loads_the_prefill_programs_without_tracing_and_samples_the_same(tmp_path, monkeypatch):
    """An engine in a process with no compiled programs (fresh jitted transitions) finds the
    prefill programs another engine stored: it traces none of them, and its tokens and
    log-probs equal the first engine's on the same seeded requests, as do those of an
    engine without the store (log-probs to float32 rounding)."""
    traces = []
    admit = slot_decode.admit
    monkeypatch.setattr(slot_decode, "admit", lambda *a, **k: traces.append(1) or admit(*a, **k))
    model = two_layer_model()
    prompts = [[(5 * i + j) % VOCAB for j in range(n)] for i, n in enumerate([30, 4, 11, 19])]
    params = SamplingParams(temperature=1.0, max_new_tokens=5)

    async def play(store=True):
        engine = jax_engine.JaxEngine(model, num_slots=2, max_len=64, steps_per_call=4, program_store=store)
        try:
            return [await engine.generate(p, params, seed=7 + i) for i, p in enumerate(prompts)]
        finally:
            await engine.close()

    def in_a_new_process():
        """The jitted transitions (and their programs) start empty, as in a new process."""
        monkeypatch.setattr(jax_engine, "_transitions_for",
                            functools.lru_cache(maxsize=16)(jax_engine._transitions_for.__wrapped__))
        traces.clear()
        return play

    with compilation_cache_dir(str(tmp_path)):
        first = asyncio.run(in_a_new_process()())
        traced_shapes = len(traces)
        second = asyncio.run(in_a_new_process()())
        second_traces = len(traces)
        without_store = asyncio.run(in_a_new_process()(store=False))
    stored = list((tmp_path / "prefill_programs").glob(f"*{program_store.SUFFIX}"))
    assert traced_shapes >= 2 and len(stored) == traced_shapes
    assert second_traces == 0
    for a, b, c in zip(first, second, without_store, strict=True):
        assert a.token_ids == b.token_ids == c.token_ids
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
        np.testing.assert_allclose(a.logprobs, c.logprobs, atol=1e-6)



def test_the_structure_key_holds_the_source_of_its_classes(tmp_path, monkeypatch):
    """A model class of the user's own, outside the project's packages: an edit of its file
    (the same structure text) gives a new key."""
    import importlib
    import sys

    source = ("from flax import nnx\n"
              "class Scaled(nnx.Module):\n"
              "    def __init__(self):\n"
              "        self.w = nnx.Param(1.0)\n"
              "    def __call__(self, x):\n"
              "        return x * self.w{}\n")
    module_file = tmp_path / "user_model.py"
    monkeypatch.syspath_prepend(str(tmp_path))
    keys, texts = [], []
    for edit in ("", " + 1.0"):
        module_file.write_text(source.format(edit))
        sys.modules.pop("user_model", None)
        graphdef, _ = nnx.split(importlib.import_module("user_model").Scaled())
        keys.append(structure_key(graphdef))
        texts.append(repr(graphdef))
    sys.modules.pop("user_model", None)
    assert texts[0] == texts[1]  # the structure's text alone is the same
    assert None not in keys and keys[0] != keys[1]


# ------------------------------------------------------------------ the learner's programs
def learner_updates(store: bool, mesh=None, updates: int = 2):
    """A fresh PolicyLearner (its own jitted step, as in a new process) on the sharding
    tests' case (a tiny model, 8 rows of unequal action counts): the losses of ``updates``
    updates and the final parameters."""
    from rollout_bridge.methods import LearnerInput
    from rollout_bridge.policy_learner import PolicyLearner
    from test_sharding import build_case

    model_def, state, batch, config = build_case()
    learner = PolicyLearner(model_def, state, config, pad_to_multiple=20, mesh=mesh, program_store=store)
    losses = [learner(LearnerInput(batch, (), None)).metrics["loss"] for _ in range(updates)]
    return losses, [np.asarray(x) for x in jax.tree.leaves(learner.state.params)]


def test_a_new_learner_steps_with_the_stored_program_without_tracing_and_the_same(tmp_path, monkeypatch):
    """A second learner (a new jitted step) finds the step program the first stored: it
    traces no loss, and its losses and parameters equal the first learner's bit for bit and
    a learner's without the store to float32 rounding."""
    from spopp_jax import learner as learner_lib

    traces = []
    loss_and_grads = learner_lib.loss_and_grads
    monkeypatch.setattr(learner_lib, "loss_and_grads", lambda *a, **k: traces.append(1) or loss_and_grads(*a, **k))
    with compilation_cache_dir(str(tmp_path)):
        first = learner_updates(store=True)
        first_traces = len(traces)
        second = learner_updates(store=True)
        second_traces = len(traces) - first_traces
        without_store = learner_updates(store=False)
    assert first_traces >= 1 and second_traces == 0
    assert len(list((tmp_path / "learner_programs").glob(f"*{program_store.SUFFIX}"))) == 1
    assert first[0] == second[0]
    np.testing.assert_allclose(first[0], without_store[0], rtol=1e-6)
    for a, b, c in zip(first[1], second[1], without_store[1], strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-7)


def test_a_learner_without_the_store_traces_its_step(tmp_path, monkeypatch):
    """The control of the test above: with ``program_store`` off a second learner traces."""
    from spopp_jax import learner as learner_lib

    traces = []
    loss_and_grads = learner_lib.loss_and_grads
    monkeypatch.setattr(learner_lib, "loss_and_grads", lambda *a, **k: traces.append(1) or loss_and_grads(*a, **k))
    with compilation_cache_dir(str(tmp_path)):
        learner_updates(store=False, updates=1)
        first = len(traces)
        learner_updates(store=False, updates=1)
    assert first >= 1 and len(traces) == 2 * first
    assert not (tmp_path / "learner_programs").exists()


def test_stored_programs_key_each_argument_layout_and_setting(tmp_path):
    """One program per argument layout (shape, dtype) and per setting, each exported once."""
    double = jax.jit(lambda x: 2 * x)
    store = ProgramStore(tmp_path, "context")
    calls = program_store.StoredPrograms(double, store, "double", {"k": 1})
    for x in (jnp.ones(3), jnp.ones(3) + 1, jnp.ones(4), jnp.ones(3, jnp.int32)):
        np.testing.assert_array_equal(calls(x), 2 * x)
    assert store.saved == 3 and store.loaded == 0
    other = program_store.StoredPrograms(double, store, "double", {"k": 2})
    other(jnp.ones(3))
    again = program_store.StoredPrograms(double, store, "double", {"k": 1})
    again(jnp.ones(4))
    assert store.saved == 4 and store.loaded == 1
    assert program_store.StoredPrograms(double, store, "double", object()).__call__(jnp.ones(2)).shape == (2,)
    assert store.saved == 4  # a setting shown by address only: no store, the function itself
    assert calls.lower(jnp.ones(3)).compile()(jnp.ones(3)).tolist() == [2.0, 2.0, 2.0]  # jit's own lowering


MESH_SCRIPT = """
import sys, numpy as np, jax
sys.path.insert(0, "tests")
from test_program_store import compilation_cache_dir, learner_updates
from spopp_jax import sharding
assert jax.device_count() == 8
mesh = sharding.make_mesh(data=2, fsdp=4, tensor=1)
with compilation_cache_dir(sys.argv[1]):
    first = learner_updates(True, mesh)
    second = learner_updates(True, mesh)
    plain = learner_updates(False, mesh)
assert first[0] == second[0], (first[0], second[0])
np.testing.assert_allclose(first[0], plain[0], rtol=1e-6)
for a, b, c in zip(first[1], second[1], plain[1], strict=True):
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-7)
print("stored programs on the mesh: same losses", first[0])
"""


def test_the_learner_program_on_a_mesh_of_eight_devices_steps_the_same(tmp_path, run_on_8_devices):
    """The step exported with its arguments sharded over data x fsdp = 2 x 4 CPU devices:
    loaded by a second learner, it gives the losses and parameters of the first, and of a
    learner without the store."""
    script = tmp_path / "mesh_case.py"
    script.write_text(MESH_SCRIPT)
    done = run_on_8_devices([script, tmp_path / "cache"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "same losses" in done.stdout
    # the state after an update comes back with its shardings spelled without the size-1
    # tensor axis: an equivalent layout, which the first program takes (no second one)
    assert len(list((tmp_path / "cache" / "learner_programs").glob("*.stablehlo"))) == 1
