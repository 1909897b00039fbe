"""Several in-flight requests per task: what m = ``max_in_flight_per_task`` buys and costs.

    python benchmarks/multi_inflight.py [--per-task 1 2 4 8] [--seeds 0 1 2] [--tasks 16]
        [--slots 64] [--batch 32] [--updates 40] [--rule balanced] [--lr 0.1]
        [--sigma 1.0] [--drain finish] [--publish-every 1]

Few tasks, many rollout slots (16 tasks, 64 slots by default): with m = 1 at most 16
requests can be in flight, so most slots idle. The real ``Orchestrator`` (and the real
agent loop) runs under ``run_virtual`` on a simulated clock:

* a request of (task x, visit v) takes ``latency_s · exp(s·ξ − s²/2)`` simulated seconds,
  ξ = sqrt(½)·ξ_x + sqrt(½)·ε_xv standard normal (a per-task and a per-visit part), and
  ends with "win" (reward 1) iff u_xv < p_x(k) = sigmoid(θ_x(k)), k the policy event that
  generated it. ξ and u come from tables keyed by (seed, x, v): every m sees the same
  draws for the same visit (common random numbers).
* the fake learner is a Bernoulli bandit per task trained with the orchestrator's
  whitened advantages: θ_x += lr · Σ_{i of x in the batch} Ã_i · (R_i − p_x(k_i))
  (REINFORCE for a logit), taking ``learner_s`` simulated seconds; published every
  ``--publish-every`` updates (``publish_s``) after the ``--drain``.

Printed per m (mean ± std over seeds): simulated time to K updates, trained trajectories
per simulated second, slot utilisation (engine busy slot-time / (slots · time)), mean
|v̂_frozen − p_x(k)| (baseline error against the true success probability of the policy
that generated the trajectory), share of dispatches made beside an in-flight sibling with
the same visible history (hence the same v̂), share of a batch that repeats a task
(1 − distinct tasks / batch), mean policy lag, true mean success Σ_x p_x / n of the served
policy at common simulated times, and the time to reach a target mean success.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import platform
import re
import statistics
import tempfile
import time

import numpy as np

from rollout_bridge.agent import AgentConfig, ChatFormat
from rollout_bridge.engine.base import SamplingParams
from rollout_bridge.engine.fake import FakeEngine, FakeRequest, ScriptedReply, run_virtual
from rollout_bridge.envs.base import AsyncEnvironment, StepResult
from rollout_bridge.envs.synthetic import first_word
from rollout_bridge.orchestrator import LearnerInput, LearnerOutput, Orchestrator, OrchestratorConfig
from rollout_bridge.tokenizer import build_tiny_tokenizer
from _hardware import cpu_model  # noqa: E402

_OBSERVATION = re.compile(r"task (\d+) visit (\d+)")


@dataclasses.dataclass(frozen=True)
class Bench:
    """One run's constants (simulated seconds)."""

    per_task: int
    seed: int
    tasks: int = 16
    slots: int = 64
    batch: int = 32
    updates: int = 40
    rule: str = "balanced"
    drain: str = "finish"
    publish_every: int = 1
    latency_s: float = 20.0
    latency_sigma: float = 1.0
    learner_s: float = 4.0
    publish_s: float = 0.5
    theta0_mean: float = -1.0
    theta0_std: float = 1.0
    lr: float = 0.1
    max_visits: int = 4096


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-np.asarray(x, np.float64)))


class Bandit:
    """Workload draws, per-event policy parameters θ(k), and the publish timeline."""

    def __init__(self, bench: Bench, chat: ChatFormat):
        rng = np.random.default_rng(bench.seed)
        self.bench, self.chat = bench, chat
        task_part = rng.standard_normal((bench.tasks, 1))
        xi = np.sqrt(0.5) * task_part + np.sqrt(0.5) * rng.standard_normal((bench.tasks, bench.max_visits))
        s = bench.latency_sigma
        self.latency = bench.latency_s * np.exp(s * xi - s * s / 2)
        self.uniform = rng.uniform(size=(bench.tasks, bench.max_visits))
        self.thetas = {0: rng.normal(bench.theta0_mean, bench.theta0_std, bench.tasks)}
        self.publishes = [(0.0, float(sigmoid(self.thetas[0]).mean()))]  # (time, true mean success)
        self.visits = np.zeros(bench.tasks, dtype=np.int64)
        encode = chat.tokenizer.encode
        self.win = tuple(encode("win", add_special_tokens=False))
        self.lose = tuple(encode("lose", add_special_tokens=False))
        self.stop = chat.stop_token_ids[0]

    def success_probability(self, task_id: int, policy_event: int) -> float:
        return float(sigmoid(self.thetas[policy_event][task_id]))

    def script(self, request: FakeRequest) -> ScriptedReply:
        tail = self.chat.tokenizer.decode(list(request.prompt_ids))
        task, visit = (int(g) for g in _OBSERVATION.findall(tail)[-1])
        won = self.uniform[task, visit] < self.success_probability(task, request.policy_event)
        return ScriptedReply((self.win if won else self.lose) + (self.stop,), latency=float(self.latency[task, visit]))

    def new_env(self) -> "BanditEnv":
        return BanditEnv(self)


