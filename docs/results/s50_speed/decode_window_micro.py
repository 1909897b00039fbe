"""Ad hoc (session 50): the engine's decode chunk (S = 16 slots, 8 steps, max_len 2048, the
main job's warm start) with every slot at one position, attending the whole cache
(key_len None) or a static window of it. It ran at commit 24bba24, whose
`slot_decode.decode_steps` took a ``key_len``; that commit was reverted (c10c7bf), so this
script no longer runs on main. Output (ms per decode step, two rounds, load 3.1):

  context 700: whole 2.49 / 2.59, window 768 2.52 / 2.71, window 1024 2.89 / 2.93
  context 1400: whole 3.63 / 3.39, window 1536 4.11 / 4.08
  context 200: whole 1.55 / 1.38, window 256 0.85 / 0.75

The whole-cache step already reads keys only up to the longest live position
(`attention.single_query_attention`'s key_limit, blocks of 512), so a static window adds
the slice and put-back copies and wins only below one key block.
"""
import functools, time, statistics, os, sys
sys.path.insert(0, "/work/main")
import jax, jax.numpy as jnp
from flax import nnx
from rollout_bridge.engine import slot_decode
from rollout_bridge import components
from spopp_jax.config import load_config
from pathlib import Path
cfg = load_config(["--model.path", "assets/textworld_text_warmstart"])
model = components.load_policy(Path("assets/textworld_text_warmstart"), cfg.model)
graphdef, params = nnx.split(model)
decode = jax.jit(functools.partial(slot_decode.decode_steps, graphdef), static_argnums=(2, 3), donate_argnums=1)
S, steps, max_len = 16, 8, 2048
def start(context):
    state = slot_decode.init_slot_state(model, S, max_len, 8, jnp.float32)
    full = lambda v: jnp.full((S,), v, jnp.int32)
    state = state.replace(position=full(context), active=jnp.ones((S,), bool), max_new_tokens=full(steps + 1), last_token=full(1))
    return jax.tree.map(jnp.copy, state)
def run(context, key_len, n=20):
    state = start(context)
    state, out = decode(params, state, steps, key_len); jax.block_until_ready(out)
    ts = []
    for _ in range(n):
        state = state.replace(position=jnp.full((S,), context, jnp.int32), num_generated=jnp.zeros((S,), jnp.int32), active=jnp.ones((S,), bool))
        t = time.perf_counter(); state, out = decode(params, state, steps, key_len); jax.block_until_ready(out); ts.append(time.perf_counter() - t)
    return statistics.median(ts) / steps * 1e3
print("load", os.getloadavg())
for context, kl in [(700, None), (700, 768), (700, 1024), (1400, None), (1400, 1536), (200, None), (200, 256)]:
    run(context, kl, 2)
for r in range(2):
    print([ (c, kl, round(run(c, kl), 3)) for c, kl in [(700, None), (700, 768), (700, 1024), (1400, None), (1400, 1536), (200, None), (200, 256)]], os.getloadavg())
