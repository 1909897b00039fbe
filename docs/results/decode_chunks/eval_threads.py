"""Per-thread CPU of the held-out evaluation (512 x 1, job settings), after a warm-up round."""
import asyncio, os, sys, time, collections
sys.path.insert(0, os.getcwd())
import train
from pathlib import Path
from rollout_bridge import components as build
from rollout_bridge.envs.kinds import build_env
from rollout_bridge.evaluation import extra_evaluations, EXTRA_EVAL_SEED_OFFSET
from rollout_bridge.job import build_job
from rollout_bridge.run_folder import RunPaths, enable_compilation_cache, log
from rollout_bridge.components import load_policy

def threads():
    out = {}
    for t in os.listdir("/proc/self/task"):
        try:
            comm = open(f"/proc/self/task/{t}/comm").read().strip()
            f = open(f"/proc/self/task/{t}/stat").read().rsplit(")", 1)[1].split()
            out[t] = (comm, (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK"))
        except OSError:
            pass
    return out

cfg = train.parse_config(["--output_dir", "/tmp/s/eval_ab_run", "--progress", "false"] + sys.argv[1:])
enable_compilation_cache(cfg.compilation_cache_dir)
env = build_env(cfg, False, log, False)
job = build_job(cfg, RunPaths(Path(cfg.output_dir)), env)
policy = Path("assets/textworld_text_warmstart")
chat = build.load_chat(policy, env.chat_tools)
async def one():
    engine = job.engine(load_policy(policy, cfg.model), seed=cfg.seed + EXTRA_EVAL_SEED_OFFSET)
    try:
        return await extra_evaluations(engine, env, chat, job.agent, job.orchestrator.max_in_flight, 1, "t", False, cfg.seed)
    finally:
        await engine.close()
for i in range(3):
    before = threads(); w0 = time.time(); load = os.getloadavg()[0]
    asyncio.run(one())
    wall = time.time() - w0; after = threads()
    groups = collections.Counter()
    for t, (comm, c) in after.items():
        name = comm.rstrip("0123456789_-") if not comm.startswith("JaxEngine") else comm
        groups[name] += c - before.get(t, (comm, 0.0))[1]
    total = sum(groups.values())
    print(f"round {i}: wall {wall:.1f} s, load {load:.2f}, CPU {total:.1f} s: " +
          ", ".join(f"{k} {v:.1f}" for k, v in groups.most_common(8)), flush=True)
env.close()
