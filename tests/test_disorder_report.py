"""The designed-disorder report (benchmarks/disorder_report.py) on synthetic campaign folders
whose scores are chosen so every paired difference, SD, t and interval is derived by hand."""

import argparse
import json
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import disorder_report

# two-sided 95% Student t quantiles t_{0.975, df} (tables)
T_975 = {1: 12.706205, 2: 4.302653}


def write_run(root, arm, seed, success, heldout, share, delay=None, before=0.15, gain=None):
    """One finished run: per-update training success, held-out success after RL, measured
    out-of-event-order share and the command that started it (with ``delay`` if given)."""
    folder = root / arm / f"seed{seed}"
    folder.mkdir(parents=True)
    with open(folder / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps({"step": step, "success_rate": s}) + "\n" for step, s in enumerate(success, 1))
    (folder / "summary.json").write_text(json.dumps({
        "success_before_rl": 0.2, "success_after_rl": 0.3, "rl_wall_s": 10.0,
        "event_order": {"received": 100.0, "out_of_event_order": 100 * share, "fraction": share},
        "heldout_before_rl": {"success_rate": before}, "heldout_after_rl": {"success_rate": heldout},
        "heldout_gain_over_warm_start": {"gain": heldout - before if gain is None else gain, "se": 0.01}}))
    command = ["python", "train.py", "--method", arm, "--config_path", "/repo/configs/default.yaml"]
    if delay is not None:
        command += ["--rollout.result_delay_s", str(delay)]
    (folder / "command.json").write_text(json.dumps(command))


@pytest.fixture
def campaign(tmp_path):
    """Level D = 0.5 s, seeds 0-2, 4 updates (2 plotted steps of 2 updates):
      held-out event − receipt = +1, +3, +5 points; AUC event − receipt = +2, +2, +8 points
      (event seed 0's curve 0.30, 0.34 has trapezoid AUC 0.32).
    Level D = 1 s, seeds 0-1, 6 updates (3 plotted steps; only the first 2 are common):
      held-out differences +1, +3 points; AUC over the first 2 steps +10, +12 points (the
      third step, 0.9 vs 0.0, must not enter)."""
    a, b = tmp_path / "d05", tmp_path / "d1"
    for seed, (auc_e, held_e, share_e, share_r) in enumerate([(None, 0.21, 0.10, 0.12), (0.32, 0.23, 0.20, 0.18),
                                                              (0.38, 0.25, 0.30, 0.24)]):
        curve = [0.3, 0.3, 0.34, 0.34] if auc_e is None else [auc_e] * 4
        write_run(a, "spopp", seed, curve, held_e, share_e, delay=0.5)
        write_run(a, "receipt_token", seed, [0.30] * 4, 0.20, share_r, delay=0.5)
    for seed, (auc_e, held_e, held_r) in enumerate([(0.50, 0.30, 0.29), (0.52, 0.33, 0.30)]):
        write_run(b, "spopp", seed, [auc_e] * 4 + [0.9, 0.9], held_e, 0.40 + 0.02 * seed, delay=1)
        write_run(b, "receipt_token", seed, [0.40] * 4 + [0.0, 0.0], held_r, 0.38, delay=1)
    return a, b


def args_for(roots, tmp_path):
    return argparse.Namespace(roots=list(roots), updates_per_step=2, figures=tmp_path / "figures", out=tmp_path / "r.md")


