"""Tables and figures from matched runs (`matched_runs.py report`): TextWorld, ALFWorld, Math-TIR.

Reads `<root>/<arm>/seed<k>/{metrics.jsonl,summary.json}` and prints markdown:
 1. SPO++ vs SPO vs GRPO: AUC over the common plotted steps (`--auc`: the normalised
    trapezoid of ALFWorld, or the step mean (1/T) Σ r_t of Math-TIR, SPEC 7), last-5 mean,
    success of the final policy (the run's evaluation after RL), paired differences per
    seed; Figure-1-style plot. Collapsed runs, final policies below the warm start, and
    turns per episode (Math-TIR: 1 + tool calls).
 2. The tracker x measure 2x2 (retention 0.875 and dual-clip 2 fixed): C10 per cell, the
    paired effects, and the paper's Table-2 comparisons against SPO; without all four cells,
    the paper's measure screen alone (SPO++ against its trajectory-measure arm, C10 and the
    AUC of the first 10 plotted steps).
 3. Per-batch Cov_n(L, A), the loss-weighted centre trajectory whitening leaves
    (sum L A~ / sum L), length quantiles, and whether the centre's size predicts the
    token-measure gain (paired by tracker and seed).
 4. The regime: policy-lag shares, results received out of event order, held-out success,
    and each 2x2 score regressed on the run's out-of-event-order share (slope per tracker).
 5. Held-out games (where the recipe has them): each arm's gain over the shared warm start,
    runs past 2 SE, and the arms paired by seed (SPO++ vs SPO and GRPO, the 2x2).
 6. Every other evaluation the env kind makes before and after RL (Math-TIR: training and
    held-out problems with the tool disabled), the same way.
A plotted step is `updates_per_step` consecutive updates (8 x 16 = 128 trajectories on
TextWorld; the trajectories per update are read from the runs' metrics).
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spopp_jax.evaluation import (
    area_under_curve,
    c10_score,
    last_mean,
    paired_differences,
    plotted_steps,
)

MAIN_ARMS = ("spopp", "spo", "grpo")
LABELS = {"spopp": "SPO++", "spo": "SPO", "grpo": "GRPO (G=8)", "event_traj": "event x trajectory",
          "receipt_token": "receipt x token", "receipt_traj": "receipt x trajectory"}
CELLS = {("event-time", "token"): "spopp", ("event-time", "trajectory"): "event_traj",
         ("receipt-order", "token"): "receipt_token", ("receipt-order", "trajectory"): "receipt_traj"}
ARM_ORDER = (*MAIN_ARMS, *(a for a in CELLS.values() if a not in MAIN_ARMS))  # tables, figures
COLORS = ("C0", "C3", "C2", "C1", "C4", "C5")  # one per arm of ARM_ORDER


def present(runs) -> list[str]:
    """Arms with runs, in ARM_ORDER (unknown arms last, by name)."""
    return [a for a in ARM_ORDER if a in runs] + sorted(a for a in runs if a not in ARM_ORDER)


@dataclass(frozen=True)
class Run:
    arm: str
    seed: int
    rows: list
    summary: dict

    def series(self, key: str) -> np.ndarray:
        return np.array([row[key] for row in self.rows], dtype=np.float64)

    def curve(self, updates_per_step: int) -> np.ndarray:
        return plotted_steps(self.series("success_rate"), updates_per_step)


def load_runs(root: Path) -> dict[str, dict[int, Run]]:
    """Finished runs only (summary.json written at the end of train.py)."""
    from rollout_bridge.metrics import read_metrics

    runs: dict[str, dict[int, Run]] = {}
    for summary_path in sorted(root.glob("*/seed*/summary.json")):
        folder = summary_path.parent
        arm, seed = folder.parent.name, int(folder.name.removeprefix("seed"))
        runs.setdefault(arm, {})[seed] = Run(arm, seed, read_metrics(folder / "metrics.jsonl"),
                                             json.loads(summary_path.read_text()))
    return runs


def run_records(root: Path, name: str, arms=None) -> list:
    """Each finished run's ``name`` JSON file (command.json, host.json), where present; of the
    runs of ``arms`` only when given."""
    return [json.loads(path.read_text()) for path in sorted(root.glob(f"*/seed*/{name}"))
            if (path.parent / "summary.json").is_file() and (arms is None or path.parent.parent.name in arms)]


def recipes(root: Path) -> list[str]:
    """The recipe files the runs started from (each command.json's --config_path)."""
    names = {Path(c[c.index("--config_path") + 1]).name for c in run_records(root, "command.json")
             if "--config_path" in c[:-1]}
    return sorted(names)


def hardware_text(root: Path, num_runs: int, arms=None) -> str:
    """The machines the `num_runs` runs (of ``arms`` when given) ran on (their host.json), with
    counts; runs without one are counted as not recorded (runs made before host.json existed)."""
    from collections import Counter

    cpus = Counter(record.get("cpu", "?") for record in run_records(root, "host.json", arms))
    parts = [f"{cpu} ({count} run{'s' if count > 1 else ''})" for cpu, count in sorted(cpus.items())]
    missing = num_runs - sum(cpus.values())
    if missing:
        parts.append(f"not recorded ({missing} run{'s' if missing > 1 else ''})")
    return ", ".join(parts)


AUC_MEASURES = {"trapezoid": area_under_curve, "step_mean": lambda curve: float(np.mean(curve))}
AUC_TEXT = {"trapezoid": "normalised trapezoid area", "step_mean": "step mean (1/T) Σ r_t"}


def trajectories_per_update(runs) -> int:
    """Trajectories per learner update, from the runs' metrics (``diag/num_trajectories``;
    16, the CPU recipes' batch, for runs that predate it). Every run must agree."""
    sizes = {int(row["diag/num_trajectories"]) for by_seed in runs.values() for r in by_seed.values()
             for row in r.rows[:1] if "diag/num_trajectories" in row}
    if len(sizes) > 1:
        raise SystemExit(f"the runs train on different batch sizes {sorted(sizes)}: not matched runs")
    return sizes.pop() if sizes else 16


def pm(values, scale: float = 1.0, digits: int = 3) -> str:
    values = np.asarray(values, np.float64) * scale
    if values.size == 1:
        return f"{values[0]:.{digits}f}"
    return f"{values.mean():.{digits}f} ± {values.std(ddof=1):.{digits}f}"


def signs(diff) -> str:
    return "".join("+" if d > 0 else "-" if d < 0 else "0" for d in diff.differences)


def paired_line(name: str, a: dict[int, float], b: dict[int, float], scale: float = 100.0) -> str:
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return f"| {name} | no common seeds | | |"
    diff = paired_differences([a[s] for s in seeds], [b[s] for s in seeds])
    std = "n/a" if np.isnan(diff.std) else f"{diff.std * scale:.2f}"
    per_seed = ", ".join(f"{d * scale:+.1f}" for d in diff.differences)
    return (f"| {name} | {diff.mean * scale:+.2f} ± {std} | {signs(diff)} "
            f"({diff.positive}+/{diff.negative}-) | {per_seed} |")


PAIRED_HEADER = ["| comparison (points = 100 x reward) | mean ± std | signs per seed | per seed |",
                 "|---|---|---|---|"]


# ----------------------------------------------------------------------------- 1. main runs


def main_section(runs, ups: int, figures: Path, title: str = "matched runs", auc_measure: str = "trapezoid") -> list[str]:
    arms = [a for a in MAIN_ARMS if a in runs]
    if not arms:
        return ["(no main runs found)"]
    t_common = min(len(r.curve(ups)) for a in arms for r in runs[a].values())
    measure = AUC_MEASURES[auc_measure]
    auc = {a: {s: measure(r.curve(ups)[:t_common]) for s, r in runs[a].items()} for a in arms}
    k = min(5, t_common)
    last5 = {a: {s: last_mean(r.curve(ups)[:t_common], k) for s, r in runs[a].items()} for a in arms}
    after = {a: {s: r.summary["success_after_rl"] for s, r in runs[a].items()} for a in arms}
    batch = trajectories_per_update(runs)
    lines = [f"T = {t_common} common plotted steps of {ups} updates x {batch} trajectories = "
             f"{ups * batch} trajectories; AUC ({AUC_TEXT[auc_measure]}) and last-5 are "
             "training-rollout success (SPEC 7); "
             f"'after RL' is the final policy on {evaluation_text(runs, arms)}; mean ± sample std over seeds.",
             "", f"| arm | runs | AUC | last-{k} mean | success before RL | success after RL | RL wall time (s) |",
             "|---|---|---|---|---|---|---|"]
    for a in arms:
        rs = runs[a].values()
        lines.append(f"| {LABELS[a]} | {len(runs[a])} | {pm(list(auc[a].values()))} | "
                     f"{pm(list(last5[a].values()))} | {pm([r.summary['success_before_rl'] for r in rs])} | "
                     f"{pm(list(after[a].values()))} | {pm([r.summary['rl_wall_s'] for r in rs], digits=0)} |")
    lines += ["", *PAIRED_HEADER]
    for other in [a for a in ("spo", "grpo") if a in runs and "spopp" in runs]:
        for name, score in (("AUC", auc), (f"last-{k}", last5), ("after RL", after)):
            lines.append(paired_line(f"SPO++ − {LABELS[other]}, {name}", score["spopp"], score[other]))
    path = figures / "matched_runs.png"
    figure_one(runs, arms, ups, t_common, path, title, batch)
    lines += ["", f"![matched runs]({FIG}/{path.name})"]
    return lines


def figure_one(runs, arms, ups: int, t_common: int, path: Path, title: str, batch: int) -> None:
    """Thin per-seed lines, the mean, and a standard-error band per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    steps = np.arange(1, t_common + 1)
    for color, arm in zip(COLORS, arms):
        curves = np.stack([r.curve(ups)[:t_common] for r in runs[arm].values()])
        for curve in curves:
            ax.plot(steps, curve, color=color, lw=0.6, alpha=0.35)
        mean = curves.mean(axis=0)
        se = curves.std(axis=0, ddof=1) / np.sqrt(len(curves)) if len(curves) > 1 else 0 * mean
        ax.plot(steps, mean, color=color, lw=2.2, label=f"{LABELS[arm]} (n={len(curves)})")
        ax.fill_between(steps, mean - se, mean + se, color=color, alpha=0.18)
    ax.set_xlabel(f"plotted step ({ups * batch} trajectories)")
    ax.set_ylabel("training success rate")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


FIG = "@FIGURES@"  # figure folder in links, made relative to where the markdown is read
WARMUP = 8  # updates: the first plotted step
COLLAPSE_LEVEL = 0.05  # a plotted step below this success is "collapsed" (prior success 0.1-0.2)


def evaluation_text(runs, arms) -> str:
    """What 'after RL' measured: the runs' own evaluation size (summary.json), or the v1
    runs' 8 rollouts x 16 tasks when their summaries predate the recorded size."""
    sizes = {(r.summary.get("train_after_rl_estimate") or {}).get("episodes") for a in arms for r in runs[a].values()}
    sizes.discard(None)
    if not sizes:
        return "8 rollouts x 16 tasks"
    return " / ".join(f"{n} episodes" for n in sorted(sizes)) + " of the training games"


def collapse_onset(run: Run, ups: int) -> int | None:
    """A collapsed run: its final policy succeeds < COLLAPSE_LEVEL in its evaluation after
    RL and its training curve ends in plotted steps below COLLAPSE_LEVEL; returns the
    first update of that final stretch, else None."""
    curve = run.curve(ups)
    alive = np.flatnonzero(curve >= COLLAPSE_LEVEL)
    first_dead = 0 if alive.size == 0 else int(alive[-1]) + 1
    if run.summary["success_after_rl"] >= COLLAPSE_LEVEL or first_dead == curve.size:
        return None
    return first_dead * ups + 1


def below_warm_start(run: Run) -> bool | None:
    """The final policy is worse than the shared warm start on the training tasks by more
    than 2 SE of their paired difference (``train_gain_over_warm_start``); None when the
    run did not record it."""
    gain = run.summary.get("train_gain_over_warm_start") or {}
    if "gain" not in gain or not np.isfinite(gain.get("se", np.nan)):
        return None
    return gain["gain"] < -2 * gain["se"]


def turns_text(rs, ups: int) -> str:
    """Mean turns per episode (``turns_mean``) in the first and the last plotted step, mean
    over runs; 'n/a' for runs that did not log it."""
    curves = [plotted_steps(r.series("turns_mean"), ups) for r in rs if all("turns_mean" in row for row in r.rows)]
    if not curves or len(curves) < len(rs):
        return "n/a"
    return f"{np.mean([c[0] for c in curves]):.2f} → {np.mean([c[-1] for c in curves]):.2f}"


def collapse_section(runs, ups: int) -> list[str]:
    before = [r.summary.get("success_before_rl") for a in runs for r in runs[a].values()]
    before = [b for b in before if b is not None]
    prior = f"success before RL {np.mean(before):.2f}" if before else "no success before RL recorded"
    lines = [f"A run counts as collapsed when its final policy succeeds < {COLLAPSE_LEVEL} in its evaluation "
             f"after RL ({prior}) and its training curve ends in plotted steps "
             f"below {COLLAPSE_LEVEL}: the policy has fallen into an absorbing reply (e.g. an empty reply, "
             "whose saturated softmax carries no gradient, or an answer without the tool). 'Below the warm "
             "start': runs whose final policy is worse than the shared warm start on the training tasks by "
             "more than 2 SE (paired by task). Turns per episode: first → last plotted step, mean over runs "
             "(Math-TIR: 1 + tool calls).", "",
             "| arm | runs | collapsed | seed (first update of the collapsed stretch) | below the warm start "
             "| turns per episode |", "|---|---|---|---|---|---|"]
    for arm in present(runs):
        onsets = {s: collapse_onset(r, ups) for s, r in sorted(runs[arm].items())}
        hit = {s: u for s, u in onsets.items() if u is not None}
        where = ", ".join(f"{s} ({u})" for s, u in hit.items()) or "none"
        below = {s: below_warm_start(r) for s, r in sorted(runs[arm].items())}
        graded = [s for s, b in below.items() if b is not None]
        worse = [s for s in graded if below[s]]
        below_cell = (f"{len(worse)} of {len(graded)}" + (f" (seed {', '.join(map(str, worse))})" if worse else "")
                      if graded else "n/a")
        lines.append(f"| {LABELS.get(arm, arm)} | {len(onsets)} | {len(hit)} | {where} | {below_cell} "
                     f"| {turns_text(list(runs[arm].values()), ups)} |")
    return lines


# ----------------------------------------------------------------------------- 2. the 2x2


def c10_by_arm(runs, ups: int) -> dict[str, dict[int, float]]:
    out = {}
    for arm, by_seed in runs.items():
        scores = {s: c10_score(r.curve(ups)) for s, r in by_seed.items() if len(r.curve(ups)) >= 10}
        if scores:
            out[arm] = scores
    return out


def auc_by_arm(runs, ups: int, arms) -> tuple[dict[str, dict[int, float]], int]:
    """AUC over the plotted steps all runs of ``arms`` share, and that step count."""
    arms = [a for a in arms if a in runs]
    t = min(len(r.curve(ups)) for a in arms for r in runs[a].values())
    return {a: {s: area_under_curve(r.curve(ups)[:t]) for s, r in runs[a].items()} for a in arms}, t


def two_by_two(g: dict, score: str) -> list[str]:
    """The 2x2 table of one score and its paired effects (points)."""
    lines = [f"| {score}: tracker \\ measure | token | trajectory |", "|---|---|---|"]
    for tracker in ("event-time", "receipt-order"):
        cells = [g[(tracker, m)] for m in ("token", "trajectory")]
        lines.append(f"| {tracker} | " + " | ".join(f"{pm(list(c.values()))} (n={len(c)})" for c in cells) + " |")
    interaction = {}
    for s in set.intersection(*(set(v) for v in g.values())):
        interaction[s] = (g[("event-time", "token")][s] - g[("event-time", "trajectory")][s]
                          - g[("receipt-order", "token")][s] + g[("receipt-order", "trajectory")][s])
    return lines + [
        "", *PAIRED_HEADER,
        paired_line(f"{score}: token − trajectory, event-time tracker", g[("event-time", "token")], g[("event-time", "trajectory")]),
        paired_line(f"{score}: token − trajectory, receipt-order tracker", g[("receipt-order", "token")], g[("receipt-order", "trajectory")]),
        paired_line(f"{score}: event-time − receipt-order, token measure", g[("event-time", "token")], g[("receipt-order", "token")]),
        paired_line(f"{score}: event-time − receipt-order, trajectory measure", g[("event-time", "trajectory")], g[("receipt-order", "trajectory")]),
        paired_line(f"{score}: interaction (token gain at event-time − at receipt-order)", interaction,
                    {s: 0.0 for s in interaction})]


SCREEN_STEPS = 10  # plotted steps the paper's measure screen reads (C10's)


def measure_screen(runs, ups: int, figures: Path | None = None) -> list[str]:
    """The paper's measure screen (its Table 2 row token vs trajectory measure, SPEC 7): SPO++
    (event-time tracker, token measure) against the same tracker with the trajectory measure,
    paired by seed, on C10 = (AUC(r_1..r_10) + mean(r_6..r_10))/2 and on the AUC of the same
    first 10 plotted steps. The arms may have run different numbers of updates: only the first
    10 plotted steps of each run are read. Empty without a seed both arms ran that far. With
    ``figures``: their curves over those steps (``measure_screen.png``, the paired seeds)."""
    token, traj = CELLS[("event-time", "token")], CELLS[("event-time", "trajectory")]
    c10 = c10_by_arm(runs, ups)
    seeds = sorted(set(c10.get(token, {})) & set(c10.get(traj, {})))
    if not seeds:
        return []
    arms = (token, traj)
    scores = {"C10": {a: {s: c10[a][s] for s in seeds} for a in arms},
              f"AUC (T = {SCREEN_STEPS})": {a: {s: area_under_curve(runs[a][s].curve(ups)[:SCREEN_STEPS])
                                                for s in seeds} for a in arms}}
    batch = trajectories_per_update(runs)
    lines = [f"The measure screen (the paper's Table 2: token vs trajectory measure under SPO++'s event-time "
             f"tracker, retention 0.875 and dual clip c = 2 in both arms): C10 and the AUC over the first "
             f"{SCREEN_STEPS} plotted steps ({SCREEN_STEPS * ups} updates, {SCREEN_STEPS * ups * batch} "
             f"trajectories) of each run, whatever its length; the seeds both arms ran, {seeds}, paired; "
             "mean ± sample std over seeds.", "",
             f"| arm | runs | updates per run | C10 | AUC (T = {SCREEN_STEPS}) |", "|---|---|---|---|---|"]
    for a in arms:
        updates = " / ".join(str(n) for n in sorted({len(runs[a][s].rows) for s in seeds}))
        lines.append(f"| {LABELS[a]} | {len(seeds)} | {updates} | "
                     + " | ".join(pm(list(values[a].values())) for values in scores.values()) + " |")
    lines += ["", *PAIRED_HEADER,
              *(paired_line(f"{score}: token − trajectory, event-time tracker", values[token], values[traj])
                for score, values in scores.items())]
    if figures is not None:
        paired = {a: {s: runs[a][s] for s in seeds} for a in arms}
        figure_one(paired, arms, ups, SCREEN_STEPS, figures / "measure_screen.png",
                   f"measure screen: the first {SCREEN_STEPS} plotted steps", batch)
        lines += ["", f"![measure screen]({FIG}/measure_screen.png)"]
    return lines


def ablation_section(runs, ups: int, figures: Path | None = None) -> list[str]:
    c10 = c10_by_arm(runs, ups)
    if not all(arm in c10 for arm in CELLS.values()):
        screen = measure_screen(runs, ups, figures)
        return [f"(2x2 incomplete: have {sorted(c10)})", *(["", *screen] if screen else [])]
    auc, t = auc_by_arm(runs, ups, [*CELLS.values(), "spo"])
    lines = [f"C10 = (AUC(r_1..r_10) + mean(r_6..r_10))/2 over the first 10 plotted steps "
             f"({10 * ups} updates, {10 * ups * 16} trajectories: the paper's short ablation); AUC over "
             f"all T = {t} common plotted steps. Retention 0.875 (fixed) and dual-clip c = 2 in all four "
             "cells; mean ± sample std over seeds (runs); the event-time x token cell is SPO++.", ""]
    for score, values in (("C10", c10), (f"AUC (T = {t})", auc)):
        lines += [*two_by_two({key: values[arm] for key, arm in CELLS.items()}, score), ""]
    if "spo" in c10:
        lines += ["The paper's Table 2 (against the full SPO recipe: KL-adaptive retention, c = 10, "
                  "trajectory measure):", "", *PAIRED_HEADER]
        for score, values in (("C10", c10), (f"AUC (T = {t})", auc)):
            lines += [paired_line(f"{score}: SPO++ with trajectory measure − SPO", values["event_traj"], values["spo"]),
                      paired_line(f"{score}: SPO++ (token measure) − SPO", values["spopp"], values["spo"]),
                      paired_line(f"{score}: token − trajectory (SPO++)", values["spopp"], values["event_traj"])]
    return lines


# ----------------------------------------------------------------------------- 3. Cov_n(L, A)


def window_mean(run: Run, key: str, first: int | None = None, absolute: bool = False) -> float:
    values = run.series(key)[:first]
    return float(np.mean(np.abs(values) if absolute else values))


def covariance_section(runs, ups: int, figures: Path) -> list[str]:
    keys = [("diag/cov_n_length_advantage", False), ("diag/center_after_trajectory_whitening", False),
            ("diag/center_after_trajectory_whitening", True), ("diag/center_after_token_whitening", True),
            ("diag/length_q10", False), ("diag/length_q50", False), ("diag/length_q90", False)]
    lines = ["Per batch (16 trajectories), averaged over every update of a run, then mean ± std over "
             "runs. Cov_n is of the RAW advantages A = R − v̂ (GRPO: R − group mean); the centre is "
             "Σ L Ã / Σ L after trajectory whitening (= Cov_n(L, Ã)/L̄, SPEC Eq. 5), logged for every "
             "batch whatever measure the run trains with; L = action tokens.", "",
             "| arm | Cov_n(L, A) | centre (signed) | abs(centre) | abs(centre), token whitening | L q10 | L q50 | L q90 |",
             "|---|---|---|---|---|---|---|---|"]
    for arm in present(runs):
        by_seed = runs[arm]
        cells = [pm([window_mean(r, k, absolute=a) for r in by_seed.values()]) for k, a in keys]
        lines.append(f"| {LABELS.get(arm, arm)} | " + " | ".join(cells) + " |")
    covariance_figure(runs, ups, figures / "centre_through_training.png")
    lines += ["", f"![centre through training]({FIG}/centre_through_training.png)", "",
              *prediction_lines(runs, ups, figures)]
    return lines


def covariance_figure(runs, ups: int, path: Path) -> None:
    """Per plotted step, mean over seeds: Cov_n(L, A), the trajectory-whitening centre and
    the median length, for every arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = (("diag/cov_n_length_advantage", "Cov_n(L, A), raw advantages"),
            ("diag/center_after_trajectory_whitening", "centre after trajectory whitening"),
            ("diag/length_q50", "median action tokens L"))
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for color, arm in zip(COLORS, present(runs)):
        for ax, (key, title) in zip(axes, keys):
            series = [plotted_steps(r.series(key), ups) for r in runs[arm].values()]
            t = min(len(x) for x in series)
            mean = np.mean([x[:t] for x in series], axis=0)
            ax.plot(np.arange(1, t + 1), mean, color=color, label=LABELS.get(arm, arm))
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("plotted step")
            ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def prediction_lines(runs, ups: int, figures: Path) -> list[str]:
    c10 = c10_by_arm(runs, ups)
    lines = [*predicts(runs, "C10", c10, 10 * ups, figures / "centre_vs_token_gain.png"), ""]
    if not all(a in runs for a in CELLS.values()):  # the AUC horizon is common to all four cells
        return [*lines, "(AUC: needs all four tracker x measure arms)"]
    auc, t = auc_by_arm(runs, ups, CELLS.values())
    return [*lines, *predicts(runs, f"AUC (T = {t})", auc, t * ups, figures / "centre_vs_token_gain_auc.png")]


def correlation(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Pearson r and its two-sided permutation p-value (20,000 permutations, seed 0)."""
    r = float(np.corrcoef(x, y)[0, 1])
    rng = np.random.default_rng(0)
    null = np.array([np.corrcoef(x, rng.permutation(y))[0, 1] for _ in range(20000)])
    return r, float(np.mean(np.abs(null) >= abs(r)))


def predicts(runs, score: str, values: dict, window: int, path: Path) -> list[str]:
    """Token-measure gain of ``score`` (token − trajectory, same tracker and seed) against the
    mean abs(centre) from three sources: the trajectory-measure run and the token-measure run
    over the updates the score covers, and both runs' first plotted step (before they differ
    much). The first two are outcomes of the runs themselves (a run's success rate moves
    its centre), so only the third is a predictor measured before the effect."""
    key = "diag/center_after_trajectory_whitening"
    pairs = []
    for tracker in ("event-time", "receipt-order"):
        token, traj = CELLS[(tracker, "token")], CELLS[(tracker, "trajectory")]
        if token not in values or traj not in values:
            continue
        for s in sorted(set(values[token]) & set(values[traj])):
            a, b = runs[traj][s], runs[token][s]
            sources = (window_mean(a, key, window, absolute=True), window_mean(b, key, window, absolute=True),
                       0.5 * (window_mean(a, key, WARMUP, absolute=True) + window_mean(b, key, WARMUP, absolute=True)))
            pairs.append((tracker, s, sources, values[token][s] - values[traj][s]))
    if len(pairs) < 3:
        return [f"({score}: too few token/trajectory pairs to relate the centre to the gain)"]
    y = np.array([p[3] for p in pairs])
    lines = [f"Does the centre's size predict the token-measure gain in {score}? {len(pairs)} pairs "
             f"(tracker x seed); gain (token − trajectory) {100 * y.mean():+.2f} ± {100 * y.std(ddof=1):.2f} "
             "points; Pearson r with a two-sided permutation p (20,000 permutations):", "",
             "| mean abs(centre) taken from | range | r | p |", "|---|---|---|---|"]
    names = (f"trajectory-measure run, first {window} updates", f"token-measure run, first {window} updates",
             f"both runs, first {WARMUP} updates (before the arms diverge)")
    for i, name in enumerate(names):
        x = np.array([p[2][i] for p in pairs])
        if np.ptp(x) == 0 or np.ptp(y) == 0:
            lines.append(f"| {name} | constant | n/a | n/a |")
            continue
        r, p_value = correlation(x, y)
        lines.append(f"| {name} | {x.min():.3f} to {x.max():.3f} | {r:+.2f} | {p_value:.3f} |")
    scatter([(p[0], p[1], p[2][0], p[3]) for p in pairs], path, score)
    return [*lines, "", f"![centre vs gain]({FIG}/{path.name})"]


def scatter(pairs, path: Path, score: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.6))
    for tracker, marker in (("event-time", "o"), ("receipt-order", "s")):
        pts = [(p[2], 100 * p[3]) for p in pairs if p[0] == tracker]
        if pts:
            ax.scatter(*zip(*pts), marker=marker, label=tracker)
    ax.axhline(0, color="gray", lw=0.8)
    ax.set_xlabel("mean abs(centre) after trajectory whitening")
    ax.set_ylabel(f"{score} gain, token − trajectory (points)", fontsize=8)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- 5. held-out games


