"""The common yardstick: the policies of every arm, at every kept checkpoint step, evaluated
on ONE fixed task mix with common random numbers, so learning curves and their AUC compare
across methods whose training rollouts sample tasks differently (GRPO uniformly, SPO++ by
its tracker's uncertainty, SPEC 3). ``scripts/common_yardstick.py`` is the command.

The task mix (``TaskMix``): one task set of the env kind (``train`` or an extra set such as
``heldout``), its first ``tasks`` task ids, ``rollouts`` episodes per task. Episode r of
task t plays with the episode seed ``derived_seed(crn_seed, t, r)``
(``prior.rollout_successes``), ``crn_seed = derived_seed(seed, "yardstick", set)``: one env
(built once from one config), one agent, one sampling setting and the same episode seeds
for every run and every step, so two policies meet the same random numbers per episode and
differ only by what they are. A run's starting policy is its step 0 (the shared warm start
of matched runs: every arm must then score the same there).

Scores over the evaluated steps s_1 < ... < s_T with success rates r_t (SPEC 7):

- success at a step: r = Σ_g s_g / Σ_g n_g over the tasks g, SE over tasks
  (``job_report.success_estimate``: a task's episodes are correlated);
- AUC = r_1 if T = 1, else (1 / (s_T − s_1)) Σ_{t=1}^{T−1} (s_{t+1} − s_t)(r_t + r_{t+1}) / 2:
  the trapezoid area divided by the step span, in [0, 1]. With evenly spaced steps it is
  SPEC 7's (1/(T−1)) Σ (r_t + r_{t+1})/2 (``spopp_jax.evaluation.area_under_curve``). Its SE
  is over tasks: with equal episodes per task AUC is the mean of the tasks' own AUCs, so
  SE = std_g(AUC_g) / √G keeps the correlation of one task's steps;
- two arms paired by seed (the runs of one seed share warm start and prior):
  d_i = score_A,i − score_B,i, mean, sample std (n − 1), SE = std / √n, the 95% interval
  mean ± t_{0.975, n−1} SE, and how many seeds improve (d_i > 0).

Records: a run's step is played once and its record (``evaluate_run``) reused while its key
holds: the env, decoding and model settings, the played tasks' content (``evaluation_cache.tasks_digest``:
games or problems changed at the same ``env.game_dir`` / ``env.data_dir`` are played again),
the mix, the policy's digest and the seed. A yardstick.json holds the ``settings_key`` it was
made with; ``--carry`` refuses an earlier one made with other settings.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from rollout_bridge import evaluation_cache
from rollout_bridge.agent import derived_seed
from rollout_bridge.job_report import success_estimate
from rollout_bridge.run_errors import UserError
from rollout_bridge.run_folder import fixed_policy_key, folder_digest, log, stage_key

TRAIN_SET = "train"
ENGINE_SEED = 0          # every engine's own seed: the episode seeds decide every sample anyway
CI_LEVEL = 0.95
# The run settings that decide what an episode of the mix is: the tasks and how they are
# shown (env), and the agent's decoding and token budget (rollout).
MATCHED_ROLLOUT_FIELDS = ("temperature", "top_p", "top_k", "max_new_tokens", "max_seq_len")
TRAINING_ONLY_ENV_FIELDS = ("rename_episodes",)   # renames training episodes in RL only


# ------------------------------------------------------------------ scores
def area_under_steps(steps: Sequence[float], rates: Sequence[float]) -> float:
    """AUC = r_1 if T = 1, else (1/(s_T − s_1)) Σ_t (s_{t+1} − s_t)(r_t + r_{t+1})/2 over
    strictly increasing steps ``s`` (the module docstring; SPEC 7 for even spacing)."""
    s, r = np.asarray(steps, np.float64), np.asarray(rates, np.float64)
    if s.ndim != 1 or s.shape != r.shape or s.size == 0:
        raise ValueError(f"steps and rates must be equal-length non-empty 1-D, got {s.shape} and {r.shape}")
    if not (np.all(np.isfinite(s)) and np.all(np.isfinite(r))):
        raise ValueError("steps and rates must be finite")
    if s.size == 1:
        return float(r[0])
    if not np.all(np.diff(s) > 0):
        raise ValueError(f"steps must be strictly increasing, got {s.tolist()}")
    return float(np.sum(np.diff(s) * (r[:-1] + r[1:]) / 2.0) / (s[-1] - s[0]))


def auc_estimate(steps: Sequence[int], successes: np.ndarray, trials: np.ndarray) -> dict:
    """AUC of the curve r_t = Σ_g s_tg / Σ_g n_tg and its SE over tasks (std_g(AUC_g)/√G,
    ddof 1, over the tasks with episodes at every step); ``successes``/``trials`` [T, G]."""
    successes, trials = np.asarray(successes, np.float64), np.asarray(trials, np.float64)
    if successes.shape != trials.shape or successes.ndim != 2 or successes.shape[0] != len(steps):
        raise ValueError(f"successes and trials must be [T={len(steps)}, G], got {successes.shape} and "
                         f"{trials.shape}")
    rates = successes.sum(1) / np.maximum(trials.sum(1), 1)
    played = (trials > 0).all(0)
    per_task = [area_under_steps(steps, successes[:, g] / trials[:, g]) for g in np.flatnonzero(played)]
    se = float(np.std(per_task, ddof=1) / np.sqrt(len(per_task))) if len(per_task) > 1 else float("nan")
    return {"auc": area_under_steps(steps, rates), "se": se, "tasks": len(per_task)}


def paired_by_seed(a: Mapping[int, float], b: Mapping[int, float], level: float = CI_LEVEL) -> dict:
    """a − b over the seeds both hold: per-seed differences, mean, sample std, SE = std/√n,
    the ``level`` t interval mean ± t_{(1+level)/2, n−1} SE, improving = #(d > 0)."""
    from scipy import stats

    from spopp_jax.evaluation import paired_differences

    seeds = sorted(set(a) & set(b))
    if not seeds:
        raise ValueError(f"no seed in common (first: {sorted(a)}, second: {sorted(b)})")
    paired = paired_differences([a[s] for s in seeds], [b[s] for s in seeds])
    n = len(seeds)
    se = paired.std / np.sqrt(n) if n > 1 else float("nan")
    half = float(stats.t.ppf(0.5 + level / 2, n - 1) * se) if n > 1 else float("nan")
    return {"seeds": seeds, "differences": paired.differences.tolist(), "n": n, "mean": paired.mean,
            "std": paired.std, "se": float(se), "ci": [paired.mean - half, paired.mean + half], "ci_level": level,
            "improving": paired.positive, "worse": paired.negative, "equal": paired.zero}


