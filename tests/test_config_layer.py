"""One config layer: every knob of a component is one dataclass field with one default,
and the shipped recipes resolve to the component configs recorded in
``tests/data/resolved_components.json`` (what they resolved to before the layers were
merged; a value that changes silently fails here)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from rollout_bridge import components
from rollout_bridge.agent import AgentConfig
from rollout_bridge.config import TrainConfig, load_config
from rollout_bridge.engine.base import SamplingParams
from rollout_bridge.engine.choice import EngineConfig
from rollout_bridge.engine.vllm_inprocess import VllmInProcessConfig
from rollout_bridge.engine.vllm_launcher import ServerLaunch, ServerLaunchConfig
from rollout_bridge.engine.vllm_servers import RolloutServersConfig, ServerFleet
from rollout_bridge.methods.base import MethodConfig, method_names, recipe
from rollout_bridge.orchestrator import OrchestratorConfig
from spopp_jax.learner import LearnerConfig

ROOT = Path(__file__).resolve().parents[1]
RECORD = json.loads((ROOT / "tests" / "data" / "resolved_components.json").read_text())


def _cases() -> dict[str, tuple[str, list[str]]]:
    cases = {path.name: (str(path), []) for path in sorted((ROOT / "configs").glob("*.yaml"))}
    for method in method_names():
        for base in ("default.yaml", "smoke.yaml"):
            cases[f"{base} --method {method}"] = (str(ROOT / "configs" / base), ["--method", method])
    return cases


# The record names the orchestrator's fields as they were before the tracker, sampler and
# advantage sections became its own (nested) configs.
RECORDED_AS = {"rho": ("tracker", "rho"), "whiten_eps": ("advantage", "whiten_eps"),
               "sampler_form": ("sampler", "form"), "sampler_floor": ("sampler", "floor"),
               "task_sampler": ("sampler", "impl")}


def _as_recorded(orchestrator: dict) -> dict:
    flat = {k: v for k, v in orchestrator.items() if k not in {"tracker", "sampler", "advantage"}}
    return {**flat, **{old: orchestrator[section][name] for old, (section, name) in RECORDED_AS.items()}}


def resolved(config_path: str, args: list[str]) -> dict:
    """The component configs ``train.py`` builds for this recipe, as plain data (the agent's
    ``max_turns`` comes from the env kind's bundle: env.max_turns stands in for it)."""
    cfg = load_config(args, config_path=config_path)
    agent = components.build_agent_config(cfg, max_turns=cfg.env.max_turns)
    orchestrator = components.build_orchestrator_config(cfg, agent, seed=cfg.seed)
    plain = lambda obj: json.loads(json.dumps(dataclasses.asdict(obj)))   # tuples as lists, like the record
    engine = cfg.rollout.engine
    # every recipe runs the JAX engine; "servers" / "server_launch" are what
    # `--rollout.engine vllm_server` starts from (the vllm_server engine's defaults)
    return {"learner": plain(components.build_learner_config(cfg)), "agent": plain(agent),
            "orchestrator": _as_recorded(plain(orchestrator)),
            "engine": {"steps_per_call": engine.steps_per_call,
                       "prefix_reuse_across_publish": engine.prefix_reuse_across_publish},
            "servers": plain(ServerFleet()), "server_launch": plain(ServerLaunch())}


def test_every_recorded_recipe_is_still_shipped():
    assert set(RECORD) <= set(_cases())


@pytest.mark.parametrize("case", sorted(RECORD))
def test_recipe_resolves_to_the_recorded_component_configs(case):
    path, args = _cases()[case]
    now = resolved(path, args)
    for component, record in RECORD[case].items():
        assert now[component] == record, f"{case}: {component} changed"


# ------------------------------------------------------------------ every knob declared once

COMPONENT_CONFIGS = (LearnerConfig, OrchestratorConfig, AgentConfig, SamplingParams, RolloutServersConfig,
                     ServerLaunchConfig)


def _sections(config=None, prefix: str = "") -> dict[str, type]:
    """Every section of the run config (nested ones too) by dotted path -> its class; the
    ``rollout.engine`` choice once per registered engine (``rollout.engine[vllm_server]``)."""
    config = TrainConfig() if config is None else config
    out = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, EngineConfig):
            for name, choice in EngineConfig.get_known_choices().items():
                path = f"{prefix}{f.name}[{name}]"
                out[path] = choice
                out.update(_section_classes(choice, path + "."))
        elif dataclasses.is_dataclass(value):
            out[prefix + f.name] = type(value)
            out.update(_sections(value, f"{prefix}{f.name}."))
    return out


