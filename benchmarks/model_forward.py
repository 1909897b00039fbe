"""Model speed on this machine: JAX forward / forward+backward / cached decode, with the
same random weights in transformers' PyTorch model (eager and torch.compile) for reference.

    python benchmarks/model_forward.py [--hidden 256 --layers 4 --batch 4 --seq 256]

Prints one line per measurement (median of --repeats after warm-up) and the hardware.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spopp_jax.models import from_pretrained
from spopp_jax.models.testing import random_hf_model, tiny_hf_config
from _hardware import cpu_model


def timed(fn, repeats: int) -> float:
    fn()  # warm-up / compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
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
    args = parser.parse_args()

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

    def decode():
        cache = model.init_cache(args.decode_slots, max_len)
        positions = jnp.arange(args.decode_slots, dtype=jnp.int32)[:, None] * 3
        for _ in range(args.decode_steps):
            _, cache = decode_step(state, slot_ids, positions, cache)
            positions = positions + 1
        jax.block_until_ready(cache)
    t = timed(decode, max(1, args.repeats // 2))
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