def after_by_arm(runs, name: str) -> dict[str, dict[int, float]]:
    """Success of each run's final policy in the evaluation ``name`` (``<name>_after_rl``
    of summary.json: heldout, no_tool, heldout_no_tool, ...), where recorded."""
    out = {}
    for arm, by_seed in runs.items():
        scores = {s: r.summary[f"{name}_after_rl"]["success_rate"] for s, r in by_seed.items()
                  if (r.summary.get(f"{name}_after_rl") or {}).get("success_rate") is not None}
        if scores:
            out[arm] = scores
    return out


def heldout_by_arm(runs) -> dict[str, dict[int, float]]:
    """Held-out success of each run's final policy (games never trained on), where recorded."""
    return after_by_arm(runs, "heldout")


def evaluation_cells(rs, name: str, after: dict[int, float]) -> list[str]:
    """One arm's row for the evaluation ``name``: episodes per run, success before and after
    RL, the runs' paired gains over the warm start and how many pass +2 SE and -2 SE."""
    gains = [r.summary.get(f"{name}_gain_over_warm_start") or {} for r in rs]
    graded = [g for g in gains if "gain" in g]
    past = sum(1 for g in graded if g["gain"] > 2 * g.get("se", np.inf))
    below = sum(1 for g in graded if g["gain"] < -2 * g.get("se", np.inf))
    episodes = sorted({(r.summary.get(f"{name}_after_rl_estimate") or {}).get("episodes") for r in rs} - {None})
    before = [b for r in rs if (b := (r.summary.get(f"{name}_before_rl") or {}).get("success_rate")) is not None]
    return [" / ".join(map(str, episodes)) or "n/a", pm(before) if before else "n/a", pm(list(after.values())),
            pm([g["gain"] for g in graded]) if graded else "n/a",
            f"{past} of {len(graded)}" + (f" ({below} below −2 SE)" if below else "") if graded else "n/a"]


