#!/usr/bin/env python
"""Can a tiny random Qwen3 learn associative recall? The skill a policy needs to read a
shuffled, numbered action list, on synthetic tokens, with our own
learner (`spopp_jax.learner.make_sft_step`, AdamW, global token-mean cross-entropy).

    python scripts/recall_drill.py --pairs 2 --queries all --layout contiguous --layers 2

One example ("BOS", "SEP" and "NL" are reserved ids; keys and values are random tokens
from disjoint ranges, every key distinct, the values a permutation):

    contiguous: BOS k1 v1 k2 v2 ... kN vN SEP q1 v(q1) q2 v(q2) ...
    separated:  BOS NL k1 v1 NL ... kN vN NL SEP NL q1 v(q1) NL ...   (a separator after
                each pair, as the numbered list has " | " or a newline)

`--queries one`: one random key is queried (the loss is on a single token per row);
`--queries all`: every key once in random order (multi-query associative recall, the loss
on every queried value). The loss is on the queried values only. `--min-pairs`: each row
has a random number of pairs; `--grow`: a curriculum over that number. Printed every
`--every` steps: the mean loss, and beside it the two losses a model that does NOT recall
reaches: `chance` (uniform over the N values) and `elimination` (uniform over the values
not queried yet in this row, the best without recall when every key is queried).

What it found (step counts, with the PyTorch `transformers` cross-check): docs/RESULTS.md,
"Associative recall in a tiny model".
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BOS, SEP, NL, PAD = 1, 2, 3, 0
KEYS = np.arange(300, 353)     # 53 single-token keys, as many as the warm-start games' one-token words
VALUES = np.arange(20, 52)     # up to 32 values ("1".."32")


def draw_keys(rng: np.random.Generator, pairs: int, key_tokens: int) -> list[list[int]]:
    """`pairs` distinct keys of `key_tokens` tokens each; with several tokens per key the
    tokens are drawn from the first 12 key ids, so keys share tokens (as "take key from
    table" and "put key on table" do)."""
    if key_tokens == 1:
        return [[int(k)] for k in rng.choice(KEYS, pairs, replace=False)]
    keys: set[tuple[int, ...]] = set()
    while len(keys) < pairs:
        keys.add(tuple(int(t) for t in rng.choice(KEYS[:12], key_tokens)))
    return [list(k) for k in rng.permutation(sorted(keys))]


def recall_row(rng: np.random.Generator, pairs: int, all_queries: bool, separated: bool,
               key_tokens: int = 1) -> tuple[list[int], list[bool]]:
    """Token ids and loss mask of one drill example (module docstring)."""
    keys = draw_keys(rng, pairs, key_tokens)
    values = VALUES[rng.permutation(pairs)]
    queries = rng.permutation(pairs) if all_queries else rng.integers(pairs, size=1)
    gap = [NL] if separated else []
    ids, mask = [BOS] + gap, [False] * (1 + len(gap))
    for key, value in zip(keys, values):
        ids += key + [int(value)] + gap
        mask += [False] * (len(key) + 1 + len(gap))
    ids += [SEP] + gap
    mask += [False] * (1 + len(gap))
    for q in queries:
        ids += keys[q] + [int(values[q])] + gap
        mask += [False] * len(keys[q]) + [True] + [False] * len(gap)
    return ids, mask


def padded(rows: list[tuple[list[int], list[bool]]], width: int
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Right-padded [B, width] ids, attention mask and loss mask."""
    ids = np.full((len(rows), width), PAD, np.int32)
    valid = np.zeros((len(rows), width), bool)
    mask = np.zeros((len(rows), width), bool)
    for b, (row_ids, row_mask) in enumerate(rows):
        ids[b, :len(row_ids)], valid[b, :len(row_ids)], mask[b, :len(row_ids)] = row_ids, True, row_mask
    return ids, valid, mask


def no_recall_losses(low: int, high: int, all_queries: bool) -> tuple[float, float]:
    """`baselines` for rows of low..high pairs (uniform), weighted as the token-mean loss
    weighs them (by their number of queries)."""
    counts = np.arange(low, high + 1)
    chance, elimination = np.average([baselines(n, all_queries) for n in counts], axis=0,
                                     weights=counts if all_queries else None)
    return float(chance), float(elimination)


def baselines(pairs: int, all_queries: bool) -> tuple[float, float]:
    """(chance, elimination) loss per queried value for a model that does not recall."""
    chance = float(np.log(pairs))
    if not all_queries:
        return chance, chance
    return chance, float(np.mean([np.log(pairs - i) for i in range(pairs)]))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=2, help="key-value pairs per example (<= 32)")
    parser.add_argument("--min-pairs", type=int, default=None,
                        help="each row draws its number of pairs uniformly from [min-pairs, pairs] "
                             "(default: pairs; 2 with --grow)")
    parser.add_argument("--queries", choices=["one", "all"], default="all")
    parser.add_argument("--layout", choices=["contiguous", "separated"], default="contiguous")
    parser.add_argument("--grow", action="store_true",
                        help="curriculum: start with rows of --min-pairs pairs only and allow one more pair "
                             "each time the last --every steps' loss is below a quarter of the no-recall "
                             "(elimination) loss of the sizes in use")
    parser.add_argument("--key-tokens", type=int, default=1, help="tokens per key (>1: shared tokens)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--every", type=int, default=250)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not 2 <= args.pairs <= len(VALUES):
        parser.error(f"--pairs must be in [2, {len(VALUES)}]")
    min_pairs = args.min_pairs if args.min_pairs is not None else 2 if args.grow else args.pairs
    if not 2 <= min_pairs <= args.pairs:
        parser.error("--min-pairs must be in [2, --pairs]")
    if args.hidden % args.heads:
        parser.error("--hidden must be a multiple of --heads")

    import jax.numpy as jnp

    from spopp_jax.learner import LearnerConfig, TrainBatch, init_train_state, make_sft_step
    from spopp_jax.models import ModelConfig, init_model

    config = ModelConfig(vocab_size=512, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                         tie_word_embeddings=True)
    learner = LearnerConfig(num_micro_batches=1, length_bucket=None, num_mini_batches=1, action_logits_fraction=None,
                            learning_rate=args.lr, weight_decay=0.0, max_grad_norm=1.0)
    model_def, state = init_train_state(init_model(config, seed=args.seed), learner)
    sft_step = make_sft_step(model_def, learner)
    all_queries, separated = args.queries == "all", args.layout == "separated"
    top = min_pairs if args.grow else args.pairs
    chance, elimination = no_recall_losses(min_pairs, top, all_queries)
    print(f"recall drill: {min_pairs}-{args.pairs} pairs of {args.key_tokens}-token keys, {args.queries} queries, "
          f"{args.layout}, {args.layers} layers, hidden {args.hidden}, lr {args.lr}, batch {args.batch}{', growing' if args.grow else ''}; "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    rng = np.random.default_rng(args.seed)
    width = 4 + 2 * args.pairs * (args.key_tokens + 2)   # the longest row (separated): one compile
    zeros = jnp.zeros((args.batch, width), jnp.float32)    # rollout_logp, advantages: unused by SFT
    losses, start = [], time.time()
    for step in range(1, args.steps + 1):
        rows = [recall_row(rng, int(rng.integers(min_pairs, top + 1)), all_queries, separated,
                           args.key_tokens) for _ in range(args.batch)]
        ids, valid, mask = padded(rows, width)
        state, metrics = sft_step(state, TrainBatch(jnp.asarray(ids), jnp.asarray(valid), jnp.asarray(mask),
                                                    zeros, zeros))
        losses.append(float(metrics["loss"]))
        if step % args.every == 0 or step == args.steps:
            recent = float(np.mean(losses[-args.every:]))
            print(f"step {step}: loss {recent:.3f} on {min_pairs}-{top} pairs (no recall: chance {chance:.3f}, "
                  f"elimination {elimination:.3f}; {time.time() - start:.0f}s, load {os.getloadavg()[0]:.1f})",
                  flush=True)
            if args.grow and top < args.pairs and recent < 0.25 * elimination:
                top += 1
                chance, elimination = no_recall_losses(min_pairs, top, all_queries)


if __name__ == "__main__":
    main()