# ------------------------------------------------------------------ the task mix
@dataclasses.dataclass(frozen=True)
class TaskMix:
    """``rollouts`` episodes of each task in ``task_ids`` of the set ``task_set``, episode r
    of task t seeded ``derived_seed(crn_seed, t, r)``; ``tasks_digest``: those tasks'
    content (``evaluation_cache.tasks_digest``), in the records' keys, not in ``record()``."""

    task_set: str
    task_ids: tuple[int, ...]
    rollouts: int
    crn_seed: int
    tasks_digest: str | None = None   # the content of the tasks played (``evaluation_cache.tasks_digest``)

    @classmethod
    def build(cls, env, task_set: str, tasks: int | None, rollouts: int, seed: int) -> "TaskMix":
        view = task_view(env, task_set)
        if rollouts < 1:
            raise UserError(f"--rollouts must be >= 1, got {rollouts}")
        if tasks is not None and tasks < 1:
            raise UserError(f"--tasks must be >= 1, got {tasks}")
        count = view.num_tasks if tasks is None else min(tasks, view.num_tasks)
        ids = tuple(range(count))
        crn_seed = derived_seed(seed, "yardstick", task_set)
        return cls(task_set, ids, rollouts, crn_seed, evaluation_cache.tasks_digest(view.train, ids))

    def record(self) -> dict:
        return {"task_set": self.task_set, "tasks": len(self.task_ids), "task_ids": list(self.task_ids),
                "rollouts": self.rollouts, "crn_seed": self.crn_seed}


def task_view(env, task_set: str):
    """The env bundle seen as one task set: ``train`` itself, or the extra set ``task_set``
    (``env.extra_evals``: ALFWorld's and TextWorld's held-out games, Math-TIR's no_tool ...)."""
    if task_set == TRAIN_SET:
        return env
    if task_set not in env.extra_evals:
        raise UserError(f"--set {task_set}: this env has the sets {[TRAIN_SET, *env.extra_evals]}")
    tasks, factory = env.extra_evals[task_set]
    return dataclasses.replace(env, train=tasks, env_factory=factory)