class BanditEnv(AsyncEnvironment):
    """One turn: the observation names the task and visit; 'win' scores 1."""

    def __init__(self, world: Bandit):
        self.world, self.num_tasks = world, world.bench.tasks

    async def reset(self, task_id: int) -> str:
        visit = int(self.world.visits[task_id])
        self.world.visits[task_id] += 1
        return f"task {task_id} visit {visit}"

    async def step(self, action_text: str) -> StepResult:
        return StepResult("done", 1.0 if first_word(action_text) == "win" else 0.0, True)


class BanditEngine(FakeEngine):
    """Scripted engine; ``publish`` stores θ(k) and the true mean success at that time."""

    def __init__(self, world: Bandit):
        super().__init__(world.script, publish_latency=world.bench.publish_s)
        self.world = world

    async def publish(self, weights, policy_event: int) -> None:
        await super().publish(weights, policy_event)
        self.world.thetas[int(policy_event)] = weights
        now = asyncio.get_running_loop().time()
        self.world.publishes.append((now, float(sigmoid(weights).mean())))


class BanditLearner:
    """θ_x += lr Σ_i Ã_i (R_i − p_x(k_i)) over the batch; takes ``learner_s`` seconds."""

    def __init__(self, world: Bandit):
        self.world = world
        self.theta = world.thetas[0].copy()

    async def __call__(self, learner_input: LearnerInput) -> LearnerOutput:
        await asyncio.sleep(self.world.bench.learner_s)
        advantages = np.asarray(learner_input.batch.advantages)
        action_mask = np.asarray(learner_input.batch.action_mask)
        for row, traj in enumerate(learner_input.trajectories):
            whitened = advantages[row, int(np.argmax(action_mask[row]))]
            p_then = self.world.success_probability(traj.task_id, traj.policy_event)
            self.theta[traj.task_id] += self.world.bench.lr * whitened * (traj.reward - p_then)
        return LearnerOutput(weights=self.theta.copy())


async def _simulate(bench: Bench, chat: ChatFormat):
    world = Bandit(bench, chat)
    config = OrchestratorConfig(
        batch_size=bench.batch, max_in_flight=bench.slots, max_in_flight_per_task=bench.per_task,
        sibling_rule=bench.rule, drain=bench.drain,
        publish_every=bench.publish_every, seed=bench.seed, pad_to_multiple=8,
    )
    agent = AgentConfig(max_turns=1, max_total_tokens=256, sampling=SamplingParams(max_new_tokens=8),
                        env_timeout_s=None)
    engine = BanditEngine(world)
    orch = Orchestrator(engine, world.new_env, chat, BanditLearner(world), bench.tasks, config, agent)
    try:
        await orch.run(bench.updates)
    finally:
        await orch.close()
    return world, engine, orch


def sibling_shares(orch: Orchestrator) -> tuple[float, float]:
    """Shares of all dispatches made (a) beside an in-flight sibling, (b) beside one with no
    result of the task received since the previous dispatch (same H, so the same v̂)."""
    in_flight = np.zeros(orch.num_tasks, dtype=np.int64)
    received = np.zeros(orch.num_tasks, dtype=np.int64)
    received_at_dispatch = np.full(orch.num_tasks, -1, dtype=np.int64)
    beside = shared = total = 0
    for kind, item in orch.events:
        if kind == "dispatch":
            x = item.task_id
            total += 1
            beside += in_flight[x] > 0
            shared += in_flight[x] > 0 and received_at_dispatch[x] == received[x]
            in_flight[x] += 1
            received_at_dispatch[x] = received[x]
        elif kind == "receive":
            in_flight[item.task_id] -= 1
            received[item.task_id] += item.usable
        elif kind == "drop":
            in_flight[item.task_id] -= 1
    return beside / max(total, 1), shared / max(total, 1)


def step_value(points: list[tuple[float, float]], when: float) -> float:
    """Value of a right-continuous step function given (time, value) points, at ``when``."""
    value = points[0][1]
    for t, v in points:
        if t <= when:
            value = v
    return value