def test_paired_difference_matches_hand_computed_t_interval():
    # d = 1, 3, 5: mean 3, SD 2, SE 2/√3, t = 3√3/2, half-width t_{.975,2}·2/√3
    p = disorder_report.paired({0: 0.21, 1: 0.23, 2: 0.25}, {0: 0.20, 1: 0.20, 2: 0.20})
    se = 0.02 / math.sqrt(3)
    assert p["n"] == 3 and p["seeds"] == [0, 1, 2]
    assert p["mean"] == pytest.approx(0.03) and p["std"] == pytest.approx(0.02)
    assert p["t"] == pytest.approx(3 * math.sqrt(3) / 2)
    assert p["ci"] == pytest.approx([0.03 - T_975[2] * se, 0.03 + T_975[2] * se], abs=1e-6)
    # d = 1, 3 with n = 2: mean 2, SD √2, SE 1, t 2, CI 2 ± 12.706
    p = disorder_report.paired({0: 0.30, 1: 0.33, 7: 0.9}, {0: 0.29, 1: 0.30})
    assert p["seeds"] == [0, 1]
    assert p["std"] == pytest.approx(0.01 * math.sqrt(2)) and p["t"] == pytest.approx(2.0)
    assert p["ci"] == pytest.approx([0.02 - T_975[1] * 0.01, 0.02 + T_975[1] * 0.01], abs=1e-6)
    assert disorder_report.paired({0: 0.1}, {1: 0.1}) is None


def test_levels_read_delay_shares_scores_and_common_auc_horizon(campaign):
    a, b = campaign
    levels = [disorder_report.load_level(root) for root in (a, b)]
    assert [level.delay for level in levels] == [0.5, 1.0]
    assert levels[0].share["spopp"] == pytest.approx({0: 0.10, 1: 0.20, 2: 0.30})
    assert levels[0].gain["receipt_token"] == pytest.approx({0: 0.05, 1: 0.05, 2: 0.05})
    assert disorder_report.pair_share(levels[0], 0) == pytest.approx(0.11)
    t = disorder_report.common_plotted_steps(levels, 2)
    assert t == 2
    auc = disorder_report.auc_of(levels[0], 2, t)
    assert auc["spopp"] == pytest.approx({0: 0.32, 1: 0.32, 2: 0.38})
    auc = disorder_report.auc_of(levels[1], 2, t)  # the third plotted step is left out
    assert auc["spopp"] == pytest.approx({0: 0.50, 1: 0.52}) and auc["receipt_token"] == pytest.approx({0: 0.4, 1: 0.4})


def test_report_tables_and_figure(campaign, tmp_path, capsys):
    text = disorder_report.report(args_for(reversed(campaign), tmp_path))  # sorted by delay whatever the order
    rows = [line for line in text.splitlines() if line.startswith("| 0.5 s |") or line.startswith("| 1 s |")]
    # per arm: shares per seed, mean (range)
    assert "| 0.5 s | SPO++ | 3 | 0: 10.0, 1: 20.0, 2: 30.0 | 20.0 (10.0-30.0) |" in text
    assert "| 0.5 s | receipt x token | 3 | 0: 12.0, 1: 18.0, 2: 24.0 | 18.0 (12.0-24.0) |" in text
    # held-out, D = 0.5: +3.00, SD 2.00, t 3√3/2 = 2.60, CI 3 ± 4.302653·2/√3 = [-1.97, +7.97]
    assert "| 0.5 s | held-out after RL | 3 | +3.00 | 2.00 | 2.60 | [-1.97, +7.97] | 0: +1.0, 1: +3.0, 2: +5.0 |" in rows
    # AUC, D = 0.5: d = 2, 2, 8: mean 4, SD √12 = 3.46, SE 2, t 2.00, CI 4 ± 8.605 = [-4.61, +12.61]
    assert "| 0.5 s | AUC (T = 2) | 3 | +4.00 | 3.46 | 2.00 | [-4.61, +12.61] | 0: +2.0, 1: +2.0, 2: +8.0 |" in rows
    # D = 1: held-out d = 1, 3: [2 ± 12.706] ; AUC d = 10, 12: mean 11, SD √2, t 11, [11 ± 12.706]
    assert "| 1 s | held-out after RL | 2 | +2.00 | 1.41 | 2.00 | [-10.71, +14.71] | 0: +1.0, 1: +3.0 |" in rows
    assert "| 1 s | AUC (T = 2) | 2 | +11.00 | 1.41 | 11.00 | [-1.71, +23.71] | 0: +10.0, 1: +12.0 |" in rows
    assert rows.index(next(r for r in rows if r.startswith("| 0.5 s | held"))) < rows.index(
        next(r for r in rows if r.startswith("| 1 s | held")))
    assert (tmp_path / "figures" / "disorder_dose_response.png").stat().st_size > 0
    assert "](figures/disorder_dose_response.png)" in (tmp_path / "r.md").read_text()