# ------------------------------------------------------------------ the runs
@dataclasses.dataclass(frozen=True)
class Run:
    """A train.py run folder: its arm (the saved method), seed, checkpoint steps, the saved
    checkpoint key (``run_folder.checkpoint_key``) and the HF folder it started from."""

    folder: Path
    arm: str
    seed: int
    steps: tuple[int, ...]
    saved: dict
    start_folder: Path

    @property
    def label(self) -> str:
        return f"{self.arm}_seed{self.seed}"

    def step_dir(self, step: int) -> Path:
        return self.folder / "checkpoints" / str(step)


def read_run(folder: str | Path) -> Run:
    """The run in ``folder``; UserError when it holds no finished checkpoint step."""
    from rollout_bridge.run_guard import complete_steps
    from spopp_jax.export import read_step_config, resolve_model_folder

    folder = Path(folder).resolve()   # orbax restores by absolute path only
    steps = complete_steps(folder / "checkpoints")
    if not steps:
        raise UserError(f"{folder}: no checkpoint step in {folder / 'checkpoints'} (a train.py output_dir?)")
    saved = read_step_config(folder / "checkpoints" / str(steps[-1]))
    method = saved.get("method")
    arm = method.get("type") if isinstance(method, Mapping) else method
    if not arm or "seed" not in saved:
        raise UserError(f"{folder}: its checkpoint config names no method and seed (not a train.py run?)")
    try:
        start = resolve_model_folder(folder / "checkpoints" / str(steps[-1]), saved)
    except FileNotFoundError as error:
        raise UserError(str(error)) from None
    return Run(folder, str(arm), int(saved["seed"]), tuple(steps), saved, start)


def setting_differences(cfg, run: Run) -> list[str]:
    """What of the run's env and decoding (``MATCHED_ROLLOUT_FIELDS``) differs from the
    yardstick's config ``cfg``: 'env.x: saved <run's value>, expected <given value>'."""
    from spopp_jax.checkpoint import config_differences

    ours = stage_key(cfg, "env", "rollout")
    ours["rollout"] = {k: ours["rollout"][k] for k in MATCHED_ROLLOUT_FIELDS}
    theirs = {"env": dict(run.saved.get("env") or {}),
              "rollout": {k: (run.saved.get("rollout") or {}).get(k) for k in MATCHED_ROLLOUT_FIELDS}}
    for key in (ours, theirs):
        for field in TRAINING_ONLY_ENV_FIELDS:
            key["env"].pop(field, None)
    return config_differences(theirs, ours)


def check_runs(cfg, runs: Sequence[Run]) -> None:
    """UserError unless every run was made on the yardstick's tasks with its decoding and
    no two runs share an arm and a seed."""
    labels = [run.label for run in runs]
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        raise UserError(f"two runs of one arm and seed: {twice} (give each run once)")
    for run in runs:
        differences = setting_differences(cfg, run)
        if differences:
            raise UserError(f"{run.folder} was made with other tasks or decoding than the yardstick's settings; "
                            f"pass the flags it was made with (--env.x ...): {'; '.join(differences[:6])}"
                            + (f" and {len(differences) - 6} more" if len(differences) > 6 else ""))


def common_steps(runs: Sequence[Run], requested: Sequence[int] | None, start: bool) -> list[int]:
    """The steps every run is evaluated at: ``requested`` (each run must hold each), else the
    steps all runs hold; with 0 first when ``start`` (each run's starting policy)."""
    held = set.intersection(*(set(run.steps) for run in runs))
    if requested is not None:
        missing = {run.label: sorted(set(requested) - set(run.steps) - {0}) for run in runs}
        missing = {label: steps for label, steps in missing.items() if steps}
        if missing:
            raise UserError(f"--eval_steps: runs without those checkpoints: {missing}")
        steps = sorted(set(requested) - {0})
    else:
        steps = sorted(held)
        if not steps:
            raise UserError("the runs hold no checkpoint step in common: "
                            + "; ".join(f"{run.label}: {list(run.steps)}" for run in runs))
    return [0, *steps] if start or (requested is not None and 0 in requested) else steps


