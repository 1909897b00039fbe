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
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
from typing import Any, Awaitable, Callable, Mapping, NamedTuple, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from rollout_bridge import baselines
from rollout_bridge.agent import AgentConfig, ChatFormat, run_episode
from rollout_bridge.engine.base import RolloutEngine
from rollout_bridge.envs.base import EnvFactory
from rollout_bridge.trajectory import DispatchStamp, Trajectory, pack_train_batch
from spopp_jax import sampling, tracker

METHODS = ("spopp", "spo", "grpo")

# Jitted once per shape: the per-request tracker / sampler calls stay cheap on the host.
_all_baselines = jax.jit(lambda state: tracker.baseline(state, jnp.arange(state.alpha.shape[0])))
_observe = jax.jit(tracker.observe)
_sample_idle = jax.jit(sampling.sample_idle_tasks, static_argnames=("k", "floor", "form"))
DRAINS = ("finish", "abort")
MEASURES = ("token", "trajectory")
SIBLING_RULES = ("balanced", "proportional")


@dataclasses.dataclass(frozen=True)
class OrchestratorConfig:
    """Orchestration knobs (SPEC 2-4, 6 defaults). Every constant is configurable."""

    method: str = "spopp"  # "spopp" | "spo" | "grpo"
    measure: str = "token"  # whitening measure, SPEC 4
    batch_size: int = 128  # N trajectories per update
    publish_every: int = 1  # K: publish after every K updates
    drain: str = "finish"  # "finish" | "abort"
    max_in_flight: int = 128  # concurrent trajectories
    max_in_flight_per_task: int = 1  # m; SPEC 2 experiments: 1 (see the module docstring)
    sibling_rule: str = "balanced"  # m > 1: "balanced" | "proportional" (module docstring)
    max_buffered_batches: int = 2  # dispatch only while ready + in-flight < this x batch_size
    group_size: int = 8  # GRPO G
    rho: float = 0.875
    z0: float = 0.0
    sampler_form: str = "inside_sqrt"  # SPO++ sqrt(v(1-v)+floor); "outside_sqrt": SPO's sqrt(v(1-v))+floor
    sampler_floor: float = 0.05
    spo_d_half: float = 0.06
    spo_rho_min: float = 0.875
    spo_rho_max: float = 0.96
    train_on_failed: bool = False
    max_consecutive_failures: int = 256  # a broken engine/env stops the run instead of spinning
    pad_to_multiple: int = 64
    seed: int = 0

    def __post_init__(self):
        for name, value, allowed in (
            ("method", self.method, METHODS),
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
        if self.method == "grpo":
            if self.batch_size % self.group_size:
                raise ValueError(f"batch_size ({self.batch_size}) must be a multiple of group_size ({self.group_size})")
            if self.max_in_flight < self.group_size:
                raise ValueError("max_in_flight must be >= group_size for GRPO")
            if self.max_in_flight_per_task != 1:
                raise ValueError("max_in_flight_per_task must be 1 for GRPO (a group is its multi-request unit)")


class LearnerInput(NamedTuple):
    """What the learner callable receives for one update.

    batch: the packed ``TrainBatch``; trajectories: the batch in arrival order;
    previous: SPO only (else all None), aligned with ``trajectories``: the previous
    trajectory y′ of the same task (possibly earlier in this batch), whose
    ``rollout_logp`` is π_then; None on a task's first visit. The learner scores y′ after
    its update (π_now) and returns D_i = token-mean |π_then − π_now|
    (``baselines.token_mean_abs_log_ratio``).
    """

    batch: Any
    trajectories: tuple[Trajectory, ...]
    previous: tuple[Trajectory | None, ...]


class LearnerOutput(NamedTuple):
    """The learner's answer: weights to publish (None: nothing to publish), scalar metrics,
    and for SPO the divergence D_i aligned with the batch (None, or a None entry: D = 0)."""

    weights: Any
    metrics: Mapping[str, float] = {}
    divergence: Sequence[float | None] | None = None


Learner = Callable[[LearnerInput], Union[LearnerOutput, Awaitable[LearnerOutput]]]


def free_slot_mask(in_flight_count: np.ndarray, max_in_flight_per_task: int) -> np.ndarray:
    """Unavailable-slot mask of the [m · num_tasks] slot candidates, tier-major.

    Candidate ``j · num_tasks + x`` is the (j+1)-th concurrent request of task x; it is
    free iff ``j >= in_flight_count[x]`` (True = occupied / not dispatchable). With m = 1
    this is ``in_flight_count > 0``, SPEC 3's in-flight mask.
    """
    in_flight_count = np.asarray(in_flight_count)
    if in_flight_count.ndim != 1 or not np.issubdtype(in_flight_count.dtype, np.integer):
        raise ValueError(f"in_flight_count must be a 1-D integer array, got {in_flight_count.dtype}"
                         f"{in_flight_count.shape}")
    if max_in_flight_per_task < 1:
        raise ValueError(f"max_in_flight_per_task must be >= 1, got {max_in_flight_per_task}")
    tiers = np.arange(max_in_flight_per_task)[:, None]
    return (tiers < in_flight_count[None, :]).reshape(-1)


def sample_dispatch_tasks(
    key: jax.Array,
    v_hat: np.ndarray,
    in_flight_count: np.ndarray,
    max_in_flight_per_task: int,
    count: int,
    rule: str = "balanced",
    floor: float = 0.05,
    form: str = "inside_sqrt",
) -> np.ndarray:
    """Tasks of the next ``count`` dispatches (repeats allowed up to m − in_flight_x).

    SPEC 3 weight u(v̂) = ``sampling.uncertainty_weights``; draws without replacement via
    ``sampling.sample_idle_tasks`` (Gumbel top-k: the first ``count`` of a full draw have
    the law of ``count`` sequential draws, one compile per shape).

    rule "proportional": one draw over the slot candidates of :func:`free_slot_mask` with
      v̂ tiled per tier, so each draw picks x with probability ∝ u(v̂_x)·(m − in_flight_x).
    rule "balanced": tier by tier; the tier is the tasks with the fewest requests in flight
      (b < m); up to its size are drawn ∝ u(v̂) without replacement, their counts rise,
      repeat. The first tier uses ``key`` itself, tier t > 0 ``fold_in(key, t)``.
    At m = 1 both are exactly ``sample_idle_tasks(key, v̂, in_flight > 0)[:count]``.
    """
    if rule not in SIBLING_RULES:
        raise ValueError(f"rule must be one of {SIBLING_RULES}, got {rule!r}")
    v_hat = np.asarray(v_hat)
    in_flight_count = np.asarray(in_flight_count)
    num_tasks = v_hat.shape[0]
    if v_hat.ndim != 1 or in_flight_count.shape != v_hat.shape:
        raise ValueError(f"v_hat and in_flight_count must be [num_tasks] vectors, got {v_hat.shape}, "
                         f"{in_flight_count.shape}")
    occupied = free_slot_mask(in_flight_count, max_in_flight_per_task)
    if not 0 <= count <= int((~occupied).sum()):
        raise ValueError(f"count must be in [0, free slots = {int((~occupied).sum())}], got {count}")
    if rule == "proportional" or max_in_flight_per_task == 1:
        order = _sample_idle(key, jnp.asarray(np.tile(v_hat, max_in_flight_per_task)), jnp.asarray(occupied),
                             k=occupied.size, floor=floor, form=form)
        chosen = np.asarray(order)[:count]
        if np.any(chosen < 0) or np.any(occupied[chosen]):
            raise RuntimeError("sampler returned an occupied slot")
        return chosen % num_tasks
    counts, chosen, tier = in_flight_count.astype(np.int64).copy(), [], 0
    while len(chosen) < count:
        fewest = counts.min(where=counts < max_in_flight_per_task, initial=max_in_flight_per_task)
        members = counts == fewest
        take = min(count - len(chosen), int(members.sum()))
        tier_key = key if tier == 0 else jax.random.fold_in(key, tier)
        order = np.asarray(_sample_idle(tier_key, jnp.asarray(v_hat), jnp.asarray(~members), k=num_tasks,
                                        floor=floor, form=form))[:take]
        if np.any(order < 0) or np.any(~members[order]):
            raise RuntimeError("sampler returned a task outside its tier")
        counts[order] += 1
        chosen.extend(int(x) for x in order)
        tier += 1
    return np.asarray(chosen, dtype=np.int64)


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


class DroppedGroup(NamedTuple):
    """A GRPO group dropped whole: ``reason`` "aborted" | "failed" (the first spoiling
    member), ``finished`` the members that had finished and are discarded untrained."""

    group_id: int
    task_id: int
    reason: str
    finished: tuple[Trajectory, ...]


@dataclasses.dataclass
class _Group:
    """A GRPO group in flight: ``resolved`` members came back (any outcome) of ``size``;
    ``members`` are the trainable ones; ``spoiled`` names why the group will be dropped."""

    task_id: int
    size: int
    members: list
    resolved: int = 0
    spoiled: str | None = None


class Orchestrator:
    """Runs rollouts and updates; ``await run(num_updates)``; ``await close()`` at the end.

    ``events`` is the processing log in order: ("dispatch", DispatchStamp),
    ("receive", Trajectory), ("drop", DispatchStamp), ("drop_group", DroppedGroup) (GRPO),
    ("publish", int), ("consume", UpdateRecord). Checkpoint with :meth:`state_dict` / :meth:`load_state_dict`.
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
        on_update: Callable[[UpdateRecord], None] | None = None,
    ):
        if num_tasks < 1:
            raise ValueError(f"num_tasks must be >= 1, got {num_tasks}")
        self.engine, self.env_factory, self.chat, self.learner = engine, env_factory, chat, learner
        self.num_tasks, self.config, self.agent_config, self.on_update = num_tasks, config, agent_config, on_update
        alpha = np.full(num_tasks, 0.5, np.float32) if prior_alpha is None else np.asarray(prior_alpha, np.float32)
        beta = np.full(num_tasks, 0.5, np.float32) if prior_beta is None else np.asarray(prior_beta, np.float32)
        self.tracker = tracker.init(alpha, beta, z0=config.z0)
        self.rng_key = jax.random.key_data(jax.random.key(config.seed))
        self.policy_event = int(engine.policy_event)
        self.updates = self.dispatched = self.consumed = self.failed = self.aborted = 0
        self.events: list[tuple[str, Any]] = []
        self.records: list[UpdateRecord] = []
        self._busy = np.zeros(num_tasks, dtype=np.int64)
        self._in_flight: dict[asyncio.Task, DispatchStamp] = {}
        self._ready: list[Trajectory] = []
        self._groups: dict[int, _Group] = {}
        self._next_group = 0
        self.dropped_groups = self.dropped_group_trajectories = 0  # GRPO; diagnostics only
        self._spo_previous: dict[int, Trajectory] = {}
        self._learner_task: asyncio.Task | None = None
        self._completions: asyncio.Queue = asyncio.Queue()  # futures, in completion order
        self._learner_pending: tuple | None = None
        self._publish_pending: Any = None
        self._has_publish_pending = False
        self._target = 0
        self._z_cache: dict[int, float] = {}
        self._failure_streak = 0
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="learner")

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict:
        """Everything that must survive a crash, as a pytree of arrays."""
        counters = dict(
            policy_event=self.policy_event, updates=self.updates, dispatched=self.dispatched,
            consumed=self.consumed, failed=self.failed, aborted=self.aborted,
        )
        return {
            "tracker": self.tracker,
            "rng_key": np.asarray(self.rng_key),
            "counters": {k: np.asarray(v, np.int64) for k, v in counters.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (the engine must already serve that event)."""
        restored = state["tracker"]
        self.tracker = tracker.TrackerState(
            alpha=jnp.asarray(restored.alpha), beta=jnp.asarray(restored.beta), z_ref=jnp.asarray(restored.z_ref)
        )
        if self.tracker.num_tasks != self.num_tasks:
            raise ValueError(f"state tracker has {self.tracker.num_tasks} tasks, expected {self.num_tasks}")
        self.rng_key = jnp.asarray(state["rng_key"])
        for name, value in state["counters"].items():
            setattr(self, name, int(value))

    # ------------------------------------------------------------------ main loop
    async def run(self, num_updates: int) -> list[UpdateRecord]:
        """Collect and train until ``num_updates`` more updates are done (and published)."""
        if self.engine.policy_event != self.policy_event:
            raise ValueError(
                f"engine serves policy event {self.engine.policy_event}, orchestrator is at {self.policy_event}"
            )
        start = len(self.records)
        self._target = self.updates + num_updates
        while True:
            await self._maybe_publish()
            if self.updates >= self._target and not self._has_publish_pending:
                break
            self._maybe_start_update()
            self._dispatch()
            if not self._in_flight and self._learner_task is None:
                if self._has_publish_pending:
                    continue
                raise RuntimeError("orchestrator stalled: nothing in flight and no batch to train")
            done = await self._next_completions()
            finished = sorted((t for t in done if t in self._in_flight), key=self._arrival_key)
            for task in finished:
                self._receive(task)
            if self._learner_task is not None and self._learner_task.done():
                await self._finish_update()
        return self.records[start:]

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
        if self._learner_task is not None:
            await asyncio.gather(self._learner_task, return_exceptions=True)
        self._executor.shutdown(wait=True)

    # ------------------------------------------------------------------ dispatch
    def _capacity(self) -> int:
        """How many more trajectories may be dispatched now: none while draining, else up
        to ``max_in_flight`` concurrent and ``max_buffered_batches`` batches outstanding
        (in flight + finished but not consumed), which bounds the policy lag.

        Work still in flight when ``run`` returns continues and is collected by the next
        ``run`` call (``close`` aborts it)."""
        if self._has_publish_pending or self.updates >= self._target:
            return 0
        outstanding = len(self._ready) + self._grouped_count() + len(self._in_flight)
        room = self.config.max_buffered_batches * self.config.batch_size - outstanding
        return max(0, min(self.config.max_in_flight - len(self._in_flight), room))

    def _grouped_count(self) -> int:
        return sum(len(g.members) for g in self._groups.values())

    def _next_key(self) -> jax.Array:
        key, sub = jax.random.split(jax.random.wrap_key_data(jnp.asarray(self.rng_key)))
        self.rng_key = jax.random.key_data(key)
        return sub

    def _dispatch(self) -> None:
        capacity = self._capacity()
        if self.config.method == "grpo":
            idle = self._busy == 0
            count = int(min(capacity // self.config.group_size, idle.sum()))
            if count <= 0:
                return
            ids = np.flatnonzero(idle)
            chosen = np.asarray(jax.random.choice(self._next_key(), ids, (count,), replace=False))
            for task_id in chosen:
                self._start_group(int(task_id))
            return
        per_task = self.config.max_in_flight_per_task
        count = int(min(capacity, np.maximum(per_task - self._busy, 0).sum()))
        if count <= 0:
            return
        v_hat = np.asarray(_all_baselines(self.tracker))  # read once: no result arrives in between
        chosen = sample_dispatch_tasks(
            self._next_key(), v_hat, self._busy, per_task, count, rule=self.config.sibling_rule,
            floor=self.config.sampler_floor, form=self.config.sampler_form,
        )
        for task_id in chosen:
            self._launch(int(task_id), float(v_hat[int(task_id)]), group_id=-1)

    def _start_group(self, task_id: int) -> None:
        group_id = self._next_group
        self._next_group += 1
        self._groups[group_id] = _Group(task_id=task_id, size=self.config.group_size, members=[])
        for _ in range(self.config.group_size):
            self._launch(task_id, float("nan"), group_id)

    def _coordinate(self, policy_event: int) -> float:
        """z_k = z_0 + k·(−ln ρ), cached per event."""
        if policy_event not in self._z_cache:
            z = tracker.policy_coordinate(policy_event, self.config.rho, self.config.z0)
            self._z_cache[policy_event] = float(z)
        return self._z_cache[policy_event]

    def _launch(self, task_id: int, frozen_baseline: float, group_id: int) -> None:
        if self.config.method != "grpo" and self._busy[task_id] >= self.config.max_in_flight_per_task:
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
        future = asyncio.ensure_future(episode)
        future.add_done_callback(self._completions.put_nowait)
        self._in_flight[future] = stamp
        self.events.append(("dispatch", stamp))

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
        self.events.append(("receive", traj))
        if traj.aborted:
            self.aborted += 1
            self._resolve_member(stamp, None, spoil="aborted")
            return
        self._failure_streak = self._failure_streak + 1 if traj.failed else 0
        if self._failure_streak >= self.config.max_consecutive_failures:
            raise RuntimeError(
                f"{self._failure_streak} consecutive failed trajectories; last error: {traj.error}"
            )
        if traj.failed:
            self.failed += 1
            if not self.config.train_on_failed:
                self._resolve_member(stamp, None, spoil="failed")
                return
        if self.config.method == "spopp":  # evidence visible to later dispatches at once
            self.tracker = _observe(self.tracker, np.array([traj.task_id], np.int32),
                                    np.array([traj.z], np.float32), np.array([traj.reward], np.float32))
        if self.config.method == "grpo":
            self._resolve_member(stamp, traj)
        else:
            self._ready.append(traj)

    def _resolve_member(self, stamp: DispatchStamp, traj: Trajectory | None, spoil: str | None = None) -> None:
        """GRPO barrier: count one member of ``stamp``'s group as back (``traj`` trainable,
        or None with ``spoil`` naming why not). When all G are back, the group joins the
        ready buffer whole, or is dropped whole if any member spoiled it."""
        if stamp.group_id < 0:
            return
        group = self._groups[stamp.group_id]
        group.resolved += 1
        if traj is not None:
            group.members.append(traj)
        if spoil is not None and group.spoiled is None:
            group.spoiled = spoil
        if group.resolved < group.size:
            return
        del self._groups[stamp.group_id]
        if group.spoiled is None:
            self._ready.extend(group.members)
            return
        self.dropped_groups += 1
        self.dropped_group_trajectories += len(group.members)
        self.events.append(("drop_group", DroppedGroup(stamp.group_id, group.task_id, group.spoiled,
                                                       tuple(group.members))))

    async def _abort_in_flight(self) -> None:
        """Drain "abort": finished work is received normally; the rest is dropped."""
        done = sorted((t for t in self._in_flight if t.done() and not t.cancelled()), key=self._arrival_key)
        for task in done:
            self._receive(task)
        await self.engine.abort_all()
        pending = list(self._in_flight)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in pending:
            stamp = self._in_flight.pop(task)
            self._busy[stamp.task_id] -= 1
            self.aborted += 1
            self.events.append(("drop", stamp))
            self._resolve_member(stamp, None, spoil="aborted")

    # ------------------------------------------------------------------ consumption
    def _maybe_start_update(self) -> None:
        n = self.config.batch_size
        if self._learner_task is not None or self._has_publish_pending or self.updates >= self._target:
            return
        if len(self._ready) < n:
            return
        trajectories = tuple(self._ready[:n])
        del self._ready[:n]
        lengths = baselines.action_lengths(trajectories)
        if self.config.method == "grpo":
            # whole groups by construction (ready groups have G members, G divides N); checked
            raw = baselines.group_relative_advantages(trajectories, self.config.group_size)
        else:
            raw = baselines.frozen_baseline_advantages(trajectories)
        whitened = baselines.whiten(raw, lengths, self.config.measure)
        batch = pack_train_batch(trajectories, whitened, pad_to_multiple=self.config.pad_to_multiple)
        learner_input = LearnerInput(batch, trajectories, self._previous_responses(trajectories))
        lag = np.array([self.policy_event - t.policy_event for t in trajectories], dtype=np.int64)
        diagnostics = baselines.batch_diagnostics(raw, lengths)
        diagnostics.update(
            reward_mean=float(np.mean([t.reward for t in trajectories])),
            policy_lag_mean=float(lag.mean()),
            policy_lag_max=float(lag.max()),
            failed_total=float(self.failed),
            aborted_total=float(self.aborted),
            dropped_groups_total=float(self.dropped_groups),
            dropped_group_trajectories_total=float(self.dropped_group_trajectories),
        )
        start = asyncio.get_running_loop().time()
        self._learner_pending = (trajectories, raw, whitened, lag, diagnostics, start, self.policy_event)
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
        trajectories, raw, whitened, lag, diagnostics, start, event = self._learner_pending
        self._learner_pending = None
        if self.config.method == "spo":
            self._spo_update(trajectories, output.divergence)
        self.updates += 1
        self.consumed += len(trajectories)
        record = UpdateRecord(
            update=self.updates, policy_event=event, trajectories=trajectories, raw_advantages=raw,
            advantages=whitened, policy_lag=lag, diagnostics=diagnostics,
            learner_metrics=dict(output.metrics), start_time=start,
            end_time=asyncio.get_running_loop().time(),
        )
        self.records.append(record)
        self.events.append(("consume", record))
        if self.on_update is not None:
            self.on_update(record)
        if self.updates % self.config.publish_every == 0 and output.weights is not None:
            self._publish_pending, self._has_publish_pending = output.weights, True
            if self.config.drain == "abort":
                await self._abort_in_flight()

    def _previous_responses(self, trajectories: Sequence[Trajectory]) -> tuple[Trajectory | None, ...]:
        """SPO: y′ of each trajectory (the task's previous consumed response), else None."""
        if self.config.method != "spo":
            return (None,) * len(trajectories)
        latest, previous = dict(self._spo_previous), []
        for traj in trajectories:
            previous.append(latest.get(traj.task_id))
            latest[traj.task_id] = traj
        return tuple(previous)

    def _spo_update(self, trajectories: Sequence[Trajectory], divergence) -> None:
        """SPO receipt-order tracker, applied after the actor update in arrival order."""
        divergence = baselines.spo_divergences(len(trajectories), divergence)
        rho = tracker.spo_retention(
            jnp.asarray(divergence), self.config.spo_d_half, self.config.spo_rho_min, self.config.spo_rho_max
        )
        self.tracker = tracker.spo_observe(
            self.tracker, np.array([t.task_id for t in trajectories]),
            np.array([t.reward for t in trajectories], np.float32), rho,
        )
        for traj in trajectories:
            self._spo_previous[traj.task_id] = traj

    async def _maybe_publish(self) -> None:
        """Publish once the drain is complete (nothing from the old policy in flight)."""
        if not self._has_publish_pending or self._in_flight:
            return
        weights, self._publish_pending, self._has_publish_pending = self._publish_pending, None, False
        await self.engine.publish(weights, self.policy_event + 1)
        self.policy_event += 1
        self.events.append(("publish", self.policy_event))
