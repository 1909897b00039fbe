"""Matched runs (TextWorld, ALFWorld, Math-TIR): SPO++ vs SPO vs GRPO, and the tracker x measure ablation.

Every run is `python train.py --stage rl` (the command users run), from ONE shared
warm-start checkpoint and ONE shared offline prior, so that arms differ only in the method
each runs (ARMS below) (SPEC 7: matched runs share checkpoint, prompts,
prior, decoding, budget, optimizer and runtime).

    python benchmarks/matched_runs.py run --arms spopp spo grpo --seeds 0 1 2 3 4
    python benchmarks/matched_runs.py run --arms event_traj receipt_token receipt_traj \
        --seeds 0 1 2 3 4 --steps 80
    python benchmarks/matched_runs.py report            # tables + figures from what is there
    python benchmarks/matched_runs.py run --config configs/textworld_agentic.yaml --root runs/matched_agentic
        # the smoke task's runs (docs/RESULTS.md) are on configs/smoke.yaml, the default --config
    python benchmarks/matched_runs.py run --config configs/textworld_agentic_text.yaml \
        --warm-start runs/textworld_agentic_text/warmstart_model --drain config --steps 40 \
        --root runs/matched_text      # in-flight publishing, policy lag > 1
    python benchmarks/matched_runs.py run --config configs/default.yaml \
        --warm-start assets/textworld_text_warmstart --drain config --steps 120 \
        --arms spopp spo grpo event_traj receipt_token receipt_traj --seeds 0 1 2 3 4 5 \
        --root runs/matched_r120 --archive docs/results/evidence_r120
        # the same on the default recipe at 120 updates (docs/RESULTS.md, "SPO++ vs SPO vs GRPO")
    python benchmarks/matched_runs.py run --config configs/math_tir_tiny.yaml --drain config \
        --steps 200 --seeds 0 1 2 3 4 5 --root runs/math_tir_matched \
        --extra --checkpoint_every 10 --keep_checkpoints 21 \
        --env.data_dir runs/math_tir_matched/data --model.tiny_dir runs/math_tir_matched/tiny_model
    python benchmarks/matched_runs.py report --root runs/math_tir_matched --updates-per-step 10 \
        --auc step_mean      # Math-TIR (SPEC 7): every plotted step's policy kept in checkpoints/

`--warm-start` makes a finished warm start the shared one (no SFT is run; the shared stage
only computes the offline prior from it). `--drain finish` (the default) pins the drain of
the published v1 runs; `--drain config` keeps the recipe's own (in-flight publishing, drain
`none`, where policy lag exceeds 1 and results come back out of event order).

`--config` (default configs/smoke.yaml, the tiny 2-turn job of the published v1 runs) is passed to every
train.py call as `--config_path`.

`run` is resumable: a finished run (`summary.json` and a non-empty `metrics.jsonl`) is
skipped, any other run folder is redone from scratch (removed first). Runs go in the order seed-major
(seed 0 of every arm, then seed 1, ...), so a partial campaign is still paired.
Each run's stdout/stderr is in `<root>/<arm>/seed<k>/train.log`.

`report` (see `matched_report.py`) reads the runs' `metrics.jsonl` and prints markdown.

`archive --root R --to D` copies what the report reads (each run's `summary.json`,
`metrics.jsonl`, `command.json`, and the shared prior and warm-start record: its folder and
the sha256 of its weights, and the warm start itself when the shared stage built it) into D, e.g.
under docs/results, so that a campaign spread over several sessions keeps its finished
runs (`report --root D`); `run --root R --archive D` skips the runs D already holds and
refuses a warm start whose weights differ from the archived one (sha256 of its
safetensors) and starts from the archived prior when its root has none, so runs added later
stay matched.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

# the published matched runs (docs/RESULTS.md) drained before each publish; the train
# default became in-flight publishing ("none") later, so reproductions pin the drain
MEASURED_DRAIN = ["--rollout.drain", "finish"]
# Arm (its folder under --root) -> the method whose recipe it runs (`--method <name>`: its
# tracker, retention, measure, dual clip and groups are the method's, rollout_bridge/methods).
# spopp, spo, grpo: the matched baselines; event_traj, receipt_token, receipt_traj with spopp:
# the tracker x measure 2x2 (retention fixed at 0.875, dual clip 2; methods/ablation.py).
ARMS: dict[str, str] = {
    "spopp": "spopp",
    "spo": "spo",
    "grpo": "grpo",
    "event_traj": "event_trajectory",
    "receipt_token": "receipt_token",
    "receipt_traj": "receipt_trajectory",
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train the missing runs")
    run.add_argument("--arms", nargs="+", default=["spopp", "spo", "grpo"], choices=sorted(ARMS))
    run.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    run.add_argument("--steps", type=int, default=160, help="learner updates per run")
    run.add_argument("--root", type=Path, default=REPO / "runs" / "matched")
    run.add_argument("--config", type=Path, default=REPO / "configs" / "smoke.yaml",
                     help="the recipe every train.py call starts from (--config_path)")
    run.add_argument("--warm-start", type=Path, default=None,
                     help="a finished warm-start model folder shared by every run (no SFT is run)")
    run.add_argument("--drain", choices=("finish", "config"), default="finish",
                     help="finish: the published v1 runs' drain; config: the recipe's own (v2: none)")
    run.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                     help="flags passed to every train.py call (after --extra)")
    run.add_argument("--archive", type=Path, default=None,
                     help="an archive of finished runs (see `archive`): those runs are skipped")
    run.add_argument("--eval-rollouts", type=int, default=None,
                     help="episodes per task of each run's evaluations before/after RL (its "
                          "--prior.rollouts_per_task; the shared prior keeps the recipe's)")
    keep = sub.add_parser("archive", help="copy the finished runs' report inputs elsewhere")
    keep.add_argument("--root", type=Path, default=REPO / "runs" / "matched")
    keep.add_argument("--to", type=Path, required=True)
    report = sub.add_parser("report", help="tables and figures from the finished runs")
    report.add_argument("--root", type=Path, default=REPO / "runs" / "matched")
    report.add_argument("--updates-per-step", type=int, default=8,
                        help="learner updates per plotted step (8 x 16 = 128 trajectories, "
                             "the paper's plotted step)")
    report.add_argument("--auc", choices=("trapezoid", "step_mean"), default="trapezoid",
                        help="AUC of the plotted curve (SPEC 7): the normalised trapezoid (ALFWorld, "
                             "TextWorld) or the step mean (Math-TIR)")
    report.add_argument("--figures", type=Path, default=REPO / "docs" / "figures")
    report.add_argument("--out", type=Path, default=None, help="also write the markdown here")
    return parser.parse_args(argv)


def python() -> str:
    return sys.executable


def shared_stage(root: Path, extra: list[str], warm_start: Path | None = None) -> tuple[Path, Path]:
    """Warm start + offline prior, once: (model folder, prior.json) every run starts from.
    With ``warm_start`` (a finished warm-start model folder) only the prior is computed."""
    shared = root / "shared"
    model, prior = shared / "warmstart_model", shared / "prior.json"
    given: list[str] = []
    if warm_start is not None:
        if not (warm_start / "config.json").is_file():
            raise SystemExit(f"--warm-start {warm_start}: not a model folder (no config.json)")
        model = warm_start.resolve()
        given = ["--model.path", str(model), "--warmstart.enabled", "false"]
        recorded = shared / "warm_start.txt"
        first = recorded.read_text().splitlines()[0] if recorded.is_file() else None
        if first is not None and first != str(model):
            raise SystemExit(f"{root} was started from the warm start {first}, "
                             f"not {model}: use another --root")
    if not (model.is_dir() and prior.is_file()):
        command = [python(), str(REPO / "train.py"), "--stage", "prior", "--output_dir",
                   str(shared), "--progress", "false", "--tensorboard", "false", *extra, *given]
        print("shared stage:", " ".join(command), flush=True)
        subprocess.run(command, cwd=REPO, check=True)
        # the weights' digest, also of a warm start built here (Math-TIR's: no shipped one), so
        # that runs added later to an archive of these are refused another warm start
        (shared / "warm_start.txt").write_text(f"{model}\nsha256 {weights_digest(model)}\n")
    return model, prior


RUN_FILES = ("summary.json", "metrics.jsonl", "command.json", "host.json")


def finished(folder: Path) -> bool:
    """The run in `folder` ended and kept what the report reads: summary.json and a
    non-empty metrics.jsonl (a folder removed while its train.py still ran can end with a
    summary.json and no metrics)."""
    metrics = folder / "metrics.jsonl"
    return (folder / "summary.json").is_file() and metrics.is_file() and metrics.stat().st_size > 0


def weights_digest(model: Path) -> str:
    """sha256 over the model folder's safetensors files (name and bytes, sorted by name)."""
    digest = hashlib.sha256()
    files = sorted(model.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"{model}: no *.safetensors weights")
    for path in files:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def archive(root: Path, to: Path) -> int:
    """Copy the finished runs' report inputs (and the shared prior, the warm-start record and
    a warm start the shared stage built) from root to `to`; returns the number of runs copied."""
    copied = 0
    for summary in sorted(root.glob("*/seed*/summary.json")):
        folder = summary.parent
        if not finished(folder):
            print(f"not archived: {folder} has a summary.json but no metrics (metrics.jsonl missing or empty): run it again", flush=True)
            continue
        target = to / folder.parent.name / folder.name
        target.mkdir(parents=True, exist_ok=True)
        for name in RUN_FILES:
            if (folder / name).is_file():
                shutil.copy2(folder / name, target / name)
        copied += 1
    shared = root / "shared"
    for name in ("prior.json", "warm_start.txt"):
        if (shared / name).is_file():
            (to / "shared").mkdir(parents=True, exist_ok=True)
            shutil.copy2(shared / name, to / "shared" / name)
    if (shared / "warmstart_model").is_dir():  # built here (not a given --warm-start): keep it to continue from
        shutil.copytree(shared / "warmstart_model", to / "shared" / "warmstart_model", dirs_exist_ok=True)
    return copied


