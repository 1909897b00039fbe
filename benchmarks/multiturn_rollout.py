"""Multi-turn rollouts with and without the JAX engine's prefix reuse (the main job's
rollout budget), and with one prefill call per admission over the whole cache.

A turn of an agent conversation prompts the engine with the whole history again. Without
prefix reuse every turn prefills that history from scratch; with it, a turn prefills only
its new tokens (the reply's last token and the observation) on top of the rows its previous
turn left in the slot (``JaxEngine(prefix_reuse=...)``, rollout_bridge/engine/jax_engine.py).

This plays every held-out game of a recipe ``--episodes`` times with each engine, in
interleaved rounds (benchmarks/_protocol.py), with the same engine seed, and prints the
wall time, episodes/s, the prefilled and reused tokens and the success rate of each. The
requests' seeds follow the order in which episodes reach the engine, which the timing
decides, so the two engines sample different episodes: their success rates agree only
within sampling noise (the exact equivalence is tests/test_jax_engine.py's).

Systems (``--systems``): ``prefix_reuse`` (the engine as shipped: the requests admitted
together prefill in one call per width bucket, each over the cache window its rows reach),
``one_prefill_call`` (the same reuse, but all admitted requests in one call padded to the
widest and attending all ``max_len`` cache positions),
``full_prefill`` (no reuse), ``power_of_two_buckets`` (prefill rows, width and cache
window rounded up to powers of two, not to 2^k or 3 * 2^(k-1): fewer shapes, more
padding), ``half_slots`` (the shipped engine with half the recipe's slots, and half as many
episodes in flight), ``half_in_flight`` (the recipe's slots, half as many episodes in
flight) and ``eight_steps_per_call`` (the recipe's engine decoding 8 steps per call, the
main job's value before it took 2). The headline compares the first two given.

    python benchmarks/multiturn_rollout.py --config configs/default.yaml \\
        --model assets/textworld_text_warmstart --systems prefix_reuse power_of_two_buckets --episodes 1

    python benchmarks/multiturn_rollout.py --config configs/default.yaml \\
        --model assets/textworld_text_warmstart --systems prefix_reuse eight_steps_per_call --episodes 1

    python benchmarks/multiturn_rollout.py --config configs/textworld_agentic_text.yaml \\
        --model runs/textworld_agentic_text/warmstart_model --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _protocol import DEFAULT_MAX_LOAD_EXCESS, headline, interleaved_rounds, pin_threads  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/textworld_agentic_text.yaml")
    parser.add_argument("--model", required=True, help="an HF model folder with its tokenizer (e.g. a warm start)")
    parser.add_argument("--episodes", type=int, default=2, help="episodes per held-out game per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-load-excess", type=float, default=DEFAULT_MAX_LOAD_EXCESS)
    parser.add_argument("--allow-busy", action="store_true", help="keep rounds taken on a busy machine")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    args = parser.parse_args(argv)
    if len(args.systems) < 2:
        parser.error("--systems: give at least two (the headline compares the first two)")
    return args


SYSTEMS = ("prefix_reuse", "one_prefill_call", "full_prefill", "power_of_two_buckets", "half_slots",
           "half_in_flight", "eight_steps_per_call")


def make_engine(system: str, model, engine_kwargs: dict):
    """The JaxEngine of ``system`` (see the module docstring)."""
    from rollout_bridge.engine.jax_engine import JaxEngine, _bucket

    if system == "full_prefill":
        return JaxEngine(model, prefix_reuse=False, **engine_kwargs)
    if system == "eight_steps_per_call":
        return JaxEngine(model, **{**engine_kwargs, "steps_per_call": 8})
    if system == "half_slots":
        return JaxEngine(model, **{**engine_kwargs, "num_slots": max(1, engine_kwargs["num_slots"] // 2)})
    engine = JaxEngine(model, **engine_kwargs)
    if system == "power_of_two_buckets":
        engine.shape_bucket = _bucket                               # powers of two only
    if system == "one_prefill_call":
        engine.min_key_window = engine_kwargs["max_len"]           # attend the whole cache
        engine._prefill_groups = lambda admitted: [admitted]       # one call, padded to the widest
    return engine


def build(args):
    """(held-out task view, chat, agent config, engine kwargs, model) of the recipe."""
    import dataclasses

    from rollout_bridge import components
    from rollout_bridge.envs.kinds import build_env
    from rollout_bridge.config import load_config

    cfg = load_config(["--config_path", args.config, "--model.path", args.model, "--progress", "false"])
    env = build_env(cfg, False, log=lambda line: print(line, flush=True))
    if not env.extra_evals:
        raise SystemExit(f"{args.config}: the recipe has no held-out games (env.heldout_games = 0)")
    tasks, factory = env.extra_evals["heldout"]
    view = dataclasses.replace(env, train=tasks, env_factory=factory)
    agent = components.build_agent_config(cfg, env.max_turns)
    orchestrator = components.build_orchestrator_config(cfg, agent, args.seed)
    chat = components.load_chat(Path(args.model), env.chat_tools)
    model = components.load_policy(Path(args.model), cfg.model)
    engine_kwargs = dict(num_slots=orchestrator.max_in_flight, max_len=agent.max_total_tokens,
                         steps_per_call=cfg.rollout.engine.steps_per_call, seed=args.seed)
    return view, chat, agent, engine_kwargs, model


def play(view, chat, agent, engine_kwargs, model, episodes: int, system: str) -> dict:
    from rollout_bridge.evaluation import success_rollouts

    async def run():
        engine = make_engine(system, model, engine_kwargs)
        try:
            start = time.perf_counter()
            in_flight = engine.num_slots // 2 if system == "half_in_flight" else engine.num_slots
            successes, trials = await success_rollouts(engine, view, chat, agent, max(1, in_flight),
                                                       episodes, "play", False)
            return time.perf_counter() - start, successes, trials, engine.prefix_stats
        finally:
            await engine.close()

    seconds, successes, trials, stats = asyncio.run(run())
    return {"seconds": seconds, "success": float(successes.sum() / trials.sum()), "episodes": int(trials.sum()),
            "prefilled": stats.prefilled_tokens, "reused": stats.reused_tokens}


def main(argv=None) -> None:
    args = parse_args(argv)
    pin_threads(args.threads)
    view, chat, agent, engine_kwargs, model = build(args)
    print(f"hardware: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{args.threads} threads; load {os.getloadavg()[0]:.2f}", flush=True)
    results: dict[str, list[dict]] = {name: [] for name in args.systems}

    def system(name: str):
        def call():
            record = play(view, chat, agent, engine_kwargs, model, args.episodes, name)
            results[name].append(record)
            return record["seconds"]
        return call

    for name in args.systems:  # compile every shape once
        print(f"warm-up {name}: {play(view, chat, agent, engine_kwargs, model, 1, name)}", flush=True)
    timings = interleaved_rounds({name: system(name) for name in args.systems},
                                 args.rounds, max_load_excess=args.max_load_excess, self_timed=True)
    for name, records in results.items():
        episodes = records[0]["episodes"]
        median, low, high = timings.summary(name, args.allow_busy)
        print(f"{name:16s} {median:7.1f} s [{low:.1f}, {high:.1f}]  {episodes / median:6.2f} episodes/s  "
              f"prefilled {records[0]['prefilled']} tokens, reused {records[0]['reused']}  "
              f"success per round {[round(r['success'], 3) for r in records]}", flush=True)
    print(headline(timings, args.systems[0], args.systems[1], args.allow_busy), flush=True)


if __name__ == "__main__":
    main()