def _section_classes(config_class: type, prefix: str) -> dict[str, type]:
    """The sections nested in ``config_class`` (by its fields' defaults) by dotted path."""
    out = {}
    for f in dataclasses.fields(config_class):
        if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory):
            out[prefix + f.name] = f.default_factory
            out.update(_section_classes(f.default_factory, f"{prefix}{f.name}."))
    return out


def _declared_by(config_class: type, name: str) -> type:
    """The class of ``config_class``'s MRO whose own body declares field ``name``."""
    return next(c for c in config_class.__mro__ if name in vars(c).get("__annotations__", {}))


def _config_path_value(path: str):
    value = TrainConfig()
    for part in path.split("."):
        value = getattr(value, part)
    return value


def test_every_component_field_is_one_run_config_field_or_says_where_it_comes_from():
    """A component's field is declared once: by a class that exactly one run-config section
    is or extends (so the section exposes the same field, with the same default), or it is a
    nested config that is itself a section, or its ``metadata["from"]`` names its source; a
    source that is a run-config path has that path's default."""
    sections = _sections()
    for component in COMPONENT_CONFIGS:
        for f in dataclasses.fields(component):
            where = f"{component.__name__}.{f.name}"
            if "from" in f.metadata:
                source = f.metadata["from"]
                assert isinstance(source, str) and source, where
                try:
                    value = _config_path_value(source)
                except AttributeError:
                    continue                            # a stated derivation, not one config path
                assert value == f.default, f"{where} defaults to {f.default!r}, its source {source} to {value!r}"
                continue
            if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory()):
                nested = [path for path, cls in sections.items() if cls is type(f.default_factory())]
                assert len(nested) == 1, f"{where}: its config class is the section of {nested or 'nothing'}"
                continue
            owner = _declared_by(component, f.name)
            exposing = [path for path, cls in sections.items() if issubclass(cls, owner)]
            assert len(exposing) == 1, f"{where} ({owner.__name__}'s) is exposed by {exposing or 'no section'}"
            section = sections[exposing[0]]
            assert section.__dataclass_fields__[f.name] is f, f"{where}: {exposing[0]}.{f.name} is another field"


def test_the_method_fields_default_to_the_default_methods_recipe():
    defaults = {f.name: f.default for f in dataclasses.fields(OrchestratorConfig)}
    for name, value in recipe(MethodConfig.default_choice_name()).orchestrator_fields().items():
        assert defaults[name] == value, name
    for name, value in recipe(MethodConfig.default_choice_name()).learner_fields().items():
        assert LearnerConfig.__dataclass_fields__[name].default == value, name


def test_every_field_of_the_component_sections_reaches_a_component():
    """The other direction: a field of the optim, loss, tracker, sampler, advantage or
    rollout section is a component config's field; a field of an engine's section is its
    servers' or launcher's config field, or is read by the engine config's own builders."""
    import inspect

    component_fields = {id(f) for c in COMPONENT_CONFIGS for f in dataclasses.fields(c)}
    sections = _sections()
    for path in ("optim", "loss", "tracker", "sampler", "advantage", "rollout"):
        for f in dataclasses.fields(sections[path]):
            nested = dataclasses.is_dataclass(getattr(_config_path_value(path), f.name))
            if path in ("tracker", "sampler", "advantage") or nested:
                continue                                   # read whole (OrchestratorConfig's own) / the engine
            assert id(f) in component_fields, f"{path}.{f.name} reaches nothing"
    engines = {path: cls for path, cls in sections.items() if path.startswith("rollout.engine[")}
    assert {path.split("[")[1].split("]")[0] for path in engines} >= {"jax", "vllm", "vllm_server"}
    for path, cls in engines.items():
        source = inspect.getsource(EngineConfig.get_choice_class(path.split("[")[1].split("]")[0]))
        for f in dataclasses.fields(cls):
            assert id(f) in component_fields or f"self.{f.name}" in source, f"{path}.{f.name} reaches nothing"