# ------------------------------------------------------------------ evaluation
def policy_digest(run: Run, step: int) -> str:
    """sha1 of what a step's policy is made of: the step's checksums file (every item's
    SHA-256, written with it), else its files; step 0: the start folder's files but its
    notes and the records shipped beside it (``evaluation_cache.policy_digest``: an
    evaluation record added to a shipped warm start leaves its step 0 as it was)."""
    if step == 0:
        return evaluation_cache.policy_digest(run.start_folder)
    from spopp_jax.checkpoint_integrity import CHECKSUM_FILE

    checksums = run.step_dir(step) / CHECKSUM_FILE
    if checksums.is_file():
        return hashlib.sha1(checksums.read_bytes()).hexdigest()
    return folder_digest(run.step_dir(step))


def load_step_policy(run: Run, step: int, model_section):
    """The policy of ``run`` at ``step`` computing in ``model.compute_dtype``: its start
    folder's model at step 0, else the step's parameters (checked complete, undamaged and
    finite) in the start folder's architecture."""
    from rollout_bridge.components import load_policy
    from spopp_jax.export import check_finite, check_step_complete, model_from_params, read_step_params

    if step == 0:
        return load_policy(run.start_folder, model_section)
    step_dir = check_step_complete(run.step_dir(step))
    arrays = read_step_params(step_dir)
    check_finite(arrays, f"checkpoint {step_dir}")
    return model_from_params(arrays, run.start_folder, model_section.compute_dtype, source=f"checkpoint {step_dir}")


async def evaluate_on_mix(job, model, chat, mix: TaskMix, what: str = "yardstick") -> tuple[list[int], list[int]]:
    """(successes, trials) per task of ``mix.task_ids`` of ``model`` on a fresh engine."""
    from rollout_bridge.evaluation import success_rollouts

    view = task_view(job.env, mix.task_set)
    engine = job.engine(model, seed=ENGINE_SEED)
    try:
        successes, trials = await success_rollouts(engine, view, chat, job.agent, job.orchestrator.max_in_flight,
                                                   mix.rollouts, what, job.cfg.progress, mix.crn_seed,
                                                   mix.task_ids)
    finally:
        await engine.close()
    ids = list(mix.task_ids)
    return successes[ids].tolist(), trials[ids].tolist()


def evaluation_key(job, mix: TaskMix, run: Run, step: int) -> dict:
    """What an evaluation record depends on: the mix, the env, decoding and model settings,
    the played tasks' content (``tasks``: ``mix.tasks_digest``), the policy's bytes."""
    key = fixed_policy_key(job.cfg, "env", "rollout", "model")
    return {**key, "tasks": mix.tasks_digest, "mix": mix.record(), "policy": policy_digest(run, step),
            "seed": job.cfg.seed}


def reusable(record: Mapping, key: Mapping) -> bool:
    """Whether a step record answers ``key``: its key is ``key``; or it is a record written
    before keys held the tasks' content (no ``tasks`` field) and equals ``key`` but that
    field (the settings, mix, policy and seed pin everything else; a record that holds a
    digest must hold this one)."""
    saved = record.get("key")
    if saved == key:
        return True
    archived = {field: value for field, value in key.items() if field != "tasks"}
    return isinstance(saved, Mapping) and "tasks" not in saved and saved == archived