def use_archived_prior(archive_root: Path, root: Path) -> bool:
    """A campaign continued on a fresh checkout starts from the archive's offline prior, the
    very one its archived runs used, instead of computing it again (returns whether it did).
    A prior already in ``root`` is kept."""
    archived, prior = archive_root / "shared" / "prior.json", root / "shared" / "prior.json"
    if prior.is_file() or not archived.is_file():
        return False
    prior.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(archived, prior)
    print(f"shared prior: {archived} (the archived runs' own)", flush=True)
    return True


def check_archived_warm_start(archive_root: Path, model: Path) -> None:
    """The archive's runs started from these very weights, or refuse."""
    record = archive_root / "shared" / "warm_start.txt"
    if not record.is_file():
        return
    fields = dict(line.split(" ", 1) for line in record.read_text().splitlines()[1:] if " " in line)
    archived = fields.get("sha256")
    if archived and archived != weights_digest(model):
        raise SystemExit(f"the warm start {model} is not the one the runs in {archive_root} started from "
                         f"(sha256 {archived[:12]}...): rebuild it with the same recipe or use another archive")


def host_record() -> dict:
    """Where a run ran: the report states each run's machine, not the report's."""
    from _hardware import cpu_model

    return {"cpu": cpu_model(), "python": platform.python_version(),
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def run_one(arm: str, seed: int, steps: int, root: Path, model: Path, prior: Path,
            extra: list[str], drain: list[str] = MEASURED_DRAIN, archived: Path | None = None,
            eval_rollouts: int | None = None) -> float | None:
    """Train one run unless it is done (here or in the archive); returns its wall time
    (None when skipped). ``eval_rollouts``: episodes per task of its evaluations."""
    out = root / arm / f"seed{seed}"
    if finished(out) or (archived is not None and finished(archived / arm / f"seed{seed}")):
        return None
    if out.exists():
        shutil.rmtree(out)  # an interrupted run: redo it from scratch (no partial curves)
    out.mkdir(parents=True)
    command = [python(), str(REPO / "train.py"), "--stage", "rl", "--output_dir", str(out),
               "--model.path", str(model), "--warmstart.enabled", "false",
               "--prior.path", str(prior), "--seed", str(seed), "--steps", str(steps),
               "--progress", "false", "--tensorboard", "false", *drain, "--method", ARMS[arm], *extra]
    if eval_rollouts is not None:
        command += ["--prior.rollouts_per_task", str(eval_rollouts)]
    (out / "command.json").write_text(json.dumps(command, indent=1))
    (out / "host.json").write_text(json.dumps(host_record(), indent=1))  # a campaign can span machines
    start = time.time()
    print(f"{arm} seed {seed}: started {time.strftime('%H:%M:%S')}; its progress: {out / 'train.log'}", flush=True)
    with open(out / "train.log", "w") as log:
        result = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=False)
    wall = time.time() - start
    if result.returncode != 0:
        raise SystemExit(f"{arm} seed {seed} failed (exit {result.returncode}): see {out / 'train.log'}")
    return wall


