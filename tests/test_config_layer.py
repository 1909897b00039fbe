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
from rollout_bridge.config import load_config
from rollout_bridge.methods.base import method_names

ROOT = Path(__file__).resolve().parents[1]
RECORD = json.loads((ROOT / "tests" / "data" / "resolved_components.json").read_text())


def _cases() -> dict[str, tuple[str, list[str]]]:
    cases = {path.name: (str(path), []) for path in sorted((ROOT / "configs").glob("*.yaml"))}
    for method in method_names():
        for base in ("default.yaml", "smoke.yaml"):
            cases[f"{base} --method {method}"] = (str(ROOT / "configs" / base), ["--method", method])
    return cases


def resolved(config_path: str, args: list[str]) -> dict:
    """The component configs ``train.py`` builds for this recipe, as plain data (the agent's
    ``max_turns`` comes from the env kind's bundle: env.max_turns stands in for it)."""
    cfg = load_config(args, config_path=config_path)
    agent = components.build_agent_config(cfg, max_turns=cfg.env.max_turns)
    orchestrator = components.build_orchestrator_config(cfg, agent, seed=cfg.seed)
    plain = lambda obj: json.loads(json.dumps(dataclasses.asdict(obj)))   # tuples as lists, like the record
    r = cfg.rollout
    return {"learner": plain(components.build_learner_config(cfg)), "agent": plain(agent),
            "orchestrator": plain(orchestrator),
            "engine": {"steps_per_call": r.engine_steps_per_call,
                       "prefix_reuse_across_publish": r.prefix_reuse_across_publish},
            "servers": {name: getattr(r.servers, name) for name in
                        ("capacity", "health_interval_s", "outage_wait_s", "weights_transport")},
            "server_launch": {"python": r.servers.python,
                              **{f.name: getattr(r.servers.launch, f.name)
                                 for f in dataclasses.fields(r.servers.launch)}}}


def test_every_recorded_recipe_is_still_a_case():
    assert set(RECORD) == set(_cases())


@pytest.mark.parametrize("case", sorted(_cases()))
def test_recipe_resolves_to_the_recorded_component_configs(case):
    path, args = _cases()[case]
    now = resolved(path, args)
    for component, record in RECORD[case].items():
        assert now[component] == record, f"{case}: {component} changed"
