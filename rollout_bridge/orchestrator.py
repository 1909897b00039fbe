"""The asynchronous rollout orchestrator: the semantics of SPEC sections 2-3 in one place.

Single stream (SPO++ "spopp", and the original SPO "spo"):
  * dispatch: sample an idle task (none in flight) with weight sqrt(v̂(1−v̂) + 0.05)
    (``spopp_jax.sampling.sample_idle_tasks``), read and FREEZE v̂_q from the tracker,
    stamp z_q = z_0 + k·(−ln ρ) of the current policy event k; at most one in-flight
    request per task (``max_in_flight_per_task = 1``, the SPEC setting; see below).
  * receipt (first finished first): "spopp" adds (x, z_i, R_i) to the event-time tracker at
    once, so later dispatches see it; the trajectory joins the ready buffer.
  * consumption: the first N ready trajectories form a batch; A_i = R_i − v̂_i (frozen),
    whitened under the configured measure (SPEC 4), packed into a ``TrainBatch``. The
    learner trains in a thread (or as a coroutine) while rollouts continue.
  * "spo": after the actor update, α ← ρ_i α + R_i, β ← ρ_i β + (1−R_i) in arrival order,
    ρ_i = clip(2^{−D/D_half}, ρ_min, ρ_max) with D returned by the learner per task.
  * publish every K updates. Drain "finish": stop dispatching, let old-policy requests
    finish (they keep their z and join the next batch), then publish. Drain "abort":
    ``engine.abort_all``, drop the in-flight trajectories and free their tasks, publish.
    Drain "none" (SPEC 3, "Publishing without a drain"; the engine must have
    ``supports_inflight_publish``): ``engine.publish_inflight`` runs as a background task;
    dispatch and the learner's next update go on meanwhile, nothing is waited for or
    aborted. A trajectory keeps its dispatch stamp z and frozen v̂; its tokens may come
    from several events (``Trajectory.event_span``, in the update diagnostics as
    ``event_span_mean`` / ``mixed_policy_fraction``). Publishes stay in order: the next
    one starts when the previous install finished.
  * staleness bound (every drain): lag = (policy event at consumption) − (dispatch event).
    After each publish, a request still in flight whose lag already exceeds
    ``max_policy_lag`` is aborted (its episode task cancelled, which frees the engine
    slot) and its task freed; counted as ``lag_aborted_total``. Finished work is never
    dropped for lag: a trajectory finished in time but waiting in the ready buffer may be
    trained at a larger lag (bounded by ``max_buffered_batches``); the per-update
    histogram ``policy_lag_count_<k>`` (last bucket: lag >= ``max_policy_lag``) shows it.
  * result delay (an experiment knob, off by default): ``result_delay_s = d > 0`` holds each
    finished episode for a seeded draw U(0, d) seconds (``result_delay``: a function of
    the seed and the request id only) before the orchestrator receives it, as a fleet's
    uneven network and environment latency would. Results then come back out of event
    order (counted as ``out_of_event_order_total``) even on one machine, which is the
    regime where the receipt-order tracker and the event-time one differ (SPEC 2). A
    held result is still in flight: it occupies its slot and task, and ``max_policy_lag``
    or a drain "abort" drops it like any other.
GRPO ("grpo"): G rollouts of one task per group, a group barrier (a group joins the ready
buffer only when all its members finished), A_i = R_i − mean(group), same whitening.
Group integrity: a batch is whole groups only (``batch_size`` a multiple of ``group_size``;
every ready group has exactly G members, so cutting N from the ready list never splits
one). A group with any aborted member (drain "abort", an engine abort) is dropped WHOLE:
its finished members are not trained on (a shrunken group's mean is not the group mean; a
one-member fragment has A = 0). A failed member (env error / time-out) follows
``train_on_failed``: True: it stays a member with its reward R = 0 (as single stream
trains on it); False: the group is dropped whole, like an abort. Drops are logged as
("drop_group", DroppedGroup) events and counted in the update diagnostics
(``dropped_groups_total``, ``dropped_group_trajectories_total`` = finished members
discarded); the single-stream methods never drop groups.

Failures (environment exception / time-out) are recorded and counted; by default they are
neither evidence for the tracker nor training samples (``train_on_failed``). Nothing stops.

Several in-flight requests per task (``max_in_flight_per_task = m > 1``; single stream
only; the paper's stated limitation, SPEC 2 allows m = 1, the default, which is unchanged):
  * Visible history: request q of task x still sees H_q(x) = the results of x RECEIVED
    before q was dispatched, and v̂_q is read and frozen at dispatch by the SPEC-2 formula.
    A sibling (another in-flight request of x) is not evidence: its result is unknown.
  * Consequences: siblings dispatched with no result of x received in between have the
    same H and so the same v̂; for them A_i = R_i − v̂ is a group-style comparison against
    a common, stale baseline (the mean of older evidence, not of the siblings). Per
    request every SPEC-2 statement still holds: v̂_q depends only on H_q and coordinates,
    so it is receipt-order invariant for fixed H_q, and a late result (a sibling's
    included) never changes a baseline already frozen.
  * Sampling: a task is dispatchable while it has fewer than m requests in flight.
    ``sibling_rule="balanced"`` (default): draws go tier by tier, tier b = the tasks with
    the fewest (b) requests in flight, each tier by SPEC-3 weighted sampling without
    replacement. So a task gets its (b+1)-th sibling only when no task has fewer than b in
    flight: an idle task is never displaced by a sibling, m > 1 only fills slots that
    m = 1 would leave empty, and siblings sharing one stale v̂ are as few as possible.
    ``sibling_rule="proportional"``: each free slot (x, j) is a candidate of weight
    u(v̂_x), drawn without replacement, i.e. each draw picks x with probability
    ∝ u(v̂_x)·(m − in_flight_x); it favours uncertain tasks more but can stack siblings
    on them while other tasks sit idle. Both reduce to the SPEC-3 sampler at m = 1 (same
    key, same draw: bit-identical dispatches).
  * Rejected alternatives: a leave-one-out baseline over siblings (v̂ = mean of the
    sibling results) or a baseline re-read at receipt / consumption would make v̂_q depend
    on results that arrive after q's dispatch, i.e. on the future and on receipt order,
    breaking freezing and the invariance claim. Counting in-flight siblings as pseudo
    evidence at v̂ ("virtual loss") leaves v̂ unchanged and only inflates its confidence, so
    it changes nothing the estimator uses.
GRPO keeps its own multi-request unit (the group) and requires m = 1.

Methods: each method is one object of ``rollout_bridge.methods`` (``Method`` protocol:
what to dispatch and freeze, what a receipt adds, advantages, learner extras, its own
state). This module keeps scheduling, collection, staleness and publishing only and never
branches on a method's name; "rloo" (GRPO's groups with a leave-one-out baseline) is the
fourth method, one file.

Host cost (garbage collection), once per process at the first ``run``: (1) ``gc.freeze()``:
every object alive then (imported libraries, model, tokenizer: millions of objects with
JAX, transformers and torch loaded) moves to the collector's permanent generation and is
never scanned again. Without it each full collection (triggered by the in-flight
episodes' objects ageing into the oldest generation) rescans that whole heap, a cost per
trajectory that grows with the heap, not with the work.
Frozen objects are still freed by reference counting; only a reference cycle among them
would outlive its use (none is expected in startup state). (2) The youngest generation's
threshold is raised to at least ``GC_GEN0_THRESHOLD`` (CPython: 700): with thousands of
episodes in flight, young collections are a measurable share of a trajectory's host cost;
the cyclic garbage that can wait is at most that many objects. The cost per
trajectory with and without these: docs/PERFORMANCE.md, "Orchestrator host cost per
trajectory".
Both are process-wide: a program that embeds the orchestrator and manages its own
collector sets ``OrchestratorConfig(tune_gc=False)`` (``train.py`` keeps the default).

Memory: the orchestrator keeps what the next update and the checkpoint need (the ready
buffer, in-flight stamps, the method's state). ``keep_history=True`` (the library default,
for tests and analysis) also keeps the whole ``events`` / ``records`` log; long runs set it
False and stream per-update records to ``on_update`` sinks instead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import gc
import inspect
from typing import Any, Awaitable, Callable, Literal, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from rollout_bridge import baselines, methods, state_codec
from rollout_bridge.agent import AgentConfig, ChatFormat, run_episode
from rollout_bridge.engine.base import RolloutEngine
from rollout_bridge.envs.base import EnvFactory
from rollout_bridge.methods import DroppedGroup, LearnerInput, LearnerOutput, Receipt
from rollout_bridge.methods.single_stream import (SIBLING_RULES, TASK_SAMPLERS, free_slot_mask,
                                                  sample_dispatch_tasks)
from rollout_bridge.trajectory import DispatchStamp, Trajectory, pack_train_batch
from spopp_jax import tracker
from spopp_jax.sampling import FORMS as SAMPLER_FORMS

__all__ = ["OrchestratorConfig", "RolloutSchedule", "TrackerConfig", "SamplerConfig", "AdvantageConfig", "Orchestrator", "UpdateRecord", "LearnerInput", "LearnerOutput", "DroppedGroup",
           "free_slot_mask", "sample_dispatch_tasks", "METHODS", "DRAINS", "MEASURES", "SIBLING_RULES"]

METHODS = methods.names()
DRAINS = ("finish", "abort", "none")
MEASURES = ("token", "trajectory")
_COUNTERS = ("policy_event", "updates", "dispatched", "consumed", "failed", "aborted",
             "dropped_groups", "dropped_group_trajectories", "lag_aborted", "received",
             "out_of_event_order", "newest_received_event")


def _from(source: str, default: Any) -> Any:
    """A field the build sets from ``source`` (not a run-config field of its own)."""
    return dataclasses.field(default=default, metadata={"from": source})


METHOD_RECIPE = "method (the method section's recipe: MethodConfig.orchestrator_fields)"


@dataclasses.dataclass(frozen=True)
class TrackerConfig:
    """SPEC 2 (the run config's ``tracker`` section). ``rho``: the event-time retention per
    policy event: the coordinate z of every result, the SPO++ tracker's decay and the
    prior's mass 1/(1-rho). The receipt-order SPO tracker's own retention is its method's
    (``method.rho_min`` / ``method.rho_max``)."""

    rho: float = 0.875

    def __post_init__(self):
        if not 0.0 < self.rho < 1.0:
            raise ValueError(f"tracker.rho must be in (0, 1), got {self.rho!r}")


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """SPEC 3 (the run config's ``sampler`` section): weight sqrt(v(1-v) + floor)
    (form=inside_sqrt, SPO++) or sqrt(v(1-v)) + floor (form=outside_sqrt, the SPO authors'
    code). ``impl``: sum_tree = incremental host bookkeeping, O(log tasks) per draw; dense =
    Gumbel top-k over all tasks per dispatch round (the reference; same law)."""

    form: Literal["inside_sqrt", "outside_sqrt"] = "inside_sqrt"
    floor: float = 0.05
    impl: Literal["sum_tree", "dense"] = "sum_tree"

    def __post_init__(self):
        for name, allowed in (("form", SAMPLER_FORMS), ("impl", TASK_SAMPLERS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"sampler.{name} must be one of {list(allowed)}, got {getattr(self, name)!r}")
        if not self.floor >= 0:
            raise ValueError(f"sampler.floor must be >= 0, got {self.floor!r}")


MAX_WHITEN_EPS = 1e-2   # below 2% of the largest std of 0/1 rewards (0.5)


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    """SPEC 4 (the run config's ``advantage`` section): Ã = (A - mean) / (std + whiten_eps)
    under the method's measure (``method.measure``). ``whiten_eps`` only guards a zero std:
    the std of 0/1 rewards is at most 0.5, so a large eps would shrink every advantage toward
    0 and learning with it, silently (at most MAX_WHITEN_EPS)."""

    whiten_eps: float = 1e-8

    def __post_init__(self):
        if not 0.0 < self.whiten_eps <= MAX_WHITEN_EPS:
            raise ValueError(f"advantage.whiten_eps must be in (0, {MAX_WHITEN_EPS}], got {self.whiten_eps!r}")


@dataclasses.dataclass(frozen=True)
class RolloutSchedule:
    """How rollouts are scheduled and batched (SPEC 2-3): the orchestrator's fields of the
    run config's ``rollout`` section (`rollout_bridge.config.RolloutSection` extends this
    class; its docstring explains each field). Defaults are the main job's."""

    batch_size: int = 16  # N trajectories per update
    publish_every: int = 1  # K: publish after every K updates
    drain: Literal["finish", "abort", "none"] = "none"  # "none": in-flight publish (SPEC 3)
    max_policy_lag: int = 8  # abort requests in flight whose lag exceeds this (module docstring)
    max_in_flight: int = 16  # concurrent trajectories
    max_in_flight_per_task: int = 1  # m; SPEC 2 experiments: 1 (see the module docstring)
    sibling_rule: Literal["balanced", "proportional"] = "balanced"  # m > 1 (module docstring)
    max_buffered_batches: int = 2  # dispatch only while ready + in-flight < this x batch_size
    train_on_failed: bool = False
    max_consecutive_failures: int = 256  # a broken engine/env stops the run instead of spinning
    # learner batches [B, T], T a multiple of this; None (run config only): the agent's
    # max_total_tokens, set by the build (every batch the widest: one compile)
    pad_to_multiple: Optional[int] = 256
    pack_rows: bool = False  # several trajectories per learner row, rows <= agent max_total_tokens wide
    result_delay_s: float = 0.0  # hold each finished result U(0, this) seconds before receipt (docstring); 0: off


@dataclasses.dataclass(frozen=True)
class OrchestratorConfig(RolloutSchedule):
    """Orchestration knobs (SPEC 2-4, 6): the rollout schedule, the tracker, sampler and
    advantage sections, the method's fields and what the build sets (``metadata["from"]``)."""

    tracker: TrackerConfig = dataclasses.field(default_factory=TrackerConfig)
    sampler: SamplerConfig = dataclasses.field(default_factory=SamplerConfig)
    advantage: AdvantageConfig = dataclasses.field(default_factory=AdvantageConfig)
    method: str = _from(METHOD_RECIPE, "spopp")  # a registered method (rollout_bridge.methods.names())
    measure: str = _from(METHOD_RECIPE, "token")  # whitening measure, SPEC 4
    group_size: int = _from(METHOD_RECIPE, 8)  # GRPO / RLOO G
    spo_d_half: float = _from(METHOD_RECIPE, 0.06)
    spo_rho_min: float = _from(METHOD_RECIPE, 0.875)
    spo_rho_max: float = _from(METHOD_RECIPE, 0.96)
    z0: float = _from("0: the prior's coordinate (SPEC 2)", 0.0)
    # packed rows: a multiple of this (the learner's mini- x micro-batches)
    pack_row_multiple: int = _from("optim: components.pack_row_multiple (mini- x micro-batches)", 1)
    # keep every event / record in memory (tests, analysis); train.py: False, records stream to the sinks
    keep_history: bool = _from("False in train.py: bounded memory, records stream to the metric sinks", True)
    # process-wide gc.freeze + young threshold at the first run (docstring, "Host cost")
    tune_gc: bool = _from("True in train.py: the whole process is its to tune", True)
    seed: int = _from("seed", 0)  # the job seed

    def __post_init__(self):
        for name, value, allowed in (
            ("drain", self.drain, DRAINS),
            ("measure", self.measure, MEASURES),
            ("sibling_rule", self.sibling_rule, SIBLING_RULES),
        ):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        for name in ("batch_size", "publish_every", "max_in_flight", "max_in_flight_per_task",
                     "max_buffered_batches", "group_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_policy_lag < 0:
            raise ValueError(f"max_policy_lag must be >= 0, got {self.max_policy_lag}")
        if self.pad_to_multiple is None or self.pad_to_multiple < 1:
            raise ValueError(f"pad_to_multiple must be >= 1, got {self.pad_to_multiple} (the run config's null "
                             "is resolved to the agent's max_total_tokens by its build)")
        if self.pack_row_multiple < 1:
            raise ValueError(f"pack_row_multiple must be >= 1, got {self.pack_row_multiple}")
        if not (self.result_delay_s >= 0.0 and np.isfinite(self.result_delay_s)):
            raise ValueError(f"result_delay_s must be finite and >= 0, got {self.result_delay_s}")
        methods.method_class(self.method).check_config(self)


Learner = Callable[[LearnerInput], Union[LearnerOutput, Awaitable[LearnerOutput]]]


@dataclasses.dataclass(frozen=True)
class UpdateRecord:
    """One consumed batch: SPEC-4 diagnostics, policy lags and the learner's metrics."""

    update: int
    policy_event: int  # the newest published event when the batch was consumed
    trajectories: tuple[Trajectory, ...]
    raw_advantages: np.ndarray
    advantages: np.ndarray
    policy_lag: np.ndarray  # policy_event − trajectory.policy_event
    diagnostics: Mapping[str, float]
    learner_metrics: Mapping[str, float]
    start_time: float
    end_time: float


class _PendingUpdate:
    """The batch the learner is training on, kept until its answer comes back."""

    def __init__(self, trajectories, raw, whitened, lag, diagnostics, start, policy_event):
        self.trajectories, self.raw, self.whitened, self.lag = trajectories, raw, whitened, lag
        self.diagnostics, self.start, self.policy_event = diagnostics, start, policy_event


class Orchestrator:
    """Runs rollouts and updates; ``await run(num_updates)``; ``await close()`` at the end.

    ``events`` is the processing log in order (``keep_history``): ("dispatch",
    DispatchStamp), ("receive", Trajectory), ("drop", DispatchStamp), ("drop_group",
    DroppedGroup) (group methods), ("publish", int), ("consume", UpdateRecord).
    ``on_update`` (one callable or a list of them, the metric sinks) gets every
    ``UpdateRecord``. Checkpoint with :meth:`state_dict` / :meth:`load_state_dict`.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        env_factory: EnvFactory,
        chat: ChatFormat,
        learner: Learner,
        num_tasks: int,
        config: OrchestratorConfig = OrchestratorConfig(),
        agent_config: AgentConfig = AgentConfig(),
        prior_alpha: Sequence[float] | None = None,
        prior_beta: Sequence[float] | None = None,
        on_update: Callable[[UpdateRecord], None] | Sequence[Callable[[UpdateRecord], None]] | None = None,
    ):
        if num_tasks < 1:
            raise ValueError(f"num_tasks must be >= 1, got {num_tasks}")
        if config.drain == "none" and not getattr(engine, "supports_inflight_publish", False):
            raise ValueError(
                f"rollout.drain=none needs an engine that publishes in flight; {type(engine).__name__} "
                f"has supports_inflight_publish = False: use rollout.drain finish or abort"
            )
        self.engine, self.env_factory, self.chat, self.learner = engine, env_factory, chat, learner
        self.num_tasks, self.config, self.agent_config = num_tasks, config, agent_config
        self._pack_width = agent_config.max_total_tokens if config.pack_rows else None
        if self._pack_width is not None and self._pack_width % config.pad_to_multiple:
            raise ValueError(f"pack_rows: rows of max_total_tokens={self._pack_width} must be a multiple of "
                             f"pad_to_multiple={config.pad_to_multiple}")
        self.on_update = on_update
        alpha = np.full(num_tasks, 0.5, np.float32) if prior_alpha is None else np.asarray(prior_alpha, np.float32)
        beta = np.full(num_tasks, 0.5, np.float32) if prior_beta is None else np.asarray(prior_beta, np.float32)
        self.method = methods.build(config, num_tasks, alpha, beta)
        self.rng_key = jax.random.key_data(jax.random.key(config.seed))
        self.policy_event = int(engine.policy_event)
        self.updates = self.dispatched = self.consumed = self.failed = self.aborted = 0
        self.dropped_groups = self.dropped_group_trajectories = 0  # group methods; diagnostics only
        self.lag_aborted = 0  # requests aborted by max_policy_lag (also counted in ``aborted``)
        # receipt order vs event order: a finished result is out of event order when a result
        # of a NEWER policy event was received before it (``_count_event_order``)
        self.received = self.out_of_event_order = 0
        self.newest_received_event = -1
        self.events: list[tuple[str, Any]] = []
        self.records: list[UpdateRecord] = []
        self._busy = np.zeros(num_tasks, dtype=np.int64)
        self._in_flight: dict[asyncio.Task, DispatchStamp] = {}
        self._ready: list[Trajectory] = []
        self._learner_task: asyncio.Task | None = None
        self._completions: asyncio.Queue = asyncio.Queue()  # futures, in completion order
        self._learner_pending: _PendingUpdate | None = None
        self._publish_pending: Any = None
        self._has_publish_pending = False
        self._publish_task: asyncio.Future | None = None  # drain "none": the install running now
        self._last_update_end: float | None = None
        self._publish_wait_since: float | None = None  # a full batch ready, held by a pending publish
        self._target = 0
        self._z_cache: dict[int, float] = {}
        self._z_step: np.float32 | None = None
        self._failure_streak = 0
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="learner")

    @property
    def tracker(self):
        """The method's per-task evidence (``spopp_jax.tracker.TrackerState``; None for
        group methods)."""
        return self.method.tracker

    @property
    def ready(self) -> tuple[Trajectory, ...]:
        """Finished trajectories not yet consumed, in arrival order."""
        return tuple(self._ready)

    def _log(self, kind: str, item: Any) -> None:
        if self.config.keep_history:
            self.events.append((kind, item))

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict:
        """Everything that must survive a crash, as a pytree of non-empty arrays: the
        method's state (tracker, SPO's y′ and π_then, ...), the sampler key, the counters
        and the ready buffer (finished, untrained trajectories). Requests in flight are not
        saved (their tasks are free again after a restore)."""
        return {
            "method": self.method.state_dict(),
            "rng_key": np.asarray(self.rng_key),
            "counters": {k: np.asarray(getattr(self, k), np.int64) for k in _COUNTERS},
            "ready": state_codec.encode_trajectories(self._ready),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (the engine must already serve that event)."""
        self.method.load_state_dict(state["method"])
        self.rng_key = jnp.asarray(state["rng_key"])
        for name, value in state["counters"].items():
            setattr(self, name, int(value))
        self._ready = state_codec.decode_trajectories(state["ready"])

    # ------------------------------------------------------------------ main loop
    async def run(self, num_updates: int) -> list[UpdateRecord]:
        """Collect and train until ``num_updates`` more updates are done (and published).
        Returns this call's records when ``keep_history``, else []."""
        if self.engine.policy_event != self.policy_event:
            raise ValueError(
                f"engine serves policy event {self.engine.policy_event}, orchestrator is at {self.policy_event}"
            )
        if self.config.tune_gc:
            _tune_garbage_collector()
        start = len(self.records)
        self._target = self.updates + num_updates
        while True:
            await self._maybe_publish()
            if self.updates >= self._target and not self._publishing():
                break
            self._maybe_start_update()
            self._dispatch()
            if not self._in_flight and self._learner_task is None and self._publish_task is None:
                if self._has_publish_pending:
                    continue
                raise RuntimeError("orchestrator stalled: nothing in flight and no batch to train")
            done = await self._next_completions()
            finished = sorted((t for t in done if t in self._in_flight), key=self._arrival_key)
            for task in finished:
                self._receive(task)
            if self._publish_task is not None and self._publish_task.done():
                await self._finish_inflight_publish()
            if self._learner_task is not None and self._learner_task.done():
                await self._finish_update()
        return self.records[start:]

    def _publishing(self) -> bool:
        """A publish is waiting (for its drain or the previous install) or installing."""
        return self._has_publish_pending or self._publish_task is not None

    async def _next_completions(self) -> list[asyncio.Future]:
        """Wait for the next finished rollout or learner call; return all finished so far.

        Futures report themselves on a queue when done, so a wake-up costs O(finished),
        not O(in flight) as ``asyncio.wait`` over every in-flight task would.
        """
        done = [await self._completions.get()]
        while not self._completions.empty():
            done.append(self._completions.get_nowait())
        return done

    async def close(self) -> None:
        """Abort in-flight work, wait for the learner, release the learner thread."""
        await self._abort_in_flight()
        if self._publish_task is not None:
            await asyncio.gather(self._publish_task, return_exceptions=True)
        if self._learner_task is not None:
            await asyncio.gather(self._learner_task, return_exceptions=True)
        self._executor.shutdown(wait=True)

    # ------------------------------------------------------------------ dispatch
    def _capacity(self) -> int:
        """How many more trajectories may be dispatched now: none while draining, else up
        to ``max_in_flight`` concurrent and ``max_buffered_batches`` batches outstanding
        (in flight + finished but not consumed, held group members included), which bounds
        the policy lag.

        Work still in flight when ``run`` returns continues and is collected by the next
        ``run`` call (``close`` aborts it)."""
        if (self._has_publish_pending and self.config.drain != "none") or self.updates >= self._target:
            return 0
        outstanding = len(self._ready) + self.method.held_count() + len(self._in_flight)
        room = self.config.max_buffered_batches * self.config.batch_size - outstanding
        return max(0, min(self.config.max_in_flight - len(self._in_flight), room))

    def _next_key(self) -> jax.Array:
        key, sub = jax.random.split(jax.random.wrap_key_data(jnp.asarray(self.rng_key)))
        self.rng_key = jax.random.key_data(key)
        return sub

    def _dispatch(self) -> None:
        capacity = self._capacity()
        if capacity <= 0:
            return
        for launch in self.method.plan_dispatch(self._next_key, capacity, self._busy):
            self._launch(launch.task_id, launch.frozen_baseline, launch.group_id)

    def _coordinate(self, policy_event: int) -> float:
        """z_k = z_0 + k·(−ln ρ) (``tracker.policy_coordinate``), cached per event: the
        float32 step −ln ρ comes from ``policy_coordinate`` once; then the same two
        float32 operations on the host (bit-identical, no JAX dispatch per publish)."""
        if policy_event not in self._z_cache:
            if self._z_step is None:
                self._z_step = np.float32(tracker.policy_coordinate(1, self.config.tracker.rho, 0.0))
            z = np.float32(self.config.z0) + np.float32(policy_event) * self._z_step
            self._z_cache[policy_event] = float(z)
        return self._z_cache[policy_event]

    def _launch(self, task_id: int, frozen_baseline: float, group_id: int) -> None:
        if self._busy[task_id] >= self.method.per_task_limit:
            raise RuntimeError(f"task {task_id} already has {self._busy[task_id]} requests in flight")
        loop = asyncio.get_running_loop()
        stamp = DispatchStamp(
            request_id=self.dispatched,
            task_id=task_id,
            policy_event=self.policy_event,
            z=self._coordinate(self.policy_event),
            frozen_baseline=frozen_baseline,
            dispatch_time=loop.time(),
            group_id=group_id,
        )
        self.dispatched += 1
        self._busy[task_id] += 1
        episode = run_episode(self.engine, self.env_factory(), self.chat, stamp, self.agent_config)
        if self.config.result_delay_s > 0.0:
            delay = result_delay(self.config.seed, stamp.request_id, self.config.result_delay_s)
            episode = _delayed(episode, delay)
        future = asyncio.ensure_future(episode)
        future.add_done_callback(self._completions.put_nowait)
        self._in_flight[future] = stamp
        self._log("dispatch", stamp)

    # ------------------------------------------------------------------ receipt
    def _arrival_key(self, task: asyncio.Task):
        stamp = self._in_flight[task]
        if task.cancelled() or task.exception() is not None:
            return (float("inf"), stamp.request_id)
        return (task.result().finish_time, stamp.request_id)

    def _receive(self, task: asyncio.Task) -> None:
        stamp = self._in_flight.pop(task)
        self._busy[stamp.task_id] -= 1
        traj: Trajectory = task.result()  # run_episode records env/engine errors itself
        self._log("receive", traj)
        if traj.aborted:
            self.aborted += 1
            self._take(self.method.receive(stamp, None, "aborted"))
            return
        self._count_event_order(stamp.policy_event)
        self._failure_streak = self._failure_streak + 1 if traj.failed else 0
        if self._failure_streak >= self.config.max_consecutive_failures:
            raise RuntimeError(
                f"{self._failure_streak} consecutive failed trajectories; last error: {traj.error}"
            )
        if traj.failed:
            self.failed += 1
            if not self.config.train_on_failed:
                self._take(self.method.receive(stamp, None, "failed"))
                return
        self._take(self.method.receive(stamp, traj, None))

    def _count_event_order(self, policy_event: int) -> None:
        self.received += 1
        if policy_event < self.newest_received_event:
            self.out_of_event_order += 1
        self.newest_received_event = max(self.newest_received_event, policy_event)

    def _take(self, receipt: Receipt) -> None:
        """Trainable trajectories join the ready buffer; a dropped group is counted."""
        self._ready.extend(receipt.ready)
        if receipt.dropped is not None:
            self.dropped_groups += 1
            self.dropped_group_trajectories += len(receipt.dropped.finished)
            self._log("drop_group", receipt.dropped)

    async def _abort_in_flight(self) -> None:
        """Drain "abort": finished work is received normally; the rest is dropped."""
        done = sorted((t for t in self._in_flight if t.done() and not t.cancelled()), key=self._arrival_key)
        for task in done:
            self._receive(task)
        await self.engine.abort_all()
        await self._drop_in_flight(list(self._in_flight))

    async def _drop_in_flight(self, tasks: Sequence[asyncio.Future]) -> None:
        """Cancel these episodes (the engine frees their slots), free their tasks, count
        them as aborted and tell the method (a group with an aborted member is dropped)."""
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:
            stamp = self._in_flight.pop(task)
            self._busy[stamp.task_id] -= 1
            self.aborted += 1
            self._log("drop", stamp)
            self._take(self.method.receive(stamp, None, "aborted"))

    async def _abort_over_lag(self) -> None:
        """SPEC 3 staleness bound: abort requests in flight with policy_event − dispatch
        event > ``max_policy_lag`` (finished-but-unreceived ones are received normally)."""
        limit = self.config.max_policy_lag
        stale = [task for task, stamp in self._in_flight.items()
                 if not task.done() and self.policy_event - stamp.policy_event > limit]
        if stale:
            self.lag_aborted += len(stale)
            await self._drop_in_flight(stale)

    # ------------------------------------------------------------------ consumption
    def _maybe_start_update(self) -> None:
        n = self.config.batch_size
        if self._learner_task is not None or self.updates >= self._target or len(self._ready) < n:
            return
        if self._has_publish_pending:  # the batch waits for the publish (its drain or the previous install)
            if self._publish_wait_since is None:
                self._publish_wait_since = asyncio.get_running_loop().time()
            return
        trajectories = tuple(self._ready[:n])
        del self._ready[:n]
        lengths = baselines.action_lengths(trajectories)
        raw = self.method.advantages(trajectories)
        whitened = baselines.whiten(raw, lengths, self.config.measure, self.config.advantage.whiten_eps)
        batch = pack_train_batch(trajectories, whitened, pad_to_multiple=self.config.pad_to_multiple,
                                 pack_width=self._pack_width, row_multiple=self.config.pack_row_multiple)
        learner_input = LearnerInput(batch, trajectories, self.method.learner_extras(trajectories))
        lag = np.array([self.policy_event - t.policy_event for t in trajectories], dtype=np.int64)
        start = asyncio.get_running_loop().time()
        diagnostics = baselines.batch_diagnostics(raw, lengths)
        diagnostics.update(policy_lag_histogram(lag, self.config.max_policy_lag))
        diagnostics.update(event_span_diagnostics(trajectories))
        diagnostics.update(
            reward_mean=float(np.mean([t.reward for t in trajectories])),
            learner_rows=float(batch.input_ids.shape[0]),  # [rows, width] of the learner batch
            learner_width=float(batch.input_ids.shape[1]),
            learner_pad_fraction=float(1.0 - np.mean(batch.attention_mask)),  # padding tokens trained through
            policy_lag_mean=float(lag.mean()),
            policy_lag_max=float(lag.max()),
            failed_total=float(self.failed),
            aborted_total=float(self.aborted),
            dropped_groups_total=float(self.dropped_groups),
            dropped_group_trajectories_total=float(self.dropped_group_trajectories),
            lag_aborted_total=float(self.lag_aborted),
            received_total=float(self.received),
            out_of_event_order_total=float(self.out_of_event_order),
            **learner_wait_diagnostics(self._last_update_end, self._publish_wait_since, start),
        )
        self._publish_wait_since = None
        self._learner_pending = _PendingUpdate(trajectories, raw, whitened, lag, diagnostics, start,
                                               self.policy_event)
        self._learner_task = asyncio.ensure_future(self._call_learner(learner_input))
        self._learner_task.add_done_callback(self._completions.put_nowait)

    async def _call_learner(self, learner_input: LearnerInput) -> LearnerOutput:
        if inspect.iscoroutinefunction(self.learner) or inspect.iscoroutinefunction(
            getattr(self.learner, "__call__", None)
        ):
            output = await self.learner(learner_input)
        else:
            loop = asyncio.get_running_loop()
            output = await loop.run_in_executor(self._executor, self.learner, learner_input)
        if not isinstance(output, LearnerOutput):
            raise TypeError(f"learner must return LearnerOutput, got {type(output).__name__}")
        return output

    async def _finish_update(self) -> None:
        task, self._learner_task = self._learner_task, None
        output: LearnerOutput = task.result()  # a learner crash propagates (restore from checkpoint)
        pending, self._learner_pending = self._learner_pending, None
        self.method.after_update(pending.trajectories, output)
        self.updates += 1
        self.consumed += len(pending.trajectories)
        record = UpdateRecord(
            update=self.updates, policy_event=pending.policy_event, trajectories=pending.trajectories,
            raw_advantages=pending.raw, advantages=pending.whitened, policy_lag=pending.lag,
            diagnostics=pending.diagnostics, learner_metrics=dict(output.metrics), start_time=pending.start,
            end_time=asyncio.get_running_loop().time(),
        )
        self._last_update_end = record.end_time
        if self.config.keep_history:
            self.records.append(record)
        self._log("consume", record)
        for sink in self._update_sinks():
            sink(record)
        if self.updates % self.config.publish_every == 0 and output.weights is not None:
            self._publish_pending, self._has_publish_pending = output.weights, True
            if self.config.drain == "abort":
                await self._abort_in_flight()

    def _update_sinks(self) -> Sequence[Callable[[UpdateRecord], None]]:
        if self.on_update is None:
            return ()
        return self.on_update if isinstance(self.on_update, (list, tuple)) else (self.on_update,)

    async def _maybe_publish(self) -> None:
        """Drain "finish" / "abort": publish once nothing from the old policy is in flight.
        Drain "none": start the in-flight install now unless the previous one still runs."""
        if not self._has_publish_pending:
            return
        if self.config.drain == "none":
            if self._publish_task is None:
                weights, self._publish_pending, self._has_publish_pending = self._publish_pending, None, False
                self._publish_task = asyncio.ensure_future(
                    self.engine.publish_inflight(weights, self.policy_event + 1))
                self._publish_task.add_done_callback(self._completions.put_nowait)
            return
        if self._in_flight:
            return
        weights, self._publish_pending, self._has_publish_pending = self._publish_pending, None, False
        await self.engine.publish(weights, self.policy_event + 1)
        await self._published()

    async def _finish_inflight_publish(self) -> None:
        task, self._publish_task = self._publish_task, None
        task.result()  # a failed install propagates (restore from checkpoint)
        await self._published()

    async def _published(self) -> None:
        self.policy_event += 1
        self._log("publish", self.policy_event)
        await self._abort_over_lag()


GC_GEN0_THRESHOLD = 7000  # young-generation collection threshold, 10x CPython's default
_garbage_collector_tuned = False


def result_delay(seed: int, request_id: int, max_delay_s: float) -> float:
    """Seconds request ``request_id`` is held after it finished: U(0, max_delay_s), a
    function of (seed, request_id) only, so a rerun draws the same delays."""
    return float(np.random.default_rng((seed, 0x0DE1A7, request_id)).uniform(0.0, max_delay_s))


async def _delayed(episode: Awaitable[Trajectory], delay_s: float) -> Trajectory:
    """The episode's trajectory, delivered ``delay_s`` seconds after it finished; its
    ``finish_time`` becomes the delivery time (the orchestrator orders simultaneous
    receipts by it)."""
    trajectory = await episode
    await asyncio.sleep(delay_s)
    return dataclasses.replace(trajectory, finish_time=asyncio.get_running_loop().time())


def _tune_garbage_collector() -> None:
    """Once per process: ``gc.freeze()`` and the youngest generation's threshold raised to at
    least ``GC_GEN0_THRESHOLD`` (never lowered; module docstring, "Host cost")."""
    global _garbage_collector_tuned
    if not _garbage_collector_tuned:
        gc.freeze()
        young, middle, old = gc.get_threshold()
        gc.set_threshold(max(young, GC_GEN0_THRESHOLD), middle, old)
        _garbage_collector_tuned = True


def learner_wait_diagnostics(last_update_end: float | None, publish_wait_since: float | None,
                             start: float) -> dict[str, float]:
    """The learner's idle time before an update, split by cause (loop seconds):

        learner_idle_s          = start − previous update's end (0 for the run's first update)
        learner_publish_wait_s  = start − the moment a full batch was ready but a publish was
                                  pending (its drain, or the previous in-flight install); 0 if never
        learner_batch_wait_s    = learner_idle_s − learner_publish_wait_s (waiting for rollouts)
    """
    idle = 0.0 if last_update_end is None else start - last_update_end
    waited = 0.0 if publish_wait_since is None else start - publish_wait_since
    publish_wait = min(idle, waited) if last_update_end is not None else waited
    return {"learner_idle_s": idle, "learner_publish_wait_s": publish_wait,
            "learner_batch_wait_s": max(0.0, idle - publish_wait)}


def policy_lag_histogram(lag: np.ndarray, max_policy_lag: int) -> dict[str, float]:
    """Counts of trained trajectories per policy lag: ``policy_lag_count_<k>`` for
    k = 0..max_policy_lag, the last bucket holding every lag >= max_policy_lag (fixed keys
    per run, so tabular sinks keep their columns)."""
    counts = np.bincount(np.minimum(lag, max_policy_lag), minlength=max_policy_lag + 1)
    return {f"policy_lag_count_{k}": float(c) for k, c in enumerate(counts)}


def event_span_diagnostics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """SPEC 3 in-flight publishing: event_span_mean = mean(last − first event among a
    trajectory's tokens); mixed_policy_fraction = share of trajectories with tokens of
    more than one policy event (0 under a drained publish)."""
    widths = np.array([t.event_span[1] - t.event_span[0] for t in trajectories], dtype=np.float64)
    return {"event_span_mean": float(widths.mean()), "mixed_policy_fraction": float(np.mean(widths > 0))}
