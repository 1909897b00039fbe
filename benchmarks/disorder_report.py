"""The policy clock under designed disorder: event-time vs receipt-order tracker against the
measured share of results received out of event order.

`--rollout.result_delay_s D` holds each finished episode a seeded U(0, D) seconds before
the orchestrator receives it (rollout_bridge/orchestrator.py), so results arrive out of
event order by design; each run's summary.json records the share it measured
(``event_order.fraction``). One campaign of `matched_runs.py` per delay level, each with
the two arms that differ in the tracker only:

    spopp          SPO++: event-time tracker (weights by policy event, evidence visible to
                   dispatch at receipt), retention tracker.rho = 0.875, token measure, dual clip 2
    receipt_token  SPO's receipt-order tracker (retention per result of the task, in arrival
                   order, evidence visible after the update that consumes it), retention fixed
                   at 0.875 (no divergence forward), token measure, dual clip 2

(the sampler, its floor and form, the prior, the frozen v̂, the advantage A = R − v̂, the
whitening, the loss and the learner's work per update are the same; methods/ablation.py).

    python benchmarks/disorder_report.py calibrate --delays 0 0.5 1 2 4 \
        --config configs/default.yaml --warm-start assets/textworld_text_warmstart --steps 20
        # one short run per delay (seed 0, spopp): prints each run's out-of-event-order share,
        # to choose the levels of ~0 / ~20 / ~40 % (the evaluations after RL are cut to
        # 1 episode per held-out game and 1 training game: shares, not scores, come out of it)
    python benchmarks/disorder_report.py report runs/disorder/d0 runs/disorder/d1 runs/disorder/d2 \
        --figures docs/figures/disorder --out docs/results/disorder/report.md

The campaign (levels D0 = 0 and D1, D2 from `calibrate`; the first level computes the shared
prior, the others start from the same one):

    for D in 0 D1 D2; do
      mkdir -p runs/disorder/d$D/shared
      [ $D = 0 ] || cp runs/disorder/d0/shared/prior.json runs/disorder/d$D/shared/
      python benchmarks/matched_runs.py run --config configs/default.yaml \
          --warm-start assets/textworld_text_warmstart --drain config --steps 120 \
          --arms spopp receipt_token --seeds 0 1 2 3 4 5 --root runs/disorder/d$D \
          --archive docs/results/disorder/d$D --extra --rollout.result_delay_s $D
      python benchmarks/matched_runs.py archive --root runs/disorder/d$D --to docs/results/disorder/d$D
    done

3 levels x 2 arms x 6 seeds = 36 runs (their time per run on a 2-core CPU: docs/RESULTS.md,
"The clock under designed disorder"; a delay lengthens each update; a seed's evaluation before
RL is played once and reused at every level, since fixed-policy records do not key the delay);
seeds run seed-major, so a
partial campaign is still paired. The two arms of a seed may run at once (one
`matched_runs.py run --arms <arm>` per arm on the same root): a pair then shares its
machine state.

`report` takes one campaign root per level (its runs under `<root>/<arm>/seed<k>/`, as
`matched_runs.py` writes them). A level's delay D is read from its runs' command.json
(`--rollout.result_delay_s`; "recipe's" when no run sets it). Per level: each run's measured
share, its mean and range per arm; each arm's held-out success before and after RL and its
gain over the shared warm start; AUC of the training curve over the plotted steps every run
of every level shares (SPEC 7); and event − receipt paired by seed, for held-out success
after RL and for AUC: mean, sample SD, t = mean / (SD/√n) and the 95% t interval (n − 1
degrees of freedom). One figure: each seed's difference against the pair's measured share
(the mean of its two runs'), with each level's mean ± 95% CI.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from matched_report import FIG, LABELS, hardware_text, heldout_by_arm, load_runs, pm, recipes, run_records  # noqa: E402

EVENT, RECEIPT = "spopp", "receipt_token"  # arms (matched_runs.py ARMS) differing in the tracker only
ARMS = (EVENT, RECEIPT)
DELAY_FLAG = "--rollout.result_delay_s"
CI_LEVEL = 0.95


@dataclass(frozen=True)
class Level:
    """One campaign root: its delay (None: not set by any run) and per-arm, per-seed records."""

    root: Path
    delay: float | None
    runs: dict
    share: dict[str, dict[int, float]]
    heldout_before: dict[str, dict[int, float]]
    heldout: dict[str, dict[int, float]]
    gain: dict[str, dict[int, float]]


def campaign_delay(root: Path) -> float | None:
    """The ``--rollout.result_delay_s`` every finished run under ``root`` was started with
    (its command.json); None when none sets it; SystemExit when the runs disagree."""
    values = set()
    for command in run_records(root, "command.json"):
        if DELAY_FLAG in command[:-1]:
            values.add(float(command[command.index(DELAY_FLAG) + 1]))
    if len(values) > 1:
        raise SystemExit(f"{root}: runs with different {DELAY_FLAG} {sorted(values)}: one delay per campaign root")
    return values.pop() if values else None


def summary_values(runs, arm: str, read) -> dict[int, float]:
    """``read(summary)`` of each run of ``arm`` where it is recorded (not None)."""
    out = {}
    for seed, run in runs.get(arm, {}).items():
        value = read(run.summary)
        if value is not None:
            out[seed] = float(value)
    return out


def load_level(root: Path) -> Level:
    runs = load_runs(root)
    if not any(arm in runs for arm in ARMS):
        raise SystemExit(f"{root}: no finished {EVENT} or {RECEIPT} runs")
    held = heldout_by_arm(runs)
    return Level(
        root=root, delay=campaign_delay(root), runs=runs,
        share={a: summary_values(runs, a, lambda s: (s.get("event_order") or {}).get("fraction")) for a in ARMS},
        heldout_before={a: summary_values(runs, a, lambda s: (s.get("heldout_before_rl") or {}).get("success_rate"))
                        for a in ARMS},
        heldout={a: held.get(a, {}) for a in ARMS},
        gain={a: summary_values(runs, a, lambda s: (s.get("heldout_gain_over_warm_start") or {}).get("gain"))
              for a in ARMS})


def common_plotted_steps(levels, ups: int) -> int:
    """Plotted steps every run of both arms at every level has (the AUC horizon)."""
    return min(len(r.curve(ups)) for level in levels for a in ARMS for r in level.runs.get(a, {}).values())


def auc_of(level: Level, ups: int, t: int) -> dict[str, dict[int, float]]:
    """Normalised trapezoid AUC (SPEC 7) of each run's first ``t`` plotted steps."""
    from spopp_jax.evaluation import area_under_curve

    return {a: {s: area_under_curve(r.curve(ups)[:t]) for s, r in level.runs.get(a, {}).items()} for a in ARMS}


