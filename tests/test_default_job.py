"""The main job's config (configs/default.yaml, what `python train.py` runs) and the warm
start it ships (assets/textworld_text_warmstart): the file is the agentic recipe, the
shipped weights are the ones its README records, and they load and read a game's text."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
ASSET = ROOT / "assets" / "textworld_text_warmstart"


def test_python_train_py_without_config_path_runs_default_yaml():
    import train
    from rollout_bridge.config import load_config

    cfg = train.parse_config([])
    assert cfg == load_config(config_path=ROOT / "configs" / "default.yaml")
    assert train.parse_config(["--steps", "3"]).steps == 3
    assert train.parse_config(["--config_path", str(ROOT / "configs" / "smoke.yaml")]).env.max_turns == 2


def test_default_job_is_the_agentic_recipe_from_the_shipped_warm_start():
    import train

    cfg = train.parse_config([])
    env = cfg.env
    assert env.kind == "textworld" and env.world_size >= 3 and env.quest_length >= 3 and env.max_turns >= 12
    assert env.heldout_games * cfg.evaluation.rollouts(cfg.prior, "heldout") >= 128   # held-out episodes per evaluation
    assert env.max_feedback_chars >= 600 and env.free_text_commands
    assert cfg.rollout.drain == "none" and cfg.rollout.max_buffered_batches >= 2
    assert (ROOT / cfg.model.path).resolve() == ASSET.resolve() and not cfg.warmstart.enabled


def check_shipped_warm_start(asset: Path, config_path: Path, prompt: str) -> dict:
    """A shipped warm start: its weights are the bytes `model.safetensors.sha256` records,
    it loads under the recipe's model config and gives finite logits for ``prompt``.
    Returns its `warmstart.json` record."""
    from rollout_bridge import components
    from rollout_bridge.config import load_config

    digest = hashlib.sha256((asset / "model.safetensors").read_bytes()).hexdigest()
    assert (asset / "model.safetensors.sha256").read_text().split()[0] == digest
    cfg = load_config(config_path=config_path)
    chat = components.load_chat(asset)
    model = components.load_policy(asset, cfg.model)
    ids = np.asarray([chat.encode(prompt)], np.int32)
    logits = np.asarray(model(ids))
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size) and np.isfinite(logits).all()
    return json.loads((asset / "warmstart.json").read_text())


def test_shipped_warm_start_is_the_recorded_one_and_loads():
    record = check_shipped_warm_start(ASSET, ROOT / "configs" / "default.yaml",
                                      "You are in a kitchen. Actions:\nopen fridge\ngo east\n")
    assert len(record["losses"]) == 6144 and record["losses"][-1] < 0.5 * record["losses"][0]


def test_shipped_blind_control_is_a_blind_run_of_the_default_game_sets():
    """env.blind_control (assets/textworld_blind_control): a blind run's summary whose game
    sets are the ones configs/default.yaml generates, so the job prints it beside the agent's
    success instead of refusing it."""
    import train
    from rollout_bridge.envs.blind_control import describe_tasks, load_blind_control
    from rollout_bridge.envs.textworld_games import GameSetSpec

    cfg = train.parse_config([])
    env = cfg.env
    control = ROOT / env.blind_control
    recorded = json.loads((control / "summary.json").read_text())["env"]
    train_set = GameSetSpec("train", env.num_games, env.game_seed, env.world_size, env.nb_objects, env.quest_length)
    heldout = GameSetSpec("heldout", env.heldout_games, env.heldout_seed, env.world_size, env.nb_objects,
                          env.quest_length)
    assert recorded["train_games"] == train_set.folder_name
    assert recorded["heldout_games"].startswith(heldout.folder_name + "_x")   # + the training set's digest
    references, ses = load_blind_control(control, describe_tasks(recorded["train_games"], recorded["heldout_games"],
                                                                 prompt_blind=False))
    assert set(references) == {"prompt_blind_ceiling", "heldout_prompt_blind_ceiling"}
    assert all(0.0 <= references[k] < 0.01 and ses[k] >= 0.0 for k in references)   # the control wins ~nothing