def heldout_section(runs) -> list[str]:
    """Per arm: held-out success before/after RL, the runs' paired gains over the warm start
    and how many pass 2 SE; then the arms paired by seed (every arm of a seed meets the same
    held-out episodes from the same warm-start evaluation), SPO++ against SPO and GRPO and
    the tracker x measure 2x2."""
    held = heldout_by_arm(runs)
    if not held:
        return ["(no held-out evaluations in these runs)"]
    lines = ["The final policy of each run on games never trained on, against the shared warm start on the "
             "same episodes (common random numbers: the warm start's evaluation is the same for every arm of "
             "a seed, so arms are paired by seed). Gain: a run's paired gain over the warm start (its SE "
             "from per-game differences); 'past 2 SE': runs whose gain exceeds twice its own SE; mean ± "
             "sample std over seeds.", "",
             "| arm | runs | episodes per run | held-out before RL | held-out after RL | gain over warm start "
             "| runs past 2 SE |", "|---|---|---|---|---|---|---|"]
    for arm in present(runs):
        if arm not in held:
            continue
        rs = [runs[arm][s] for s in sorted(held[arm])]
        lines.append(f"| {LABELS.get(arm, arm)} | {len(rs)} | " + " | ".join(evaluation_cells(rs, "heldout", held[arm])) + " |")
    lines += ["", *PAIRED_HEADER]
    for other in [a for a in ("spo", "grpo") if a in held and "spopp" in held]:
        lines.append(paired_line(f"SPO++ − {LABELS[other]}, held-out after RL", held["spopp"], held[other]))
    if all(arm in held for arm in CELLS.values()):
        lines += ["", *two_by_two({key: held[arm] for key, arm in CELLS.items()}, "held-out after RL")]
    else:
        lines += ["", f"(held-out 2x2 incomplete: have {sorted(held)})"]
    return lines


