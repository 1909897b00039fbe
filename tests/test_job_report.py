"""The end-of-job report (rollout_bridge.job_report): success with standard errors over games, the
paired gain of RL over the warm start, the policy-lag histogram, learning_curve.png.
Expected values are derived by hand from the docstring formulas."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rollout_bridge.job_report import paired_gain, report_run, success_estimate
from rollout_bridge.run_folder import RunPaths
from rollout_bridge.run_report import event_order, lag_histogram


def test_success_estimate_by_hand():
    est = success_estimate([4, 0, 2], [4, 4, 4])          # per game 1, 0, 0.5
    assert est["success_rate"] == pytest.approx(0.5)
    assert est["se"] == pytest.approx(0.5 / math.sqrt(3))  # std(ddof 1) = 0.5
    assert (est["episodes"], est["games"]) == (12, 3)


def test_success_estimate_drops_games_without_trials():
    assert success_estimate([1, 0, 3], [2, 0, 4])["games"] == 2
    with pytest.raises(ValueError):
        success_estimate([0], [0])


def test_paired_gain_by_hand():
    before = {"successes": [0, 1, 2, 1], "trials": [4, 4, 4, 4]}
    after = {"successes": [2, 1, 4, 3], "trials": [4, 4, 4, 4]}   # d = .5, 0, .5, .5
    gain = paired_gain(before, after)
    assert gain["gain"] == pytest.approx(0.375)
    assert gain["se"] == pytest.approx(np.std([0.5, 0, 0.5, 0.5], ddof=1) / 2)


def test_lag_histogram_sums_counts_over_updates():
    rows = [{"diag/policy_lag_count_0": 3.0, "diag/policy_lag_count_1": 1.0},
            {"diag/policy_lag_count_0": 1.0, "diag/policy_lag_count_2": 3.0}, {"success_rate": 1.0}]
    assert lag_histogram(rows) == {"0": 0.5, "1": 0.125, "2": 0.375}
    assert lag_histogram([]) == {}


def test_event_order_reads_the_last_cumulative_counts():
    rows = [{"diag/received_total": 10.0, "diag/out_of_event_order_total": 1.0},
            {"diag/received_total": 40.0, "diag/out_of_event_order_total": 6.0}, {"success_rate": 1.0}]
    assert event_order(rows) == {"received": 40.0, "out_of_event_order": 6.0, "fraction": 0.15}
    assert event_order([{"success_rate": 1.0}]) is None
    assert event_order([{"diag/received_total": 0.0, "diag/out_of_event_order_total": 0.0}]) is None


def test_report_run_writes_curve_and_margins(tmp_path):
    rows = [{"step": k, "success_rate": k / 10, "diag/policy_lag_count_1": 2.0} for k in range(1, 6)]
    before = {"successes": [0, 1, 0, 1], "trials": [4, 4, 4, 4]}
    after = {"successes": [3, 4, 2, 4], "trials": [4, 4, 4, 4]}
    fields = report_run(RunPaths(tmp_path), "t", rows, before, after, {"heldout": before}, {"heldout": after},
                        {"prompt_blind_ceiling": 0.1, "heldout_prompt_blind_ceiling": 0.12})
    assert (tmp_path / "learning_curve.png").stat().st_size > 0
    assert fields["heldout_after_rl_estimate"]["success_rate"] == pytest.approx(13 / 16)
    assert fields["heldout_gain_over_warm_start"]["gain"] == pytest.approx(11 / 16)
    assert fields["prompt_blind_ceiling"] == 0.1 and fields["policy_lag_histogram"] == {"1": 1.0}


def test_margins_with_zero_spread_say_so_instead_of_inf():
    from rollout_bridge.job_report import margin_line, margin_text

    assert margin_text(0.1, 0.05) == "+2.0 SE"
    assert margin_text(0.0, 0.0) == margin_text(0.2, 0.0) == "SE 0 (no spread over games)"
    line = margin_line("held-out", {"success_rate": 0.5, "se": 0.0, "games": 4, "episodes": 16}, 0.5, "ceiling")
    assert "inf" not in line and "nan" not in line and line.endswith("SE 0 (no spread over games)")


def test_a_measured_reference_widens_the_margin_by_its_own_se(tmp_path, caplog):
    from rollout_bridge.job_report import margin_line

    estimate = {"success_rate": 0.5, "se": 0.03, "games": 4, "episodes": 16}
    line = margin_line("held-out", estimate, 0.1, "prompt-blind ceiling", 0.04)
    # (0.5 - 0.1) / sqrt(0.03^2 + 0.04^2) = 0.4 / 0.05 = 8.0
    assert line.endswith("vs prompt-blind ceiling 0.100 ± 0.040 (measured): +8.0 SE"), line
    assert margin_line("held-out", estimate, 0.1, "ceiling").endswith(f"{0.4 / 0.03:+.1f} SE")
    before = {"successes": [0, 1, 0, 1], "trials": [4, 4, 4, 4]}
    fields = report_run(RunPaths(tmp_path), "t", [{"step": 1, "success_rate": 0.1}], before, before, {}, {},
                        {"prompt_blind_ceiling": 0.02}, {"prompt_blind_ceiling": 0.01})
    assert fields["prompt_blind_ceiling"] == 0.02 and fields["prompt_blind_ceiling_se"] == 0.01


def test_sft_progress_logs_each_tenth_with_the_window_mean(capsys):
    from rollout_bridge.warmstart_stage import SFTProgress

    progress = SFTProgress(total_steps=20, epochs=2, progress=False)
    for step in range(20):
        progress.step(step, {"loss": float(step)})
    progress.close()
    lines = [line for line in capsys.readouterr().out.splitlines() if "warm start: step" in line]
    assert len(lines) == 10
    assert "step 2/20 (epoch 1/2), loss 0.500," in lines[0]   # mean of steps 0 and 1
    assert "step 12/20 (epoch 2/2), loss 10.500," in lines[5]
    assert "step 20/20 (epoch 2/2), loss 18.500," in lines[-1]


def test_rl_progress_logs_each_tenth_with_the_window_mean(capsys):
    """The RL log line (issue: a run's log showed nothing for the 36 minutes of RL when no
    terminal showed the bar): one per tenth of the updates, success and lag averaged over
    the updates since the previous line."""
    from types import SimpleNamespace

    from rollout_bridge.rl_stage import UpdateLogger

    class Writer:
        def __init__(self):
            self.rows = []

        def write(self, step, row):
            self.rows.append((step, row))

        def close(self):
            pass

    def record(update, successes, lag):
        trajectories = tuple(SimpleNamespace(num_action_tokens=3, token_ids=np.zeros(5), reward=r, truncated=False,
                                             num_turns=2) for r in successes)
        return SimpleNamespace(update=update, policy_event=update, trajectories=trajectories,
                               policy_lag=np.full(len(successes), lag), diagnostics={}, learner_metrics={},
                               start_time=0.0, end_time=1.0)

    writer = Writer()
    logger = UpdateLogger(writer, steps=20, start_step=0, progress=False)
    for update in range(1, 21):  # success 0, 1/2 alternating by update; lag = update % 3
        logger(record(update, [0.0, 1.0] if update % 2 else [0.0, 0.0], update % 3))
    logger.close()
    lines = [line for line in capsys.readouterr().out.splitlines() if "RL: update" in line]
    assert len(lines) == 10 and len(writer.rows) == 20
    # updates 1 and 2: success 0.5 and 0 -> 0.25; lags 1 and 2 -> 1.5
    assert "RL: update 2/20, success 0.250 over updates 1-2 (trailing 5: 0.250), policy lag 1.50," in lines[0]
    # updates 19, 20: lags 1, 2; trailing = updates 16..20 = (0 + .5 + 0 + .5 + 0) / 5
    assert "RL: update 20/20, success 0.250 over updates 19-20 (trailing 5: 0.200), policy lag 1.50," in lines[-1]


def test_rl_progress_counts_from_a_resumed_update(capsys):
    from types import SimpleNamespace

    from rollout_bridge.rl_stage import UpdateLogger

    writer = SimpleNamespace(write=lambda step, row: None, close=lambda: None)
    logger = UpdateLogger(writer, steps=10, start_step=6, progress=False)
    trajectory = SimpleNamespace(num_action_tokens=1, token_ids=np.zeros(2), reward=1.0, truncated=False, num_turns=1)
    for update in (7, 8, 9, 10):
        logger(SimpleNamespace(update=update, policy_event=update, trajectories=(trajectory,),
                               policy_lag=np.zeros(1), diagnostics={}, learner_metrics={}, start_time=0.0, end_time=0.0))
    lines = [line for line in capsys.readouterr().out.splitlines() if "RL: update" in line]
    assert [line.split("RL: update ")[1].split(",")[0] for line in lines] == ["7/10", "8/10", "9/10", "10/10"]
    assert "success 1.000 over update 7 " in lines[0]


def test_game_generation_logs_a_line_per_tenth_without_a_bar(monkeypatch):
    from rollout_bridge import progress_lines
    from rollout_bridge.envs.kinds import GenerationBar

    lines = []
    bar = GenerationBar("training games", enabled=False, log=lines.append)
    for done in range(0, 21):
        bar(done, 20)
    bar.close()
    assert [line.split(" in ")[0] for line in lines] == [f"generating training games: {2 * k}/20" for k in range(1, 11)]
    quiet = []
    monkeypatch.setattr(progress_lines, "stderr_is_terminal", lambda: True)
    shown = GenerationBar("training games", enabled=True, log=quiet.append)   # the bar shows progress
    shown(10, 20)
    shown.close()
    assert quiet == []


def test_rollout_stages_log_a_line_per_tenth_without_a_bar():
    from rollout_bridge.progress_lines import TenthLines

    lines = []
    counter = TenthLines("prior", lines.append, 1024, unit=" episodes")
    for _ in range(1024):
        counter.step()
    assert len(lines) == 10 and lines[0].startswith("prior: 103/1024 episodes") and "1024/1024" in lines[-1]
    silent = TenthLines("prior", None, 3)
    for _ in range(3):
        silent.step()
    assert silent.done == 3
