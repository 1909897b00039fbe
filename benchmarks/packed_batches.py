"""Learner train step on a packed batch (several trajectories per row, `rollout.pack_rows`)
against the same trajectories one per row, in interleaved rounds (benchmarks/_protocol.py).

    python benchmarks/packed_batches.py                      # the main job's shapes
    python benchmarks/packed_batches.py --lengths 300 1600 --batches 6 --rounds 3

Each round draws nothing: `--batches` batches of `--batch` trajectories are drawn once
(seeded), lengths uniform in [--lengths], a prompt of a quarter of each, the rest actions
with an observation span; every batch is laid out both ways with
`rollout_bridge.trajectory.pack_train_batch` (width = longest rounded up to
`--pad-to-multiple`, or packed rows up to `--pack-width` of least padded area, rows a
multiple of the K PPO mini-batches), each layout's shapes are compiled first, and a round
times one pass over all batches per layout. The model is the main job's (128-wide,
2 layers, vocab 1,024; `--hidden` etc. override), K = 4. Prints the padding share of each
layout, the load per round, medians and the same-run ratio.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _model_shapes import add_job_batch_arguments, job_batch_header, resolve_shape  # noqa: E402


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_job_batch_arguments(parser, batches=6)
    parser.add_argument("--pack-width", type=int, default=2048)
    args = parser.parse_args()
    resolve_shape(args)
    args.seq = args.pack_width  # positions the benchmark model must hold (_batches.learner_hf_config)
    return args


def random_trajectories(rng, count: int, low: int, high: int, vocab: int):
    from _batches import random_trajectory

    out = []
    for i in range(count):
        length = int(rng.integers(low, high + 1))
        prompt = length // 4
        mask = np.zeros(length, bool)
        mask[prompt:] = True
        middle = prompt + (length - prompt) // 2
        mask[middle:middle + 8] = False  # an observation span
        out.append(random_trajectory(rng, i, mask, prompt, vocab, logp_mean=-6.2))
    return out


def main(args):
    import jax
    import jax.numpy as jnp

    from _batches import learner_hf_config
    from rollout_bridge.trajectory import pack_train_batch
    from spopp_jax import learner
    from spopp_jax.models import from_pretrained
    from spopp_jax.models.testing import random_hf_model
    import tempfile

    rng = np.random.default_rng(args.seed)
    batches = {"one per row": [], "packed": []}
    for _ in range(args.batches):
        trajectories = random_trajectories(rng, args.batch, *args.lengths, args.vocab)
        advantages = rng.normal(size=args.batch).astype(np.float32)
        batches["one per row"].append(pack_train_batch(
            trajectories, advantages, pad_to_multiple=args.pad_to_multiple))
        batches["packed"].append(pack_train_batch(
            trajectories, advantages, pad_to_multiple=args.pad_to_multiple,
            pack_width=args.pack_width, row_multiple=args.mini_batches))
    batches = {name: [jax.tree.map(jnp.asarray, b) for b in bs] for name, bs in batches.items()}
    with tempfile.TemporaryDirectory() as folder:
        random_hf_model(learner_hf_config(args), seed=0).save_pretrained(folder)
        model = from_pretrained(folder, dtype="float32")
    config = learner.LearnerConfig(num_micro_batches=1, length_bucket=None, action_logits_fraction=None,
                                   learning_rate=1e-4, num_mini_batches=args.mini_batches)
    model_def, state = learner.init_train_state(model, config)
    step = learner.make_train_step(model_def, config)

    print(job_batch_header(args), flush=True)
    holders = {}
    for name, bs in batches.items():
        real = sum(int(jnp.sum(b.attention_mask)) for b in bs)
        slots = sum(b.input_ids.size for b in bs)
        shapes = sorted({tuple(b.input_ids.shape) for b in bs})
        holders[name] = {"state": jax.tree.map(jnp.copy, state)}
        start = time.perf_counter()
        for b in bs + bs:  # compiles every shape (twice for the first: a fresh state's placement differs)
            holders[name]["state"], _ = step(holders[name]["state"], b)
        jax.block_until_ready(holders[name]["state"])
        print(f"{name}: shapes {shapes}, padding {1 - real / slots:.1%} of {slots} token slots; "
              f"two warm-up passes (compiles) {time.perf_counter() - start:.1f} s", flush=True)

    def one_pass(name):
        def run():
            for b in batches[name]:
                holders[name]["state"], metrics = step(holders[name]["state"], b)
            jax.block_until_ready((holders[name]["state"], metrics))
        return run

    timings = _protocol.interleaved_rounds({name: one_pass(name) for name in batches}, args.rounds,
                                           max_load_excess=args.max_load_excess)
    _protocol.report(timings, args.batches, "batch", args.allow_busy)
    print("headline: " + _protocol.headline(timings, "packed", "one per row", args.allow_busy))


if __name__ == "__main__":
    ARGS = parse_args()
    import _protocol

    _protocol.pin_threads(ARGS.threads)
    import numpy as np

    main(ARGS)