def test_a_section_and_its_component_share_one_default():
    """A section and its component share one default: a library user gets the main job's
    values."""
    cfg = TrainConfig()
    learner = LearnerConfig()
    assert (learner.learning_rate, learner.num_mini_batches, learner.action_logits_fraction) == \
        (cfg.optim.learning_rate, cfg.optim.num_mini_batches, cfg.optim.action_logits_fraction)
    orchestrator = OrchestratorConfig()
    assert (orchestrator.batch_size, orchestrator.drain, orchestrator.max_in_flight, orchestrator.pad_to_multiple) == \
        (cfg.rollout.batch_size, cfg.rollout.drain, cfg.rollout.max_in_flight, cfg.rollout.pad_to_multiple)
    assert SamplingParams().max_new_tokens == cfg.rollout.max_new_tokens
    assert AgentConfig().max_total_tokens == cfg.rollout.max_total_tokens


def test_renamed_fields_keep_the_keys_records_were_written_under():
    """A prior, an evaluation cache or a checkpoint written before a rename is still found:
    the renamed fields are keyed under their first names."""
    from rollout_bridge.run_folder import checkpoint_key

    cfg = load_config(["--rollout.max_in_flight", "8", "--rollout.max_total_tokens", "512",
                       "--advantage.whiten_eps", "1e-6"])
    key = checkpoint_key(cfg)
    assert (key["rollout"]["max_inflight"], key["rollout"]["max_seq_len"], key["advantage"]["eps"]) == (8, 512, 1e-6)
    assert not {"max_in_flight", "max_total_tokens"} & set(key["rollout"]) and "whiten_eps" not in key["advantage"]


def _declared_twice(section: type, component: type) -> list[str]:
    """Fields a section and a component config each declare themselves under one name (not
    one declaration shared by extending the other's class), the component's not marked as
    set by the job (``metadata["from"]``)."""
    section_fields = {f.name: f for f in dataclasses.fields(section)}
    return [f"{section.__name__}.{f.name} / {component.__name__}.{f.name}" for f in dataclasses.fields(component)
            if f.name in section_fields and section_fields[f.name] is not f and "from" not in f.metadata]


# which component config each section configures (the sections a build reads into it)
CONFIGURES = {"optim": (LearnerConfig,), "loss": (LearnerConfig,),
              "rollout": (OrchestratorConfig, AgentConfig, SamplingParams),
              "rollout.engine[vllm]": (VllmInProcessConfig,),
              "rollout.engine[vllm_server]": (RolloutServersConfig,),
              "rollout.engine[vllm_server].launch": (ServerLaunchConfig,)}


def test_no_knob_is_declared_twice_between_the_sections_and_the_component_configs():
    """Zero fields declared in two layers: e.g. the vLLM servers' settings are the fleet's
    `ServerFleet` and the launcher's `ServerLaunch` themselves (the vllm_server engine's
    section extends the one and nests the other), and in-process vLLM's are `InProcessVllm`
    (the vllm engine's section and `VllmInProcessConfig` both extend it), so no section
    repeats a `RolloutServersConfig`, `ServerLaunchConfig` or `VllmInProcessConfig` knob
    with a default of its own."""
    sections = _sections()
    twice = [pair for path, components_ in CONFIGURES.items() for component in components_
             for pair in _declared_twice(sections[path], component)]
    assert twice == [], f"{len(twice)} fields declared twice: {twice}"
