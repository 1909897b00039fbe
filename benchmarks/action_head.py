"""Learner train step with the LM head at every position against the head at the action
tokens only (`optim.action_logits_fraction`, `spopp_jax.learner.action_token_logprobs`), on
agent-like batches, in interleaved rounds (benchmarks/_protocol.py).

    python benchmarks/action_head.py                     # the main job's shapes, fraction 0.25
    python benchmarks/action_head.py --fraction 0.5 --rounds 5

An agent trajectory is mostly observations: a first observation (the prompt, `--prompt`
tokens), then turns of a reply (`--reply` action tokens) and the environment's answer
(`--observation` tokens) until the trajectory's length (uniform in `--lengths`). Only the
replies are actions, and the actor loss reads only their log-probs, so the head (the
[T, V] logits and their float32 logsumexp, forward and backward) can run at a gathered
fraction of the positions. `--batches` batches of `--batch` trajectories are drawn once
(seeded) and laid out one per row (width = longest rounded up to `--pad-to-multiple`, as
the job does); both variants compile every shape first, their first losses and gradient
norms are printed (they must agree), then each round times one pass over all batches per
variant. The model is the main job's (128 wide, 2 layers, vocab 1,024; `--hidden` etc.
override), K = 4 PPO mini-batches. Prints the action share, the load per round, medians
and the same-run ratio.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _model_shapes import add_job_batch_arguments, resolve_shape  # noqa: E402


def parse_args(description: str = __doc__.split("\n\n")[0]):
    """The job-batch arguments plus the agent trajectories' shape and the head fraction
    (shared with benchmarks/old_policy_forward.py)."""
    parser = argparse.ArgumentParser(description=description)
    add_job_batch_arguments(parser, batches=4)
    parser.add_argument("--prompt", type=int, default=300, help="first observation tokens")
    parser.add_argument("--reply", type=int, nargs=2, default=[4, 14], help="action tokens per turn, uniform")
    parser.add_argument("--observation", type=int, nargs=2, default=[40, 120],
                        help="observation tokens per turn, uniform")
    parser.add_argument("--fraction", type=float, default=0.25, help="optim.action_logits_fraction")
    args = parser.parse_args()
    resolve_shape(args)
    args.seq = args.lengths[1] + args.pad_to_multiple  # positions the model must hold
    return args


def agent_trajectories(rng, args):
    """`args.batch` trajectories: prompt, then (reply, observation) turns up to the length."""
    import numpy as np

    from rollout_bridge.trajectory import DispatchStamp, Trajectory

    out = []
    for i in range(args.batch):
        length = int(rng.integers(args.lengths[0], args.lengths[1] + 1))
        mask = np.zeros(length, bool)
        position = min(args.prompt, length - 1)
        while position < length:
            reply = int(rng.integers(args.reply[0], args.reply[1] + 1))
            mask[position:position + reply] = True
            position += reply + int(rng.integers(args.observation[0], args.observation[1] + 1))
        logp = np.where(mask, rng.normal(-6.2, 0.3, length), 0.0)
        out.append(Trajectory(DispatchStamp(i, i, 0, 0.0, 0.5, 0.0),
                              rng.integers(0, args.vocab, length).astype(np.int32), mask,
                              logp.astype(np.float32), min(args.prompt, length - 1), float(i % 2), 0.0))
    return out


def agent_batches(args) -> list:
    """`args.batches` packed TrainBatches of `agent_trajectories`, drawn once (seeded)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from rollout_bridge.trajectory import pack_train_batch

    rng = np.random.default_rng(args.seed)
    batches = []
    for _ in range(args.batches):
        trajectories = agent_trajectories(rng, args)
        advantages = rng.normal(size=args.batch).astype(np.float32)
        batches.append(jax.tree.map(jnp.asarray, pack_train_batch(
            trajectories, advantages, pad_to_multiple=args.pad_to_multiple)))
    return batches


