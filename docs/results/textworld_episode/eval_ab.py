"""A/B of the held-out evaluation (512 games x 1 episode, the job's settings) with the room
description tracked by TextWorld every turn (old) against read once at reset (new)."""
import asyncio, os, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, "/tmp/s")
import numpy as np
import train
from pathlib import Path
from rollout_bridge import components as build
from rollout_bridge.envs.kinds import build_env
from rollout_bridge.evaluation import extra_evaluations
from rollout_bridge.job import build_job
from rollout_bridge.run_folder import RunPaths, enable_compilation_cache, log
from rollout_bridge.components import load_policy
from rollout_bridge.evaluation import EXTRA_EVAL_SEED_OFFSET
from rollout_bridge.envs import textworld_env as tw
from desc_equal_old import Old

NEW_RESET, NEW_REPLAY = tw.TextWorldEpisode.reset, tw.TextWorldEpisode._replay
def variant(name):
    tw.TextWorldEpisode.reset = Old.reset if name == "old" else NEW_RESET
    tw.TextWorldEpisode._replay = Old._replay if name == "old" else NEW_REPLAY

cfg = train.parse_config(["--output_dir", "/tmp/s/eval_ab_run", "--progress", "false"])
enable_compilation_cache(cfg.compilation_cache_dir)
env = build_env(cfg, False, log, False)
job = build_job(cfg, RunPaths(Path(cfg.output_dir)), env)
policy = Path("assets/textworld_text_warmstart")
chat = build.load_chat(policy, env.chat_tools)

async def one(name):
    variant(name)
    engine = job.engine(load_policy(policy, cfg.model), seed=cfg.seed + EXTRA_EVAL_SEED_OFFSET)
    try:
        return await extra_evaluations(engine, env, chat, job.agent, job.orchestrator.max_in_flight,
                                       1, name, False, cfg.seed)
    finally:
        await engine.close()

rows = []
for i, name in enumerate(["new", "old", "new", "new", "old", "old", "new"]):
    load = os.getloadavg()[0]; w0, c0 = time.time(), time.process_time()
    res = asyncio.run(one(name))["heldout"]
    wall, cpu = time.time() - w0, time.process_time() - c0
    sr = sum(res["successes"]) / sum(res["trials"])
    print(f"round {i} {name}: {wall:.1f} s wall, {cpu:.1f} s CPU, load {load:.2f}, success {sr:.4f}", flush=True)
    if i: rows.append((name, wall, cpu))
for name in ("old", "new"):
    w = sorted(r[1] for r in rows if r[0] == name); c = sorted(r[2] for r in rows if r[0] == name)
    print(f"{name}: wall median {np.median(w):.1f} {w}, CPU median {np.median(c):.1f}")
mo = np.median([r[1] for r in rows if r[0] == "old"]); mn = np.median([r[1] for r in rows if r[0] == "new"])
print(f"old/new wall {mo/mn:.3f}x")
env.close()