# ----------------------------------------------------------------------------- 6. other evaluations


def other_evaluations(runs) -> list[str]:
    """Names of the env kind's evaluations besides the training tasks and held-out games
    that some run recorded after RL (summary.json ``<name>_after_rl``), sorted."""
    names = {key.removesuffix("_after_rl") for by_seed in runs.values() for r in by_seed.values()
             for key, value in r.summary.items()
             if key.endswith("_after_rl") and isinstance(value, dict) and "success_rate" in value}
    return sorted(names - {"heldout"})


def other_evaluations_section(runs) -> list[str]:
    """Per evaluation and arm (Math-TIR: ``no_tool``, ``heldout_no_tool``, the training and
    held-out problems with the tool disabled): success before/after RL and the gain over the
    warm start, as for the held-out games; then SPO++ against SPO and GRPO paired by seed."""
    names = other_evaluations(runs)
    if not names:
        return ["(no other evaluations in these runs)"]
    lines = ["The env kind's other evaluations of the final policy, each against the shared warm start on "
             "the same episodes, as for the held-out games (no_tool: the training problems with the tool "
             "disabled; heldout_no_tool: the held-out ones); mean ± sample std over seeds.", "",
             "| evaluation | arm | runs | episodes per run | before RL | after RL | gain over warm start "
             "| runs past 2 SE |", "|---|---|---|---|---|---|---|---|"]
    paired = []
    for name in names:
        after = after_by_arm(runs, name)
        for arm in present(runs):
            if arm not in after:
                continue
            rs = [runs[arm][s] for s in sorted(after[arm])]
            lines.append(f"| {name} | {LABELS.get(arm, arm)} | {len(rs)} | "
                         + " | ".join(evaluation_cells(rs, name, after[arm])) + " |")
        for other in [a for a in ("spo", "grpo") if a in after and "spopp" in after]:
            paired.append(paired_line(f"SPO++ − {LABELS[other]}, {name} after RL", after["spopp"], after[other]))
    return [*lines, "", *PAIRED_HEADER, *paired] if paired else lines


