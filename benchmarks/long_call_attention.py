"""Learner train step on calls longer than the attention chunk: causal query blocks (each
rematerialised in the backward pass, the model's path) against dense query chunks over
all keys (`chunked_attention`), same weights, batch and step.

    python benchmarks/long_call_attention.py                 # the main job's shape
    python benchmarks/long_call_attention.py --seq 2048 --rounds 7

Default shape = configs/default.yaml's policy (vocab 1024, hidden 128, 2 layers, 4 / 2
heads x 32, ffn 384) and learner batch (16 rows, K = 4 PPO mini-batches); T = 1536 is the
padded length of a typical 12-turn batch (a 1,300-token longest trajectory rounded up to
256). The attention chunk is 1,024 queries (`DEFAULT_ATTENTION_CHUNK`), so every such
batch is a long call. Timed under the benchmark protocol (benchmarks/_protocol.py):
interleaved rounds, the load average printed per round, busy rounds left out, and the
same-run ratio as the headline.
"""

from __future__ import annotations

import argparse
import os
import sys

# This checkout's spopp_jax, not an editable install's (the script's folder is sys.path[0]).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _model_shapes import add_shape_arguments, resolve_shape  # noqa: E402

MAIN_JOB_SHAPE = dict(vocab=1024, hidden=128, ffn=384, layers=2, heads=4, kv_heads=2,
                      head_dim=32)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(parser)
    parser.set_defaults(**MAIN_JOB_SHAPE)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1536)
    parser.add_argument("--mini-batches", type=int, default=4, help="K PPO mini-batches")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--allow-busy", action="store_true")
    args = parser.parse_args()
    resolve_shape(args)
    return args


def dense_chunks_step(args, model, batch):
    """The train step with the long-call attention of before: dense query chunks of 1,024
    over all keys, each rematerialised (`chunked_attention`)."""
    from spopp_jax.models import attention

    def dense_chunks(query, key, value, layout, block_size, remat=False):
        return attention.chunked_attention(query, key, value, layout,
                                           attention.DEFAULT_ATTENTION_CHUNK)

    causal_blocks = attention.causal_block_attention
    attention.causal_block_attention = dense_chunks
    try:
        return compiled_step(args, model, batch)
    finally:
        attention.causal_block_attention = causal_blocks


def compiled_step(args, model, batch):
    """(run, state): `run()` takes one train step and waits for it (compiled here)."""
    import jax

    from spopp_jax import learner

    config = learner.LearnerConfig(num_micro_batches=1, length_bucket=None, action_logits_fraction=None,
                                   num_mini_batches=args.mini_batches, learning_rate=1e-4)
    model_def, state = learner.init_train_state(model, config)
    step = learner.make_train_step(model_def, config)
    holder = {"state": state}

    def run():
        holder["state"], metrics = step(holder["state"], batch)
        jax.block_until_ready(metrics)

    run()  # compile
    run()  # the first call after compiling is slower (allocations)
    return run


def main(args):
    import _protocol

    _protocol.pin_threads(args.threads)
    import tempfile

    import jax.numpy as jnp
    import numpy as np

    from _batches import learner_batch, learner_hf_config
    from _hardware import cpu_model
    from spopp_jax import learner
    from spopp_jax.models import from_pretrained
    from spopp_jax.models.testing import random_hf_model

    with tempfile.TemporaryDirectory() as folder:
        random_hf_model(learner_hf_config(args), seed=0).save_pretrained(folder)
        model = from_pretrained(folder, dtype="float32")
    batch = learner.TrainBatch(*(jnp.asarray(x) for x in learner_batch(
        args.batch, args.seq, args.vocab, np.random.default_rng(0))))
    print(f"CPU {cpu_model()}, {args.threads} threads; batch {args.batch} x {args.seq}, "
          f"K = {args.mini_batches}, hidden {args.hidden}, {args.layers} layers")
    fns = {"causal blocks": compiled_step(args, model, batch),
           "dense chunks": dense_chunks_step(args, model, batch)}
    timings = _protocol.interleaved_rounds(fns, args.rounds)
    _protocol.report(timings, args.batch * args.seq, "tokens", args.allow_busy)
    print(_protocol.headline(timings, "causal blocks", "dense chunks", args.allow_busy))


if __name__ == "__main__":
    main(parse_args())
