"""The matched-runs report (benchmarks/matched_report.py) on synthetic run folders whose
curves are chosen so every score can be derived by hand."""

import argparse
import json
import os
import platform
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import matched_report


def write_run(root, arm, seed, success, centre=-0.1, after=None, regime=None, per_update=None):
    """``per_update``: more metrics per update, name -> one value per update."""
    folder = root / arm / f"seed{seed}"
    folder.mkdir(parents=True)
    per_update = per_update or {}
    with open(folder / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps({
                "step": step, "success_rate": s,
                "diag/cov_n_length_advantage": 2 * centre,
                "diag/center_after_trajectory_whitening": centre,
                "diag/center_after_token_whitening": 0.0,
                "diag/length_q10": 2.0, "diag/length_q50": 3.0, "diag/length_q90": 4.0,
                **{name: values[step - 1] for name, values in per_update.items()},
            }) + "\n" for step, s in enumerate(success, 1))
    (folder / "summary.json").write_text(json.dumps({
        "success_before_rl": 0.2,
        "success_after_rl": float(np.mean(success[-8:])) if after is None else after,
        "rl_wall_s": 10.0, **(regime or {})}))


def args_for(root, tmp_path, auc="trapezoid"):
    return argparse.Namespace(root=root, updates_per_step=2, figures=tmp_path / "figures", out=None, auc=auc)


def test_main_table_and_paired_differences_hand_derived(tmp_path):
    root = tmp_path / "runs"
    # 2 updates per plotted step; SPO++ plotted curve [0.2, 0.4, 0.6], SPO [0.2, 0.2, 0.2]
    write_run(root, "spopp", 0, [0.2, 0.2, 0.4, 0.4, 0.6, 0.6])
    write_run(root, "spo", 0, [0.2] * 6)
    write_run(root, "spopp", 1, [0.3] * 6)
    write_run(root, "spo", 1, [0.4] * 6)
    text = matched_report.report(args_for(root, tmp_path))
    # AUC SPO++ seed 0 = ((0.2+0.4)/2 + (0.4+0.6)/2)/2 = 0.4; seed 1 = 0.3 -> mean 0.35
    assert "| SPO++ | 2 | 0.350 ± 0.071 |" in text
    # paired AUC: seed 0 +20 points, seed 1 -10 points -> mean +5, std sqrt(450) = 21.21
    assert "| SPO++ − SPO, AUC | +5.00 ± 21.21 | +- (1+/1-) | +20.0, -10.0 |" in text
    assert (tmp_path / "figures" / "matched_runs.png").is_file()
    assert "2x2 incomplete" in text
    assert "(AUC: needs all four tracker x measure arms)" in text and "T = 0" not in text


def test_ablation_and_centre_prediction(tmp_path):
    root = tmp_path / "runs"
    steps = 20  # 10 plotted steps of 2 updates
    for seed in range(3):
        gain = 0.0625 * (seed + 1)  # token gain grows with the centre's size (exact binary)
        centre = -0.1 * (seed + 1)
        write_run(root, "spopp", seed, [0.25 + gain] * steps)
        write_run(root, "event_traj", seed, [0.25] * steps, centre=centre)
        write_run(root, "receipt_token", seed, [0.125 + gain] * steps)
        write_run(root, "receipt_traj", seed, [0.125] * steps, centre=centre)
    text = matched_report.report(args_for(root, tmp_path))
    # constant curves: C10 = the constant; token - trajectory = 6.25, 12.5, 18.75 points
    assert "| C10: token − trajectory, event-time tracker | +12.50 ± 6.25 | +++ (3+/0-) |" in text
    assert "| C10: event-time − receipt-order, token measure | +12.50 ± 0.00 |" in text
    assert "C10: interaction (token gain at event-time − at receipt-order) | +0.00 ± 0.00 | 000 (0+/0-)" in text
    # constant curves: the AUC over all 10 steps equals C10 here
    assert "| AUC (T = 10): token − trajectory, event-time tracker | +12.50 ± 6.25 |" in text
    assert "in C10? 6 pairs" in text
    assert "| trajectory-measure run, first 20 updates | 0.100 to 0.300 | +1.00 |" in text