def run_once(bench: Bench, chat: ChatFormat) -> dict:
    real0 = time.perf_counter()
    world, engine, orch = run_virtual(_simulate(bench, chat))
    real = time.perf_counter() - real0
    wall = orch.records[-1].end_time
    spans = [(r.start_time, min(r.finish_time, wall), r.result.finish_reason == "abort")
             for r in engine.records if r.start_time < wall]
    busy = sum(end - start for start, end, _ in spans)
    useful = sum(end - start for start, end, aborted in spans if not aborted)
    consumed = [t for r in orch.records for t in r.trajectories]
    stale = [abs(t.frozen_baseline - world.success_probability(t.task_id, t.policy_event)) for t in consumed]
    repeats = [1.0 - len({t.task_id for t in r.trajectories}) / len(r.trajectories) for r in orch.records]
    beside, shared = sibling_shares(orch)
    return dict(
        bench=bench, wall=wall, real=real, consumed_per_s=len(consumed) / wall,
        utilisation=busy / (bench.slots * wall), useful=useful / (bench.slots * wall), peak=engine.max_concurrent,
        stale=float(np.mean(stale)), beside=beside, shared=shared, repeats=float(np.mean(repeats)),
        lag=float(np.mean(np.concatenate([r.policy_lag for r in orch.records]))),
        reward=float(np.mean([t.reward for t in consumed])), publishes=world.publishes,
    )


def _mean_std(values, digits: int = 3) -> str:
    values = [float(v) for v in values]
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}g} ± {std:.2g}"


def time_to(points, target: float) -> float:
    return next((t for t, v in points if v >= target), float("inf"))


def summarize(results: list[dict], per_tasks, target: float) -> str:
    horizon = min(r["wall"] for r in results)  # a time every run reached
    lines = [f"common simulated horizon T = {horizon:.0f} s; target mean success {target}\n",
             "| m | time to K updates (s) | trained traj / s | slot utilisation (not aborted) | peak in flight | "
             "mean abs(v̂ − p) | dispatches beside a sibling | ... with the same v̂ | batch share repeating a task | "
             "policy lag | success at T/4 | at T/2 | at T | time to target (s) |",
             "|---|" + "---|" * 13]
    for m in per_tasks:
        rows = [r for r in results if r["bench"].per_task == m]
        reach = [time_to(r["publishes"], target) for r in rows]
        reached = [t for t in reach if np.isfinite(t)]
        reach_text = (_mean_std(reached) if len(reached) == len(reach) else
                      f"{len(reached)}/{len(reach)} runs reached it")
        cells = [
            _mean_std(r["wall"] for r in rows), _mean_std(r["consumed_per_s"] for r in rows),
            f"{_mean_std(r['utilisation'] for r in rows)} ({_mean_std(r['useful'] for r in rows)})",
            _mean_std(r["peak"] for r in rows),
            _mean_std(r["stale"] for r in rows), _mean_std(r["beside"] for r in rows),
            _mean_std(r["shared"] for r in rows), _mean_std(r["repeats"] for r in rows),
            _mean_std(r["lag"] for r in rows),
            *(_mean_std(step_value(r["publishes"], f * horizon) for r in rows) for f in (0.25, 0.5, 1.0)),
            reach_text,
        ]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--per-task", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--updates", type=int, default=40)
    parser.add_argument("--rule", default="balanced", choices=["balanced", "proportional"])
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--sigma", type=float, default=1.0, help="latency tail: std of ln(latency)")
    parser.add_argument("--drain", default="finish", choices=["finish", "abort"])
    parser.add_argument("--publish-every", type=int, default=1)
    parser.add_argument("--target", type=float, default=0.6)
    args = parser.parse_args(argv)
    import jax

    print(f"host: {platform.platform()}, {cpu_model()}, "
          f"{os.cpu_count()} CPUs; python {platform.python_version()}, jax {jax.__version__} "
          f"({jax.default_backend()}); simulated clock (run_virtual), real Orchestrator + agent loop")
    print(f"tasks {args.tasks}, slots {args.slots}, batch {args.batch}, updates {args.updates}, rule {args.rule}, "
          f"lr {args.lr}, sigma {args.sigma}, drain {args.drain}, "
          f"publish every {args.publish_every}, seeds {args.seeds}; defaults: {Bench(per_task=1, seed=0)}")
    with tempfile.TemporaryDirectory() as directory:
        tokenizer = build_tiny_tokenizer(["task visit win lose 0123456789"] * 20, directory, 300)
        chat = ChatFormat.from_tokenizer(tokenizer)
        results = []
        for m in args.per_task:
            for seed in args.seeds:
                bench = Bench(per_task=m, seed=seed, tasks=args.tasks, slots=args.slots, batch=args.batch,
                              updates=args.updates, rule=args.rule, lr=args.lr,
                              latency_sigma=args.sigma, drain=args.drain,
                              publish_every=args.publish_every)
                result = run_once(bench, chat)
                results.append(result)
                print(f"  m={m} seed={seed}: simulated {result['wall']:.0f} s, real {result['real']:.1f} s, "
                      f"utilisation {result['utilisation']:.3f}, final success {result['publishes'][-1][1]:.3f}",
                      flush=True)
    print()
    print(summarize(results, args.per_task, args.target))


if __name__ == "__main__":
    main()
