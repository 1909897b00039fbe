"""env.blind_control: a finished blind run's summary as the prompt-blind reference."""

from __future__ import annotations

import json

import pytest

from rollout_bridge.envs.blind_control import describe_tasks, load_blind_control
from rollout_bridge.config import load_config
from rollout_bridge.run_errors import UserError
from tiny_run import SMOKE_CONFIG, games_dir

AGENT = describe_tasks("train_w3_o4_q3_s0_n64", "heldout_w3_o4_q3_s200000_n32", prompt_blind=False)


def _control_run(tmp_path, env=None, heldout=True):
    summary = {"env": env if env is not None else {**AGENT, "prompt_blind": True},
               "train_after_rl_estimate": {"success_rate": 0.03, "se": 0.01, "games": 64, "episodes": 256}}
    if heldout:
        summary["heldout_after_rl_estimate"] = {"success_rate": 0.008, "se": 0.008, "games": 32, "episodes": 128}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    return tmp_path


def test_a_blind_run_of_the_same_games_gives_both_references_with_their_ses(tmp_path):
    references, ses = load_blind_control(_control_run(tmp_path), AGENT)
    assert references == {"prompt_blind_ceiling": 0.03, "heldout_prompt_blind_ceiling": 0.008}
    assert ses == {"prompt_blind_ceiling": 0.01, "heldout_prompt_blind_ceiling": 0.008}


def test_a_control_without_held_out_games_gives_the_training_reference_only(tmp_path):
    references, _ = load_blind_control(_control_run(tmp_path, heldout=False), AGENT)
    assert references == {"prompt_blind_ceiling": 0.03}


@pytest.mark.parametrize("env, message", [
    ({**AGENT}, "was not trained blind"),
    ({**AGENT, "prompt_blind": True, "heldout_games": "heldout_other"}, "heldout_games .* are not this job's.*--env.blind_control null"),
    ({**AGENT, "prompt_blind": True, "train_games": "train_other"}, "train_games .* are not this job's.*--env.blind_control null"),
])
def test_a_control_that_is_not_comparable_is_refused(tmp_path, env, message):
    with pytest.raises(UserError, match=message):
        load_blind_control(_control_run(tmp_path, env), AGENT)


def test_a_missing_or_unreadable_control_is_named(tmp_path):
    with pytest.raises(UserError, match=r"no .*summary.json .*--env.blind_observations true"):
        load_blind_control(tmp_path / "nope", AGENT)
    (tmp_path / "summary.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        load_blind_control(tmp_path, AGENT)


def test_a_control_without_results_after_rl_is_named(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({"env": {**AGENT, "prompt_blind": True}}))
    with pytest.raises(UserError, match="no train_after_rl_estimate"):
        load_blind_control(tmp_path, AGENT)


def test_a_blind_job_cannot_take_a_blind_control(tmp_path):
    with pytest.raises(UserError, match="set on a blind run"):
        load_blind_control(_control_run(tmp_path), {**AGENT, "prompt_blind": True})


def _tiny_textworld(tmp_path, *args):
    return load_config(["--env.data_dir", str(games_dir(tmp_path)), "--env.num_games", "2", "--rollout.max_in_flight", "2",
                        "--env.warmstart_games", "0", "--env.heldout_games", "0", *args],
                       config_path=SMOKE_CONFIG)


def test_the_textworld_job_reports_a_blind_control_of_its_own_games(tmp_path):
    from rollout_bridge.envs.kinds import build_env

    agent = build_env(_tiny_textworld(tmp_path), False, log=lambda _: None)
    assert agent.tasks_record["prompt_blind"] is False and agent.reference_success == {}
    blind = build_env(_tiny_textworld(tmp_path, "--env.blind_observations", "true"), False, log=lambda _: None)
    assert blind.tasks_record == {**agent.tasks_record, "prompt_blind": True}
    control = _control_run(tmp_path, dict(blind.tasks_record), heldout=False)
    with_control = build_env(_tiny_textworld(tmp_path, "--env.blind_control", str(control)), False,
                             log=lambda _: None)
    assert with_control.reference_success == {"prompt_blind_ceiling": 0.03}
    assert with_control.reference_se == {"prompt_blind_ceiling": 0.01}
    with pytest.raises(UserError, match="for free-text commands"):   # the exact ceiling applies there
        build_env(_tiny_textworld(tmp_path, "--env.blind_control", str(control), "--env.shuffle_actions", "true",
                                  "--env.free_text_commands", "false"), False, log=lambda _: None)
