"""The end-of-job report: success with standard errors over games (games as clusters), the
gain of RL over the warm start paired by game, the margins to the reference successes, the
summary (``summary.json``) and its log lines. ``run_report`` holds the readings of the
run's asynchronous regime and the report's wording."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from rollout_bridge.learning_curve import plot_job_curve
from rollout_bridge.metrics import read_metrics
from rollout_bridge.atomic_files import write_json_atomic
from rollout_bridge.run_folder import RunPaths, log
from rollout_bridge.run_report import (event_order, final_line, lag_histogram, log_regime, reference_name,
                                       stage_times)


def success_estimate(successes, trials) -> dict:
    """Success rate of per-task rollouts and its standard error, games as clusters:

        rate = Σ_g s_g / Σ_g n_g,   se = std_g(s_g / n_g) / √G   (ddof 1; equal n_g)

    (rollouts of one game are correlated, so the SE is over games, not episodes)."""
    successes, trials = np.asarray(successes, np.float64), np.asarray(trials, np.float64)
    if successes.shape != trials.shape or successes.ndim != 1 or not (trials > 0).any():
        raise ValueError("successes and trials must be equal-length 1-D arrays, some trials > 0")
    played = trials > 0   # a game whose every rollout failed (env error) carries no evidence
    successes, trials = successes[played], trials[played]
    per_game = successes / trials
    games = len(per_game)
    se = float(per_game.std(ddof=1) / np.sqrt(games)) if games > 1 else float("nan")
    return {"success_rate": float(successes.sum() / trials.sum()), "se": se, "episodes": int(trials.sum()),
            "games": games}


def paired_gain(before: dict, after: dict) -> dict:
    """After − before on the same games (records with per-game ``successes``/``trials``):

        gain = mean_g(d_g),  se = std_g(d_g) / √G,  d_g = after_g − before_g   (ddof 1)"""
    rate = lambda record: np.asarray(record["successes"], np.float64) / np.asarray(record["trials"], np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        diff = rate(after) - rate(before)
    diff = diff[np.isfinite(diff)]   # games with rollouts on both sides
    if diff.size < 2:
        return {"gain": float(diff.mean()), "se": float("nan")}
    return {"gain": float(diff.mean()), "se": float(diff.std(ddof=1) / np.sqrt(diff.size))}


def margin_text(difference: float, se: float) -> str:
    """'<difference / se> SE', or 'SE 0 (no spread over games)' when the SE is 0 (every
    game agrees: a ratio would print as inf or nan)."""
    return f"{difference / se:+.1f} SE" if se > 0 else "SE 0 (no spread over games)"


def margin_line(name: str, estimate: dict, reference: float | None, what: str, reference_se: float | None = None) -> str:
    """'<name> <rate> ± <se> vs <what> <reference>: margin <k> SE' (one report line). A
    measured reference (``reference_se``, independent of the estimate) widens the SE of
    the difference to sqrt(se² + reference_se²)."""
    line = f"{name}: {estimate['success_rate']:.3f} ± {estimate['se']:.3f} (SE over {estimate['games']} games, " \
           f"{estimate['episodes']} episodes)"
    if reference is None:
        return line
    shown = f"{reference:.3f}" if reference_se is None else f"{reference:.3f} ± {reference_se:.3f} (measured)"
    se = float(np.hypot(estimate["se"], reference_se or 0.0))
    return f"{line} vs {what} {shown}: {margin_text(estimate['success_rate'] - reference, se)}"



def report_run(paths: RunPaths, title: str, rows, train_before: dict | None, train_after: dict,
               extra_before: dict, extra_after: dict, references: dict, reference_se: dict | None = None) -> dict:
    """The end-of-job report: summary fields (success with SEs over games, the held-out
    gain over the warm start paired by game, the reference successes such as the exact
    prompt-blind ceiling and the margins to them, the policy-lag histogram), the log lines
    and ``learning_curve.png``. ``train_*``/``extra_*`` are evaluation records with per-game
    ``successes`` / ``trials``; ``references`` name -> success (``EnvBundle.reference_success``),
    ``reference_se`` name -> SE of a measured one (``EnvBundle.reference_se``)."""
    reference_se = dict(reference_se or {})
    fields: dict[str, Any] = dict(references)
    fields.update({f"{name}_se": se for name, se in reference_se.items()})
    lines = []
    last_update = max((r["step"] for r in rows), default=0)
    held_points = {}
    for name, before, after in (("train", train_before, train_after),
                                *((name, extra_before.get(name), extra_after[name]) for name in extra_after)):
        ceiling = "prompt_blind_ceiling" if name == "train" else f"{name}_prompt_blind_ceiling"
        blind, blind_se = references.get(ceiling), reference_se.get(ceiling)
        blind_name = reference_name(ceiling, blind_se is not None, games=False)
        after_estimate = success_estimate(after["successes"], after["trials"])
        fields[f"{name}_after_rl_estimate"] = after_estimate
        lines.append(margin_line(f"{name} success after RL", after_estimate, blind, blind_name, blind_se))
        if before is not None:
            before_estimate = success_estimate(before["successes"], before["trials"])
            gain = paired_gain(before, after)
            fields[f"{name}_before_rl_estimate"] = before_estimate
            fields[f"{name}_gain_over_warm_start"] = gain
            lines.append(margin_line(f"{name} success of the warm start", before_estimate, blind,
                                     blind_name, blind_se))
            lines.append(f"{name} gain of RL over the warm start: {gain['gain']:+.3f} ± {gain['se']:.3f} "
                         f"(paired by game): {margin_text(gain['gain'], gain['se'])}")
            if name != "train":
                held_points[f"{name} before RL (warm start)"] = (0, before_estimate)
        if name != "train":
            held_points[f"{name} after RL"] = (last_update, after_estimate)
    histogram = lag_histogram(rows)
    fields["policy_lag_histogram"] = histogram
    lines.append("policy lag of trained trajectories: " + ", ".join(f"{k}: {v:.0%}" for k, v in histogram.items()))
    order = event_order(rows)
    if order is not None:
        fields["event_order"] = order
        lines.append(f"results received out of event order: {order['out_of_event_order']:.0f} of "
                     f"{order['received']:.0f} ({order['fraction']:.1%})")
    curve_refs = {"train success before RL (warm start)": None if train_before is None else
                  success_estimate(train_before["successes"], train_before["trials"])["success_rate"]}
    curve_refs.update({reference_name(name, name in reference_se): value for name, value in references.items()})
    plot_job_curve(rows, paths.curve, title, held_points, curve_refs)
    for line in lines:
        log(line)
    return fields


def same_tasks(prior: dict, evaluated: dict) -> dict:
    """The prior's record restricted to the tasks ``evaluated`` played (``evaluation.train_games``
    evaluates a subset after RL): before and after RL then compare the same games."""
    played = np.asarray(evaluated["trials"]) > 0
    if played.all():
        return prior
    successes = np.where(played, prior["successes"], 0)
    trials = np.where(played, prior["trials"], 0)
    return {"successes": successes.tolist(), "trials": trials.tolist(),
            "success_rate": float(successes.sum() / max(trials.sum(), 1))}


def job_wall_times(summary_path: Path, resume: bool, job_wall_s: float) -> dict:
    """``total_wall_s``: the wall time of the jobs that finished the run, the whole job
    (games, warm start, prior, RL, evaluations) that finished it first and every ``--resume``
    of it since (re-exported, re-evaluated or trained on); ``resumed_wall_s``: those
    resumes' part of it. A ``--resume`` adds its ``job_wall_s`` to the figures of the
    summary it replaces, so the first run's time is never lost; without an earlier summary
    (a run that never finished, or no ``--resume``) ``total_wall_s`` is ``job_wall_s``."""
    try:
        earlier = json.loads(Path(summary_path).read_text()) if resume else None
    except (OSError, ValueError):
        earlier = None
    if not isinstance(earlier, dict) or not isinstance(earlier.get("total_wall_s"), (int, float)):
        return {"total_wall_s": job_wall_s}
    return {"total_wall_s": earlier["total_wall_s"] + job_wall_s,
            "resumed_wall_s": earlier.get("resumed_wall_s", 0.0) + job_wall_s}


def write_summary(job, prior: dict | None, successes, trials, before_extra: dict, after_extra: dict,
                  rl_start: float, job_start: float, *, resumed_from: int | None) -> dict:
    """The job's results: ``eval_after.json`` (the final policy's per-task record), the
    report (``report_run``, the async regime) and ``summary.json``; logs the final line.
    ``prior``: the prior's record (success before RL), ``successes`` / ``trials`` per task
    after RL, ``*_extra`` the env kind's extra evaluations; ``rl_start`` / ``job_start``
    the wall times the RL stage (with its evaluations) and the job began (``job_wall_times``:
    a ``--resume`` of a finished run adds its time to the summary's); ``resumed_from`` the
    checkpoint step the RL stage continued from (None: afresh), which tells this job's
    metrics rows from the earlier jobs' (`stage_times`)."""
    cfg, paths = job.cfg, job.paths
    after = float(successes.sum() / max(trials.sum(), 1))
    after_record = {"successes": successes.tolist(), "trials": trials.tolist(), "success_rate": after}
    write_json_atomic(paths.eval_after, after_record)
    rows = read_metrics(paths.root / "metrics.jsonl")
    prior = None if prior is None else same_tasks(prior, after_record)
    before = None if prior is None else prior["success_rate"]
    summary = {"success_before_rl": before, "success_after_rl": after,
               "success_per_step": [r.get("success_rate") for r in rows],
               **stage_times(rows, time.time() - rl_start, resumed_from)}
    summary.update(report_run(paths, f"SPO++ ({cfg.method.name}) on {cfg.env.kind}", rows, prior, after_record,
                              before_extra, after_extra, job.env.reference_success, job.env.reference_se))
    summary["async_regime"] = log_regime(cfg, rows, log)
    if job.env.tasks_record:
        summary["env"] = dict(job.env.tasks_record)
    for name in after_extra:  # e.g. heldout_before_rl / heldout_after_rl (ALFWorld), no_tool_* (Math-TIR)
        summary[f"{name}_before_rl"] = before_extra.get(name)
        summary[f"{name}_after_rl"] = after_extra[name]
    summary.update(job_wall_times(paths.summary, cfg.resume, time.time() - job_start))
    write_json_atomic(paths.summary, summary)
    log(final_line(summary, paths.curve))
    return summary
