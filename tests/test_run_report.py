"""The end-of-job report's readings (rollout_bridge.run_report): the async regime against the
tuned runs', one before/after line per task set, RL time without the evaluations, a success
axis that fits the curve, and the prompt-blind control's name."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

from rollout_bridge import run_report
from rollout_bridge.job_report import report_run
from rollout_bridge.learning_curve import plot_job_curve
from rollout_bridge.run_folder import RunPaths
from rollout_bridge.run_report import (TUNED_REGIME, final_line, recipe_differences, regime_report,
                                       stage_times, success_axis_limits)
from rollout_bridge.config import load_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def default_cfg():
    return load_config(config_path=ROOT / "configs" / "default.yaml")


def fake_rows(seconds: float, lag_counts: dict[int, int], late: int, received: int, updates: int = 10):
    """Metrics rows of a run: each update `seconds` long, the lag counts spread evenly over
    the updates, the cumulative event-order counters on every row."""
    return [{"step": k, "success_rate": 0.1, "update_wall_s": seconds,
             **{f"diag/policy_lag_count_{lag}": count / updates for lag, count in lag_counts.items()},
             "diag/received_total": received * k / updates, "diag/out_of_event_order_total": late * k / updates}
            for k in range(1, updates + 1)]


def test_the_reference_is_the_default_recipes(default_cfg):
    assert recipe_differences(default_cfg, TUNED_REGIME) == []


def test_the_tuned_warm_start_named_by_another_path_is_the_tuned_recipe(default_cfg, monkeypatch, tmp_path):
    """matched_runs.py passes model.path absolute; a run from another folder names it relative
    to there: the same folder, the same recipe. Another folder is another recipe."""
    def with_path(path):
        return dataclasses.replace(default_cfg, model=dataclasses.replace(default_cfg.model, path=path))

    assert recipe_differences(with_path(str(ROOT / "assets" / "textworld_text_warmstart")), TUNED_REGIME) == []
    monkeypatch.chdir(ROOT / "docs")
    assert recipe_differences(with_path("../assets/textworld_text_warmstart"), TUNED_REGIME) == []
    assert recipe_differences(with_path("assets/textworld_text_warmstart"), TUNED_REGIME) != []   # docs/assets
    assert recipe_differences(with_path(str(tmp_path)), TUNED_REGIME) == \
        [f"model.path {str(tmp_path)!r} (tuned 'assets/textworld_text_warmstart')"]


def test_a_run_like_the_tuned_ones_is_reported_as_tuned(default_cfg):
    rows = fake_rows(2.9, {0: 2, 1: 14, 2: 75, 3: 9}, late=26, received=1000)
    fields, lines = regime_report(default_cfg, rows)
    assert fields["differs"] == [] and fields["seconds_per_update"] == pytest.approx(2.9)
    assert lines == ["async regime as tuned: 2.9 s/update (median; tuned 2.7-2.9), out of event order 2.6% "
                     "(tuned 1.6%-4.9%), policy lag 2 for 75% of trained trajectories (tuned 73%-78%)"]


def test_the_slow_machines_run_is_reported_as_different(default_cfg):
    """The issue's run on a busy 2-core Xeon: 7.3 s per update, 23.1% out of event order,
    policy lag 0/1/2/3 for 8/41/43/8% of trajectories."""
    rows = fake_rows(7.3, {0: 8, 1: 41, 2: 43, 3: 8}, late=231, received=1000)
    fields, lines = regime_report(default_cfg, rows)
    assert len(fields["differs"]) == 3
    assert lines[0].startswith("async regime DIFFERS from the tuned runs (updates slower than 4.5 s; more than "
                               "10% of results out of event order; policy lag 2 for fewer than 60% of trajectories)")
    assert "7.3 s/update" in lines[0] and "23.1%" in lines[0] and "43%" in lines[0]
    assert "not the tuned recipe's" in lines[1]


def test_one_reading_outside_is_enough(default_cfg):
    fields, lines = regime_report(default_cfg, fake_rows(3.0, {1: 20, 2: 72, 3: 8}, late=137, received=1000))
    assert fields["differs"] == ["more than 10% of results out of event order"]
    assert "DIFFERS" in lines[0]


def test_another_recipe_gets_no_verdict(default_cfg):
    cfg = dataclasses.replace(default_cfg, rollout=dataclasses.replace(default_cfg.rollout, batch_size=32))
    fields, lines = regime_report(cfg, fake_rows(7.3, {0: 8, 1: 41, 2: 43, 3: 8}, late=231, received=1000))
    assert fields["differs"] is None
    assert "no tuned reference for this recipe (it changes rollout.batch_size 32 (tuned 16))" in lines[0]
    assert "DIFFERS" not in " ".join(lines)
    smoke = load_config(config_path=ROOT / "configs" / "smoke.yaml")   # another task and model: a short list
    assert re.search(r"no tuned reference for this recipe \(it changes .* and \d+ more\)$",
                     regime_report(smoke, [])[1][0])


def test_rl_wall_time_is_the_updates_alone():
    rows = [{"step": k, "update_wall_s": s, "wall_s": w}
            for k, (s, w) in enumerate([(40.0, 40.0), (3.0, 43.0), (2.5, 45.5), (3.5, 49.0)], start=1)]
    times = stage_times(rows, stage_wall_s=300.0, resumed_from=None)   # the stage also ran 251 s of evaluations
    assert times == {"rl_wall_s": 49.0, "evaluation_wall_s": 251.0, "rl_stage_wall_s": 300.0}


def test_a_resumed_runs_rl_time_counts_both_parts_and_its_evaluations_this_ones():
    first = [{"step": 1, "update_wall_s": 40.0, "wall_s": 40.0}, {"step": 2, "update_wall_s": 3.0, "wall_s": 43.0}]
    resumed = [{"step": 3, "update_wall_s": 30.0, "wall_s": 30.0}]   # the clock restarts with the process
    times = stage_times(first + resumed, stage_wall_s=100.0, resumed_from=2)
    assert times == {"rl_wall_s": 73.0, "evaluation_wall_s": 70.0, "rl_stage_wall_s": 100.0}


def test_a_resume_of_a_finished_run_trains_nothing_so_its_stage_is_evaluation():
    """Every row is the earlier job's (the last one's clock is that job's, not this one's):
    the 20 s stage of a resume from the last checkpoint is all evaluations and export."""
    first = [{"step": 1, "update_wall_s": 40.0, "wall_s": 40.0}, {"step": 2, "update_wall_s": 3.0, "wall_s": 43.0}]
    times = stage_times(first, stage_wall_s=20.0, resumed_from=2)
    assert times == {"rl_wall_s": 43.0, "evaluation_wall_s": 20.0, "rl_stage_wall_s": 20.0}


def estimate(rate: float, games: int, episodes: int) -> dict:
    return {"success_rate": rate, "se": 0.01, "games": games, "episodes": episodes}


def test_the_final_line_states_before_and_after_on_the_same_tasks_rounded():
    summary = {"total_wall_s": 912.4, "success_before_rl": 0.10546875, "success_after_rl": 0.11328125,
               "train_before_rl_estimate": estimate(0.10546875, 256, 256),
               "train_after_rl_estimate": estimate(0.11328125, 256, 256),
               "heldout_before_rl_estimate": estimate(0.115234375, 512, 2048),
               "heldout_after_rl_estimate": estimate(0.1259765625, 512, 2048)}
    line = final_line(summary, "runs/default/learning_curve.png")
    assert line == ("done in 912s: success on training tasks (256 games, 256 episodes): 0.105 before RL -> "
                    "0.113 after RL; held-out games (512 games, 2,048 episodes): 0.115 before RL -> 0.126 after "
                    "RL; curve runs/default/learning_curve.png")
    assert not re.search(r"\d\.\d{4}", line)


def test_the_prior_says_what_its_success_is_over():
    record = {"successes": [1, 0, 0, 1] * 256, "trials": [1] * 1024, "success_rate": 0.5}
    assert run_report.prior_text(record) == ("the warm start's success on all 1,024 training tasks 0.500 "
                                             "(512/1024 episodes)")


def test_axis_limits_fit_a_curve_low_on_the_unit_interval():
    values = [0.05, 0.3, 0.12, 0.0008]   # training success, held-out ±2 SE, the blind control
    lo, hi = success_axis_limits(values)
    assert lo <= min(values) and hi >= max(values)
    assert (max(values) - min(values)) / (hi - lo) > 0.7    # the data fill most of the axis
    assert hi < 0.45 and lo > -0.05
    assert success_axis_limits([0.9, 1.0]) == pytest.approx((0.89, 1.02))   # within [0, 1] plus a margin
    lo, hi = success_axis_limits([0.2, 0.2])
    assert lo < 0.2 < hi and hi - lo >= 0.05


def test_the_learning_curve_axis_shows_the_data(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    seen = []
    original = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (seen.append(fig.axes[0].get_ylim()),
                                                                   original(fig, *a, **k)))
    rng = np.random.default_rng(0)
    rows = [{"step": k, "success_rate": float(v)} for k, v in enumerate(rng.uniform(0.0, 0.31, 120), start=1)]
    held = {"heldout after RL": (120, estimate(0.126, 512, 2048))}
    plot_job_curve(rows, tmp_path / "curve.png", "t", held, {"prompt-blind control": 0.0005})
    (lo, hi), = seen
    assert lo <= 0.0 + 1e-9 and 0.31 <= hi < 0.45   # was 0-1: the data in its bottom 30%


def test_a_measured_blind_run_is_the_prompt_blind_control_in_log_and_readme(tmp_path, capsys):
    before = {"successes": [0, 1, 0, 1], "trials": [4, 4, 4, 4]}
    report_run(RunPaths(tmp_path), "t", [{"step": 1, "success_rate": 0.1}], before, before, {"heldout": before},
               {"heldout": before}, {"prompt_blind_ceiling": 0.02, "heldout_prompt_blind_ceiling": 0.01},
               {"prompt_blind_ceiling": 0.01, "heldout_prompt_blind_ceiling": 0.005})
    out = capsys.readouterr().out
    assert "vs prompt-blind control 0.020 ± 0.010 (measured)" in out and "ceiling" not in out
    assert "prompt-blind control" in (ROOT / "README.md").read_text()
    report_run(RunPaths(tmp_path), "t", [{"step": 1, "success_rate": 0.1}], before, before, {}, {},
               {"prompt_blind_ceiling": 0.02})   # exact (no SE): the uniform-random ceiling
    assert "vs prompt-blind ceiling 0.020" in capsys.readouterr().out
