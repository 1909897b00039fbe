"""Model speed on this machine: JAX forward / forward+backward / cached decode, with the
same random weights in transformers' PyTorch model (eager and torch.compile) for reference.

    python benchmarks/model_forward.py [--hidden 256 --layers 4 --batch 4 --seq 256]
    python benchmarks/model_forward.py --arch qwen3_5 [--rounds 3]

Prints one line per measurement (median of --repeats after warm-up) and the hardware.

`--arch qwen3_5`: a ~10M-parameter Qwen3.5-shaped hybrid (3 Gated DeltaNet layers per full
attention layer): forward+backward tokens/s at T = 512 and 4096 for JAX and transformers'
torch fallback (`torch_chunk_gated_delta_rule`), interleaved per round with the 1-minute
load average printed per round; the compiled forward+backward's memory (XLA's
`memory_analysis`: temporaries + arguments + outputs) at T = 4096 and 16384; and cached
engine decode (`slot_decode.decode_steps`, the engine's jitted chunk) tokens/s with every
slot at context 256 vs 4096, for the hybrid and a pure Qwen3 of the same shape, interleaved
per round (`--decode-only`: just these rows).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rollout_bridge.engine import slot_decode
from spopp_jax.models import ModelConfig, from_pretrained, init_model
from spopp_jax.models.hf_io import param_count
from spopp_jax.models.testing import random_hf_model, tiny_hf_config, tiny_qwen35_hf_config
from _hardware import cpu_model


def timed(fn, repeats: int) -> float:
    fn()  # warm-up / compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# The hybrid's shape: ~10M parameters, Qwen3.5 layout (interval 4, rotary 1/4 of head_dim).
QWEN35_SHAPE = dict(vocab_size=8192, hidden_size=256, intermediate_size=768,
                    num_hidden_layers=8, full_attention_interval=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
                    linear_num_value_heads=8, linear_key_head_dim=32,
                    linear_value_head_dim=32, max_position_embeddings=32768)
QWEN35_TRAIN_LENGTHS = (512, 4096)
QWEN35_MEMORY_LENGTHS = (4096, 16384)
QWEN35_DECODE_CONTEXTS = (256, 4096)


def load_average() -> str:
    return "load average (1 min) %.2f" % os.getloadavg()[0]


def hybrid_loss_fn(graphdef):
    def token_logp_sum(state, ids):
        logits = nnx.merge(graphdef, state)(ids)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        return jnp.sum(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))
    return jax.jit(jax.grad(token_logp_sum))


def hybrid_rows(args) -> None:
    """The Qwen3.5 rows (module docstring)."""
    import torch
    hf_model = random_hf_model(tiny_qwen35_hf_config(**QWEN35_SHAPE))
    hf_model.config._attn_implementation = "sdpa"
    with tempfile.TemporaryDirectory() as folder:
        hf_model.save_pretrained(folder)
        model = from_pretrained(folder)
    graphdef, state = nnx.split(model)
    grad_fn = hybrid_loss_fn(graphdef)
    rng = np.random.default_rng(0)
    print(f"hardware: {cpu_model()}, {os.cpu_count()} cpus, jax {jax.__version__} on "
          f"{jax.devices()[0].platform}, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads); {load_average()}")
    print(f"qwen3_5 model: {param_count(model) / 1e6:.1f}M parameters, layer types "
          f"{model.config.layer_types}, delta-rule chunk {model.config.linear_chunk_size}")

    def torch_step(ids):
        hf_model.zero_grad(set_to_none=True)
        logits = hf_model(input_ids=ids).logits
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        logp.gather(-1, ids[:, 1:, None]).sum().backward()

    for length in QWEN35_TRAIN_LENGTHS:
        ids_np = rng.integers(0, QWEN35_SHAPE["vocab_size"], size=(1, length))
        ids, torch_ids = jnp.asarray(ids_np, jnp.int32), torch.as_tensor(ids_np)
        jax_step = lambda: jax.block_until_ready(grad_fn(state, ids))
        jax_step(), torch_step(torch_ids)  # warm-up / compile
        jax_times, torch_times = [], []
        for round_index in range(args.rounds):  # interleaved: same load for both
            jax_times.append(timed_once(jax_step))
            torch_times.append(timed_once(lambda: torch_step(torch_ids)))
            print(f"  T={length} round {round_index}: jax {length / jax_times[-1]:8.0f} tok/s,"
                  f" torch {length / torch_times[-1]:8.0f} tok/s; {load_average()}")
        jax_t, torch_t = statistics.median(jax_times), statistics.median(torch_times)
        print(f"qwen3_5 fwd+bwd T={length}: jax {length / jax_t:8.0f} tok/s, torch fallback "
              f"{length / torch_t:8.0f} tok/s, ratio {torch_t / jax_t:.2f}x (median of "
              f"{args.rounds})")
    for length in QWEN35_MEMORY_LENGTHS:
        ids = jax.ShapeDtypeStruct((1, length), jnp.int32)
        stats = grad_fn.lower(state, ids).compile().memory_analysis()
        total = (stats.temp_size_in_bytes + stats.argument_size_in_bytes
                 + stats.output_size_in_bytes)
        print(f"qwen3_5 fwd+bwd memory T={length}: {total / 2**20:8.1f} MiB "
              f"(temporaries {stats.temp_size_in_bytes / 2**20:.1f} MiB)")


def decode_models() -> dict:
    """The hybrid and a pure Qwen3 of the same shape (every layer full attention), random
    weights (decode speed does not depend on their values)."""
    shape = {k: QWEN35_SHAPE[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                          "num_hidden_layers", "num_attention_heads",
                                          "num_key_value_heads", "head_dim",
                                          "max_position_embeddings")}
    return {"qwen3_5": init_model(ModelConfig.from_hf(tiny_qwen35_hf_config(**QWEN35_SHAPE))),
            "qwen3": init_model(ModelConfig.from_hf(tiny_hf_config(**shape)))}


def engine_decode_fn(model, steps: int, max_len: int):
    """The engine's jitted decode chunk (`slot_decode.decode_steps`, state donated) with
    every slot active at position `context` of a `max_len` cache (one cache length for all
    contexts, as in an engine): `run(slots, context)` -> seconds for `steps` steps."""
    graphdef, params = nnx.split(model)
    decode = jax.jit(functools.partial(slot_decode.decode_steps, graphdef),
                     static_argnums=2, donate_argnums=1)

    def start_state(slots: int, context: int) -> slot_decode.SlotState:
        state = slot_decode.init_slot_state(model, slots, max_len, 1, jnp.float32)
        full = lambda value: jnp.full((slots,), value, jnp.int32)
        state = state.replace(position=full(context), active=jnp.ones((slots,), bool),
                              max_new_tokens=full(steps + 1), last_token=full(1))
        return jax.tree.map(jnp.copy, state)  # distinct buffers: the state is donated

    def run(slots: int, context: int) -> float:
        state = jax.block_until_ready(start_state(slots, context))
        start = time.perf_counter()
        jax.block_until_ready(decode(params, state, steps))
        return time.perf_counter() - start

    return run


def decode_rows(args) -> None:
    """Engine decode tokens/s with every slot at context 256 vs 4096 (one cache of
    4096 + steps + 1 positions), hybrid and pure Qwen3 interleaved per round (same load),
    the 1-minute load average per round. Cache contents are zeros: a step's cost does not
    depend on them."""
    slots, steps = args.decode_slots, args.decode_steps
    max_len = max(QWEN35_DECODE_CONTEXTS) + steps + 1
    runs = {name: engine_decode_fn(model, steps, max_len)
            for name, model in decode_models().items()}
    cases = [(name, context) for name in runs for context in QWEN35_DECODE_CONTEXTS]
    for name, context in cases:
        runs[name](slots, context)  # compile
    times = {case: [] for case in cases}
    for round_index in range(args.rounds):
        row = []
        for name, context in cases:
            times[(name, context)].append(runs[name](slots, context))
            row.append(f"{name}@{context} {slots * steps / times[(name, context)][-1]:6.0f}")
        print(f"  decode round {round_index} (tok/s): {', '.join(row)}; {load_average()}")
    for name in runs:
        rates = {c: slots * steps / statistics.median(times[(name, c)])
                 for c in QWEN35_DECODE_CONTEXTS}
        short, long = QWEN35_DECODE_CONTEXTS
        print(f"{name} engine decode ({slots} slots, cache {max_len}, {steps} steps per call): "
              + ", ".join(f"context {c}: {r:7.0f} tok/s ({1e3 * slots / r:6.2f} ms/step)"
                          for c, r in rates.items())
              + f"; {short}/{long} slowdown {rates[short] / rates[long]:.2f}x "
                f"(median of {args.rounds})")


def decode_loop(decode_step, state, tokens, positions, cache, steps: int) -> None:
    """`steps` cached decode steps, every slot one position further each step."""
    for _ in range(steps):
        _, cache = decode_step(state, tokens, positions, cache)
        positions = positions + 1
    jax.block_until_ready(cache)


def timed_once(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", choices=("qwen3", "qwen3_5"), default="qwen3")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--decode-slots", type=int, default=8)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-torch-compile", action="store_true")
    parser.add_argument("--decode-only", action="store_true",
                        help="--arch qwen3_5: only the engine decode rows")
    args = parser.parse_args()
    if args.arch == "qwen3_5":
        if not args.decode_only:
            hybrid_rows(args)
        else:
            print(f"hardware: {cpu_model()}, {os.cpu_count()} cpus, jax {jax.__version__} on "
                  f"{jax.devices()[0].platform}; {load_average()}")
        decode_rows(args)
        return

    import torch
    hf_config = tiny_hf_config(
        hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
        intermediate_size=3 * args.hidden, head_dim=args.hidden // args.heads,
        rope_theta=1e6, max_position_embeddings=4096)
    hf_model = random_hf_model(hf_config)
    with tempfile.TemporaryDirectory() as folder:
        hf_model.save_pretrained(folder)
        model = from_pretrained(folder)
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(0)
    ids_np = rng.integers(0, args.vocab, size=(args.batch, args.seq))
    ids = jnp.asarray(ids_np, jnp.int32)
    mask = jnp.ones_like(ids, bool)
    tokens = args.batch * args.seq

    print(f"hardware: {cpu_model()}, {os.cpu_count()} cpus, "
          f"jax {jax.__version__} on {jax.devices()[0].platform}, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads)")
    print(f"model: hidden {args.hidden}, layers {args.layers}, heads {args.heads}/"
          f"{args.kv_heads}, vocab {args.vocab}; batch {args.batch} x seq {args.seq}")

    @jax.jit
    def forward(state, ids, mask):
        return nnx.merge(graphdef, state)(ids, attention_mask=mask)

    def token_logp_sum(state, ids, mask):
        logits = forward(state, ids, mask)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        return jnp.sum(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))

    grad_fn = jax.jit(jax.grad(token_logp_sum))
    t = timed(lambda: forward(state, ids, mask).block_until_ready(), args.repeats)
    print(f"jax forward:            {t * 1e3:8.1f} ms  ({tokens / t:9.0f} tok/s)")
    t = timed(lambda: jax.block_until_ready(grad_fn(state, ids, mask)), args.repeats)
    print(f"jax forward+backward:   {t * 1e3:8.1f} ms  ({tokens / t:9.0f} tok/s)")

    # Cached decode: every slot at its own position, one token per step.
    @jax.jit
    def decode_step(state, token, position, cache):
        return nnx.merge(graphdef, state).forward_cached(token, position, cache)

    max_len = args.seq + args.decode_steps
    slot_ids = jnp.asarray(rng.integers(0, args.vocab, size=(args.decode_slots, 1)), jnp.int32)

    positions = jnp.arange(args.decode_slots, dtype=jnp.int32)[:, None] * 3
    t = timed(lambda: decode_loop(decode_step, state, slot_ids, positions,
                                  model.init_cache(args.decode_slots, max_len),
                                  args.decode_steps), max(1, args.repeats // 2))
    print(f"jax cached decode:      {t / args.decode_steps * 1e3:8.2f} ms/step "
          f"({args.decode_slots} slots, cache {max_len})")

    torch_ids = torch.as_tensor(ids_np, dtype=torch.long)

    def torch_forward(m):
        with torch.no_grad():
            m(input_ids=torch_ids).logits

    def torch_backward(m):
        m.zero_grad(set_to_none=True)
        logits = m(input_ids=torch_ids).logits
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        logp.gather(-1, torch_ids[:, 1:, None]).sum().backward()

    hf_model.config._attn_implementation = "sdpa"
    t = timed(lambda: torch_forward(hf_model), args.repeats)
    print(f"torch eager forward:    {t * 1e3:8.1f} ms  ({tokens / t:9.0f} tok/s)")
    t = timed(lambda: torch_backward(hf_model), args.repeats)
    print(f"torch eager fwd+bwd:    {t * 1e3:8.1f} ms  ({tokens / t:9.0f} tok/s)")
    if not args.no_torch_compile:
        compiled = torch.compile(hf_model)
        t = timed(lambda: torch_forward(compiled), args.repeats)
        print(f"torch.compile forward:  {t * 1e3:8.1f} ms  ({tokens / t:9.0f} tok/s)")
        t = timed(lambda: torch_backward(compiled), args.repeats)
        print(f"torch.compile fwd+bwd:  {t * 1e3:8.1f} ms  ({tokens / t:9.0f} tok/s)")


if __name__ == "__main__":
    main()
