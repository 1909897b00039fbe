"""Learner train step with micro-batches at their used length (`optim.length_bucket`) against
the full-width step, on the same main-job-like batches, in interleaved rounds
(benchmarks/_protocol.py).

    python benchmarks/length_buckets.py                   # the main job's shapes
    python benchmarks/length_buckets.py --lengths 300 1600 --batches 6 --rounds 3

Trajectories are drawn once (seeded): lengths uniform in [--lengths] (the main job: mean
~930, longest of a batch ~1,400), multi-turn like the job's (a 120-token first
observation, then turns of an 8-token typed command and a ~90-token observation), so
about 8% of tokens are actions. Every batch is laid out with
`rollout_bridge.trajectory.pack_train_batch` (width = longest rounded up to
--pad-to-multiple; with `--pad-to-multiple 0` every batch is max_total_tokens = 2048 wide,
one shape). Each variant is a learner config, `name=micro:bucket:pad` (micro-batches per
PPO mini-batch, the length bucket or 0 for none, the padding multiple or 0 for one width);
the default compares the job's step (1 micro-batch, full width) with one row per
micro-batch at its own length in multiples of 256. The model is the main job's (128-wide,
2 layers, vocab 1,024; `--hidden` etc. override), K = 4, the action-only LM head at 0.25
as in the job. Each variant's shapes compile first (timed and printed); the first step's
loss and gradient norm show the variants compute the same update. Prints the load per
round, medians and the same-run ratios against the first variant.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _model_shapes import add_job_batch_arguments, job_batch_header, resolve_shape  # noqa: E402

MAX_TOTAL_TOKENS = 2048  # the main job's rollout.max_total_tokens
FIRST_OBSERVATION, COMMAND, OBSERVATION = 120, 8, 90


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_job_batch_arguments(parser, batches=6)
    parser.add_argument("--variants", nargs="+", default=["full_width=1:0:256", "used_length=4:256:256"],
                        help="name=micro_batches:length_bucket:pad_to_multiple (0: none / one width)")
    args = parser.parse_args()
    resolve_shape(args)
    args.seq = MAX_TOTAL_TOKENS
    return args


def parse_variant(text: str) -> tuple[str, int, int | None, int]:
    name, _, spec = text.partition("=")
    micro, bucket, pad = (int(x) for x in spec.split(":"))
    return name, micro, bucket or None, pad or MAX_TOTAL_TOKENS


def job_like_trajectories(rng, count: int, low: int, high: int, vocab: int):
    """`count` trajectories, lengths uniform in [low, high]: a first observation, then turns
    of a typed command (action tokens) and an observation."""
    from _batches import random_trajectory

    out = []
    for i in range(count):
        length = int(rng.integers(low, high + 1))
        mask = np.zeros(length, bool)
        position = FIRST_OBSERVATION
        while position < length:
            mask[position:position + COMMAND] = True
            position += COMMAND + OBSERVATION + int(rng.integers(-30, 31))
        out.append(random_trajectory(rng, i, mask, FIRST_OBSERVATION, vocab, logp_mean=-1.0))
    return out


def main(args):
    import tempfile

    import jax
    import jax.numpy as jnp

    from _batches import learner_hf_config
    from rollout_bridge.trajectory import pack_train_batch
    from spopp_jax import learner
    from spopp_jax.models import from_pretrained
    from spopp_jax.models.testing import random_hf_model

    variants = [parse_variant(v) for v in args.variants]
    rng = np.random.default_rng(args.seed)
    drawn = []
    for _ in range(args.batches):
        trajectories = job_like_trajectories(rng, args.batch, *args.lengths, args.vocab)
        drawn.append((trajectories, rng.normal(size=args.batch).astype(np.float32)))
    with tempfile.TemporaryDirectory() as folder:
        random_hf_model(learner_hf_config(args), seed=0).save_pretrained(folder)
        model = from_pretrained(folder, dtype="float32")

    print(job_batch_header(args), flush=True)
    runs = {}
    for name, micro, bucket, pad in variants:
        batches = [jax.tree.map(jnp.asarray, pack_train_batch(t, a, pad_to_multiple=pad)) for t, a in drawn]
        config = learner.LearnerConfig(learning_rate=1e-4, num_mini_batches=args.mini_batches,
                                       num_micro_batches=micro, length_bucket=bucket,
                                       action_logits_fraction=0.25)
        model_def, state = learner.init_train_state(model, config)
        step = learner.make_train_step(model_def, config)
        real = sum(int(jnp.sum(b.attention_mask)) for b in batches)
        slots = sum(b.input_ids.size for b in batches)
        actions = sum(int(jnp.sum(b.action_mask)) for b in batches)
        shapes = sorted({tuple(b.input_ids.shape) for b in batches})
        start = time.perf_counter()
        _, first = step(jax.tree.map(jnp.copy, state), batches[0])
        for b in batches:  # every shape compiled
            state, _ = step(state, b)
        jax.block_until_ready(state)
        print(f"{name}: {micro} micro-batch(es) per mini-batch, length bucket {bucket}, shapes {shapes}, "
              f"padding {1 - real / slots:.1%} of {slots} token slots, actions {actions / real:.1%} of tokens; "
              f"first step loss {float(first['loss']):.6f} grad_norm {float(first['grad_norm']):.6f}; "
              f"compiles + a pass {time.perf_counter() - start:.1f} s", flush=True)
        runs[name] = {"state": state, "step": step, "batches": batches}

    def one_pass(name):
        run = runs[name]

        def go():
            for b in run["batches"]:
                run["state"], metrics = run["step"](run["state"], b)
            jax.block_until_ready((run["state"], metrics))
        return go

    timings = _protocol.interleaved_rounds({name: one_pass(name) for name, *_ in variants}, args.rounds,
                                           max_load_excess=args.max_load_excess)
    _protocol.report(timings, args.batches, "batch", args.allow_busy)
    base = variants[0][0]
    for name, *_ in variants[1:]:
        print("headline: " + _protocol.headline(timings, name, base, args.allow_busy))


if __name__ == "__main__":
    ARGS = parse_args()
    import _protocol

    _protocol.pin_threads(ARGS.threads)
    import numpy as np

    main(ARGS)