def test_measure_screen_reads_the_first_10_plotted_steps_of_runs_of_any_length(tmp_path):
    """Without the full 2x2, SPO++ against its trajectory-measure arm alone (the paper's
    screen): paired by seed on C10 and the AUC of the first 10 plotted steps, though SPO++
    ran 30 updates (15 plotted steps of 2) and the trajectory arm 20."""
    root = tmp_path / "runs"
    # trajectory arm, plotted [0]*5 + [0.25]*5: AUC = (0.125 + 4 * 0.25) / 9 = 0.125,
    # mean(r_6..r_10) = 0.25, C10 = 0.1875; SPO++ constant c over its first 10 steps, then 0
    for seed, c in enumerate((0.5, 0.5625, 0.625)):
        write_run(root, "spopp", seed, [c] * 20 + [0.0] * 10)
        write_run(root, "event_traj", seed, [0.0] * 10 + [0.25] * 10)
    write_run(root, "spopp", 3, [1.0] * 30)  # no trajectory-arm partner: not paired
    text = matched_report.report(args_for(root, tmp_path))
    assert "2x2 incomplete" in text
    assert "| SPO++ | 3 | 30 | 0.562 ± 0.062 | 0.562 ± 0.062 |" in text
    assert "| event x trajectory | 3 | 20 | 0.188 ± 0.000 | 0.125 ± 0.000 |" in text
    # C10: c - 0.1875 = 31.25, 37.5, 43.75 points; AUC (T = 10): c - 0.125 = 37.5, 43.75, 50
    assert "| C10: token − trajectory, event-time tracker | +37.50 ± 6.25 | +++ (3+/0-) |" in text
    assert "| AUC (T = 10): token − trajectory, event-time tracker | +43.75 ± 6.25 | +++ (3+/0-) |" in text
    # the figure: the paired seeds' first 10 plotted steps
    assert "![measure screen](" in text and (tmp_path / "figures" / "measure_screen.png").stat().st_size > 0


def test_no_measure_screen_without_a_trajectory_arm_that_ran_10_plotted_steps(tmp_path):
    root = tmp_path / "runs"
    write_run(root, "spopp", 0, [0.5] * 20)
    write_run(root, "event_traj", 0, [0.25] * 18)  # 9 plotted steps: no C10
    text = matched_report.report(args_for(root, tmp_path))
    assert "2x2 incomplete" in text and "measure screen" not in text


def test_collapse_is_counted_with_its_onset(tmp_path):
    root = tmp_path / "runs"
    # plotted steps (2 updates each): 0.25 x 4, then 0 x 6, final policy 0 -> collapsed from update 9
    write_run(root, "spopp", 0, [0.25] * 8 + [0.0] * 12, after=0.0)
    # a dip of 4 plotted steps that recovers is not a collapse
    write_run(root, "spopp", 1, [0.25] * 4 + [0.0] * 8 + [0.25] * 8)
    # a training curve ending at 0 whose final policy still succeeds is not one either
    write_run(root, "spopp", 2, [0.25] * 16 + [0.0] * 4, after=0.2)
    text = matched_report.report(args_for(root, tmp_path))
    assert "| SPO++ | 3 | 1 | 0 (9) |" in text


def test_regime_table_means_over_seeds(tmp_path):
    root = tmp_path / "runs"
    for seed, (late, held) in enumerate([(0.1, 0.25), (0.3, 0.5)]):
        write_run(root, "spopp", seed, [0.2] * 4, regime={
            "policy_lag_histogram": {"1": 0.25, "2": 0.75}, "event_order": {"fraction": late},
            "heldout_before_rl": {"success_rate": 0.25}, "heldout_after_rl": {"success_rate": held}})
    write_run(root, "spo", 0, [0.2] * 4)  # an older run without the records
    text = matched_report.report(args_for(root, tmp_path))
    # lag shares 25 / 75 %, out of event order mean 20.0 std 14.1, held-out after 37.5 ± 17.7
    assert "| SPO++ | 2 | 25.0 ± 0.0 | 75.0 ± 0.0 | 20.0 ± 14.1 | 25.0 ± 0.0 | 37.5 ± 17.7 |" in text
    assert "| SPO | 1 | 0.0 | 0.0 | n/a | n/a | n/a |" in text


