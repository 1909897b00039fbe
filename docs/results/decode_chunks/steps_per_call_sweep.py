"""Held-out evaluation (512 x 1, job settings) at several rollout.engine.steps_per_call, interleaved rounds."""
import asyncio, os, sys, time
sys.path.insert(0, os.getcwd())
import numpy as np
import train
from pathlib import Path
from rollout_bridge import components as build
from rollout_bridge.envs.kinds import build_env
from rollout_bridge.evaluation import extra_evaluations, EXTRA_EVAL_SEED_OFFSET
from rollout_bridge.job import build_job
from rollout_bridge.run_folder import RunPaths, enable_compilation_cache, log
from rollout_bridge.components import load_policy

values = [int(v) for v in sys.argv[1].split(",")]
rounds = int(sys.argv[2])
base = ["--output_dir", "/tmp/s/eval_ab_run", "--progress", "false"]
cfgs = {v: train.parse_config(base + ["--rollout.engine.steps_per_call", str(v)]) for v in values}
cfg0 = cfgs[values[0]]
enable_compilation_cache(cfg0.compilation_cache_dir)
env = build_env(cfg0, False, log, False)
jobs = {v: build_job(c, RunPaths(Path(c.output_dir)), env) for v, c in cfgs.items()}
policy = Path("assets/textworld_text_warmstart")
chat = build.load_chat(policy, env.chat_tools)
async def one(job):
    engine = job.engine(load_policy(policy, job.cfg.model), seed=job.cfg.seed + EXTRA_EVAL_SEED_OFFSET)
    try:
        out = await extra_evaluations(engine, env, chat, job.agent, job.orchestrator.max_in_flight, 1, "t", False, job.cfg.seed)
        return out, engine.num_tokens_generated
    finally:
        await engine.close()
res = {v: [] for v in values}
for r in range(rounds + 1):
    order = values if r % 2 == 0 else values[::-1]
    for v in order:
        load = os.getloadavg()[0]; w0, c0 = time.time(), time.process_time()
        out, toks = asyncio.run(one(jobs[v]))
        wall, cpu = time.time() - w0, time.process_time() - c0
        h = out["heldout"]; sr = sum(h["successes"]) / sum(h["trials"])
        print(f"round {r} steps_per_call {v}: {wall:.1f} s wall, {cpu:.1f} s CPU, load {load:.2f}, success {sr:.4f}, tokens {toks}{' (warm-up)' if r == 0 else ''}", flush=True)
        if r: res[v].append((wall, cpu))
for v in values:
    w = [x[0] for x in res[v]]; c = [x[1] for x in res[v]]
    print(f"steps_per_call {v}: wall median {np.median(w):.1f} s {[round(x,1) for x in w]}, CPU median {np.median(c):.1f} s")
env.close()
