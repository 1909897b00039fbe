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
    r = cfg.rollout
    return {"learner": plain(components.build_learner_config(cfg)), "agent": plain(agent),
            "orchestrator": _as_recorded(plain(orchestrator)),
            "engine": {"steps_per_call": r.engine_steps_per_call,
                       "prefix_reuse_across_publish": r.prefix_reuse_across_publish},
            "servers": {name: getattr(r.servers, name) for name in
                        ("capacity", "health_interval_s", "outage_wait_s", "weights_transport")},
            "server_launch": {"python": r.servers.python,
                              **{f.name: getattr(r.servers.launch, f.name)
                                 for f in dataclasses.fields(r.servers.launch)}}}


def test_every_recorded_recipe_is_still_shipped():
    assert set(RECORD) <= set(_cases())


@pytest.mark.parametrize("case", sorted(RECORD))
def test_recipe_resolves_to_the_recorded_component_configs(case):
    path, args = _cases()[case]
    now = resolved(path, args)
    for component, record in RECORD[case].items():
        assert now[component] == record, f"{case}: {component} changed"


# ------------------------------------------------------------------ every knob declared once

COMPONENT_CONFIGS = (LearnerConfig, OrchestratorConfig, AgentConfig, SamplingParams)


def _sections(config=None, prefix: str = "") -> dict[str, type]:
    """Every section of the run config (nested ones too) by dotted path -> its class."""
    config = TrainConfig() if config is None else config
    out = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out[prefix + f.name] = type(value)
            out.update(_sections(value, f"{prefix}{f.name}."))
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
    rollout section is a component config's field, or (the engine's own) is read by the
    engine builders."""
    import inspect

    component_fields = {id(f) for c in COMPONENT_CONFIGS for f in dataclasses.fields(c)}
    engine_source = "".join(inspect.getsource(fn) for fn in (components.build_engine, components.build_rollout_servers,
                                                              components.check_engine_choice))
    sections = _sections()
    for path in ("optim", "loss", "tracker", "sampler", "advantage", "rollout"):
        for f in dataclasses.fields(sections[path]):
            nested = dataclasses.is_dataclass(getattr(_config_path_value(path), f.name))
            if path in ("tracker", "sampler", "advantage") or nested:
                continue                                   # read whole (OrchestratorConfig's own) / the servers
            assert id(f) in component_fields or f".{f.name}" in engine_source, f"{path}.{f.name} reaches nothing"
    for f in dataclasses.fields(sections["rollout.servers"]) + dataclasses.fields(sections["rollout.servers.launch"]):
        assert f".{f.name}" in engine_source, f"rollout.servers: {f.name} reaches nothing"


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