def paired(a: dict[int, float], b: dict[int, float]) -> dict | None:
    """a − b over common seeds (``rollout_bridge.yardstick.paired_by_seed``: mean, sample SD,
    SE = SD/√n, the 95% t interval on n − 1 df) and t = mean / SE; None without common seeds."""
    from rollout_bridge.yardstick import paired_by_seed

    if not set(a) & set(b):
        return None
    out = paired_by_seed(a, b, CI_LEVEL)
    out["t"] = out["mean"] / out["se"] if out["n"] > 1 and out["se"] > 0 else float("nan")
    return out


def pair_share(level: Level, seed: int) -> float | None:
    """A seed's measured disorder: the mean of its two runs' shares."""
    shares = [level.share[a].get(seed) for a in ARMS]
    return None if None in shares else float(np.mean(shares))


def delay_text(delay: float | None) -> str:
    return "recipe's" if delay is None else f"{delay:g} s"


def _num(x: float, digits: int = 2, sign: str = "") -> str:
    return "n/a" if not np.isfinite(x) else f"{x:{sign}.{digits}f}"


def shares_cell(values: dict[int, float]) -> tuple[str, str]:
    """(per-seed shares, 'mean (min-max)') in percent."""
    if not values:
        return "n/a", "n/a"
    pct = {s: 100 * v for s, v in sorted(values.items())}
    per_seed = ", ".join(f"{s}: {v:.1f}" for s, v in pct.items())
    vals = list(pct.values())
    return per_seed, f"{np.mean(vals):.1f} ({min(vals):.1f}-{max(vals):.1f})"


def arm_lines(levels) -> list[str]:
    lines = ["| D | arm | runs | out of event order per seed (%) | mean (range) | held-out before RL "
             "| held-out after RL | gain over warm start |", "|---|---|---|---|---|---|---|---|"]
    for level in levels:
        for arm in ARMS:
            if arm not in level.runs:
                continue
            per_seed, summary = shares_cell(level.share[arm])
            cells = [pm(list(d[arm].values())) if d[arm] else "n/a"
                     for d in (level.heldout_before, level.heldout, level.gain)]
            lines.append(f"| {delay_text(level.delay)} | {LABELS[arm]} | {len(level.runs[arm])} | {per_seed} "
                         f"| {summary} | " + " | ".join(cells) + " |")
    return lines


def paired_rows(level: Level, scores: dict[str, dict[str, dict[int, float]]]) -> list[tuple[str, dict | None]]:
    return [(name, paired(values[EVENT], values[RECEIPT])) for name, values in scores.items()]


