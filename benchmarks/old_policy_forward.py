"""PPO π_old with K mini-batches: one extra forward over all K mini-batches against one over
mini-batches 2..K only (mini-batch 1 takes its own gradient forward's log-probs,
`spopp_jax.learner._starting_old_logp`), on the main job's batches, in interleaved rounds
(benchmarks/_protocol.py).

    python benchmarks/old_policy_forward.py               # the main job's shapes, K = 4
    python benchmarks/old_policy_forward.py --mini-batches 2 --rounds 5

Both variants run the job's learner config (``old_logp_source: current``,
``action_logits_fraction`` `--fraction`). "forward over all K": π_old of every row at the
step's starting params, from one no-grad forward (`lax.map` over all K·M micro-batch
pieces) in its own jitted call and passed as ``batch.old_logp``, then
the train step. "forward over 2..K": the train step alone. Batches and model as in
benchmarks/action_head.py; their first losses and gradient norms are printed (they must
agree to float32 rounding).
"""

from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from action_head import parse_args  # noqa: E402


def main(args):
    import jax
    import jax.numpy as jnp
    from action_head import agent_batches, describe, random_policy, time_train_steps

    from spopp_jax import learner

    batches = agent_batches(args)
    model = random_policy(args)
    config = learner.LearnerConfig(num_micro_batches=1, length_bucket=None, learning_rate=1e-4, num_mini_batches=args.mini_batches,
                                   action_logits_fraction=args.fraction)
    model_def, state = learner.init_train_state(model, config)
    train_step = learner.make_train_step(model_def, config)
    pieces = args.mini_batches * config.num_micro_batches

    @jax.jit
    def all_pieces_logp(params, batch):
        """π_old from one no-grad forward over all K·M pieces
        (`lax.map`, one micro-batch of rows at a time), 0 off the action mask."""
        def piece_logp(piece):
            return learner.model_token_logprobs(
                model_def, params, piece.input_ids, piece.attention_mask, None, piece.segment_ids,
                piece.action_mask, args.fraction)

        logp = learner._merge_rows(jax.lax.map(piece_logp, learner.split_micro_batches(batch, pieces)))
        return jnp.where(batch.action_mask != 0, logp, 0.0)

    def all_k_forward(state, batch):
        old_logp = all_pieces_logp(state.params, batch)
        return train_step(state, dataclasses.replace(batch, old_logp=old_logp))

    names = ("forward over all K", "forward over 2..K")
    steps = {names[0]: all_k_forward, names[1]: train_step}
    _, other = learner.init_train_state(model, config)
    holders = {names[0]: state, names[1]: other}
    describe(args, batches, f"old_logp_source current, action_logits_fraction {args.fraction:g}")
    time_train_steps(args, batches, steps, holders, baseline=names[0], candidate=names[1])


if __name__ == "__main__":
    ARGS = parse_args(__doc__.split("\n\n")[0])
    import _protocol

    _protocol.pin_threads(ARGS.threads)
    main(ARGS)
