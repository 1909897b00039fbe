"""Host CPU cost of the orchestrator per trajectory, against the task count and slots.

    python benchmarks/orchestrator_scale.py [--scales 64:128 1000:10000 10000:100000]
        [--tracker-tasks 1000000] [--trajectories 20000] [--rss-updates 20000] [--no-old]
        [--drain finish|none] [--pack 1024:600]

The real ``rollout_bridge.orchestrator.Orchestrator`` and agent loop, an engine whose
requests complete at once (``InstantEngine``), a one-turn environment and a stub learner
(no training; it hands back weights so every update publishes). ``--drain finish`` (the
default; the old path knows no other): every update stops dispatch until the requests in
flight finished, so between updates only about one batch is in flight, whatever the slot
count. ``--drain none`` (new path only, ``--no-old``; the configs' default): in-flight
publishes, dispatch never stops, so ``slots`` requests really are in flight; its
``max_policy_lag`` is set beyond reach (``NO_LAG_LIMIT``: lag aborts are not the path
measured).
Per (slots, tasks): host CPU seconds (``time.process_time``: every thread of the process)
per dispatched-and-received trajectory, for

  * new:  this orchestrator (SPO++, incremental NumPy tracker, sum-tree sampler);
  * old:  the orchestrator of commit OLD_REF (``git show``), which recomputes every
          baseline and samples over all tasks (Gumbel top-k, JAX) per dispatch round and
          updates the tracker with a jitted JAX call per receipt,

each measured in a fresh process (so one path's ``gc.freeze`` or garbage cannot change the
other's figure), old and new alternating per row, with the 1-minute load average printed
next to each figure (this machine is shared: say so next to any figure). The old path
runs this checkout's agent loop and ``Trajectory`` (token arrays): the ratio is the orchestrator's
share of the gain only. Each figure is measured after a 3-update warm-up that pays the
compiles (``cpu_per_trajectory``); the mean number of requests in flight when an update
ends is printed (about one batch under "finish", ``slots`` under "none"). The
orchestrator's own share (without the agent loop / engine / env) is not separated: the
figure is the whole host path of one trajectory. ``--tracker-tasks`` adds one scale with
that many tasks at the largest slot count. The agent's HF chat-template rendering of the
(constant) observation is cached unless ``--template-per-episode``. RSS (VmRSS) is read before and after a run of
``--rss-updates`` updates of 8 trajectories with ``keep_history=False``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _hardware import cpu_model  # noqa: E402

from rollout_bridge.agent import AgentConfig, ChatFormat  # noqa: E402
from rollout_bridge.engine.fake import run_virtual  # noqa: E402
from rollout_bridge.engine.base import GenerationResult, RolloutEngine, SamplingParams  # noqa: E402
from rollout_bridge.envs.base import AsyncEnvironment, StepResult  # noqa: E402
from rollout_bridge.tokenizer import build_tiny_tokenizer  # noqa: E402

OLD_REF = "b3045bb"  # the orchestrator before the methods / incremental-sampler redesign
TUPLES_REF = "89f664f"  # the last commit whose Trajectory held tuples of Python numbers
REPLY_TOKENS = 4


class InstantEngine(RolloutEngine):
    """Every request completes with ``REPLY_TOKENS`` tokens after an exponential latency
    of mean 1 in VIRTUAL time (``run_virtual``: costs no wall or CPU time), so requests
    finish one by one, as on a fleet, and each completion is its own dispatch round."""

    def __init__(self, stop_token: int, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.policy_event = 0
        self.tokens = (5,) * (REPLY_TOKENS - 1) + (stop_token,)
        self.replies: dict[int, GenerationResult] = {}  # one result object per policy event

    async def generate(self, prompt_ids, params: SamplingParams) -> GenerationResult:
        await asyncio.sleep(float(self.rng.exponential()))
        if self.policy_event not in self.replies:
            self.replies = {self.policy_event: GenerationResult(self.tokens, (-1.0,) * REPLY_TOKENS, "stop",
                                                                self.policy_event)}
        return self.replies[self.policy_event]

    supports_inflight_publish = True  # drain "none": the install is instant either way

    async def publish_inflight(self, weights, policy_event: int) -> None:
        await self.publish(weights, policy_event)

    async def publish(self, weights, policy_event: int) -> None:
        self.policy_event = int(policy_event)

    async def abort_all(self) -> None:
        return None


class CoinEnv(AsyncEnvironment):
    """One turn; reward 1 with a fixed per-task probability."""

    def __init__(self, success: np.ndarray, rng: np.random.Generator):
        self.success, self.rng = success, rng

    async def reset(self, task_id: int) -> str:
        self.task = task_id
        return "task"

    async def step(self, action_text: str) -> StepResult:
        return StepResult("done", float(self.rng.random() < self.success[self.task]), True)


def load_old_module(ref: str, relative_path: str, name: str):
    """The module at ``relative_path`` of git commit ``ref``, imported as ``name``."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{ref}:{relative_path}"],
                            capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def pack_cost(batch: int, mean_tokens: int, rounds: int = 5, seed: int = 0) -> tuple[float, float]:
    """(old, new) best-of-``rounds`` seconds of ``pack_train_arrays`` for one batch of
    ``batch`` trajectories of ~``mean_tokens`` tokens (exponential lengths): the old
    ``Trajectory`` of TUPLES_REF (tuples of Python numbers, a row loop) against this checkout's
    (read-only arrays, one scatter per array), same data, rounds interleaved."""
    import rollout_bridge.trajectory as new

    old = load_old_module(TUPLES_REF, "rollout_bridge/trajectory.py", "trajectory_old")
    rng = np.random.default_rng(seed)
    lengths = np.maximum(8, rng.exponential(mean_tokens, batch).astype(int))
    rows = []
    for n in lengths:
        ids = rng.integers(0, 32000, n)
        mask = np.zeros(n, bool)
        mask[n // 4:] = True
        rows.append((ids, mask, np.where(mask, -rng.random(n), 0.0)))
    advantages = rng.standard_normal(batch)
    built = {}
    for label, module, convert in (("old", old, lambda a: tuple(a.tolist())), ("new", new, lambda a: a)):
        stamp = module.DispatchStamp(0, 0, 0, 0.0, 0.5, 0.0)
        built[label] = (module, [module.Trajectory(stamp, convert(i), convert(m), convert(lp), int(n // 4), 1.0, 0.0)
                                 for (i, m, lp), n in zip(rows, lengths)])
    best = {"old": float("inf"), "new": float("inf")}
    for _ in range(rounds):
        for label, (module, trajectories) in built.items():
            start = time.perf_counter()
            module.pack_train_arrays(trajectories, advantages, pad_to_multiple=64)
            best[label] = min(best[label], time.perf_counter() - start)
    return best["old"], best["new"]


def load_old_orchestrator():
    """The orchestrator module of ``OLD_REF`` (git history), imported under another name."""
    return load_old_module(OLD_REF, "rollout_bridge/orchestrator.py", "orchestrator_old")


def load_average() -> float:
    return os.getloadavg()[0]


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


# drain "none": max_policy_lag beyond any lag the instant engine produces (its exponential
# latency spans ~10 updates at 10k slots; the update record holds one histogram bucket per
# lag value, so the bound is not made astronomically large)
NO_LAG_LIMIT = 256


def make_orchestrator(module, chat, slots: int, tasks: int, batch: int, keep_history: bool, seed: int = 0,
                      drain: str = "finish"):
    rng = np.random.default_rng(seed)
    success = rng.random(tasks)
    engine = InstantEngine(chat.stop_token_ids[0])
    kwargs = dict(method="spopp", batch_size=batch, max_in_flight=slots, max_buffered_batches=max(2, -(-slots // batch) + 1),
                  pad_to_multiple=16, seed=seed, drain=drain)
    if module is not None and hasattr(module.OrchestratorConfig, "keep_history"):
        kwargs["keep_history"] = keep_history
    if drain != "finish":
        kwargs.update(max_policy_lag=NO_LAG_LIMIT)
    config = module.OrchestratorConfig(**kwargs)
    agent = AgentConfig(max_turns=1, max_total_tokens=64, sampling=SamplingParams(max_new_tokens=REPLY_TOKENS),
                        env_timeout_s=None)
    stub_learner = lambda learner_input: module.LearnerOutput(weights="w")  # no training; publishes
    return module.Orchestrator(engine, lambda: CoinEnv(success, rng), chat, stub_learner, tasks, config, agent)


def cpu_per_trajectory(module, chat, slots: int, tasks: int, trajectories: int,
                       drain: str = "finish") -> tuple[float, int, float]:
    """(host CPU seconds per received trajectory, trajectories received, mean requests in
    flight when an update ends) over ~``trajectories`` trajectories, after a warm-up of 3
    updates that pays the compiles. The in-flight mean says how many of the ``slots`` were
    in use (module docstring: about one batch under the "finish" drain)."""
    batch = max(8, min(slots, 1024))
    orch = make_orchestrator(module, chat, slots, tasks, batch, keep_history=False, drain=drain)
    in_flight: list[int] = []
    orch.on_update = lambda record: in_flight.append(len(orch._in_flight))

    async def main():
        try:
            await orch.run(1)  # jit compiles, first dispatch wave
            await orch.run(2)
            in_flight.clear()
            start_received, start = orch.consumed + len(getattr(orch, "_ready", [])), time.process_time()
            await orch.run(max(1, trajectories // batch))
            received = orch.consumed + len(getattr(orch, "_ready", [])) - start_received
            return (time.process_time() - start) / max(received, 1), received, float(np.mean(in_flight))
        finally:
            await orch.close()

    return run_virtual(main())


def rss_run(chat, updates: int, tasks: int = 128) -> tuple[float, float, float]:
    """(RSS before, after 10% of the updates, after all) in MiB, keep_history=False."""
    import rollout_bridge.orchestrator as new

    orch = make_orchestrator(new, chat, 16, tasks, 8, keep_history=False)

    async def main():
        try:
            await orch.run(max(1, updates // 10))
            early = rss_mib()
            await orch.run(updates - max(1, updates // 10))
            return early, rss_mib()
        finally:
            await orch.close()

    before = rss_mib()
    early, after = run_virtual(main())
    return before, early, after


def chat_format(template_per_episode: bool) -> ChatFormat:
    tokenizer = build_tiny_tokenizer(["task done " * 10] * 10, tempfile.mkdtemp(), 300)
    chat = ChatFormat.from_tokenizer(tokenizer)
    if not template_per_episode:  # the env's observation is constant: render it once
        object.__setattr__(chat, "prompt_ids", functools.lru_cache(maxsize=None)(chat.prompt_ids))
    return chat


def measure_one(path: str, scale: str, trajectories: int, template_per_episode: bool, drain: str) -> None:
    """``--one``: one (path, scale) measurement in this fresh process; prints a JSON line."""
    import rollout_bridge.orchestrator as new

    module = load_old_orchestrator() if path == "old" else new
    slots, tasks = (int(v) for v in scale.split(":"))
    load = load_average()
    seconds, received, in_flight = cpu_per_trajectory(module, chat_format(template_per_episode), slots, tasks,
                                                      trajectories, drain)
    print(json.dumps(dict(us=seconds * 1e6, received=received, in_flight=in_flight, load=load)))


def measure_in_subprocess(path: str, slots: int, tasks: int, args) -> dict:
    command = [sys.executable, __file__, "--one", path, f"{slots}:{tasks}", "--trajectories", str(args.trajectories),
               "--drain", args.drain]
    if args.template_per_episode:
        command.append("--template-per-episode")
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{path} {slots}:{tasks} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scales", nargs="+", default=["64:128", "1000:10000", "10000:100000"])
    parser.add_argument("--tracker-tasks", type=int, default=1_000_000)
    parser.add_argument("--trajectories", type=int, default=20_000)
    parser.add_argument("--rss-updates", type=int, default=20_000)
    parser.add_argument("--no-old", action="store_true", help="skip the old path")
    parser.add_argument("--template-per-episode", action="store_true",
                        help="render the HF chat template for every episode (~150-300 us of jinja each, "
                             "the agent's cost, not the orchestrator's); default: cached per observation")
    parser.add_argument("--pack", default="1024:600", help="BATCH:MEAN_TOKENS of the batch-packing "
                        "comparison (old tuples vs arrays); empty: skip")
    parser.add_argument("--drain", default="finish", choices=["finish", "none"],
                        help="the publish drain (module docstring); none needs --no-old")
    parser.add_argument("--one", nargs=2, metavar=("PATH", "SLOTS:TASKS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        measure_one(args.one[0], args.one[1], args.trajectories, args.template_per_episode, args.drain)
        return
    if args.drain != "finish" and not args.no_old:
        parser.error("--drain none needs --no-old (the old orchestrator has no in-flight publish)")
    chat = chat_format(args.template_per_episode)
    scales = [tuple(int(v) for v in s.split(":")) for s in args.scales]
    if args.tracker_tasks:
        scales.append((scales[-1][0], args.tracker_tasks))
    print(f"cpu: {cpu_model()}, {os.cpu_count()} logical cores; python {sys.version.split()[0]}; drain {args.drain}")
    print("shared machine: each figure is its own fresh process (old, new alternating per row); "
          "compare figures within a row, with the load next to them")
    print(f"{'slots':>6} {'tasks':>8} | {'old us/traj':>11} {'new us/traj':>11} {'old/new':>7} | load1 (old, new)")
    for slots, tasks in scales:
        row_old = None if args.no_old else measure_in_subprocess("old", slots, tasks, args)
        row_new = measure_in_subprocess("new", slots, tasks, args)
        ratio = f"{row_old['us'] / row_new['us']:7.2f}" if row_old else "      -"
        old_text = f"{row_old['us']:11.1f}" if row_old else "          -"
        print(f"{slots:>6} {tasks:>8} | {old_text} {row_new['us']:11.1f} {ratio} | "
              f"{row_old['load'] if row_old else float('nan'):.2f}, {row_new['load']:.2f}  "
              f"({row_new['received']} trajectories, {row_new['in_flight']:.0f} in flight per update; "
              f"old: {row_old['in_flight'] if row_old else float('nan'):.0f})",
              flush=True)
    if args.pack:
        batch, mean_tokens = (int(v) for v in args.pack.split(":"))
        load = load_average()
        old_s, new_s = pack_cost(batch, mean_tokens)
        print(f"pack_train_arrays, {batch} trajectories of ~{mean_tokens} tokens (best of 5, interleaved): "
              f"old tuples {old_s * 1e3:.1f} ms, arrays {new_s * 1e3:.1f} ms ({old_s / new_s:.1f}x); load1 {load:.2f}",
              flush=True)
    if args.rss_updates:
        before, early, after = rss_run(chat, args.rss_updates)
        print(f"RSS over {args.rss_updates} updates x 8 trajectories (keep_history=False): "
              f"before {before:.1f} MiB, after 10% {early:.1f} MiB, after all {after:.1f} MiB; "
              f"load1 {load_average():.2f}")


if __name__ == "__main__":
    main()
