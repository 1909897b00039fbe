"""The prompt-blind control of a finished run, as the reference beside the agent's success.

With free-text commands no exact prompt-blind ceiling exists (a blind policy may type
anything), so a control run measures one: the same recipe trained and evaluated with
every observation hidden (``env.blind_observations=true``). A job given that run's folder (``env.blind_control``) reads its summary.json and prints the control's
success beside the agent's, with the margin in standard errors of the difference.

The control must be a blind run of the same task sets: its summary's ``env`` record (written
by every textworld job, ``describe_tasks``) must say ``prompt_blind`` and name the same
training and held-out game sets, or the comparison means nothing and the job stops with a
``UserError`` before any work.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from rollout_bridge.run_errors import UserError

# summary.json estimate read per reference name (the names report_run looks up)
ESTIMATES = {"prompt_blind_ceiling": "train", "heldout_prompt_blind_ceiling": "heldout"}


def describe_tasks(train_set: str, heldout_set: str | None, prompt_blind: bool) -> dict[str, Any]:
    """The ``env`` record of a run's summary.json: the game sets and whether it was blind."""
    return {"train_games": train_set, "heldout_games": heldout_set, "prompt_blind": prompt_blind}


def load_blind_control(run_dir: str | Path, tasks: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, float]]:
    """(reference successes, their SEs) from a finished blind run's summary.json.

    ``tasks``: this job's ``describe_tasks`` record. References are the control's success
    after RL on the training games (``prompt_blind_ceiling``) and on the held-out games
    (``heldout_prompt_blind_ceiling``, when both runs have them)."""
    if tasks.get("prompt_blind"):
        raise UserError("env.blind_control is set on a blind run (env.blind_observations=true): the control "
                        "is for the sighted agent's job")
    path = Path(run_dir) / "summary.json"
    if not path.is_file():
        raise UserError(f"env.blind_control={run_dir}: no {path} (run the blind control to the end first: "
                        "the same config with --env.blind_observations true --env.warmstart_rename 0)")
    try:
        summary = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise UserError(f"env.blind_control: {path} is not valid JSON ({error})") from None
    control = summary.get("env")
    if not isinstance(control, dict) or not control.get("prompt_blind"):
        raise UserError(f"env.blind_control={run_dir}: that run was not trained blind "
                        f"(its summary.json env record: {control!r}; it needs env.blind_observations=true)")
    for field in ("train_games", "heldout_games"):
        if control.get(field) != tasks.get(field):
            raise UserError(f"env.blind_control={run_dir}: its {field} {control.get(field)!r} are not this "
                            f"job's {tasks.get(field)!r}; the control must play the same games (run the "
                            "blind control of these games, or --env.blind_control null to go without it)")
    references, ses = {}, {}
    for name, prefix in ESTIMATES.items():
        estimate = summary.get(f"{prefix}_after_rl_estimate")
        if estimate is None:
            if prefix == "train":
                raise UserError(f"env.blind_control={run_dir}: its summary.json has no {prefix}_after_rl_estimate")
            continue
        references[name] = float(estimate["success_rate"])
        ses[name] = float(estimate["se"])
    return references, ses