# ----------------------------------------------------------------------------- entry


# ----------------------------------------------------------------------------- 4. regime


def _mean_std(values) -> str:
    values = [v for v in values if v is not None]
    return pm(values, scale=100.0, digits=1) if values else "n/a"


def regime_section(runs) -> list[str]:
    """Per arm, over seeds: the policy lag of trained trajectories (share per lag), the
    share of results received out of event order (a newer event's result came first), and
    held-out success before and after RL where the recipe has held-out games."""
    lags = sorted({int(k) for by_seed in runs.values() for r in by_seed.values()
                   for k in r.summary.get("policy_lag_histogram", {})})
    if not lags:
        return ["(these runs predate the policy-lag and event-order records)"]
    lines = ["Percent, mean ± std over seeds. A result is out of event order when a result of a "
             "newer policy event was received before it (receipt order ≠ event order); "
             "'held-out' is the final policy on games never trained on.", "",
             "| arm | runs | " + " | ".join(f"lag {k}" for k in lags)
             + " | out of event order | held-out before RL | held-out after RL |",
             "|---|---|" + "---|" * (len(lags) + 3)]
    for arm in present(runs):
        rs = list(runs[arm].values())
        cells = [_mean_std([r.summary.get("policy_lag_histogram", {}).get(str(k), 0.0) for r in rs]) for k in lags]
        order = _mean_std([r.summary.get("event_order", {}).get("fraction") for r in rs])
        held = [_mean_std([(r.summary.get(f"heldout_{when}_rl") or {}).get("success_rate") for r in rs])
                for when in ("before", "after")]
        lines.append(f"| {LABELS.get(arm, arm)} | {len(rs)} | " + " | ".join(cells) + f" | {order} | "
                     + " | ".join(held) + " |")
    return lines