def test_hardware_counts_only_the_two_arms_runs(campaign, tmp_path):
    """A level whose root also holds other arms' runs (a matched campaign's root used as the
    D = 0 level) names the hardware of the compared runs only, not a negative 'not recorded'."""
    a, _ = campaign
    for arm in ("spopp", "receipt_token", "grpo"):
        for seed in range(3 if arm != "grpo" else 1):
            folder = a / arm / f"seed{seed}"
            folder.mkdir(parents=True, exist_ok=True)
            if arm == "grpo":
                (folder / "summary.json").write_text("{}")
            (folder / "host.json").write_text(json.dumps({"cpu": "AMD EPYC"}))
    text = disorder_report.report(args_for([a], tmp_path))
    assert "hardware AMD EPYC (6 runs)\n" in text, text


def test_delay_from_commands(tmp_path):
    write_run(tmp_path / "x", "spopp", 0, [0.3] * 4, 0.2, 0.1)
    assert disorder_report.campaign_delay(tmp_path / "x") is None  # no run sets it: the recipe's
    write_run(tmp_path / "y", "spopp", 0, [0.3] * 4, 0.2, 0.1, delay=0.5)
    write_run(tmp_path / "y", "receipt_token", 0, [0.3] * 4, 0.2, 0.1, delay=2)
    with pytest.raises(SystemExit, match="different --rollout.result_delay_s"):
        disorder_report.campaign_delay(tmp_path / "y")


def test_calibration_command_and_measured_share(tmp_path):
    args = argparse.Namespace(config=tmp_path / "c.yaml", root=tmp_path / "cal", steps=3, seed=1, method="spopp",
                              warm_start=None, extra=["--rollout.batch_size", "4"])
    command = disorder_report.calibration_command(0.25, args)
    assert command[command.index("--rollout.result_delay_s") + 1] == "0.25"
    assert command[command.index("--output_dir") + 1] == str(tmp_path / "cal" / "delay0.25")
    assert command[command.index("--steps") + 1] == "3" and command[-2:] == ["--rollout.batch_size", "4"]
    folder = tmp_path / "cal" / "delay0.25"
    folder.mkdir(parents=True)
    with open(folder / "metrics.jsonl", "w") as f:  # cumulative counters: the last row decides, 12 of 48
        for step, (received, late) in enumerate([(16, 1), (32, 5), (48, 12)], 1):
            f.write(json.dumps({"step": step, "diag/received_total": received, "diag/out_of_event_order_total": late}) + "\n")
    assert disorder_report.measured_share(folder)["fraction"] == pytest.approx(0.25)
    assert disorder_report.calibration_line(0.25, folder, 7.0) == "| 0.25 | 48 | 12 | 25.0 | 7 |"


def test_the_two_arms_differ_in_the_tracker_only():
    """spopp and receipt_token share the measure, the dual clip and the learner's fields; the
    receipt-order retention is fixed at the event-time tracker's rho of configs/default.yaml
    (so no divergence forward runs: the learner's work per update is the same)."""
    import yaml

    from matched_runs import ARMS
    from rollout_bridge.methods.base import MethodConfig

    event, receipt = (MethodConfig.get_choice_class(ARMS[arm])() for arm in disorder_report.ARMS)
    assert (event.measure, event.dual_clip) == (receipt.measure, receipt.dual_clip)
    assert event.learner_fields() == receipt.learner_fields()
    rho = yaml.safe_load(open(os.path.join(disorder_report.REPO, "configs", "default.yaml")))["tracker"]["rho"]
    assert receipt.rho_min == receipt.rho_max == rho
