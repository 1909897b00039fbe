"""Wall clock: SPO++ async single stream vs GRPO group-synchronous, heavy-tailed lengths.

    python benchmarks/wallclock_async_vs_group.py [--tails 0.5 1.0 1.5] [--seeds 0 1 2]
        [--updates 12] [--slots 64] [--batch 64] [--group 8] [--tasks 256]
        [--drain finish|abort|none] [--buffered-batches 2] [--max-policy-lag 8] [--figure docs/figures/wallclock_async_vs_group.png]

The real ``rollout_bridge.orchestrator.Orchestrator`` (and the real agent loop) runs under
``run_virtual``: a simulated clock driven by the latency model of ``benchmarks/_latency.py``
(per-token decode time, environment step time, learner time per batch token, publish
time). Both methods get the same rollout slots (``max_in_flight``), batch size, number of
updates, drain rule and success-improvement rule; GRPO uses ``group_size`` rollouts of one
task per group. Everything is measured from outside the orchestrator: the environment
records when each episode holds a slot (reset to close), the engine records publishes
and aborts, the learner records its busy intervals.

Printed per tail setting (mean ± std over seeds): simulated wall time to the K-th update,
trajectories per simulated second, rollout-slot utilisation, learner idle fraction, the
served policy's expected success at a common time, mean policy lag, and the real host CPU
time per trajectory of the whole simulated pipeline (orchestrator + agent loop + the fake
engine and environment), measured with ``time.process_time``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _latency  # noqa: E402
from _latency import LatencyModel, Workload  # noqa: E402

from rollout_bridge.agent import AgentConfig, ChatFormat  # noqa: E402
from rollout_bridge.engine.base import SamplingParams  # noqa: E402
from rollout_bridge.engine.fake import FakeEngine, FakeRequest, ScriptedReply, run_virtual  # noqa: E402
from rollout_bridge.envs.base import AsyncEnvironment, StepResult  # noqa: E402
from rollout_bridge.envs.synthetic import first_word  # noqa: E402
from rollout_bridge.orchestrator import LearnerOutput, Orchestrator, OrchestratorConfig  # noqa: E402
from rollout_bridge.tokenizer import build_tiny_tokenizer  # noqa: E402
from _hardware import cpu_model  # noqa: E402

METHODS = ("spopp", "grpo")
_OBSERVATION = re.compile(r"task (\d+) visit (\d+) turn (\d+)")


def build_chat(directory: str) -> ChatFormat:
    tokenizer = build_tiny_tokenizer(["task visit turn win lose next 0123456789"] * 20, directory, 300)
    return ChatFormat.from_tokenizer(tokenizer)


@dataclasses.dataclass
class Timeline:
    """Everything recorded from outside the orchestrator, in simulated seconds."""

    episodes: dict[int, list] = dataclasses.field(default_factory=dict)  # env id -> [start, end|None, done]
    learner: list[tuple[float, float, int]] = dataclasses.field(default_factory=list)  # start, end, tokens
    publishes: list[tuple[float, int]] = dataclasses.field(default_factory=list)  # time, updates in weights
    aborts: list[float] = dataclasses.field(default_factory=list)

    def episode_intervals(self, wall: float, only_done: bool = False) -> list[tuple[float, float]]:
        """(reset, close) per episode; an episode cancelled without a close ends at the
        first engine abort after its start (else at ``wall``). ``only_done``: only the
        episodes the environment played to the end (not aborted)."""
        intervals = []
        for start, end, done in self.episodes.values():
            if only_done and not done:
                continue
            if end is None:
                later = [t for t in self.aborts if t >= start]
                end = min(later) if later else wall
            intervals.append((start, end))
        return intervals


class SimWorld:
    """Shared state of one simulated run: workload draws, visit counters, timeline."""

    def __init__(self, chat: ChatFormat, workload: Workload):
        self.chat, self.workload, self.timeline = chat, workload, Timeline()
        self.visits = np.zeros(workload.num_tasks, dtype=np.int64)
        encode = chat.tokenizer.encode
        self.win_ids = tuple(encode("win", add_special_tokens=False))
        self.lose_ids = tuple(encode("lose", add_special_tokens=False))
        (self.filler_id,) = encode("0", add_special_tokens=False)
        self.stop_id = chat.stop_token_ids[0]
        self.updates_in_event = {0: 0}  # policy event -> learner updates in those weights
        self._next_env = 0

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def new_env(self) -> "SimEnv":
        self._next_env += 1
        return SimEnv(self, self._next_env)

    def script(self, request: FakeRequest) -> ScriptedReply:
        """Engine reply: the planned tokens of this turn, 'win'/'lose' first on the last turn."""
        tail = self.chat.tokenizer.decode(list(request.prompt_ids[-24:]))
        task, visit, turn = (int(g) for g in _OBSERVATION.findall(tail)[-1])
        plan = self.workload.plan(task, visit)
        n = plan.turn_tokens[turn]
        head: tuple[int, ...] = ()
        if turn == len(plan.turn_tokens) - 1:
            updates = self.updates_in_event[request.policy_event]
            head = self.win_ids if self.workload.succeeds(plan, updates) else self.lose_ids
        body = (self.filler_id,) * max(n - len(head) - 1, 0)
        return ScriptedReply(head + body + (self.stop_id,),
                             latency=n * self.workload.model.decode_s_per_token)


class SimEnv(AsyncEnvironment):
    """One episode of the planned trajectory; records when it holds a rollout slot."""

    def __init__(self, world: SimWorld, env_id: int):
        self.world, self.env_id, self.num_tasks = world, env_id, world.workload.num_tasks
        self.plan = None
        self.turn = 0

    async def reset(self, task_id: int) -> str:
        world = self.world
        world.timeline.episodes[self.env_id] = [world.now(), None, False]
        visit = int(world.visits[task_id])
        world.visits[task_id] += 1
        self.plan, self.turn = world.workload.plan(task_id, visit), 0
        await asyncio.sleep(world.workload.model.env_reset_s)
        return f"task {task_id} visit {visit} turn 0"

    async def step(self, action_text: str) -> StepResult:
        await asyncio.sleep(self.world.workload.model.env_step_s)
        self.turn += 1
        if self.turn == len(self.plan.turn_tokens):
            self.world.timeline.episodes[self.env_id][2] = True
            return StepResult("done", 1.0 if first_word(action_text) == "win" else 0.0, True)
        return StepResult(f"task {self.plan.task_id} visit {self.plan.visit} turn {self.turn}", 0.0, False)

    async def close(self) -> None:
        self.world.timeline.episodes[self.env_id][1] = self.world.now()


class TimedEngine(FakeEngine):
    """The scripted engine, plus publish / abort times for the timeline."""

    def __init__(self, world: SimWorld):
        super().__init__(world.script, publish_latency=world.workload.model.publish_s)
        self.world = world

    async def publish(self, weights: Any, policy_event: int) -> None:
        await super().publish(weights, policy_event)
        self._record_publish(weights, policy_event)

    async def publish_inflight(self, weights: Any, policy_event: int) -> None:
        """Drain "none": same install time, nothing waits; a turn's success is decided by
        the event current when the turn started (its first tokens' weights)."""
        await super().publish_inflight(weights, policy_event)
        self._record_publish(weights, policy_event)

    def _record_publish(self, weights: Any, policy_event: int) -> None:
        self.world.updates_in_event[int(policy_event)] = int(weights)
        self.world.timeline.publishes.append((self.world.now(), int(weights)))

    async def abort_all(self) -> None:
        self.world.timeline.aborts.append(self.world.now())
        await super().abort_all()


class TimedLearner:
    """Async learner: takes the modelled time for the batch's tokens; returns new weights."""

    def __init__(self, world: SimWorld):
        self.world = world

    async def __call__(self, learner_input) -> LearnerOutput:
        start = self.world.now()
        tokens = sum(len(t.token_ids) for t in learner_input.trajectories)
        await asyncio.sleep(self.world.workload.learner_seconds(tokens))
        self.world.timeline.learner.append((start, self.world.now(), tokens))
        return LearnerOutput(weights=len(self.world.timeline.learner), metrics={})


@dataclasses.dataclass(frozen=True)
class RunSpec:
    method: str
    model: LatencyModel
    seed: int
    slots: int = 64
    batch: int = 64
    group: int = 8
    updates: int = 12
    tasks: int = 256
    drain: str = "finish"
    publish_every: int = 1
    buffered_batches: int = 2  # OrchestratorConfig.max_buffered_batches
    max_policy_lag: int = 8  # OrchestratorConfig.max_policy_lag


def agent_config(model: LatencyModel) -> AgentConfig:
    per_turn = model.max_tokens + 8  # one turn never exceeds the clipped length
    return AgentConfig(max_turns=model.max_turns + 1, max_total_tokens=4 * model.max_tokens + 4096,
                       sampling=SamplingParams(max_new_tokens=per_turn), env_timeout_s=None)


async def _simulate(spec: RunSpec, chat: ChatFormat):
    world = SimWorld(chat, Workload(spec.model, spec.tasks, spec.seed))
    config = OrchestratorConfig(
        method=spec.method, batch_size=spec.batch, max_in_flight=spec.slots, group_size=spec.group,
        drain=spec.drain, publish_every=spec.publish_every, seed=spec.seed, pad_to_multiple=64,
        max_buffered_batches=spec.buffered_batches, max_policy_lag=spec.max_policy_lag,
    )
    orch = Orchestrator(TimedEngine(world), world.new_env, chat, TimedLearner(world), spec.tasks, config,
                        agent_config(spec.model))
    cpu0, real0 = time.process_time(), time.perf_counter()
    try:
        await orch.run(spec.updates)
        wall = asyncio.get_running_loop().time()
        cpu, real = time.process_time() - cpu0, time.perf_counter() - real0
    finally:
        await orch.close()
    return world, orch, wall, cpu, real


def run_once(spec: RunSpec, chat: ChatFormat) -> dict:
    """Run one (method, tail, seed) simulation and reduce it to the reported numbers."""
    world, orch, wall, cpu, real = run_virtual(_simulate(spec, chat))
    timeline = world.timeline
    episodes = timeline.episode_intervals(wall)
    received = [t for kind, t in orch.events if kind == "receive"]
    usable = [t for t in received if t.usable]
    update_ends = [end for _, end, _ in timeline.learner]
    lags = np.concatenate([r.policy_lag for r in orch.records])
    consumed = [(t, r.start_time) for r in orch.records for t in r.trajectories]
    group_done: dict[int, float] = {}
    for t, _ in consumed:
        group_done[t.stamp.group_id] = max(group_done.get(t.stamp.group_id, 0.0), t.finish_time)
    served_updates = [k for _, k in timeline.publishes]
    half = max(spec.updates // 2, 1)
    aborted_s, busy_s = _latency.aborted_slot_time(episodes, [done for _, _, done in timeline.episodes.values()],
                                                   wall)
    return dict(
        spec=spec, wall=wall, cpu=cpu, real=real,
        dispatched=orch.dispatched, completed=len(usable), consumed=orch.consumed, aborted=orch.aborted,
        lag_aborted=orch.lag_aborted,
        mixed_policy=float(np.mean([t.event_span[1] > t.event_span[0] for t, _ in consumed])),
        traj_per_s=len(usable) / wall, consumed_per_s=orch.consumed / wall,
        slot_utilisation=_latency.slot_utilisation(episodes, spec.slots, wall),
        useful_utilisation=_latency.slot_utilisation(timeline.episode_intervals(wall, only_done=True),
                                                     spec.slots, wall),
        consumed_tokens=float(np.mean([t.num_action_tokens for t, _ in consumed])),
        peak_slots=_latency.max_concurrency(episodes),
        slot_s_per_update=_latency.clipped_busy_time(episodes, 0.0, wall) / spec.updates,
        learner_idle=_latency.learner_idle_fraction([(s, e) for s, e, _ in timeline.learner], wall),
        t_half=update_ends[half - 1], t_full=update_ends[spec.updates - 1],
        # steady state: the second half of the run, past the start-up (first batches, empty buffers)
        s_per_update_late=(update_ends[spec.updates - 1] - update_ends[half - 1]) / max(spec.updates - half, 1),
        aborted_share=aborted_s / busy_s if busy_s > 0 else 0.0,
        lag_mean=float(lags.mean()), lag_max=int(lags.max()),
        out_of_event_order=orch.out_of_event_order / max(orch.received, 1),
        drain_share=_latency.drain_wait(update_ends, [t for t, _ in timeline.publishes]) / wall,
        barrier_wait=float(np.mean([group_done[t.stamp.group_id] - t.finish_time if t.stamp.group_id >= 0 else 0.0
                                    for t, _ in consumed])),
        finish_to_train=float(np.mean([start - t.finish_time for t, start in consumed])),
        publish_times=[t for t, _ in timeline.publishes],
        expected_success=list(world.workload.expected_success(np.asarray(served_updates, dtype=np.int64))),
        initial_success=float(world.workload.expected_success(0)),
        finishes=[(t.finish_time, t.reward) for t in usable],
        cpu_ms_per_traj=1e3 * cpu / max(orch.dispatched, 1),
    )


def planned_lengths(model: LatencyModel, tasks: int, seeds, visits: int = 16) -> np.ndarray:
    """Action tokens of the workload's planned trajectories (what an unbiased sample sees)."""
    return np.array([Workload(model, tasks, seed).plan(x, v).num_tokens
                     for seed in seeds for x in range(tasks) for v in range(visits)])


def success_at(result: dict, when: float) -> float:
    return float(_latency.step_values(result["publish_times"], result["expected_success"],
                                      result["initial_success"], np.array([when]))[0])


def _mean_std(values) -> str:
    values = [float(v) for v in values]
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3g} ± {std:.2g}"


def summarize(results: list[dict], tails: list[float]) -> str:
    """Markdown table per tail setting (mean ± std over seeds)."""
    lines = []
    for sigma in tails:
        rows = {m: [r for r in results if r["spec"].method == m and r["spec"].model.sigma == sigma] for m in METHODS}
        t_ref = min(r["wall"] for rs in rows.values() for r in rs)
        spec = rows["spopp"][0]["spec"]
        lengths = planned_lengths(spec.model, spec.tasks, seeds=sorted({r["spec"].seed for r in rows["spopp"]}))
        lines.append(f"\n#### tail sigma = {sigma}: planned action tokens per trajectory mean {lengths.mean():.0f}, "
                     f"p50 {np.percentile(lengths, 50):.0f}, p99 {np.percentile(lengths, 99):.0f}, "
                     f"max {lengths.max()}; common time T = {t_ref:.0f} s\n")
        lines.append("| metric | SPO++ (spopp) | GRPO (G=%d) |" % rows["grpo"][0]["spec"].group)
        lines.append("|---|---|---|")
        metrics = [
            ("simulated time to K/2 updates (s)", lambda r: r["t_half"]),
            ("simulated time to K updates (s)", lambda r: r["t_full"]),
            ("steady state: simulated s per update, updates K/2+1..K", lambda r: r["s_per_update_late"]),
            ("completed trajectories / s", lambda r: r["traj_per_s"]),
            ("consumed (trained) trajectories / s", lambda r: r["consumed_per_s"]),
            ("rollout-slot utilisation (busy slot-time / (S x wall))", lambda r: r["slot_utilisation"]),
            ("  of which episodes played to the end (not aborted)", lambda r: r["useful_utilisation"]),
            ("aborted work: busy slot time of episodes aborted before the end / all busy", lambda r: r["aborted_share"]),
            ("rollout slot-seconds per update (compute)", lambda r: r["slot_s_per_update"]),
            ("learner idle fraction", lambda r: r["learner_idle"]),
            ("expected success of served policy at T", lambda r: success_at(r, t_ref)),
            ("share of time draining before a publish", lambda r: r["drain_share"]),
            ("group-barrier wait per consumed trajectory (s)", lambda r: r["barrier_wait"]),
            ("finish -> training start per consumed trajectory (s)", lambda r: r["finish_to_train"]),
            ("mean policy lag (events)", lambda r: r["lag_mean"]),
            ("results received out of event order (share of received)", lambda r: r["out_of_event_order"]),
            ("aborted trajectories", lambda r: r["aborted"]),
            ("  of which aborted for max_policy_lag", lambda r: r["lag_aborted"]),
            ("trained trajectories with tokens of > 1 policy event", lambda r: r["mixed_policy"]),
            ("mean action tokens of trained trajectories", lambda r: r["consumed_tokens"]),
            ("host CPU ms per dispatched trajectory", lambda r: r["cpu_ms_per_traj"]),
        ]
        for name, fn in metrics:
            lines.append(f"| {name} | {_mean_std(fn(r) for r in rows['spopp'])} | "
                         f"{_mean_std(fn(r) for r in rows['grpo'])} |")
    return "\n".join(lines)


def plot(results: list[dict], tails: list[float], path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tails), figsize=(4.2 * len(tails), 3.4), squeeze=False)
    colors = {"spopp": "tab:blue", "grpo": "tab:orange"}
    labels = {"spopp": "SPO++ async", "grpo": "GRPO G=%d" % results[0]["spec"].group}
    for ax, sigma in zip(axes[0], tails):
        chosen = [r for r in results if r["spec"].model.sigma == sigma]
        horizon = max(r["wall"] for r in chosen)
        grid = np.linspace(0.0, horizon, 400)
        for method in METHODS:
            curves = np.stack([
                _latency.step_values(r["publish_times"], r["expected_success"], r["initial_success"], grid)
                for r in chosen if r["spec"].method == method
            ])
            mean, std = curves.mean(0), curves.std(0)
            ax.plot(grid, mean, color=colors[method], label=labels[method])
            ax.fill_between(grid, mean - std, mean + std, color=colors[method], alpha=0.2)
            ends = [r["t_full"] for r in chosen if r["spec"].method == method]
            ax.axvline(float(np.mean(ends)), color=colors[method], ls=":", lw=1)
        ax.set_title(f"lognormal tail sigma = {sigma}")
        ax.set_xlabel("simulated wall-clock (s)")
        ax.set_ylabel("expected success of served policy")
        ax.grid(alpha=0.3)
    axes[0][0].legend(loc="lower right", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.92 if title else 1))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)