MIN_RUNS_FOR_SLOPE = 7  # five coefficients and two residual degrees of freedom


def share_slopes(rows) -> dict[str, tuple[float, float]] | None:
    """OLS of a run's score on its out-of-event-order share, tracker and measure:
    y = b0 + b1·[trajectory] + b2·[receipt] + b3·share + b4·share·[receipt]. Returns
    (estimate, standard error) of the slope at event-time (b3), at receipt-order (b3 + b4)
    and their difference (b4); None when the design cannot identify them.
    ``rows``: (tracker, measure, share, y)."""
    if len(rows) < MIN_RUNS_FOR_SLOPE:
        return None
    receipt = np.array([r[0] == "receipt-order" for r in rows], np.float64)
    traj = np.array([r[1] == "trajectory" for r in rows], np.float64)
    share = np.array([r[2] for r in rows], np.float64)
    y = np.array([r[3] for r in rows], np.float64)
    x = np.stack([np.ones_like(y), traj, receipt, share, share * receipt], axis=1)
    if np.linalg.matrix_rank(x) < x.shape[1]:
        return None
    beta, *_ = np.linalg.lstsq(x, y, rcond=None)
    residual = y - x @ beta
    cov = np.linalg.inv(x.T @ x) * (residual @ residual) / (len(y) - x.shape[1])
    contrasts = {"event-time": [0, 0, 0, 1, 0], "receipt-order": [0, 0, 0, 1, 1], "receipt − event": [0, 0, 0, 0, 1]}
    return {name: (float(np.dot(c, beta)), float(np.sqrt(np.dot(c, cov @ np.asarray(c, np.float64)))))
            for name, c in contrasts.items()}