def run(args) -> None:
    from _hardware import cpu_model

    print(f"hardware: {cpu_model()}; python {platform.python_version()}", flush=True)
    if not args.config.is_file():
        raise SystemExit(f"--config {args.config}: no such file")
    if args.eval_rollouts is not None and args.eval_rollouts < 1:
        raise SystemExit(f"--eval-rollouts must be >= 1, got {args.eval_rollouts}")
    extra = ["--config_path", str(args.config.resolve()), *args.extra]
    if args.archive is not None:
        use_archived_prior(args.archive, args.root)
    model, prior = shared_stage(args.root, extra, args.warm_start)
    if args.archive is not None:
        check_archived_warm_start(args.archive, model)
    drain = MEASURED_DRAIN if args.drain == "finish" else []
    todo = [(arm, seed) for seed in args.seeds for arm in args.arms]
    for i, (arm, seed) in enumerate(todo, 1):
        wall = run_one(arm, seed, args.steps, args.root, model, prior, extra, drain, args.archive,
                       args.eval_rollouts)
        state = "done already" if wall is None else f"{wall:.0f} s"
        folder = args.root / arm / f"seed{seed}"
        if not finished(folder):
            folder = args.archive / arm / f"seed{seed}"
        summary = json.loads((folder / "summary.json").read_text())
        print(f"[{i}/{len(todo)}] {arm} seed {seed}: {state}; success after RL "
              f"{summary['success_after_rl']:.3f}", flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.command == "run":
        run(args)
    elif args.command == "archive":
        print(f"archived {archive(args.root, args.to)} runs from {args.root} in {args.to}")
    else:
        from matched_report import report

        report(args)


if __name__ == "__main__":
    main()