def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tails", type=float, nargs="+", default=[0.5, 1.0, 1.5])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--updates", type=int, default=12)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tasks", type=int, default=256)
    parser.add_argument("--drain", default="finish", choices=["finish", "abort", "none"])
    parser.add_argument("--publish-every", type=int, default=1)
    parser.add_argument("--max-policy-lag", type=int, default=8,
                        help="abort requests in flight more than this many policy events after their dispatch; "
                             "below (longest episode time / time per update) it censors the longest episodes")
    parser.add_argument("--buffered-batches", type=int, default=2,
                        help="max_buffered_batches for both methods (finished-but-untrained work, GRPO's held "
                             "group members included, plus in flight <= this x batch)")
    parser.add_argument("--task-share", type=float, default=LatencyModel().task_share,
                        help="share of ln-length variance that is per task (GRPO siblings share it)")
    parser.add_argument("--figure", default="docs/figures/wallclock_async_vs_group.png")
    args = parser.parse_args(argv)

    import jax
    import transformers

    start = time.perf_counter()
    print(f"host: {cpu_model()}, {os.cpu_count()} CPUs, load avg {os.getloadavg()[0]:.1f}; "
          f"python {platform.python_version()}, jax {jax.__version__} ({jax.default_backend()}), "
          f"numpy {np.__version__}, transformers {transformers.__version__}")
    print(f"slots S={args.slots}, batch N={args.batch}, GRPO G={args.group}, updates K={args.updates}, "
          f"tasks={args.tasks}, drain={args.drain}, publish_every={args.publish_every}, "
          f"max_buffered_batches={args.buffered_batches}, max_policy_lag={args.max_policy_lag}, "
          f"tails sigma={args.tails}, seeds={args.seeds}")
    print(f"latency model: {LatencyModel(task_share=args.task_share)} (sigma varied)")
    with tempfile.TemporaryDirectory() as directory:
        chat = build_chat(directory)
        for method in METHODS:  # warm-up: compile the orchestrator's jitted helpers
            run_once(RunSpec(method, LatencyModel(sigma=0.5), seed=99, slots=args.slots, batch=args.batch,
                             group=args.group, updates=1, tasks=args.tasks, drain=args.drain,
                             buffered_batches=args.buffered_batches, max_policy_lag=args.max_policy_lag), chat)
        results = []
        for sigma in args.tails:
            for seed in args.seeds:
                for method in METHODS:
                    spec = RunSpec(method, LatencyModel(sigma=sigma, task_share=args.task_share), seed, args.slots, args.batch, args.group,
                                   args.updates, args.tasks, args.drain, args.publish_every, args.buffered_batches,
                                   args.max_policy_lag)
                    result = run_once(spec, chat)
                    results.append(result)
                    print(f"  sigma={sigma} seed={seed} {method:5s}: sim {result['wall']:7.1f} s, "
                          f"{result['completed']} done, util {result['slot_utilisation']:.3f}, "
                          f"learner idle {result['learner_idle']:.3f}, real {result['real']:.1f} s, "
                          f"cpu {result['cpu_ms_per_traj']:.2f} ms/traj", flush=True)
    print(summarize(results, args.tails))
    if args.figure:
        plot(results, args.tails, args.figure,
             f"S={args.slots} slots, N={args.batch}, K={args.updates} updates, drain={args.drain}, "
             f"publish_every={args.publish_every}, task_share={args.task_share}, buffer={args.buffered_batches}, "
             f"max_policy_lag={args.max_policy_lag}; mean ± std over seeds {args.seeds}; "
             f"dotted: time to K updates")
        print(f"\nfigure: {args.figure}")
    print(f"real wall time of the benchmark: {time.perf_counter() - start:.0f} s")
    return results


if __name__ == "__main__":
    main()
