"""The end-of-job report's readings of a run: its asynchronous regime against the tuned
recipe's, one before/after line per task set, the RL stage's time split into updates and
the rest, and the learning curve's success axis.

The regime of an asynchronous run (how stale the trained trajectories are, how often a
result arrives after one of a newer policy) depends on how fast the machine turns updates
around, so the same recipe on a slower or busier machine trains on different data. A run
prints its own regime beside the tuned runs' (``TUNED_REGIME``) and says when it is outside
them: then its gain is not the tuned recipe's, whatever the cause (a slower CPU, other work
beside the job, a first run's compiles), rather than noise of the same experiment.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

CHECKOUT = Path(__file__).resolve().parents[1]   # the tuned recipe's paths are relative to it


@dataclasses.dataclass(frozen=True)
class RegimeReference:
    """The async regime of a recipe's tuned runs, and the bounds outside which a run's
    regime is reported as different.

    recipe: the settings (dotted config paths) the reference holds for; a run that differs
      in one gets no verdict.
    seconds_per_update: range over the runs of the median wall seconds per learner update.
    out_of_event_order: range of the share of results received out of event order.
    lag, lag_share: the most common policy lag of trained trajectories and the range of its
      share.
    max_seconds_per_update, max_out_of_event_order, min_lag_share: the bounds of "as tuned".
    """

    source: str
    recipe: Mapping[str, Any]
    seconds_per_update: tuple[float, float]
    out_of_event_order: tuple[float, float]
    lag: int
    lag_share: tuple[float, float]
    max_seconds_per_update: float
    max_out_of_event_order: float
    min_lag_share: float


# configs/default.yaml's recipe, measured in 9 runs with games, prior and compiled programs
# cached, each alone on an idle 2-core AMD EPYC (docs/RESULTS.md "The first run at 120
# updates" def_s0-2 and the evidence_r120 SPO++ seeds 0-5; records under docs/results/).
TUNED_REGIME = RegimeReference(
    source="9 cached runs of configs/default.yaml on an idle 2-core AMD EPYC (docs/RESULTS.md)",
    recipe={"method.name": "spopp", "env.kind": "textworld", "model.path": "assets/textworld_text_warmstart",
            "rollout.engine.name": "jax", "rollout.batch_size": 16, "rollout.max_in_flight": 16,
            "rollout.max_in_flight_per_task": 1, "rollout.publish_every": 1, "rollout.max_buffered_batches": 2,
            "rollout.drain": "none", "rollout.max_policy_lag": 8, "rollout.result_delay_s": 0.0,
            "optim.num_mini_batches": 4, "optim.num_micro_batches": 1, "optim.length_bucket": None,
            "env.max_turns": 12},
    seconds_per_update=(2.71, 2.90),
    out_of_event_order=(0.016, 0.049),
    lag=2,
    lag_share=(0.73, 0.78),
    max_seconds_per_update=4.5,
    max_out_of_event_order=0.10,
    min_lag_share=0.60,
)


def setting(cfg, dotted: str) -> Any:
    """``cfg.a.b`` for ``"a.b"`` (None where the config has no such field)."""
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part, None)
    return value


def same_setting(name: str, value: Any, tuned: Any) -> bool:
    """Whether a run's ``value`` of setting ``name`` is the tuned one; a ``*.path`` names
    the same folder however it is spelled (the tuned one relative to the checkout, the
    run's relative to where it runs, or absolute)."""
    if name.endswith(".path") and isinstance(value, str) and isinstance(tuned, str):
        return Path(value).expanduser().resolve() == (CHECKOUT / tuned).resolve()
    return value == tuned


def recipe_differences(cfg, reference: RegimeReference) -> list[str]:
    """'<setting> <run's value> (tuned <value>)' for each recipe setting the run changed."""
    return [f"{name} {setting(cfg, name)!r} (tuned {value!r})" for name, value in reference.recipe.items()
            if not same_setting(name, setting(cfg, name), value)]


def lag_histogram(rows) -> dict[str, float]:
    """Fraction of trained trajectories per policy lag over the run, from the per-update
    ``diag/policy_lag_count_<k>`` metrics (last bucket: lag >= rollout.max_policy_lag)."""
    prefix = "diag/policy_lag_count_"
    counts: dict[int, float] = {}
    for row in rows:
        for key, value in row.items():
            if key.startswith(prefix):
                counts[int(key[len(prefix):])] = counts.get(int(key[len(prefix):]), 0.0) + float(value)
    total = sum(counts.values())
    return {str(k): counts[k] / total for k in sorted(counts)} if total else {}


def event_order(rows) -> dict[str, float] | None:
    """Results received out of event order over the run (a result is, when one of a newer
    policy event was received before it): the last update's cumulative
    ``diag/out_of_event_order_total`` over ``diag/received_total``. None without them."""
    last = next((r for r in reversed(rows) if "diag/received_total" in r), None)
    if last is None or not last["diag/received_total"]:
        return None
    received, late = float(last["diag/received_total"]), float(last["diag/out_of_event_order_total"])
    return {"received": received, "out_of_event_order": late, "fraction": late / received}


def measured_regime(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A run's regime from its metrics rows: median wall seconds per update
    (``update_wall_s``; the median, so a first run's compiles count as a few slow updates),
    the policy-lag histogram of trained trajectories, the share of results received out of
    event order (None when the rows do not count them)."""
    per_update = [float(r["update_wall_s"]) for r in rows if "update_wall_s" in r]
    order = event_order(rows)
    return {"seconds_per_update": float(np.median(per_update)) if per_update else None,
            "lag_histogram": lag_histogram(rows),
            "out_of_event_order": None if order is None else order["fraction"]}


def regime_report(cfg, rows: Sequence[Mapping[str, Any]],
                  reference: RegimeReference = TUNED_REGIME) -> tuple[dict[str, Any], list[str]]:
    """(summary fields, log lines): the run's regime beside ``reference`` and the verdict.

    ``async_regime.differs`` lists each reading outside the reference's bounds (median
    s/update above ``max_seconds_per_update``, out-of-event-order share above
    ``max_out_of_event_order``, share of the tuned lag below ``min_lag_share``); None when
    the run's recipe is not the reference's (``recipe_differences``)."""
    regime = measured_regime(rows)
    changed = recipe_differences(cfg, reference)
    fields = dict(regime, reference=reference.source)
    seconds, late = regime["seconds_per_update"], regime["out_of_event_order"]
    lag_share = regime["lag_histogram"].get(str(reference.lag), 0.0) if regime["lag_histogram"] else None
    lo, hi = reference.seconds_per_update
    parts = [f"{seconds:.1f} s/update (median; tuned {lo:.1f}-{hi:.1f})" if seconds is not None else None,
             f"out of event order {late:.1%} (tuned {reference.out_of_event_order[0]:.1%}-"
             f"{reference.out_of_event_order[1]:.1%})" if late is not None else None,
             f"policy lag {reference.lag} for {lag_share:.0%} of trained trajectories (tuned "
             f"{reference.lag_share[0]:.0%}-{reference.lag_share[1]:.0%})" if lag_share is not None else None]
    measured = ", ".join(p for p in parts if p is not None) or "no updates"
    if changed:
        fields["differs"] = None
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        return fields, [f"async regime: {measured}; no tuned reference for this recipe (it changes "
                        f"{', '.join(changed[:3])}{more})"]
    differs = []
    if seconds is not None and seconds > reference.max_seconds_per_update:
        differs.append(f"updates slower than {reference.max_seconds_per_update:g} s")
    if late is not None and late > reference.max_out_of_event_order:
        differs.append(f"more than {reference.max_out_of_event_order:.0%} of results out of event order")
    if lag_share is not None and lag_share < reference.min_lag_share:
        differs.append(f"policy lag {reference.lag} for fewer than {reference.min_lag_share:.0%} of trajectories")
    fields["differs"] = differs
    if not differs:
        return fields, [f"async regime as tuned: {measured}"]
    return fields, [f"async regime DIFFERS from the tuned runs ({'; '.join(differs)}): {measured}",
                    "  this run trained on staler or differently ordered data than the recipe was tuned on "
                    "(a slower or busier machine, or a first run's compiles): its gain is not the tuned "
                    f"recipe's; the reference is {reference.source}"]


def log_regime(cfg, rows: Sequence[Mapping[str, Any]], log) -> dict[str, Any]:
    """``regime_report``'s lines to ``log``; its fields (the summary's ``async_regime``)."""
    fields, lines = regime_report(cfg, rows)
    for line in lines:
        log(line)
    return fields


def stage_times(rows: Sequence[Mapping[str, Any]], stage_wall_s: float,
                resumed_from: int | None) -> dict[str, float]:
    """The RL stage's wall time split. ``rl_wall_s``: the learner updates alone over every
    part of the run (the sum of the rows' ``update_wall_s``: each from the previous update,
    or from the part's first dispatch). ``rl_stage_wall_s``: this job's RL stage
    ``stage_wall_s`` (the evaluations before and after RL, starting the engine, the updates
    it trained, the final export); ``evaluation_wall_s``: that stage less the updates this
    job trained, which are the rows after ``resumed_from`` (the checkpoint step its RL stage
    continued from, None for a run started afresh: every row). The rows up to
    ``resumed_from`` are the earlier jobs' and count in ``rl_wall_s`` only; a ``--resume`` of
    a finished run trains none, so its ``evaluation_wall_s`` is its whole stage."""
    timed = [r for r in rows if "update_wall_s" in r]
    rl = float(sum(float(r["update_wall_s"]) for r in timed))
    this_job = float(sum(float(r["update_wall_s"]) for r in timed
                         if resumed_from is None or r["step"] > resumed_from))
    return {"rl_wall_s": rl, "evaluation_wall_s": max(stage_wall_s - this_job, 0.0),
            "rl_stage_wall_s": stage_wall_s}


def before_after_text(summary: Mapping[str, Any], name: str, what: str) -> str | None:
    """'<what> (<g> games, <e> episodes): <before> before RL -> <after> after RL', rounded
    (the episodes of each side when they differ),
    from the summary's ``<name>_before_rl_estimate`` / ``<name>_after_rl_estimate`` (the
    same games on both sides); None without an after-RL estimate."""
    after = summary.get(f"{name}_after_rl_estimate")
    if after is None:
        return None
    before = summary.get(f"{name}_before_rl_estimate")
    if before is None:
        return (f"{what} ({after['games']:,} games, {after['episodes']:,} episodes): "
                f"{after['success_rate']:.3f} after RL")
    episodes = (f"{after['episodes']:,} episodes" if before["episodes"] == after["episodes"] else
                f"{before['episodes']:,} episodes before RL, {after['episodes']:,} after")
    return (f"{what} ({after['games']:,} games, {episodes}): {before['success_rate']:.3f} before RL -> "
            f"{after['success_rate']:.3f} after RL")


SET_NAMES = {"train": "training tasks", "heldout": "held-out games"}


def final_line(summary: Mapping[str, Any], curve) -> str:
    """The job's last log line: its wall time and, per task set, success before and after RL
    over the same games (the evaluation after RL plays training tasks 0..train_games-1)."""
    sets = [name[:-len("_after_rl_estimate")] for name in summary if name.endswith("_after_rl_estimate")]
    texts = [before_after_text(summary, name, SET_NAMES.get(name, name.replace("_", " ")))
             for name in sorted(sets, key=lambda name: name != "train")]
    shown = "; ".join(t for t in texts if t is not None)
    if not shown:   # no estimates (a report without per-game records): the plain rates
        shown = f"success after RL {summary['success_after_rl']:.3f}"
    return f"done in {summary['total_wall_s']:.0f}s: success on {shown}; curve {curve}"


def prior_text(record: Mapping[str, Any]) -> str:
    """The prior's success as the log states it: the warm start over every training task, one
    rollout each (the report's 'before RL' is over the tasks evaluated after RL)."""
    successes, trials = int(np.sum(record["successes"])), int(np.sum(record["trials"]))
    tasks = len(record["trials"])
    return (f"the warm start's success on all {tasks:,} training tasks {record['success_rate']:.3f} "
            f"({successes}/{trials} episodes)")


def success_axis_limits(values: Sequence[float], floor: float = 0.05) -> tuple[float, float]:
    """y limits of a success-rate plot that fit ``values`` (every plotted point, error bar end
    and reference line): their range (at least ``floor``) plus a tenth of it below and a
    third above (room for the legend), within [0, 1] up to a small margin."""
    finite = [float(v) for v in values if v is not None and np.isfinite(v)]
    if not finite:
        return -0.02, 1.02
    lo, hi = min(finite), max(finite)
    span = max(hi - lo, floor)
    return max(lo - 0.1 * span, -0.02), min(lo + span * 4 / 3, 1.02)


def reference_name(name: str, measured: bool, games: bool = True) -> str:
    """How the report names a reference success: the measured prompt-blind run is the
    'prompt-blind control' (as the job's log and README call it), the exact uniform-random
    value the 'prompt-blind ceiling' (``games``: with the task set it is over); other
    references by their field name."""
    if not name.endswith("prompt_blind_ceiling"):
        return name.replace("_", " ")
    kind = f"prompt-blind {'control' if measured else 'ceiling'}"
    if not games:
        return kind
    return f"{kind} ({'held-out games' if name.startswith('heldout_') else 'training games'})"
