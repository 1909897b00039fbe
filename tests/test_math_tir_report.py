"""The multi-seed report of the Math-TIR job: per-seed before/after, mean ± SE over seeds
(checked against values computed by hand), and the curve figure."""

from __future__ import annotations

import json
import math

import pytest

from rollout_bridge.envs.math_tir.seed_report import format_table, main, mean_and_se, seed_table


def _summary(before, after, no_tool=(0.0, 0.0), heldout=None):
    summary = {"success_before_rl": before, "success_after_rl": after,
               "no_tool_before_rl": {"success_rate": no_tool[0]}, "no_tool_after_rl": {"success_rate": no_tool[1]}}
    if heldout is not None:
        summary["heldout_before_rl"] = {"success_rate": heldout[0]}
        summary["heldout_after_rl"] = {"success_rate": heldout[1]}
    return summary


def test_mean_and_standard_error_by_hand():
    mean, se = mean_and_se([0.5, 0.7, 0.9])
    assert mean == pytest.approx(0.7)
    assert se == pytest.approx(0.2 / math.sqrt(3))  # sample std of (0.5, 0.7, 0.9) is 0.2
    assert math.isnan(mean_and_se([0.4])[1])


def test_seed_table_keeps_evaluations_every_seed_has():
    summaries = {"s0": _summary(0.5, 0.8, heldout=(0.4, 0.9)), "s1": _summary(0.6, 0.7, heldout=(0.5, 0.6)),
                 "s2": _summary(0.7, 0.9)}  # s2 has no held-out evaluation: that row is left out
    rows = {r["evaluation"]: r for r in seed_table(summaries)}
    assert set(rows) == {"train", "no_tool"}
    train = rows["train"]
    assert train["per_seed"]["s1"] == (0.6, 0.7)
    assert train["gain"][0] == pytest.approx((0.3 + 0.1 + 0.2) / 3)
    assert train["gain"][1] == pytest.approx(0.1 / math.sqrt(3))
    assert rows["no_tool"]["after"] == (0.0, 0.0)
    text = format_table(seed_table(summaries))
    assert "| train | 0.500 -> 0.800, 0.600 -> 0.700, 0.700 -> 0.900 |" in text and "+0.200 ± 0.058" in text


def test_command_prints_the_table_and_draws_the_seeds(tmp_path, capsys):
    runs = []
    for seed, (before, after) in enumerate([(0.5, 0.8), (0.6, 0.9)]):
        folder = tmp_path / f"s{seed}"
        folder.mkdir()
        (folder / "summary.json").write_text(json.dumps(_summary(before, after, heldout=(before, after))))
        rows = [{"step": k, "success_rate": before + (after - before) * k / 30, "turns_mean": 1.5 + k / 60}
                for k in range(1, 31)]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs.append(str(folder))
    figure = tmp_path / "fig" / "curves.png"
    rows = main([*runs, "--figure", str(figure)])
    assert [r["evaluation"] for r in rows] == ["train", "no_tool", "heldout"]
    assert figure.stat().st_size > 0 and "| heldout |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="summary.json"):
        main([str(tmp_path / "missing")])