def test_score_against_the_out_of_order_share_hand_derived(tmp_path):
    root = tmp_path / "runs"
    # score = base + slope x share exactly: event-time slope +0.2, receipt-order slope -0.3,
    # the trajectory measure 0.05 below the token measure under both trackers
    base = {"spopp": (0.2, 0.2), "event_traj": (0.15, 0.2), "receipt_token": (0.3, -0.3), "receipt_traj": (0.25, -0.3)}
    for arm, (b, slope) in base.items():
        for seed, share in enumerate((0.1, 0.3)):
            y = b + slope * share
            write_run(root, arm, seed, [y] * 20, after=y, regime={"event_order": {"fraction": share}})
    text = matched_report.report(args_for(root, tmp_path))
    # points of score per 10 points of share: +2.00, -3.00, difference -5.00; an exact fit, SE 0
    for score in ("success after RL", "AUC (T = 10)"):
        assert f"| {score} | 8 | 10-30% | 10-30% | +2.00 ± 0.00 | -3.00 ± 0.00 | -5.00 ± 0.00 |" in text


def test_share_slopes_need_both_trackers_to_vary():
    rows = [(t, m, 0.1, 0.2) for t in ("event-time", "receipt-order") for m in ("token", "trajectory")] * 2
    assert matched_report.share_slopes(rows) is None  # every share equal: no slope identified
    assert matched_report.share_slopes(rows[:6]) is None  # fewer than 7 runs
    assert "same share (10%)" in matched_report.no_fit_reason(rows)
    varied = [(t, m, 0.1 * i, 0.2) for i, (t, m, _, _) in enumerate(rows)]
    assert "fewer than the 7" in matched_report.no_fit_reason(varied[:6])
    event_only = [r for r in varied if r[0] == "event-time"]
    assert matched_report.share_slopes(event_only) is None
    assert matched_report.no_fit_reason(event_only) == "runs of one tracker only (event-time): the 2x2 arms were not run"
    token_only = [r for r in varied if r[1] == "token"] * 2
    assert matched_report.share_slopes(token_only) is None
    assert matched_report.no_fit_reason(token_only) == "runs of one measure only (token): the 2x2 arms were not run"
    within = [(t, m, 0.1 if t == "event-time" else 0.3, 0.2) for t, m, _, _ in rows]  # varies only across trackers
    assert matched_report.share_slopes(within) is None
    assert matched_report.no_fit_reason(within) == "the share does not vary within one of the trackers"


def test_shared_warm_start_must_be_a_model_folder_and_stay_the_same(tmp_path):
    import pytest

    import matched_runs

    with pytest.raises(SystemExit, match="not a model folder"):
        matched_runs.shared_stage(tmp_path / "root", [], warm_start=tmp_path)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    shared = tmp_path / "root" / "shared"
    shared.mkdir(parents=True)
    (shared / "prior.json").write_text("{}")
    (shared / "warm_start.txt").write_text(f"{model}\n")
    assert matched_runs.shared_stage(tmp_path / "root", [], warm_start=model) == (model.resolve(), shared / "prior.json")
    (shared / "warm_start.txt").write_text("/elsewhere\n")
    with pytest.raises(SystemExit, match="use another --root"):
        matched_runs.shared_stage(tmp_path / "root", [], warm_start=model)


def test_archive_keeps_report_inputs_and_pins_the_warm_start_weights(tmp_path):
    import pytest

    import matched_runs

    root, kept = tmp_path / "runs", tmp_path / "kept"
    write_run(root, "spopp", 0, [0.2] * 4)
    (root / "spopp" / "seed0" / "train.log").write_text("not archived")
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights")
    (root / "shared").mkdir()
    (root / "shared" / "warm_start.txt").write_text(f"{model}\nsha256 {matched_runs.weights_digest(model)}\n")
    lost = root / "spo" / "seed0"          # a summary whose metrics were lost: neither archived nor done
    lost.mkdir(parents=True)
    (lost / "summary.json").write_text((root / "spopp" / "seed0" / "summary.json").read_text())
    assert matched_runs.archive(root, kept) == 1 and not (kept / "spo").exists()
    assert not matched_runs.finished(lost) and matched_runs.finished(root / "spopp" / "seed0")
    assert sorted(p.name for p in (kept / "spopp" / "seed0").iterdir()) == ["metrics.jsonl", "summary.json"]
    assert matched_report.load_runs(kept)["spopp"][0].summary["rl_wall_s"] == 10.0
    matched_runs.check_archived_warm_start(kept, model)  # same weights: accepted
    assert matched_runs.run_one("spopp", 0, 4, tmp_path / "new", model, tmp_path / "p", [], archived=kept) is None
    with pytest.raises(SystemExit, match="no \\*.safetensors"):
        matched_runs.weights_digest(root)  # a folder without weights
    (model / "model.safetensors").write_bytes(b"other weights")
    with pytest.raises(SystemExit, match="not the one the runs"):
        matched_runs.check_archived_warm_start(kept, model)


