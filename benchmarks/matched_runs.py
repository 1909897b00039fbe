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
skipped when its `command.json` is the command this call would run (or it has none: runs made
before it was recorded), and refused otherwise, before any work, with the flags that differ,
so one report never mixes settings. The comparison (`command_differences`) leaves out the
interpreter, reads paths relative to the repo and to the campaign's root (an archive made on
another checkout compares equal), reads the arms' recipe flags of commands made before each
method owned its recipe as `--method <name>`, and ignores the flags in NOT_SETTINGS (where a
run's files lie, and checkpoint retention); it compares commands, not the recipe files they
name. A run folder whose run lock (train.py's `.spopp-run.lock`) a live process holds is
refused and left as it is; an interrupted run with a complete checkpoint step and the same
command is continued with train.py's `--resume` (its train.log appended); any other run
folder is redone from scratch (removed first). Runs go in the order seed-major (seed 0 of
every arm, then seed 1, ...), so a partial campaign is still paired. Each run's
stdout/stderr is in `<root>/<arm>/seed<k>/train.log`.

`report` (see `matched_report.py`) reads the runs' `metrics.jsonl` and prints markdown.

`archive --root R --to D` copies what the report reads (each run's `summary.json`,
`metrics.jsonl`, `command.json`, and the shared prior and warm-start record: its folder and
the sha256 of its weights, and the warm start itself when the shared stage built it) into D, e.g.
under docs/results, so that a campaign spread over several sessions keeps its finished
runs (`report --root D`); `run --root R --archive D` skips the runs D already holds and
refuses a warm start whose weights differ from the archived one (sha256 of its
safetensors) and starts from the archived prior when its root has none, so runs added later
stay matched. One D holds one campaign: `archive` and `run --archive` refuse, before any work,
an R whose shared prior or warm-start record is another than D's (`shared_differences`: the
prior's alpha0/beta0, the warm start's sha256). `archive` adds the runs D lacks, skips those
it holds with the same `summary.json`, and refuses a run D holds with another one unless
`--replace` is given (then it is replaced, and said so).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from rollout_bridge.run_guard import complete_steps  # noqa: E402  (no JAX: this script stays light)
from rollout_bridge.run_lock import live_holder  # noqa: E402

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
# Each arm's recipe as the flags that commands made before each method owned its recipe
# spelled it (on the TrainConfig defaults of that version; tests/test_methods.py checks that
# `--method ARMS[arm]` alone gives the same settings field by field). An archived command
# holding one of these lists compares as `--method ARMS[arm]`.
_FIXED_RECEIPT = ["--method", "spo", "--tracker.spo_rho_min", "0.875", "--tracker.spo_rho_max", "0.875",
                  "--loss.dual_clip", "2.0"]
RECIPE_FLAGS_BEFORE_METHODS: dict[str, list[str]] = {
    "spopp": ["--method", "spopp", "--advantage.measure", "token", "--loss.dual_clip", "2.0"],
    "spo": ["--method", "spo", "--advantage.measure", "trajectory", "--loss.dual_clip", "10.0"],
    "grpo": ["--method", "grpo", "--rollout.group_size", "8", "--advantage.measure", "token",
             "--loss.dual_clip", "2.0"],
    "event_traj": ["--method", "spopp", "--advantage.measure", "trajectory", "--loss.dual_clip", "2.0"],
    "receipt_token": _FIXED_RECEIPT + ["--advantage.measure", "token"],
    "receipt_traj": _FIXED_RECEIPT + ["--advantage.measure", "trajectory"],
}
# Flags two commands of one run may differ in: where the run's folder and the shared stage's
# outputs lie (the warm start's weights are pinned by their sha256, `check_archived_warm_start`
# and `shared_stage`; the prior is the root's own or the archive's, `use_archived_prior`), and
# which checkpoints stay on disk (`--keep_checkpoints`: retention, not what is trained).
NOT_SETTINGS = ("--output_dir", "--model.path", "--prior.path", "--keep_checkpoints")


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
    keep.add_argument("--replace", action="store_true",
                      help="replace a run --to holds whose summary.json differs from --root's (else refused)")
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


def shared_paths(root: Path, warm_start: Path | None = None) -> tuple[Path, Path]:
    """(model folder, prior.json) of the shared stage: the given warm start or the one built
    in ``root``/shared, and the prior there."""
    shared = root / "shared"
    model = shared / "warmstart_model" if warm_start is None else warm_start.resolve()
    return model, shared / "prior.json"


def shared_stage(root: Path, extra: list[str], warm_start: Path | None = None) -> tuple[Path, Path]:
    """Warm start + offline prior, once: (model folder, prior.json) every run starts from.
    With ``warm_start`` (a finished warm-start model folder) only the prior is computed."""
    shared = root / "shared"
    model, prior = shared_paths(root, warm_start)
    given: list[str] = []
    if warm_start is not None:
        if not (warm_start / "config.json").is_file():
            raise SystemExit(f"--warm-start {warm_start}: not a model folder (no config.json)")
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


def warm_start_digest(record: Path) -> str | None:
    """The sha256 of the weights a warm-start record (``shared/warm_start.txt``: the model
    folder, then ``sha256 <hex>``) names; None when it records none."""
    fields = dict(line.split(" ", 1) for line in record.read_text().splitlines()[1:] if " " in line)
    return fields.get("sha256") or None


def prior_values(path: Path) -> tuple[list, list] | None:
    """(alpha0, beta0) of a prior.json, what a run reads of it (`prior_stage.read_prior_file`);
    None when the file holds no such lists."""
    try:
        record = json.loads(path.read_text())
    except ValueError:
        return None
    if not (isinstance(record, dict) and isinstance(record.get("alpha0"), list)
            and isinstance(record.get("beta0"), list)):
        return None
    return record["alpha0"], record["beta0"]


def same_prior(a: Path, b: Path) -> bool:
    """Whether two prior.json files give runs one prior: the same bytes, or the same alpha0 and
    beta0 (a record written again, e.g. with another wall time, is still the same prior)."""
    if a.read_bytes() == b.read_bytes():
        return True
    values = prior_values(a)
    return values is not None and values == prior_values(b)


def shared_differences(root: Path, other: Path) -> list[str]:
    """The shared records both ``root``/shared and ``other``/shared hold that name another
    campaign's shared stage, one phrase each (both files named): the prior (`same_prior`) and
    the warm start (the sha256 its record gives, `warm_start_digest`). [] when none differs;
    a record only one side holds compares with nothing."""
    ours, theirs = root / "shared", other / "shared"
    differences = []
    prior, archived = ours / "prior.json", theirs / "prior.json"
    if prior.is_file() and archived.is_file() and not same_prior(prior, archived):
        differences.append(f"the priors {prior} and {archived} differ (alpha0/beta0)")
    record, archived = ours / "warm_start.txt", theirs / "warm_start.txt"
    if record.is_file() and archived.is_file():
        mine, kept = warm_start_digest(record), warm_start_digest(archived)
        if mine != kept:
            shown = [f"sha256 {d[:12]}..." if d else "no sha256" for d in (mine, kept)]
            differences.append(f"the warm starts {record} ({shown[0]}) and {archived} ({shown[1]}) differ")
    return differences


def archive(root: Path, to: Path, replace: bool = False) -> int:
    """Copy the finished runs' report inputs (and the shared prior, the warm-start record and
    a warm start the shared stage built) from root to `to`; returns the number of runs copied.
    Refused (SystemExit, `to` unchanged) when `to` holds another campaign's shared stage
    (`shared_differences`), or a run of the same arm and seed with another summary.json
    unless ``replace`` (then that run's files are replaced). A run `to` holds with the same
    summary.json is left as it is, and so is a shared record `to` holds: archiving twice
    changes nothing, and new seeds or arms of the same campaign are added."""
    differences = shared_differences(root, to)
    if differences:
        raise SystemExit(f"{to} holds another campaign than {root}: " + "; ".join(differences)
                         + " (archive it elsewhere)")
    new, other = [], []
    for summary in sorted(root.glob("*/seed*/summary.json")):
        folder = summary.parent
        if not finished(folder):
            print(f"not archived: {folder} has a summary.json but no metrics (metrics.jsonl missing or empty): run it again", flush=True)
            continue
        target = to / folder.parent.name / folder.name
        if not finished(target):
            new.append((folder, target))
        elif (target / "summary.json").read_bytes() != summary.read_bytes():
            other.append((folder, target))
    if other and not replace:
        raise SystemExit(f"{to} holds other runs of the same arm and seed (summary.json differs) than {root}: "
                         + ", ".join(str(target) for _, target in other)
                         + " (pass --replace to replace them, or archive elsewhere)")
    for folder, target in other:
        print(f"replaced: {target} (its summary.json differed) by {folder}", flush=True)
        for name in RUN_FILES:
            (target / name).unlink(missing_ok=True)
    for folder, target in new + other:
        target.mkdir(parents=True, exist_ok=True)
        for name in RUN_FILES:
            if (folder / name).is_file():
                shutil.copy2(folder / name, target / name)
    shared = root / "shared"
    for name in ("prior.json", "warm_start.txt"):   # one `to` holds is the same (checked above): kept
        if (shared / name).is_file() and not (to / "shared" / name).exists():
            (to / "shared").mkdir(parents=True, exist_ok=True)
            shutil.copy2(shared / name, to / "shared" / name)
    built, kept = shared / "warmstart_model", to / "shared" / "warmstart_model"
    if built.is_dir() and not kept.exists():   # built here (not a given --warm-start): keep it to continue from
        shutil.copytree(built, kept)
    return len(new) + len(other)


def use_archived_prior(archive_root: Path, root: Path) -> bool:
    """A campaign continued on a fresh checkout starts from the archive's offline prior, the
    very one its archived runs used, instead of computing it again (returns whether it did).
    A prior already in ``root`` is kept (`run` has refused one that is not the archive's,
    `shared_differences`)."""
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
    archived = warm_start_digest(record)
    if archived and archived != weights_digest(model):
        raise SystemExit(f"the warm start {model} is not the one the runs in {archive_root} started from "
                         f"(sha256 {archived[:12]}...): rebuild it with the same recipe or use another archive")


def host_record() -> dict:
    """Where a run ran: the report states each run's machine, not the report's."""
    from _hardware import cpu_model

    return {"cpu": cpu_model(), "python": platform.python_version(),
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def train_command(arm: str, seed: int, steps: int, out: Path, model: Path, prior: Path,
                  extra: list[str], drain: list[str] = MEASURED_DRAIN,
                  eval_rollouts: int | None = None) -> list[str]:
    """The train.py command of one run (``eval_rollouts``: episodes per task of its evaluations)."""
    command = [python(), str(REPO / "train.py"), "--stage", "rl", "--output_dir", str(out),
               "--model.path", str(model), "--warmstart.enabled", "false",
               "--prior.path", str(prior), "--seed", str(seed), "--steps", str(steps),
               "--progress", "false", "--tensorboard", "false", *drain, "--method", ARMS[arm], *extra]
    if eval_rollouts is not None:
        command += ["--prior.rollouts_per_task", str(eval_rollouts)]
    return command


def _normal_path(value: str, repo: Path | None, root: Path | None) -> str:
    """A path argument as it compares between checkouts: under the campaign's root as
    ``<root>/...``, under the repo relative to it (train.py runs in the repo), else as given."""
    path = Path(value) if repo is None else repo / value   # an absolute value stays itself
    path = Path(os.path.normpath(path))
    for base, name in ((root, "<root>"), (repo, None)):
        if base is not None and path.is_relative_to(base):
            relative = path.relative_to(base).as_posix()
            return relative if name is None else f"{name}/{relative}"
    return value


def command_settings(command: list[str]) -> dict[str, tuple[str, ...]]:
    """A train.py command as ``flag -> values``, the form in which two commands of one run
    compare: the interpreter left out (all before ``train.py``); paths under the campaign's
    root (``--output_dir``'s grandparent) as ``<root>/...`` and under the repo (``train.py``'s
    folder) relative to it; an arm's RECIPE_FLAGS_BEFORE_METHODS as ``--method ARMS[arm]``;
    the NOT_SETTINGS left out. A repeated flag keeps its last values (as train.py reads it).
    The command is compared, not the files it names: a recipe file edited since compares equal."""
    at = next((i for i, token in enumerate(command) if Path(token).name == "train.py"), None)
    repo = None if at is None else Path(os.path.normpath(command[at])).parent
    args = list(command[at + 1:] if at is not None else command)
    for arm, flags in RECIPE_FLAGS_BEFORE_METHODS.items():
        for i in range(len(args) - len(flags) + 1):
            if args[i:i + len(flags)] == flags:
                args[i:i + len(flags)] = ["--method", ARMS[arm]]
                break
    settings: dict[str, tuple[str, ...]] = {}
    flag = None
    for token in args:
        if token.startswith("--"):
            flag, _, value = token.partition("=")
            settings[flag] = (value,) if value else ()
        elif flag is not None:
            settings[flag] += (token,)
    root = None
    if settings.get("--output_dir"):
        out = Path(settings["--output_dir"][-1])
        root = Path(os.path.normpath(out if repo is None else repo / out)).parent.parent
    return {flag: tuple(_normal_path(v, repo, root) if "/" in v and "://" not in v else v for v in values)
            for flag, values in settings.items() if flag not in NOT_SETTINGS}


def command_differences(stored: list[str], asked: list[str], stored_as: str = "archived") -> list[str]:
    """The flags in which the run ``stored`` (its command.json) differs from ``asked``, one
    ``--flag: <stored_as> a, asked b`` each (``command_settings`` form); [] when they are one run."""
    before, now = command_settings(stored), command_settings(asked)

    def shown(values: tuple[str, ...] | None) -> str:
        return "(not given)" if values is None else " ".join(values) or "(given)"

    order = [*now, *(flag for flag in before if flag not in now)]
    return [f"{flag}: {stored_as} {shown(before.get(flag))}, asked {shown(now.get(flag))}"
            for flag in order if before.get(flag) != now.get(flag)]


def stored_command(folder: Path) -> list[str] | None:
    """The run's command.json (None when it has none)."""
    path = folder / "command.json"
    if not path.is_file():
        return None
    try:
        command = json.loads(path.read_text())
    except ValueError:
        command = None
    if not (isinstance(command, list) and all(isinstance(token, str) for token in command)):
        raise SystemExit(f"{path}: not a JSON list of train.py arguments; fix or remove it")
    return command


def done_already(arm: str, seed: int, root: Path, command: list[str], archived: Path | None = None) -> bool:
    """Whether the run is finished here or in the archive; refused (SystemExit listing the
    differing flags) when it was made with another command than ``command``."""
    for folder, stored_as in ((root / arm / f"seed{seed}", "made with"),
                              (None if archived is None else archived / arm / f"seed{seed}", "archived")):
        if folder is None or not finished(folder):
            continue
        stored = stored_command(folder)
        differences = [] if stored is None else command_differences(stored, command, stored_as)
        if differences:
            raise SystemExit(f"{folder} was made with another command than this call's: "
                             + "; ".join(differences)
                             + " (run with its settings, or use another --root / --archive)")
        return True
    return False


def prepare_folder(out: Path, command: list[str]) -> bool:
    """Ready the run folder ``out`` for ``command``; True when it continues the interrupted
    run there (train.py ``--resume``: a complete checkpoint step and the same command.json).
    A folder a live process holds is refused untouched; any other is removed and made anew."""
    if not out.exists():
        out.mkdir(parents=True)
        return False
    holder = live_holder(out)
    if holder is not None:
        raise SystemExit(f"{out} is in use by pid {holder.pid} ({holder.describe()}): left as it is; "
                         "wait for that run to end or use another --root")
    steps = complete_steps(out / "checkpoints")
    stored = stored_command(out) if steps else None
    differences = None if stored is None else command_differences(stored, command, "made with")
    if differences == []:
        print(f"{out}: an interrupted run, continued from its checkpoint step {steps[-1]} with --resume "
              "(train.log appended)", flush=True)
        return True
    why = ("no complete checkpoint step" if not steps else "no command.json" if stored is None
           else "its command differs: " + "; ".join(differences))
    print(f"{out}: an interrupted run, redone from scratch ({why}); its folder removed", flush=True)
    shutil.rmtree(out)
    out.mkdir(parents=True)
    return False


def run_one(arm: str, seed: int, steps: int, root: Path, model: Path, prior: Path,
            extra: list[str], drain: list[str] = MEASURED_DRAIN, archived: Path | None = None,
            eval_rollouts: int | None = None) -> float | None:
    """Train one run unless it is done (here or in the archive, with this command; see
    `done_already`), continuing an interrupted one where it can (`prepare_folder`); returns
    its wall time (None when skipped). ``eval_rollouts``: episodes per task of its evaluations."""
    out = root / arm / f"seed{seed}"
    command = train_command(arm, seed, steps, out, model, prior, extra, drain, eval_rollouts)
    if done_already(arm, seed, root, command, archived):
        return None
    resume = prepare_folder(out, command)
    if not resume:   # a resumed run keeps the record of how it was started
        (out / "command.json").write_text(json.dumps(command, indent=1))
        (out / "host.json").write_text(json.dumps(host_record(), indent=1))  # a campaign can span machines
    start = time.time()
    print(f"{arm} seed {seed}: started {time.strftime('%H:%M:%S')}; its progress: {out / 'train.log'}", flush=True)
    with open(out / "train.log", "a" if resume else "w") as log:
        result = subprocess.run([*command, "--resume"] if resume else command, cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT, check=False)
    wall = time.time() - start
    if result.returncode != 0:
        again = f"; it was continued with --resume: remove {out} to redo it from scratch" if resume else ""
        raise SystemExit(f"{arm} seed {seed} failed (exit {result.returncode}): see {out / 'train.log'}{again}")
    return wall


def run(args) -> None:
    from _hardware import cpu_model

    print(f"hardware: {cpu_model()}; python {platform.python_version()}", flush=True)
    if not args.config.is_file():
        raise SystemExit(f"--config {args.config}: no such file")
    if args.eval_rollouts is not None and args.eval_rollouts < 1:
        raise SystemExit(f"--eval-rollouts must be >= 1, got {args.eval_rollouts}")
    extra = ["--config_path", str(args.config.resolve()), *args.extra]
    drain = MEASURED_DRAIN if args.drain == "finish" else []
    todo = [(arm, seed) for seed in args.seeds for arm in args.arms]
    differences = [] if args.archive is None else shared_differences(args.root, args.archive)
    if differences:   # the new runs would train on another prior or warm start than the archived ones
        raise SystemExit(f"--root {args.root} and --archive {args.archive} are two campaigns: "
                         + "; ".join(differences) + " (use another --root or --archive)")
    planned_model, planned_prior = shared_paths(args.root, args.warm_start)
    for arm, seed in todo:   # a finished run made with other settings is refused before any work
        done_already(arm, seed, args.root, train_command(arm, seed, args.steps, args.root / arm / f"seed{seed}",
                                                         planned_model, planned_prior, extra, drain,
                                                         args.eval_rollouts), args.archive)
    if args.archive is not None:
        use_archived_prior(args.archive, args.root)
    model, prior = shared_stage(args.root, extra, args.warm_start)
    if args.archive is not None:
        check_archived_warm_start(args.archive, model)
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
        print(f"archived {archive(args.root, args.to, args.replace)} runs from {args.root} in {args.to}")
    else:
        from matched_report import report

        report(args)


if __name__ == "__main__":
    main()