def random_policy(args):
    """A float32 NNX policy of the benchmark's shape, random (seed 0), via HF I/O."""
    import tempfile

    from _batches import learner_hf_config
    from spopp_jax.models import from_pretrained
    from spopp_jax.models.testing import random_hf_model

    with tempfile.TemporaryDirectory() as folder:
        random_hf_model(learner_hf_config(args), seed=0).save_pretrained(folder)
        return from_pretrained(folder, dtype="float32")


def describe(args, batches, what: str) -> None:
    """The header line: hardware, load, model, K, batch shapes and action share."""
    import jax
    import jax.numpy as jnp

    from _hardware import cpu_model

    load = os.getloadavg()
    actions = sum(int(jnp.sum(b.action_mask)) for b in batches)
    real = sum(int(jnp.sum(b.attention_mask)) for b in batches)
    most = max(int(jnp.max(jnp.sum(b.action_mask, axis=1))) for b in batches)
    print(f"hardware: {cpu_model()}, {os.cpu_count()} cpus, load avg {load[0]:.1f}/{load[1]:.1f}/"
          f"{load[2]:.1f}; {args.threads} threads; jax {jax.__version__}; model: hidden "
          f"{args.hidden} x {args.layers} layers, vocab {args.vocab}; K = {args.mini_batches}; "
          f"{what}; {args.batches} batches of {args.batch} trajectories, lengths U[{args.lengths[0]}, "
          f"{args.lengths[1]}], shapes {sorted({tuple(b.input_ids.shape) for b in batches})}; action tokens "
          f"{actions / real:.1%} of the tokens, at most {most} in a row", flush=True)


def time_train_steps(args, batches, steps: dict, holders: dict, baseline: str, candidate: str) -> None:
    """Compile every shape for each variant (printing its first loss and gradient norm, which
    must agree across variants), then interleaved rounds of one pass over all batches per
    variant; prints medians and the ``candidate`` / ``baseline`` headline. ``steps[name]``
    is a `(state, batch) -> (state, metrics)` train step, ``holders[name]`` its state."""
    import _protocol
    import jax

    for name in steps:
        start = time.perf_counter()
        first = None
        for b in batches + batches:  # compiles every shape (twice for the first: a fresh state's placement differs)
            holders[name], metrics = steps[name](holders[name], b)
            first = first or {key: float(metrics[key]) for key in ("loss", "grad_norm")}
        jax.block_until_ready(holders[name])
        print(f"{name}: first step loss {first['loss']:.6f}, grad norm {first['grad_norm']:.6f}; "
              f"two warm-up passes (compiles) {time.perf_counter() - start:.1f} s", flush=True)

    def one_pass(name):
        def run():
            for b in batches:
                holders[name], metrics = steps[name](holders[name], b)
            jax.block_until_ready((holders[name], metrics))
        return run

    timings = _protocol.interleaved_rounds({name: one_pass(name) for name in steps}, args.rounds,
                                           max_load_excess=args.max_load_excess)
    _protocol.report(timings, args.batches, "batch", args.allow_busy)
    print("headline: " + _protocol.headline(timings, candidate, baseline, args.allow_busy))


def main(args):
    from spopp_jax import learner

    batches = agent_batches(args)
    model = random_policy(args)
    variants = {"full head": None, f"action head {args.fraction:g}": args.fraction}
    steps, holders = {}, {}
    for name, fraction in variants.items():
        config = learner.LearnerConfig(num_micro_batches=1, length_bucket=None, learning_rate=1e-4, num_mini_batches=args.mini_batches,
                                       action_logits_fraction=fraction)
        model_def, state = learner.init_train_state(model, config)
        steps[name] = learner.make_train_step(model_def, config)
        holders[name] = state
    describe(args, batches, "old_logp_source current")
    names = list(variants)
    time_train_steps(args, batches, steps, holders, baseline=names[0], candidate=names[1])


if __name__ == "__main__":
    ARGS = parse_args()
    import _protocol

    _protocol.pin_threads(ARGS.threads)
    main(ARGS)