def test_eval_rollouts_set_each_runs_evaluations_only(tmp_path, monkeypatch, capsys):
    import subprocess

    import matched_runs

    calls = []
    monkeypatch.setattr(matched_runs.subprocess, "run",
                        lambda command, **kw: calls.append(command) or subprocess.CompletedProcess(command, 0))
    matched_runs.run_one("spopp", 3, 5, tmp_path, tmp_path / "m", tmp_path / "p.json", ["--x", "1"],
                         eval_rollouts=2)
    command = json.loads((tmp_path / "spopp" / "seed3" / "command.json").read_text())
    assert calls == [command] and command[-2:] == ["--prior.rollouts_per_task", "2"]
    assert command[command.index("--prior.path") + 1] == str(tmp_path / "p.json")   # the shared prior stays
    matched_runs.run_one("spo", 3, 5, tmp_path, tmp_path / "m", tmp_path / "p.json", [])
    assert "--prior.rollouts_per_task" not in calls[-1]
    host = json.loads((tmp_path / "spo" / "seed3" / "host.json").read_text())  # where it ran
    assert host["cpu"] and host["python"] == platform.python_version()
    started = [line for line in capsys.readouterr().out.splitlines() if "started" in line]  # where to watch it
    assert len(started) == 2 and started[1].endswith(str(tmp_path / "spo" / "seed3" / "train.log"))


def test_the_header_names_the_recipe_and_each_runs_machine(tmp_path):
    root = tmp_path / "runs"
    write_run(root, "spopp", 0, [0.2] * 4)
    write_run(root, "spo", 0, [0.1] * 4)
    write_run(root, "spo", 1, [0.1] * 4)
    for arm, seed in (("spopp", 0), ("spo", 0), ("spo", 1)):
        (root / arm / f"seed{seed}" / "command.json").write_text(
            json.dumps(["python", "train.py", "--config_path", "/x/configs/alfworld_tiny.yaml", "--seed", str(seed)]))
    for arm in ("spopp", "spo"):
        (root / arm / "seed0" / "host.json").write_text(json.dumps({"cpu": "AMD EPYC", "python": "3.11.7"}))
    text = matched_report.report(args_for(root, tmp_path))
    assert "; recipe alfworld_tiny.yaml. Hardware of the runs: AMD EPYC (2 runs), not recorded (1 run)." in text


def test_the_evaluation_size_and_the_start_level_come_from_the_runs(tmp_path):
    root = tmp_path / "runs"
    write_run(root, "spopp", 0, [0.2] * 4)
    text = matched_report.report(args_for(root, tmp_path))
    assert "final policy on 8 rollouts x 16 tasks" in text and "(success before RL 0.20)" in text  # v1 summaries
    write_run(root, "spo", 0, [0.1] * 4, regime={"train_after_rl_estimate": {"episodes": 256}})
    assert "final policy on 256 episodes of the training games" in matched_report.report(args_for(root, tmp_path))