def no_fit_reason(rows) -> str:
    """Why ``share_slopes`` identifies no slope for these (tracker, measure, share, y) rows."""
    for position, kind in ((0, "tracker"), (1, "measure")):
        seen = sorted({r[position] for r in rows})
        if len(seen) < 2:
            return f"runs of one {kind} only ({', '.join(seen) or 'none'}): the 2x2 arms were not run"
    shares = {round(100 * r[2], 6) for r in rows}
    if len(shares) == 1:
        return f"every run has the same share ({shares.pop():.0f}%), so no slope"
    if len(rows) < MIN_RUNS_FOR_SLOPE:
        return f"{len(rows)} runs, fewer than the {MIN_RUNS_FOR_SLOPE} the fit needs"
    return "the share does not vary within one of the trackers"


def order_effect_lines(runs, ups: int) -> list[str]:
    """Does a run's score fall with its share of results received out of event order, and
    more so under the receipt-order tracker (whose estimates that order changes) than under
    the event-time one (invariant to it)? The 2x2 cells only (same recipe otherwise)."""
    arms = [a for a in CELLS.values() if a in runs]
    scores = {"success after RL": {a: {s: r.summary.get("success_after_rl") for s, r in runs[a].items()} for a in arms}}
    held = heldout_by_arm(runs)
    if any(a in held for a in arms):
        scores["held-out after RL"] = {a: held[a] for a in arms if a in held}
    if arms:
        auc, t = auc_by_arm(runs, ups, arms)
        scores[f"AUC (T = {t})"] = auc
    lines = ["Observational: the share is not set by the experiment (async timing decides it), so a "
             "slope is an association. Per run, score = b0 + b1·[trajectory measure] + b2·[receipt-order] "
             "+ slope·share (its own slope per tracker), OLS over the 2x2 runs; points of score per "
             "10 points of share, ± standard error.", "",
             "| score | runs | share range, event-time | share range, receipt-order | slope, event-time "
             "| slope, receipt-order | receipt − event |", "|---|---|---|---|---|---|---|"]
    for score, values in scores.items():
        rows = [(tracker, measure, runs[arm][s].summary["event_order"]["fraction"], v)
                for (tracker, measure), arm in CELLS.items() if arm in values
                for s, v in values[arm].items()
                if v is not None and "fraction" in runs[arm][s].summary.get("event_order", {})]
        fit = share_slopes(rows)
        if fit is None:
            lines.append(f"| {score} | {len(rows)} | no fit: {no_fit_reason(rows)} | | | | |")
            continue
        ranges = [[100 * r[2] for r in rows if r[0] == tracker] for tracker in ("event-time", "receipt-order")]
        cells = [f"{10 * b:+.2f} ± {10 * se:.2f}" for b, se in fit.values()]
        lines.append(f"| {score} | {len(rows)} | " + " | ".join(f"{min(r):.0f}-{max(r):.0f}%" for r in ranges)
                     + " | " + " | ".join(cells) + " |")
    return lines


