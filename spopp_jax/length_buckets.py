"""Run a [b, T] batch at its used length: the positions past every row's last real token cut off.

A learner batch is padded to one width T for all its rows, so a micro-batch whose rows are
all short still pays attention over T x T positions and the MLP over T. Inside one jitted
step the width must be static, so `call_at_used_length` compiles one branch per multiple of
``bucket`` up to T and `jax.lax.switch` runs only the branch of the smallest multiple that
holds the micro-batch's used length

    n = 1 + max_{b, t : attention_mask[b, t]} t,

on the batch's fields cut to ``[:, :L]``. Positions t >= n are padding in every row, so the
cut is exact for a causal model: a query at t < n attends keys <= t only, default positions
count real tokens from the left, and the loss reads action tokens, all at t < n. What
changes is the order of float sums (smaller attention blocks), nothing else.

With gradient accumulation over M micro-batches (`OptimConfig.num_micro_batches`) each
micro-batch takes its own branch, so a step costs about Σ_m L_m (MLP) and Σ_m L_m² (attention)
instead of M·T and M·T². Every branch is compiled: about T / bucket programs in one.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

# Every branch is compiled with the step (each about as long as a step of one width): past
# this many, a larger bucket is the better trade.
MAX_BRANCHES = 32

__all__ = ["used_length", "bucket_lengths", "cut_positions", "call_at_used_length"]


def used_length(attention_mask: jax.Array) -> jax.Array:
    """int32 scalar: 1 + the last position holding a real token in any row (0 if none).

    attention_mask: [b, T] bool or 0/1.
    """
    if attention_mask.ndim != 2:
        raise ValueError(f"attention_mask must be [b, T], got shape {attention_mask.shape}")
    index = jnp.arange(1, attention_mask.shape[1] + 1, dtype=jnp.int32)
    return jnp.max(jnp.where(attention_mask != 0, index, 0))


def bucket_lengths(width: int, bucket: int) -> tuple[int, ...]:
    """The branch widths for a batch of ``width`` positions: bucket, 2·bucket, ... below
    ``width``, then ``width`` itself."""
    if not (isinstance(bucket, int) and bucket > 0):
        raise ValueError(f"bucket must be a positive int, got {bucket!r}")
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    lengths = tuple(range(bucket, width, bucket)) + (width,)
    if len(lengths) > MAX_BRANCHES:
        raise ValueError(f"length bucket {bucket} at width {width} makes {len(lengths)} branches to compile "
                         f"(at most {MAX_BRANCHES}): take a bucket of at least {-(-width // MAX_BRANCHES)}")
    return lengths


def cut_positions(tree: Any, width: int, length: int) -> Any:
    """Every array leaf of ``tree`` shaped [b, width, ...] cut to [b, length, ...]."""
    def cut(x):
        if getattr(x, "ndim", 0) >= 2 and x.shape[1] == width:
            return x[:, :length]
        return x

    return jax.tree.map(cut, tree)


def _pad_positions(tree: Any, length: int, width: int) -> Any:
    """Every array leaf shaped [b, length, ...] zero-padded to [b, width, ...]."""
    def pad(x):
        if getattr(x, "ndim", 0) >= 2 and x.shape[1] == length and length != width:
            widths = [(0, 0)] * x.ndim
            widths[1] = (0, width - length)
            return jnp.pad(x, widths)
        return x

    return jax.tree.map(pad, tree)


def call_at_used_length(fn: Callable[[Any], Any], batch: Any, attention_mask: jax.Array,
                        bucket: int | None, positions_out: bool = False) -> Any:
    """``fn(batch)`` computed on ``batch`` cut to its used length rounded up to a multiple of
    ``bucket`` (see the module docstring); ``bucket`` None or >= T: ``fn(batch)`` itself.

    batch: a pytree whose [b, T, ...] leaves are cut (``attention_mask``'s T); fn: batch ->
    pytree whose shapes do not depend on T, or, with ``positions_out``, whose [b, L, ...]
    leaves are per-position outputs, returned zero-padded to [b, T, ...] (positions past
    the cut are padding: their values are not computed). Jit- and scan-safe.
    """
    width = attention_mask.shape[1]
    if bucket is None or bucket >= width:
        return fn(batch)
    lengths = bucket_lengths(width, bucket)
    index = jnp.searchsorted(jnp.asarray(lengths, jnp.int32), used_length(attention_mask))
    index = jnp.minimum(index, len(lengths) - 1)

    def branch(length: int) -> Callable[[Any], Any]:
        def run(whole):
            out = fn(cut_positions(whole, width, length))
            return _pad_positions(out, length, width) if positions_out else out
        return run

    return jax.lax.switch(index, [branch(n) for n in lengths], batch)