def test_heldout_gains_and_arms_paired_by_seed_hand_derived(tmp_path):
    root = tmp_path / "runs"
    after = {"spopp": (0.25, 0.5), "spo": (0.125, 0.25), "grpo": (0.375, 0.375),
             "event_traj": (0.125, 0.25), "receipt_token": (0.25, 0.25), "receipt_traj": (0.125, 0.125)}
    gains = ({"gain": 0.05, "se": 0.02}, {"gain": 0.03, "se": 0.02})  # past 2 SE, then not
    for arm, held in after.items():
        for seed in (0, 1):
            write_run(root, arm, seed, [0.2] * 20, regime={
                "heldout_before_rl": {"success_rate": 0.1}, "heldout_after_rl": {"success_rate": held[seed]},
                "heldout_after_rl_estimate": {"episodes": 2048}, "heldout_gain_over_warm_start": gains[seed]})
    text = matched_report.report(args_for(root, tmp_path))
    assert "| SPO++ | 2 | 2048 | 0.100 ± 0.000 | 0.375 ± 0.177 | 0.040 ± 0.014 | 1 of 2 |" in text
    # per seed: SPO++ - SPO = +12.5, +25 points; SPO++ - GRPO = -12.5, +12.5
    assert "| SPO++ − SPO, held-out after RL | +18.75 ± 8.84 | ++ (2+/0-) | +12.5, +25.0 |" in text
    assert "| SPO++ − GRPO (G=8), held-out after RL | +0.00 ± 17.68 | -+ (1+/1-) | -12.5, +12.5 |" in text
    assert "| held-out after RL: token − trajectory, event-time tracker | +18.75 ± 8.84 | ++ (2+/0-) |" in text
    assert "| held-out after RL: token − trajectory, receipt-order tracker | +12.50 ± 0.00 |" in text
    assert ("| held-out after RL: interaction (token gain at event-time − at receipt-order) | +6.25 ± 8.84 "
            "| 0+ (1+/0-) |") in text


def test_heldout_section_without_records_or_cells(tmp_path):
    root = tmp_path / "runs"
    write_run(root, "spo", 0, [0.2] * 4)
    assert "(no held-out evaluations in these runs)" in matched_report.report(args_for(root, tmp_path))
    write_run(root, "spopp", 0, [0.2] * 4, regime={"heldout_after_rl": {"success_rate": 0.25}})
    text = matched_report.report(args_for(root, tmp_path))
    assert "| SPO++ | 1 | n/a | n/a | 0.250 | n/a | n/a |" in text
    assert "(held-out 2x2 incomplete: have ['spopp'])" in text


def test_a_continued_campaign_starts_from_the_archived_prior(tmp_path):
    import matched_runs

    kept, root = tmp_path / "kept", tmp_path / "runs"
    assert not matched_runs.use_archived_prior(kept, root)  # nothing archived: the prior is computed
    (kept / "shared").mkdir(parents=True)
    (kept / "shared" / "prior.json").write_text('{"alpha": [1.0]}')
    assert matched_runs.use_archived_prior(kept, root)
    assert (root / "shared" / "prior.json").read_text() == '{"alpha": [1.0]}'
    (kept / "shared" / "prior.json").write_text('{"alpha": [2.0]}')
    assert not matched_runs.use_archived_prior(kept, root)  # the root's own prior is kept
    assert (root / "shared" / "prior.json").read_text() == '{"alpha": [1.0]}'
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert matched_runs.shared_stage(root, [], warm_start=model) == (model.resolve(), root / "shared" / "prior.json")


def math_tir_summary(no_tool_held, train_gain):
    """A Math-TIR run's summary fields: the tool-disabled evaluations before/after RL and
    the final policy's paired gain over the warm start on the training problems."""
    def evaluation(before, after, gain):
        return {"before_rl": {"success_rate": before}, "after_rl": {"success_rate": after},
                "after_rl_estimate": {"episodes": 256}, "gain_over_warm_start": gain}

    fields = {"train_gain_over_warm_start": train_gain}
    for name, after, gain in (("no_tool", 0.0, {"gain": 0.0, "se": 0.0}),
                              ("heldout_no_tool", no_tool_held, {"gain": no_tool_held, "se": 0.05})):
        fields.update({f"{name}_{key}": value for key, value in evaluation(0.0, after, gain).items()})
    return fields