def twin_record(records: Path, key: Mapping) -> tuple[dict, Path] | None:
    """A step record of any run under ``records`` whose key is ``key`` exactly (the same
    policy bytes, mix, settings and seed: the same episodes), with its path; None if none.
    Matched runs share their start, so step 0 is played once for all of them."""
    for path in sorted(records.glob("*/step_*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and record.get("key") == key:
            return record, path
    return None


async def evaluate_run(job, run: Run, steps: Sequence[int], mix: TaskMix, records: Path) -> list[dict]:
    """One record per step ({step, successes, trials, wall_s}), each written to
    ``records/<label>/step_<k>.json`` as it finishes and reused from there when its key is
    unchanged (``reusable``; a stopped yardstick loses at most the step it was on), or
    copied from another run's record of the same key (``twin_record``: a shared start)."""
    from rollout_bridge.components import load_chat
    from rollout_bridge.atomic_files import write_json_atomic

    chat = load_chat(run.start_folder, job.env.chat_tools)
    out = []
    for step in steps:
        path = records / run.label / f"step_{step}.json"
        key = evaluation_key(job, mix, run, step)
        if path.is_file():
            record = json.loads(path.read_text())
            if reusable(record, key):
                unchecked = "tasks" not in record["key"]
                log(f"yardstick: {run.label} step {step}: reusing {path}"
                    + (" (written before records held the tasks' digest: their content not checked)"
                       if unchecked else ""))
                out.append(record)
                continue
        twin = twin_record(records, key)
        if twin is not None:
            record, source = twin
            log(f"yardstick: {run.label} step {step}: the same policy, mix and settings as {source}: reusing it")
            write_json_atomic(path, record)
            out.append(record)
            continue
        start = time.time()
        model = load_step_policy(run, step, job.cfg.model)
        successes, trials = await evaluate_on_mix(job, model, chat, mix, f"{run.label} step {step}")
        record = {"step": step, "successes": successes, "trials": trials, "wall_s": time.time() - start,
                  "key": key}
        write_json_atomic(path, record)
        rate = sum(successes) / max(sum(trials), 1)
        log(f"yardstick: {run.label} step {step}: success {rate:.3f} ({sum(trials)} episodes, "
            f"{record['wall_s']:.0f} s)")
        out.append(record)
    return out


# ------------------------------------------------------------------ the record
def training_curve(rows: Sequence[dict], steps: Sequence[int]) -> list[float] | None:
    """The run's own training-rollout success beside the yardstick (what the learning
    curves show: each method's own task sampling): at each evaluated step s > 0
    the mean ``success_rate`` of the updates in (previous evaluated step, s] (their rows; a
    torn one is left out); None when update s has no row (no metrics.jsonl, a run not that far)."""
    by_update = {row["step"]: row["success_rate"] for row in rows if "success_rate" in row}
    out, previous = [], 0
    for step in steps:
        if step == 0:
            continue
        if step not in by_update:
            return None
        window = [by_update[u] for u in range(previous + 1, step + 1) if u in by_update]
        out.append(float(np.mean(window)))
        previous = step
    return out or None


def run_summary(run: Run, records: Sequence[dict]) -> dict:
    """A run's curve (step -> success ± SE) and its AUC ± SE over the evaluated steps; with
    ``training_auc`` the AUC of its own training-rollout success (``training_curve``) over
    the evaluated steps after 0."""
    from rollout_bridge.metrics import METRICS_FILE, read_metrics

    steps = [r["step"] for r in records]
    successes = np.array([r["successes"] for r in records])
    trials = np.array([r["trials"] for r in records])
    curve = [{"step": r["step"], **success_estimate(r["successes"], r["trials"])} for r in records]
    trained = training_curve(read_metrics(run.folder / METRICS_FILE), steps)
    trained_steps = [s for s in steps if s > 0]
    return {"training_curve": trained,
            "training_auc": None if trained is None else area_under_steps(trained_steps, trained),
            "folder": str(run.folder), "arm": run.arm, "seed": run.seed, "label": run.label,
            "start_folder": str(run.start_folder), "curve": curve, "auc": auc_estimate(steps, successes, trials),
            "final": curve[-1]["success_rate"], "wall_s": float(sum(r.get("wall_s", 0.0) for r in records)),
            "per_task": {"successes": successes.tolist(), "trials": trials.tolist()}}


def known_arm_order() -> tuple[str, ...]:
    """The tables' order of the known methods: the default method, then the registry's order."""
    from rollout_bridge.methods import MethodConfig, names

    default = MethodConfig.default_choice_name()
    return (default, *(name for name in names() if name != default))


def arm_order(arms: Sequence[str], reference: str | None) -> list[str]:
    """The reference arm first (by default the first of ``known_arm_order`` present), then
    the others in that order, then unknown arms by name."""
    known = known_arm_order()
    arms = sorted(set(arms), key=lambda a: (known.index(a) if a in known else len(known), a))
    reference = reference or arms[0]
    if reference not in arms:
        raise UserError(f"--reference {reference}: no run of that arm (arms: {arms})")
    return [reference, *(a for a in arms if a != reference)]


def comparisons(summaries: Sequence[dict], arms: Sequence[str]) -> list[dict]:
    """The reference arm (``arms[0]``) minus each other arm, paired by seed, on AUC, the final
    step, the first step (0 = the shared start: there the difference must be 0) and, for
    contrast, the AUC of the runs' own training rollouts."""
    by_arm: dict[str, dict[int, dict]] = {}
    for summary in summaries:
        by_arm.setdefault(summary["arm"], {})[summary["seed"]] = summary
    out = []
    for other in arms[1:]:
        scores = {"auc": lambda s: s["auc"]["auc"], "final": lambda s: s["final"],
                  "first": lambda s: s["curve"][0]["success_rate"], "training_auc": lambda s: s["training_auc"]}
        row = {"a": arms[0], "b": other}
        for name, score in scores.items():
            a = {seed: score(s) for seed, s in by_arm[arms[0]].items() if score(s) is not None}
            b = {seed: score(s) for seed, s in by_arm[other].items() if score(s) is not None}
            row[name] = paired_by_seed(a, b) if set(a) & set(b) else None
        out.append(row)
    return out


def read_record(path: str | Path) -> dict:
    """An earlier yardstick record (its yardstick.json); UserError when the file is missing,
    not JSON, or not a yardstick record."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise UserError(f"--carry {path}: not a readable yardstick.json ({error})") from None
    if not isinstance(record, dict) or not {"mix", "steps", "runs", "settings"} <= record.keys():
        raise UserError(f"--carry {path}: not a yardstick record (a yardstick.json holds mix, steps, runs, settings)")
    return record


def settings_key(cfg, mix: TaskMix) -> dict:
    """The settings a yardstick record's episodes were played with: the env, decoding and
    model sections (``fixed_policy_key``, without the ``TRAINING_ONLY_ENV_FIELDS``) and the
    played tasks' content (``tasks``: ``mix.tasks_digest``). ``--carry`` compares them."""
    key = fixed_policy_key(cfg, "env", "rollout", "model")
    for field in TRAINING_ONLY_ENV_FIELDS:
        key["env"].pop(field, None)
    return {**key, "tasks": mix.tasks_digest}


def unchecked_runs(earlier: dict, carried: Sequence[dict]) -> list[str]:
    """The labels of ``carried`` not checked against a key: all of them when ``earlier``
    holds no ``key`` (written before records held it), else those it lists as unchecked
    itself (``settings.unchecked``: runs it carried unchecked or played from step records
    written before they held the tasks' digest)."""
    labels = [run["label"] for run in carried]
    if "key" not in earlier:
        return labels
    before = set((earlier.get("settings") or {}).get("unchecked") or ())
    return [label for label in labels if label in before]


def unchecked_steps(records: Sequence[dict]) -> list[int]:
    """The steps of a run's records (``evaluate_run``) reused from files written before
    step records held the tasks' digest (their tasks' content not checked)."""
    return [record["step"] for record in records if "tasks" not in record["key"]]


def carried_runs(earlier: dict, mix: TaskMix, steps: Sequence[int], played: Sequence[str],
                 key: dict) -> list[dict]:
    """The run summaries of an ``earlier`` yardstick record (its yardstick.json) but those
    labelled in ``played`` (the runs evaluated now): a record grows by new runs without
    playing the ones it holds again (their folders may be gone, or older than the
    settings' current key). UserError unless it was made on this mix at these steps and,
    when it holds the ``key`` of its settings, with these ones (``key``, ``settings_key``);
    a record written before records held it is carried with a warning line."""
    from spopp_jax.checkpoint import config_differences

    if earlier.get("mix") != mix.record():
        raise UserError(f"--carry: its task mix {earlier.get('mix')} is not this one {mix.record()} "
                        "(pass the --set, --tasks, --rollouts and --seed it was made with)")
    if list(earlier.get("steps", [])) != list(steps):
        raise UserError(f"--carry: its steps {earlier.get('steps')} are not these {list(steps)} "
                        "(pass the --eval_steps and --start it was made with)")
    if "key" in earlier:
        differences = config_differences(earlier["key"], key)
        if differences:
            raise UserError("--carry: its runs were evaluated with other settings or tasks; pass the flags it was "
                            f"made with (--env.x ...): {'; '.join(differences[:6])}"
                            + (f" and {len(differences) - 6} more" if len(differences) > 6 else ""))
    carried = [run for run in earlier["runs"] if run["label"] not in set(played)]
    unchecked = unchecked_runs(earlier, carried)
    if unchecked:
        log(f"yardstick: warning: --carry: {len(unchecked)} carried runs were recorded before yardstick records held "
            f"their settings; their env, decoding or tasks are not checked: {', '.join(unchecked)}")
    return carried


def yardstick_record(summaries: Sequence[dict], mix: TaskMix, steps: Sequence[int], arms: Sequence[str],
                     settings: dict, key: dict) -> dict:
    """The yardstick.json record; ``key``: the settings it was made with (``settings_key``)."""
    return {"mix": mix.record(), "steps": list(steps), "arms": list(arms), "settings": settings, "key": key,
            "runs": list(summaries), "comparisons": comparisons(summaries, arms)}


def _pm(values: Sequence[float], digits: int = 3) -> str:
    values = np.asarray(values, np.float64)
    if values.size < 2:
        return f"{values.mean():.{digits}f}"
    return f"{values.mean():.{digits}f} ± {values.std(ddof=1):.{digits}f}"


def markdown(record: dict) -> str:
    """The yardstick's tables: per arm (mean ± std over seeds) the success at each step and
    the AUC; per run its AUC ± SE over tasks; the paired differences by seed (points)."""
    mix, steps, arms = record["mix"], record["steps"], record["arms"]
    runs = record["runs"]
    lines = [f"Common yardstick: {mix['rollouts']} episodes x {mix['tasks']} tasks of the `{mix['task_set']}` set "
             f"(common random numbers, CRN seed {mix['crn_seed']}) per policy, at steps {steps}"
             + (" (0 = the run's starting policy)" if steps and steps[0] == 0 else "") + ".", "",
             "| arm | runs | " + " | ".join(f"step {s}" for s in steps) + " | AUC |",
             "|---|---|" + "---|" * (len(steps) + 1)]
    for arm in arms:
        mine = [r for r in runs if r["arm"] == arm]
        cells = [_pm([r["curve"][t]["success_rate"] for r in mine]) for t in range(len(steps))]
        lines.append(f"| {arm} | {len(mine)} | " + " | ".join(cells) + f" | {_pm([r['auc']['auc'] for r in mine])} |")
    lines += ["", "Per run (AUC ± SE over tasks; final = the last step; training-rollout AUC: the run's own "
              "rollouts, its own task sampling, over the same steps after 0):", "",
              "| run | AUC | final | training-rollout AUC | wall (s) |", "|---|---|---|---|---|"]
    for r in sorted(runs, key=lambda r: (arms.index(r["arm"]), r["seed"])):
        trained = "-" if r["training_auc"] is None else f"{r['training_auc']:.3f}"
        lines.append(f"| {r['label']} | {r['auc']['auc']:.3f} ± {r['auc']['se']:.3f} | {r['final']:.3f} | "
                     f"{trained} | {r['wall_s']:.0f} |")
    if record["comparisons"]:
        lines += ["", "Paired by seed (points; a − b; CI: t interval):", "",
                  "| a − b | score | n | mean ± SE | 95% CI | improving |", "|---|---|---|---|---|---|"]
        for row in record["comparisons"]:
            for name in ("auc", "final", "first", "training_auc"):
                p = row[name]
                if p is None:
                    continue
                score = {"auc": "AUC", "final": f"step {steps[-1]}", "first": f"step {steps[0]}",
                         "training_auc": "training-rollout AUC (own sampler)"}[name]
                lines.append(f"| {row['a']} − {row['b']} | {score} | {p['n']} | {100 * p['mean']:+.2f} ± "
                             f"{100 * p['se']:.2f} | [{100 * p['ci'][0]:+.2f}, {100 * p['ci'][1]:+.2f}] | "
                             f"{p['improving']}/{p['n']} |")
    return "\n".join(lines) + "\n"


def figure(record: dict, path: Path) -> Path:
    """Each arm's mean curve over seeds (± SE over seeds) and each run's curve, thin."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for color, arm in zip((f"C{k}" for k in range(10)), record["arms"]):
        mine = [r for r in record["runs"] if r["arm"] == arm]
        curves = np.array([[p["success_rate"] for p in r["curve"]] for r in mine])
        for curve in curves:
            ax.plot(record["steps"], curve, "-", color=color, alpha=0.2, lw=1)
        mean = curves.mean(0)
        se = curves.std(0, ddof=1) / np.sqrt(len(curves)) if len(curves) > 1 else np.zeros_like(mean)
        aucs = [r["auc"]["auc"] for r in mine]
        ax.plot(record["steps"], mean, "o-", color=color, lw=2, label=f"{arm} (n={len(mine)}, AUC {np.mean(aucs):.3f})")
        ax.fill_between(record["steps"], mean - se, mean + se, color=color, alpha=0.15)
    mix = record["mix"]
    ax.set_xlabel("learner update (checkpoint step)")
    ax.set_ylabel(f"success, {mix['task_set']} set ({mix['tasks']} tasks x {mix['rollouts']}, CRN)")
    ax.set_title("common yardstick")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
