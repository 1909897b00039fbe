"""The warm-start cache key (rollout_bridge.warmstart_stage.warmstart_key): a cached warm start is
reused only when the SFT would come out the same. Everything the SFT result depends on
must change the key; where the run writes or how long RL runs must not."""

from __future__ import annotations

import dataclasses

import pytest

from rollout_bridge.run_folder import folder_digest
from rollout_bridge.warmstart_stage import warmstart_key
from rollout_bridge.config import TrainConfig


@pytest.fixture
def base(tmp_path):
    folder = tmp_path / "base"
    folder.mkdir()
    (folder / "config.json").write_text('{"hidden_size": 8}')
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)
    return folder


def _with(cfg: TrainConfig, section: str, **changes) -> TrainConfig:
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **changes)})


@pytest.mark.parametrize("changed", [
    lambda c: dataclasses.replace(c, seed=c.seed + 1),                         # SFT batch order
    lambda c: _with(c, "env", reply_format="command_number"),                 # observation text
    lambda c: _with(c, "env", warmstart_games=c.env.warmstart_games + 1),     # which games
    lambda c: _with(c, "env", num_games=c.env.num_games + 1),                 # disjointness
    lambda c: _with(c, "warmstart", epochs=c.warmstart.epochs + 1),
    lambda c: _with(c, "model", tiny_hidden_size=2 * c.model.tiny_hidden_size),
    lambda c: _with(c, "optim", max_grad_norm=0.5),                           # read by the SFT step
])
def test_what_changes_the_sft_changes_the_key(base, changed):
    cfg = TrainConfig()
    assert warmstart_key(changed(cfg), base) != warmstart_key(cfg, base)


@pytest.mark.parametrize("unchanged", [
    lambda c: dataclasses.replace(c, steps=c.steps + 7, output_dir="elsewhere", progress=not c.progress),
    lambda c: _with(c, "optim", learning_rate=0.5),                           # RL's, not the SFT's
    lambda c: _with(c, "rollout", batch_size=2 * c.rollout.batch_size),
])
def test_what_the_sft_ignores_leaves_the_key(base, unchanged):
    cfg = TrainConfig()
    assert warmstart_key(unchanged(cfg), base) == warmstart_key(cfg, base)


def test_the_base_model_counts_by_content_not_path(base, tmp_path):
    cfg = TrainConfig()
    key, digest = warmstart_key(cfg, base), folder_digest(base)
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in base.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    assert warmstart_key(cfg, copy) == key
    (copy / "model.safetensors").write_bytes(b"\x01" + b"\x00" * 63)
    assert warmstart_key(cfg, copy) != key
    (base / "warmstart.json").write_text("{}")   # the cache's own record is not content
    assert folder_digest(base) == digest
    assert warmstart_key(cfg, base) == key
