"""The method protocol: what a training method (SPO++, SPO, GRPO, RLOO, ...) decides.

The orchestrator (``rollout_bridge.orchestrator``) owns scheduling, collection, staleness
and publishing; it never branches on a method's name. A method is one object that answers:

  * ``plan_dispatch``: which tasks to start now, and the baseline v̂ frozen for each
    (SPEC 2-3), given the free capacity and the per-task in-flight counts;
  * ``receive``: what a finished (or failed / aborted) request adds to its evidence, and
    which trajectories become trainable (a group method holds members back until their
    group is whole, and may drop a group whole);
  * ``advantages``: the raw advantage A_i of each trajectory of a consumed batch (SPEC 4
    whitening is applied by the orchestrator, the same for every method);
  * ``learner_extras`` / ``after_update``: what extra the learner needs with a batch and
    what the method does with the learner's answer (SPO's divergence D);
  * ``state_dict`` / ``load_state_dict``: everything it must keep across a crash, as a
    pytree of non-empty NumPy arrays (orbax refuses zero-size arrays).

A method also owns its recipe: a :class:`MethodConfig` subclass registered under the
method's name is the run config's ``method`` section, its fields (measure, dual clip,
retention, group size) defaulting to the method's published recipe. Adding a method is one
new file in ``rollout_bridge/methods/`` with its ``Method`` class and its registered
``MethodConfig``: the registry imports every module of the package, so ``--method <name>``
selects it with no other edit.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, ClassVar, Literal, Mapping, NamedTuple, Optional, Protocol, Sequence

import draccus
import jax
import numpy as np

from rollout_bridge.trajectory import DispatchStamp, Trajectory

NextKey = Callable[[], jax.Array]  # a fresh PRNG key per call (the orchestrator's stream)


class Launch(NamedTuple):
    """One request to start: its task, the baseline frozen at dispatch (NaN when the
    method's baseline is computed later, e.g. a group mean) and its group (-1: none)."""

    task_id: int
    frozen_baseline: float
    group_id: int = -1


class DroppedGroup(NamedTuple):
    """A group dropped whole: ``reason`` "aborted" | "failed" (the first spoiling member),
    ``finished`` the members that had finished and are discarded untrained."""

    group_id: int
    task_id: int
    reason: str
    finished: tuple[Trajectory, ...]


class Receipt(NamedTuple):
    """What one resolved request yields: trajectories now trainable, a dropped group."""

    ready: tuple[Trajectory, ...] = ()
    dropped: DroppedGroup | None = None


class PreviousResponse(NamedTuple):
    """SPO's y′: a task's previous consumed response and π_then, the LEARNER's log-probs
    of it recorded when it was trained on (SPEC 2 "Baseline"; the SPO recipe computes both
    π_then and π_now with the actor's ``compute_log_prob``).

    ``batch_row >= 0``: y′ is row ``batch_row`` of the same batch; its π_then is the
    learner's log-probs of that row at the update's starting parameters, and
    ``logp_then`` is None. Otherwise ``logp_then`` [len(token_ids)] float32 (0 off
    actions) was recorded at an earlier update.
    """

    task_id: int
    token_ids: np.ndarray
    action_mask: np.ndarray
    logp_then: np.ndarray | None
    batch_row: int = -1


class LearnerInput(NamedTuple):
    """What the learner callable receives for one update.

    batch: the packed ``TrainBatch``; trajectories: the batch in arrival order;
    previous: None when the method needs no divergence; else aligned with
    ``trajectories``, the task's :class:`PreviousResponse` (None on a first visit). The
    learner then returns D_i = token-mean |π_then − π_now| over y′ with π_now its
    log-probs after the update (``LearnerOutput.divergence``) and its log-probs of this
    batch at the update's starting parameters (``LearnerOutput.trained_logp``).
    """

    batch: Any
    trajectories: tuple[Trajectory, ...]
    previous: tuple[PreviousResponse | None, ...] | None = None


class LearnerOutput(NamedTuple):
    """The learner's answer: weights to publish (None: nothing to publish), scalar
    metrics, and when ``LearnerInput.previous`` was given: ``divergence`` D_i aligned with
    the batch (None entries: D = 0) and ``trained_logp`` [B, T] the learner's log-probs of
    the batch rows at the update's starting parameters (π_then of a later visit)."""

    weights: Any
    metrics: Mapping[str, float] = {}
    divergence: Sequence[float | None] | None = None
    trained_logp: Any = None


class Method(Protocol):
    """See the module docstring. ``tracker``: the per-task evidence the sampler reads
    (None for methods without one); ``per_task_limit``: most requests one task may have in
    flight; ``held_count``: trajectories resolved but held back (not yet trainable)."""

    tracker: Any
    per_task_limit: int

    def held_count(self) -> int: ...

    def plan_dispatch(self, next_key: NextKey, capacity: int, in_flight: np.ndarray) -> Sequence[Launch]: ...

    def receive(self, stamp: DispatchStamp, traj: Trajectory | None, spoil: str | None) -> Receipt: ...

    def advantages(self, trajectories: Sequence[Trajectory]) -> np.ndarray: ...

    def learner_extras(self, trajectories: Sequence[Trajectory]) -> tuple[PreviousResponse | None, ...] | None: ...

    def after_update(self, trajectories: Sequence[Trajectory], output: LearnerOutput) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


MEASURES = ("token", "trajectory")   # SPEC 4 whitening measures


@dataclasses.dataclass
class MethodConfig(draccus.PluginRegistry, discover_packages_path="rollout_bridge.methods"):
    """The run config's ``method`` section: one registered subclass per method, whose
    defaults ARE the method's recipe (``--method spo`` is SPO's tracker, measure and dual
    clip); ``--method.<field> v`` overrides one field. In YAML: ``method: spo`` or
    ``method: {type: spo, dual_clip: 5.0}``.

    ``measure``: the SPEC 4 whitening measure (token = SPO++, trajectory = SPO);
    ``dual_clip``: the SPEC 5 dual clip c (null = off). ``method_class``: the
    :class:`Method` the orchestrator builds. Subclasses add their own fields and checks.
    """

    measure: Literal["token", "trajectory"] = "token"
    dual_clip: Optional[float] = 2.0

    method_class: ClassVar[Callable[..., Method]]

    @classmethod
    def default_choice_name(cls) -> str:
        return "spopp"

    @property
    def name(self) -> str:
        """The name this recipe is registered (and selected on the command line) under."""
        return MethodConfig.get_choice_name(type(self))

    def __post_init__(self):
        if self.measure not in MEASURES:
            raise ValueError(f"method.measure must be one of {list(MEASURES)}, got {self.measure!r}")
        if self.dual_clip is not None and not (math.isfinite(self.dual_clip) and self.dual_clip > 1.0):
            raise ValueError(f"method.dual_clip must be finite and > 1 or null, got {self.dual_clip!r}")

    def orchestrator_fields(self) -> dict[str, Any]:
        """The orchestrator's method fields (``OrchestratorConfig``) this recipe sets."""
        return {"method": self.name, "measure": self.measure}

    def learner_fields(self) -> dict[str, Any]:
        """The learner's fields (``LearnerConfig``) this recipe sets."""
        return {"dual_clip": self.dual_clip}

    def check(self, cfg) -> None:
        """Checks against the whole run config (``TrainConfig``); ValueError naming the field."""

    def to_dict(self) -> dict[str, Any]:
        """The section as a YAML/JSON mapping, ``type`` first (what ``method:`` parses back)."""
        return {"type": self.name, **dataclasses.asdict(self)}


def method_names() -> tuple[str, ...]:
    """Every registered method (each module of ``rollout_bridge.methods`` imported)."""
    return tuple(MethodConfig.get_known_choices())


def recipe(name: str) -> MethodConfig:
    """The recipe of method ``name`` (its section with every default)."""
    if name not in method_names():
        raise ValueError(f"method must be one of {list(method_names())}, got {name!r}")
    return MethodConfig.get_choice_class(name)()