def test_math_tir_step_mean_auc_tool_free_evaluations_and_runs_below_the_warm_start(tmp_path):
    import matched_runs

    root = tmp_path / "runs"
    # 2 updates of 4 trajectories per plotted step; plotted curves per seed
    curves = {("spopp", 0): [0.5, 0.5, 0.8], ("spo", 0): [0.5, 0.5, 0.5],
              ("spopp", 1): [0.6, 0.6, 0.6], ("spo", 1): [0.5, 0.5, 0.8]}
    turns = {0: [2, 2, 2, 2, 1, 1], 1: [2] * 6}  # SPO++ seed 0 stops calling the tool
    for (arm, seed), curve in curves.items():
        per_update = {"diag/num_trajectories": [4] * 6}
        if arm == "spopp":
            per_update["turns_mean"] = turns[seed]
        gain = {"gain": -0.1 if (arm, seed) == ("spo", 1) else 0.1, "se": 0.02}
        write_run(root, arm, seed, [x for x in curve for _ in range(2)], after=0.5, per_update=per_update,
                  regime=math_tir_summary(0.25 if (arm, seed) == ("spopp", 0) else 0.0, gain))
    text = matched_report.report(args_for(root, tmp_path, auc="step_mean"))
    assert "T = 3 common plotted steps of 2 updates x 4 trajectories = 8 trajectories; AUC (step mean" in text
    # step mean: SPO++ 0.6 and 0.6; SPO 0.5 and 0.6
    assert "| SPO++ | 2 | 0.600 ± 0.000 |" in text
    assert "| SPO++ − SPO, AUC | +5.00 ± 7.07 | +0 (1+/0-) | +10.0, +0.0 |" in text
    # the trapezoid: SPO++ 0.575 and 0.6, SPO 0.5 and 0.575
    trapezoid = matched_report.report(args_for(root, tmp_path))
    assert "| SPO++ − SPO, AUC | +5.00 ± 3.54 | ++ (2+/0-) | +7.5, +2.5 |" in trapezoid
    # the tool-disabled evaluations, each arm against the warm start and paired by seed
    assert "| heldout_no_tool | SPO++ | 2 | 256 | 0.000 ± 0.000 | 0.125 ± 0.177 | 0.125 ± 0.177 | 1 of 2 |" in text
    assert "| no_tool | SPO | 2 | 256 | 0.000 ± 0.000 | 0.000 ± 0.000 | 0.000 ± 0.000 | 0 of 2 |" in text
    assert "| SPO++ − SPO, heldout_no_tool after RL | +12.50 ± 17.68 | +0 (1+/0-) | +25.0, +0.0 |" in text
    # no collapse; SPO seed 1 ends 5 SE below the warm start; SPO++'s turns 2 -> (1 + 2) / 2
    assert "| SPO++ | 2 | 0 | none | 0 of 2 | 2.00 → 1.50 |" in text
    assert "| SPO | 2 | 0 | none | 1 of 2 (seed 1) | n/a |" in text
    assert matched_runs.parse_args(["report", "--auc", "step_mean"]).auc == "step_mean"


def test_runs_of_different_batch_sizes_are_refused(tmp_path):
    import pytest

    root = tmp_path / "runs"
    for arm, batch in (("spopp", 4), ("spo", 8)):
        write_run(root, arm, 0, [0.5] * 4, per_update={"diag/num_trajectories": [batch] * 4})
    with pytest.raises(SystemExit, match="different batch sizes \\[4, 8\\]"):
        matched_report.report(args_for(root, tmp_path))


def test_a_warm_start_built_by_the_shared_stage_is_pinned_by_its_digest(tmp_path, monkeypatch):
    import subprocess

    import pytest

    import matched_runs

    def train_prior(command, **kw):  # what `train.py --stage prior` leaves in the shared folder
        shared = tmp_path / "runs" / "shared"
        (shared / "warmstart_model").mkdir(parents=True)
        (shared / "warmstart_model" / "model.safetensors").write_bytes(b"built weights")
        (shared / "prior.json").write_text("{}")
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(matched_runs.subprocess, "run", train_prior)
    model, _ = matched_runs.shared_stage(tmp_path / "runs", ["--config_path", "configs/math_tir_tiny.yaml"])
    record = (tmp_path / "runs" / "shared" / "warm_start.txt").read_text().splitlines()
    assert record == [str(model), f"sha256 {matched_runs.weights_digest(model)}"]
    kept = tmp_path / "kept"
    matched_runs.archive(tmp_path / "runs", kept)
    matched_runs.check_archived_warm_start(kept, model)  # the same build: accepted
    kept_model = kept / "shared" / "warmstart_model"      # kept, so a later campaign can start from it
    assert matched_runs.weights_digest(kept_model) == matched_runs.weights_digest(model)
    (model / "model.safetensors").write_bytes(b"a rebuild that differs")
    with pytest.raises(SystemExit, match="not the one the runs"):
        matched_runs.check_archived_warm_start(kept, model)