def report(args) -> str:
    import jax
    from _hardware import cpu_model

    runs = load_runs(args.root)
    if not runs:
        raise SystemExit(f"no finished runs under {args.root}")
    ups = args.updates_per_step
    walls = [r.summary["rl_wall_s"] for by_seed in runs.values() for r in by_seed.values()]
    repo = Path(__file__).resolve().parent.parent
    root = args.root.resolve()
    shown = root.relative_to(repo) if root.is_relative_to(repo) else root
    recipe = ", ".join(recipes(args.root)) or "recipe not recorded"
    num_runs = sum(len(by_seed) for by_seed in runs.values())
    lines = [f"Runs under `{shown}`: " + ", ".join(f"{a} {sorted(s)}" for a, s in sorted(runs.items()))
             + f"; recipe {recipe}. Hardware of the runs: {hardware_text(args.root, num_runs)}. "
             f"Report made on {cpu_model()}; python {platform.python_version()}, jax {jax.__version__}. "
             f"RL wall time per run {min(walls):.0f} to {max(walls):.0f} s, {sum(walls) / 60:.0f} min in all.",
             "", "### SPO++ vs SPO vs GRPO", "",
             *main_section(runs, ups, args.figures, f"{recipe}: matched runs (training success)", args.auc),
             "", "### Collapsed runs", "", *collapse_section(runs, ups),
             "", "### Tracker x measure (2x2) and the measure ablation", "", *ablation_section(runs, ups, args.figures),
             "", "### Length-advantage covariance and the loss-weighted centre", "",
             *covariance_section(runs, ups, args.figures),
             "", "### Held-out games", "", *heldout_section(runs),
             "", "### Other evaluations", "", *other_evaluations_section(runs),
             "", "### Policy lag, event order and held-out success", "", *regime_section(runs),
             "", "Score against the out-of-event-order share:", "", *order_effect_lines(runs, ups)]
    text = "\n".join(lines) + "\n"
    figures = args.figures.resolve()
    if args.out is not None:
        args.out.write_text(text.replace(FIG, os.path.relpath(figures, args.out.resolve().parent)))
    text = text.replace(FIG, os.path.relpath(figures, repo / "docs"))  # as read from docs/
    print(text)
    return text