def paired_lines(levels, ups: int, t: int) -> tuple[list[str], dict]:
    """The paired table and, per level, {score name: paired dict} for the figure."""
    lines = [f"| D | score | pairs | mean | SD | t | {CI_LEVEL:.0%} CI | per seed |", "|---|---|---|---|---|---|---|---|"]
    results = {}
    for level in levels:
        scores = {"held-out after RL": level.heldout, f"AUC (T = {t})": auc_of(level, ups, t)}
        results[level.root] = dict(paired_rows(level, scores))
        for name, p in results[level.root].items():
            if p is None:
                lines.append(f"| {delay_text(level.delay)} | {name} | 0 | no common seeds | | | | |")
                continue
            per_seed = ", ".join(f"{s}: {100 * d:+.1f}" for s, d in zip(p["seeds"], p["differences"]))
            lo, hi = (100 * c for c in p["ci"])
            lines.append(f"| {delay_text(level.delay)} | {name} | {p['n']} | {100 * p['mean']:+.2f} "
                         f"| {_num(100 * p['std'])} | {_num(p['t'])} | [{_num(lo, sign='+')}, {_num(hi, sign='+')}] "
                         f"| {per_seed} |")
    return lines, results


def figure(levels, results: dict, path: Path) -> None:
    """Per score: each pair's event − receipt difference (points) against its measured share
    (%), and each level's mean ± CI at its mean share."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(next(iter(results.values())))
    fig, axes = plt.subplots(1, len(names), figsize=(5.2 * len(names), 3.8), squeeze=False)
    for ax, name in zip(axes[0], names):
        for i, level in enumerate(levels):
            p = results[level.root][name]
            if p is None:
                continue
            xs = [pair_share(level, s) for s in p["seeds"]]
            pts = [(100 * x, 100 * d) for x, d in zip(xs, p["differences"]) if x is not None]
            color = f"C{i}"
            if pts:
                ax.scatter(*zip(*pts), color=color, s=18, alpha=0.6)
                x_mean = np.mean([x for x, _ in pts])
                half = 100 * (p["ci"][1] - p["ci"][0]) / 2
                ax.errorbar([x_mean], [100 * p["mean"]], yerr=[[half if np.isfinite(half) else 0]],
                            color=color, marker="D", ms=7, capsize=4, lw=1.6,
                            label=f"D = {delay_text(level.delay)} (n={p['n']})")
        ax.axhline(0, color="gray", lw=0.8)
        ax.set_xlabel("results out of event order (%, mean of the pair)")
        ax.set_ylabel(f"{name}: event − receipt (points)", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("event-time vs receipt-order tracker under designed disorder", fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(args) -> str:
    from _hardware import cpu_model

    levels = sorted((load_level(root) for root in args.roots),
                    key=lambda level: (level.delay is not None, level.delay or 0.0))
    ups = args.updates_per_step
    t = common_plotted_steps(levels, ups)
    num_runs = {level.root: sum(len(level.runs.get(a, {})) for a in ARMS) for level in levels}
    lines = [f"{LABELS[EVENT]} (event-time tracker) vs {LABELS[RECEIPT]} (receipt-order tracker, retention fixed "
             "at 0.875), everything else fixed; one campaign per delay D (each result held U(0, D) s before "
             "receipt). Share out of event order: a result is, when a result of a newer policy event was "
             "received before it (measured per run). Held-out: the final policy on games never trained on, "
             f"mean ± sample SD over seeds; AUC over the T = {t} plotted steps of {ups} updates every run shares. "
             f"Paired differences in points (100 x success), by seed; t = mean/(SD/√n), {CI_LEVEL:.0%} CI "
             "from the t distribution with n − 1 df.", ""]
    for level in levels:
        root = level.root.resolve()
        shown = root.relative_to(REPO) if root.is_relative_to(REPO) else root
        lines.append(f"- D = {delay_text(level.delay)}: `{shown}`, recipe "
                     f"{', '.join(recipes(level.root)) or 'not recorded'}; hardware "
                     f"{hardware_text(level.root, num_runs[level.root], ARMS)}")
    lines += [f"- report made on {cpu_model()}; python {platform.python_version()}", "",
              "### Disorder and held-out success per arm", "", *arm_lines(levels)]
    table, results = paired_lines(levels, ups, t)
    lines += ["", "### Event-time − receipt-order, paired by seed", "", *table]
    path = args.figures / "disorder_dose_response.png"
    if any(p is not None for r in results.values() for p in r.values()):
        figure(levels, results, path)
        lines += ["", f"![score difference vs disorder]({FIG}/{path.name})"]
    text = "\n".join(lines) + "\n"
    figures = args.figures.resolve()
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text.replace(FIG, os.path.relpath(figures, args.out.resolve().parent)))
    text = text.replace(FIG, os.path.relpath(figures, REPO / "docs"))  # as read from docs/
    print(text)
    return text


# ----------------------------------------------------------------------------- calibrate

# the evaluations after RL cut to their least (the share, not the score, is what calibration reads)
CALIBRATION_EVALUATION = ["--evaluation.heldout_rollouts", "1", "--evaluation.train_games", "1",
                          "--evaluation.train_rollouts", "1"]


def delay_folder(root: Path, delay: float) -> Path:
    return root / f"delay{delay:g}"


def calibration_command(delay: float, args) -> list[str]:
    """The train.py call of one calibration run (the recipe's drain, the whole job)."""
    command = [sys.executable, str(REPO / "train.py"), "--config_path", str(args.config.resolve()),
               "--output_dir", str(delay_folder(args.root, delay)), "--steps", str(args.steps),
               "--seed", str(args.seed), "--method", args.method, DELAY_FLAG, f"{delay:g}",
               "--progress", "false", "--tensorboard", "false", *CALIBRATION_EVALUATION]
    if args.warm_start is not None:
        command += ["--model.path", str(args.warm_start.resolve()), "--warmstart.enabled", "false"]
    return command + list(args.extra)


def measured_share(folder: Path) -> dict | None:
    """A run's out-of-event-order record from its metrics.jsonl (``run_report.event_order``)."""
    from rollout_bridge.metrics import read_metrics
    from rollout_bridge.run_report import event_order

    return event_order(read_metrics(folder / "metrics.jsonl"))


def calibration_line(delay: float, folder: Path, wall: float | None) -> str:
    order = measured_share(folder)
    if order is None:
        return f"| {delay:g} | n/a | n/a | n/a | {'' if wall is None else f'{wall:.0f}'} |"
    return (f"| {delay:g} | {order['received']:.0f} | {order['out_of_event_order']:.0f} | "
            f"{100 * order['fraction']:.1f} | {'done already' if wall is None else f'{wall:.0f}'} |")


def calibrate(args) -> None:
    from _hardware import cpu_model

    if not args.config.is_file():
        raise SystemExit(f"--config {args.config}: no such file")
    if any(not np.isfinite(d) or d < 0 for d in args.delays):
        raise SystemExit(f"--delays must be finite and >= 0, got {args.delays}")
    print(f"hardware: {cpu_model()}; load average {os.getloadavg()}", flush=True)
    lines = [f"| D (s) | results received | out of event order | share (%) | wall (s) |", "|---|---|---|---|---|"]
    for delay in args.delays:
        folder = delay_folder(args.root, delay)
        wall = None
        if not (folder / "summary.json").is_file():
            if folder.exists():
                shutil.rmtree(folder)  # an interrupted run: redo it from scratch
            folder.mkdir(parents=True)
            command = calibration_command(delay, args)
            print(" ".join(command), flush=True)
            start = time.time()
            with open(folder / "train.log", "w") as log:
                result = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=False)
            wall = time.time() - start
            if result.returncode != 0:
                raise SystemExit(f"delay {delay:g} failed (exit {result.returncode}): see {folder / 'train.log'}")
        lines.append(calibration_line(delay, folder, wall))
        print(lines[-1], flush=True)
    print("\n".join(["", f"{args.method}, seed {args.seed}, {args.steps} updates of {args.config.name}:", *lines]))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="markdown and a figure from one campaign root per delay")
    rep.add_argument("roots", nargs="+", type=Path, help="campaign roots (matched_runs.py --root), one per delay")
    rep.add_argument("--updates-per-step", type=int, default=8, help="learner updates per plotted step")
    rep.add_argument("--figures", type=Path, default=REPO / "docs" / "figures")
    rep.add_argument("--out", type=Path, default=None, help="also write the markdown here")
    cal = sub.add_parser("calibrate", help="one short run per delay: its measured out-of-event-order share")
    cal.add_argument("--delays", nargs="+", type=float, required=True, help="result_delay_s values (s)")
    cal.add_argument("--steps", type=int, default=20)
    cal.add_argument("--config", type=Path, default=REPO / "configs" / "default.yaml")
    cal.add_argument("--warm-start", type=Path, default=None, help="a finished warm-start model folder")
    cal.add_argument("--method", default=EVENT)
    cal.add_argument("--seed", type=int, default=0)
    cal.add_argument("--root", type=Path, default=REPO / "runs" / "disorder_calibration")
    cal.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="flags passed to every train.py call")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.command == "report":
        report(args)
    else:
        calibrate(args)


if __name__ == "__main__":
    main()
