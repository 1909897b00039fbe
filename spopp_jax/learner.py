"""The SPO++ learner: `TrainState`, `TrainBatch` and jitted train / SFT steps (SPEC 5).

Loss normalisation is the GLOBAL token-mean (SPEC 5, DESIGN "Learner contract"):

    loss = Σ_{micro-batches m} Σ_{devices d} loss_sum_{m,d} / N,    N = Σ_{whole batch} action_mask

N is computed once from the whole (sharded) batch before the micro-batch loop, and every
micro-batch contributes ``loss_sum_m / N`` to the loss and ``∇ loss_sum_m / N`` to the
gradient. A mean of per-micro-batch means (verl PR #906) weighs the tokens of a short
micro-batch more and is NOT what this computes. Under `jax.jit` with sharded inputs the
sums above are global over devices (XLA inserts the all-reduces), so the same code runs on
1 or N devices.

Model plumbing: the NNX module is split once into a static `ModelDef` (graphdef + the
layout of its parameter state) and a graphdef-free pure-dict `params` pytree; jitted
functions merge them back inside the trace.

Mixed precision (MaxText's `weight_dtype` / `dtype`, Levanter's jmp policy): `params` and
the AdamW moments stay in the model's `param_dtype` (float32 master weights) while the
layers compute in its compute dtype (`ModelDef.compute_dtype`, e.g. bfloat16): each layer
casts a weight where it reads it, so gradients arrive in float32, are summed over
micro-batches and devices in float32, and the update is applied to the float32 master
copy. Logits, log-probs and every loss statistic are float32 whatever the compute dtype.
`frozen_weight_fraction` measures what a 16-bit master copy would lose.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Literal

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from spopp_jax import _checks
from spopp_jax.length_buckets import call_at_used_length
from spopp_jax.losses import combine_loss_metrics, loss_metric_means, policy_loss
from spopp_jax.pytree_paths import path_parts

__all__ = [
    "OptimConfig",
    "LossConfig",
    "LearnerConfig",
    "TrainBatch",
    "TrainState",
    "ModelDef",
    "split_model",
    "make_optimizer",
    "commit_to_one_device",
    "init_train_state",
    "token_logprobs",
    "chunked_token_logprobs",
    "model_token_logprobs",
    "action_token_logprobs",
    "split_micro_batches",
    "split_mini_batches",
    "make_compute_logprobs",
    "loss_and_grads",
    "make_loss_and_grad",
    "make_train_step",
    "make_sft_step",
    "update_is_finite",
    "cast_floating",
    "frozen_weight_fraction",
    "SkipGuard",
    "NonFiniteUpdatesError",
]

Params = Any  # nested dict of arrays (nnx.to_pure_dict of the model's nnx.Param state)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW and how one update's batch is stepped (SPEC 5): the run config's ``optim``
    section. The paper's lr 1e-6 is for 0.8B-2B models; the default is the main job's
    (a tiny model on CPU, configs/default.yaml).

    ``num_micro_batches``: gradient accumulation; micro-batch m holds rows m, m+M, m+2M, ...
    (strided, so a batch sharded by rows stays local).
    ``num_mini_batches`` = K: PPO mini-batches (verl's ``ppo_mini_batch_size`` = B/K). The
    batch's rows are split into K mini-batches, each ONE optimizer step, taken in sequence,
    all against the same π_old recorded once at the step's starting params (so the ratio
    leaves 1 from mini-batch 2 on and the clip / dual clip act). Mini-batch k holds rows
    k, k+K, k+2K, ...; its micro-batch m holds its rows m, m+M, ..., i.e. batch rows
    k + K·m + K·M·i (see `split_mini_batches`). B must be divisible by K·M. K = 1 is the
    single-step learner. ``max_grad_norm=None`` disables clipping.
    ``logprob_chunk_size``: None = log-probs from the full [B, T, V] logits; an int C = the
    LM head and logsumexp run over C positions at a time (rematerialised in the backward
    pass), so at most [B, C, V] logits are live (`chunked_token_logprobs`).
    ``action_logits_fraction``: None = the LM head runs at every position; f = only at the
    action tokens, gathered into ceil(f·T) positions per row (`action_token_logprobs`: the
    loss reads no other log-prob; a batch with a row of more action tokens than that runs
    the head everywhere). Same log-probs; for agent trajectories, where observations fill
    most of a row, most of the [B, T, V] logits are skipped. Not combined with
    ``logprob_chunk_size`` (which takes precedence).
    ``length_bucket``: None = every micro-batch runs at the batch's width T; an int b = each
    micro-batch runs at its used length (its rows' last real token) rounded up to a multiple
    of b (`spopp_jax.length_buckets`): the same loss and gradient, with attention and MLP
    work for the positions its rows use. Pays off with micro-batches of rows of unequal
    length (``num_micro_batches`` > 1); one branch per multiple of b is compiled. With one
    trajectory per micro-batch (M = 4 of the main job's K = 4 mini-batches of 4) and b = 256
    the main job's step alone is 1.7x faster on 2 CPU cores, the job itself not
    (docs/PERFORMANCE.md); on a GPU a micro-batch of one row leaves the device idle.
    ``max_consecutive_skips``: a `SkipGuard` built from this config stops the run after
    that many train steps in a row skipped for a non-finite loss, gradient or updated parameters.
    """

    learning_rate: float = 1e-4
    weight_decay: float = 0.1
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8
    max_grad_norm: float | None = 1.0
    num_micro_batches: int = 1
    num_mini_batches: int = 4
    logprob_chunk_size: int | None = None
    action_logits_fraction: float | None = 0.25
    length_bucket: int | None = None
    max_consecutive_skips: int = 5

    def __post_init__(self):
        if self.action_logits_fraction is not None and not 0.0 < self.action_logits_fraction <= 1.0:
            raise ValueError(
                f"action_logits_fraction must be in (0, 1] or None, got {self.action_logits_fraction!r}"
            )
        if self.logprob_chunk_size is not None and not (
            isinstance(self.logprob_chunk_size, int) and self.logprob_chunk_size > 0
        ):
            raise ValueError(
                f"logprob_chunk_size must be a positive int or None, got {self.logprob_chunk_size!r}"
            )
        if self.num_micro_batches < 1:
            raise ValueError(f"num_micro_batches must be >= 1, got {self.num_micro_batches}")
        if self.length_bucket is not None and not (
            isinstance(self.length_bucket, int) and self.length_bucket > 0
        ):
            raise ValueError(f"length_bucket must be a positive int or None, got {self.length_bucket!r}")
        if not (isinstance(self.num_mini_batches, int) and self.num_mini_batches >= 1):
            raise ValueError(
                f"num_mini_batches must be an int >= 1, got {self.num_mini_batches!r}"
            )
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {self.max_grad_norm}")
        if not (isinstance(self.max_consecutive_skips, int) and self.max_consecutive_skips >= 1):
            raise ValueError(
                f"max_consecutive_skips must be an int >= 1, got {self.max_consecutive_skips!r}"
            )
        if not self.learning_rate >= 0:
            raise ValueError(f"learning_rate must be >= 0, got {self.learning_rate}")

    def build(self) -> optax.GradientTransformation:
        """Global-norm clipping (optional) then AdamW."""
        adamw = optax.adamw(
            self.learning_rate,
            b1=self.adam_b1,
            b2=self.adam_b2,
            eps=self.adam_eps,
            weight_decay=self.weight_decay,
        )
        if self.max_grad_norm is None:
            return adamw
        return optax.chain(optax.clip_by_global_norm(self.max_grad_norm), adamw)


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """SPEC 5's clipped policy loss: the asymmetric PPO clip [1-clip_low, 1+clip_high] and
    the rollout importance-weight cap (the run config's ``loss`` section; the dual clip c is
    the method's recipe). ``old_logp_source`` says what the PPO ratio is taken against when
    the batch carries no ``old_logp``: ``"current"`` = the learner's own log-probs at the
    step's starting params, without gradient (identical to a recomputed old policy for 1
    epoch; no extra forward), ``"rollout"`` = the engine's ``rollout_logp`` (then the IS
    weight is 1)."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    is_cap: float = 2.0
    old_logp_source: Literal["current", "rollout"] = "current"

    def __post_init__(self):
        if self.old_logp_source not in ("current", "rollout"):
            raise ValueError(
                f"old_logp_source must be 'current' or 'rollout', got {self.old_logp_source!r}"
            )


@dataclasses.dataclass(frozen=True)
class LearnerConfig(LossConfig, OptimConfig):
    """Hyper-parameters of the learner step: the optimizer's (`OptimConfig`) and the loss's
    (`LossConfig`) fields, each declared once there, plus the method's dual clip c (SPEC 5;
    None = off). `from_sections` builds it from the two run-config sections."""

    dual_clip: float | None = dataclasses.field(default=2.0, metadata={"from": "method.dual_clip"})

    def __post_init__(self):
        OptimConfig.__post_init__(self)
        LossConfig.__post_init__(self)

    @classmethod
    def from_sections(cls, optim: OptimConfig, loss: LossConfig, **method_fields) -> "LearnerConfig":
        """The learner config of an ``optim`` and a ``loss`` section (either may be a
        subclass that only adds checks) and the method's fields (``dual_clip``)."""
        values = {f.name: getattr(optim, f.name) for f in dataclasses.fields(OptimConfig)}
        values.update({f.name: getattr(loss, f.name) for f in dataclasses.fields(LossConfig)})
        return cls(**values, **method_fields)


@flax.struct.dataclass
class TrainBatch:
    """One learner batch; every field is [B, T] (DESIGN "Learner contract").

    ``action_mask[b, t]``: token t was generated by the policy; its log-prob is
    log p(x_t | x_<t), read from the logits at t-1, so position 0 is never an action.
    ``rollout_logp``: engine log-prob of token t (0 where not an action).
    ``advantages``: the whitened trajectory advantage broadcast to its tokens.
    ``old_logp``: optional log-probs of the old policy (see `make_compute_logprobs`).
    ``segment_ids``: optional int [B, T] for packed rows (several trajectories per row,
    `rollout_bridge.trajectory.pack_train_arrays`): tokens attend only within their
    segment and positions restart at each segment's start; None = one sequence per row.
    A segment's first token must not be an action (its log-prob would be read from the
    previous segment's last token).
    """

    input_ids: jax.Array
    attention_mask: jax.Array
    action_mask: jax.Array
    rollout_logp: jax.Array
    advantages: jax.Array
    old_logp: jax.Array | None = None
    segment_ids: jax.Array | None = None


@flax.struct.dataclass
class TrainState:
    """Immutable learner state; update with `dataclasses.replace`.

    ``params``: graphdef-free pure-dict parameter pytree; ``opt_state``: optax state;
    ``step``: int32 number of optimizer updates (K per train step with
    ``num_mini_batches`` = K); ``policy_event``: int32 index of the policy
    event (SPEC 2) these params were last published as (set by the caller on publish;
    `train_step` leaves it unchanged).
    """

    params: Params
    opt_state: Any
    step: jax.Array
    policy_event: jax.Array


# ----------------------------------------------------------------------------- model plumbing


@dataclasses.dataclass(frozen=True, eq=False)
class ModelDef:
    """Static half of a split NNX model: merge(params) -> module, `apply` -> logits,
    `apply_hidden` -> final hidden states, `head` -> logits of given hidden states."""

    graphdef: Any
    param_state_def: Any  # treedef of the nnx.Param State
    param_paths: tuple[tuple[Any, ...], ...]  # key path of each State leaf, in leaf order
    rest_state: Any  # non-Param state (usually empty), kept as a constant
    compute_dtype: Any = None  # the model's compute dtype (None: as its parameters)

    def merge(self, params: Params) -> nnx.Module:
        flat = {path: leaf for path, leaf in _flatten_pure(params)}
        missing = [p for p in self.param_paths if p not in flat]
        if missing or len(flat) != len(self.param_paths):
            raise ValueError(
                f"`params` does not match the model: missing {missing[:3]}, "
                f"{len(flat)} leaves given, {len(self.param_paths)} expected"
            )
        state = jax.tree.unflatten(self.param_state_def, [flat[p] for p in self.param_paths])
        return nnx.merge(self.graphdef, state, self.rest_state)

    def apply(self, params: Params, input_ids: jax.Array, attention_mask: jax.Array,
              segment_ids: jax.Array | None = None) -> jax.Array:
        """logits[B, T, V] (float32) = model(input_ids, attention_mask, segment_ids)."""
        return self.merge(params)(input_ids, attention_mask=attention_mask,
                                  segment_ids=segment_ids)

    def apply_hidden(
        self, params: Params, input_ids: jax.Array, attention_mask: jax.Array,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """Final-norm hidden states [B, T, H]; ``head(params, ·)`` of them = `apply`."""
        return self.merge(params).hidden_states(input_ids, attention_mask=attention_mask,
                                                segment_ids=segment_ids)

    def head(self, params: Params, hidden: jax.Array) -> jax.Array:
        """float32 logits [..., V] of hidden states [..., H] (the LM head)."""
        return self.merge(params).logits_from_hidden(hidden)


def _flatten_pure(tree: Any) -> list[tuple[tuple[str, ...], Any]]:
    """(key path, leaf) pairs; a Variable's own `.value` attribute is not part of the path."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(path_parts(path, strip_value=True), leaf) for path, leaf in leaves]


def split_model(model: nnx.Module) -> tuple[ModelDef, Params]:
    """Splits an NNX module into (static `ModelDef`, pure-dict float params)."""
    graphdef, param_state, rest_state = nnx.split(model, nnx.Param, ...)
    paths = tuple(path for path, _ in _flatten_pure(param_state))
    compute_dtype = getattr(model, "dtype", None)
    model_def = ModelDef(graphdef, jax.tree.structure(param_state), paths, rest_state,
                         None if compute_dtype is None else jnp.dtype(compute_dtype))
    return model_def, nnx.to_pure_dict(param_state)


def cast_floating(tree: Any, dtype: Any) -> Any:
    """``tree`` with every floating leaf in ``dtype`` (None: unchanged). A leaf already in
    ``dtype`` is returned as is (the same buffer), any other is a new array."""
    if dtype is None:
        return tree
    dtype = jnp.dtype(dtype)

    def cast(x):
        if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)


@jax.jit
def _frozen_counts(params: Params, step: jax.Array) -> tuple[jax.Array, jax.Array]:
    frozen = total = jnp.zeros((), jnp.float32)
    for w in jax.tree.leaves(params):
        if not jnp.issubdtype(w.dtype, jnp.floating):
            continue
        moved = (w.astype(jnp.float32) - step * jnp.sign(w)).astype(w.dtype)
        nonzero = w != 0
        frozen += jnp.sum(nonzero & (moved == w), dtype=jnp.float32)
        total += jnp.sum(nonzero, dtype=jnp.float32)
    return frozen, total


def frozen_weight_fraction(params: Params, learning_rate: float) -> float:
    """Fraction of the non-zero weights w that one AdamW step cannot change as stored:
    round_{dtype(w)}(w − lr·sign(w)) == w. Adam's normalised step has magnitude ≈ lr, so
    this is the share of weights a run at ``learning_rate`` leaves frozen. For bfloat16
    (8 significant bits) and |w| ~ 0.02 that is every weight at lr 1e-6; for float32,
    none. (Exact for the first step; later steps are ≤ lr by Adam's bound.)"""
    frozen, total = _frozen_counts(params, jnp.float32(learning_rate))
    return float(frozen) / max(float(total), 1.0)


# ----------------------------------------------------------------------------- optimizer/state


def make_optimizer(config: OptimConfig) -> optax.GradientTransformation:
    """The optimizer of ``config`` (`OptimConfig.build`: clipping, then AdamW)."""
    return config.build()


def init_train_state(
    model: nnx.Module, config: LearnerConfig, policy_event: int = 0
) -> tuple[ModelDef, TrainState]:
    """Splits `model` and builds the initial `TrainState` (step 0).

    The params are copied: train steps donate their state, which would otherwise delete
    the arrays still held by `model` (e.g. by a rollout engine). To get a module back for
    publishing, use ``model_def.merge(state.params)``.
    """
    model_def, params = split_model(model)
    params = jax.tree.map(jnp.copy, params)
    opt_state = make_optimizer(config).init(params)
    state = TrainState(
        params=params,
        opt_state=opt_state,
        step=jnp.zeros((), jnp.int32),
        policy_event=jnp.asarray(policy_event, jnp.int32),
    )
    return model_def, commit_to_one_device(state)


def commit_to_one_device(tree: Any) -> Any:
    """``tree`` with every leaf committed to one device (this process's first, or the one its
    committed leaves are on); ``tree`` unchanged when its leaves are laid out over several.

    A jitted step returns committed arrays, and jit compiles anew for an input whose
    committed-ness differs: a state of uncommitted leaves (the optimizer's zeros, the step
    counters) beside committed ones (weights loaded onto a device) compiled the train step a
    second time on its second call.
    """
    leaves = [leaf for leaf in jax.tree.leaves(tree) if isinstance(leaf, jax.Array)]
    devices = {device for leaf in leaves if leaf.committed for device in leaf.sharding.device_set}
    if len(devices) > 1:
        return tree
    device = devices.pop() if devices else jax.local_devices()[0]   # this process's: each process commits its own copy
    return jax.tree.map(lambda leaf: jax.device_put(leaf, device)
                        if isinstance(leaf, jax.Array) and not leaf.committed else leaf, tree)


# ----------------------------------------------------------------------------- log-probs


def token_logprobs(logits: jax.Array, input_ids: jax.Array) -> jax.Array:
    """logp[b, t] = log_softmax(logits[b, t-1])[input_ids[b, t]] for t >= 1; logp[:, 0] = 0.

    Computed in float32 as logits[target] - logsumexp(logits). The target logit is picked
    with an iota == target compare inside a reduction, which XLA fuses (no [B, T, V]
    one-hot is materialised, and its gradient is elementwise rather than a scatter).
    """
    _check_per_position("logits", logits, input_ids)
    logp = _target_logprobs(logits[:, :-1], input_ids[:, 1:])
    return jnp.pad(logp, ((0, 0), (1, 0)))


def _check_per_position(name: str, values: jax.Array, input_ids: jax.Array) -> None:
    """``values`` is [B, T, D] and ``input_ids`` integer [B, T] with the same leading [B, T]."""
    _checks.check_rank(name, values, 3)
    _checks.check_rank("input_ids", input_ids, 2)
    _checks.check_integer("input_ids", input_ids)
    if values.shape[:2] != input_ids.shape:
        raise ValueError(
            f"`{name}` has shape {values.shape} but `input_ids` has shape {input_ids.shape}; "
            "the leading [B, T] must match"
        )


def _target_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """log_softmax(logits)[..., targets] in float32 by iota compare (no one-hot)."""
    logits = logits.astype(jnp.float32)
    vocab = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    target_logit = jnp.sum(jnp.where(vocab == targets[..., None], logits, 0.0), axis=-1)
    return target_logit - jax.nn.logsumexp(logits, axis=-1)


def chunked_token_logprobs(
    head: Callable[[Params, jax.Array], jax.Array],
    params: Params,
    hidden: jax.Array,
    input_ids: jax.Array,
    chunk_size: int,
) -> jax.Array:
    """`token_logprobs(head(params, hidden), input_ids)` without the [B, T, V] logits.

    logp[b, t] = log_softmax(head(hidden[b, t-1]))[input_ids[b, t]] for t >= 1,
    logp[:, 0] = 0 (SPEC 5 token log-probs). The T-1 shifted positions are padded to a
    multiple of `chunk_size` and mapped over chunks with `lax.map`; the per-chunk
    head + float32 logsumexp is wrapped in `jax.checkpoint`, so the forward and the
    backward pass each hold the logits of one [B, chunk_size, V] chunk at a time.
    """
    _check_per_position("hidden", hidden, input_ids)
    if not (isinstance(chunk_size, int) and chunk_size > 0):
        raise ValueError(f"`chunk_size` must be a positive int, got {chunk_size!r}")
    batch, length, width = hidden.shape
    shifted = length - 1
    if shifted == 0:
        return jnp.zeros((batch, 1), jnp.float32)
    num_chunks = -(-shifted // chunk_size)
    pad = num_chunks * chunk_size - shifted
    source = jnp.pad(hidden[:, :-1], ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(input_ids[:, 1:], ((0, 0), (0, pad)))
    # [B, n*C, ...] -> [n, B, C, ...]: one leading entry per chunk for lax.map.
    source = jnp.swapaxes(source.reshape(batch, num_chunks, chunk_size, width), 0, 1)
    targets = jnp.swapaxes(targets.reshape(batch, num_chunks, chunk_size), 0, 1)

    @jax.checkpoint
    def chunk_logprobs(p, chunk_hidden, chunk_targets):
        return _target_logprobs(head(p, chunk_hidden), chunk_targets)

    logp = jax.lax.map(lambda xs: chunk_logprobs(params, *xs), (source, targets))
    logp = jnp.swapaxes(logp, 0, 1).reshape(batch, num_chunks * chunk_size)[:, :shifted]
    return jnp.pad(logp, ((0, 0), (1, 0)))


def action_capacity(length: int, fraction: float) -> int:
    """Positions per row `action_token_logprobs` gathers for a T-token batch: ceil(f·T)
    rounded up to a multiple of 8, at most T."""
    return min(length, -(-math.ceil(fraction * length) // 8) * 8)


def action_token_logprobs(
    head: Callable[[Params, jax.Array], jax.Array],
    params: Params,
    hidden: jax.Array,
    input_ids: jax.Array,
    action_mask: jax.Array,
    capacity: int,
) -> jax.Array:
    """`token_logprobs(head(params, hidden), input_ids)` at the action tokens, 0 elsewhere,
    with the LM head run at `capacity` positions per row instead of T.

    logp[b, t] = log_softmax(head(hidden[b, t-1]))[input_ids[b, t]] where action_mask[b, t]
    (t >= 1; SPEC 5 token log-probs; the actor loss reads no other). Row b's action tokens
    t_1 < t_2 < ... are gathered (hidden[b, t_j - 1], input_ids[b, t_j]) into
    [B, capacity], the head and the float32 logsumexp run there, and the log-probs are
    scattered back. A batch where some row has more than `capacity` action tokens takes the
    full [B, T, V] path instead (`lax.cond`), so no token is dropped.
    """
    _check_per_position("hidden", hidden, input_ids)
    _checks.check_rank("action_mask", action_mask, 2)
    batch, length = input_ids.shape
    if not (isinstance(capacity, int) and 0 < capacity <= length):
        raise ValueError(f"`capacity` must be an int in [1, {length}], got {capacity!r}")
    mask = (action_mask != 0).at[:, 0].set(False)   # position 0 has no log-prob (logp[:, 0] = 0)
    counts = jnp.sum(mask, axis=-1, dtype=jnp.int32)

    def gathered():
        index = jax.vmap(lambda row: jnp.nonzero(row, size=capacity, fill_value=0)[0])(mask)   # [B, A]
        valid = jnp.arange(capacity)[None, :] < counts[:, None]
        source = jnp.take_along_axis(hidden, jnp.maximum(index - 1, 0)[..., None], axis=1)
        targets = jnp.take_along_axis(input_ids, index, axis=1)
        logp = jnp.where(valid, _target_logprobs(head(params, source), targets), 0.0)
        rows = jnp.arange(batch)[:, None]
        return jnp.zeros((batch, length), jnp.float32).at[rows, jnp.where(valid, index, length)].set(
            logp, mode="drop")

    def everywhere():
        return jnp.where(mask, token_logprobs(head(params, hidden), input_ids), 0.0)

    return jax.lax.cond(jnp.max(counts) <= capacity, gathered, everywhere)


def model_token_logprobs(
    model_def: ModelDef,
    params: Params,
    input_ids: jax.Array,
    attention_mask: jax.Array,
    logprob_chunk_size: int | None = None,
    segment_ids: jax.Array | None = None,
    action_mask: jax.Array | None = None,
    action_logits_fraction: float | None = None,
) -> jax.Array:
    """Token log-probs [B, T] of the model: `token_logprobs` of the full logits when
    `logprob_chunk_size` is None, else `chunked_token_logprobs` of the hidden states;
    with `action_mask` and `action_logits_fraction` (and no chunks), `action_token_logprobs`
    (0 off the action mask). `segment_ids`: packed rows (`TrainBatch.segment_ids`)."""
    if logprob_chunk_size is None and action_logits_fraction is not None and action_mask is not None:
        hidden = model_def.apply_hidden(params, input_ids, attention_mask, segment_ids)
        return action_token_logprobs(model_def.head, params, hidden, input_ids, action_mask,
                                     action_capacity(input_ids.shape[1], action_logits_fraction))
    if logprob_chunk_size is None:
        logits = model_def.apply(params, input_ids, attention_mask, segment_ids)
        return token_logprobs(logits, input_ids)
    hidden = model_def.apply_hidden(params, input_ids, attention_mask, segment_ids)
    return chunked_token_logprobs(model_def.head, params, hidden, input_ids, logprob_chunk_size)


def _check_batch(batch: TrainBatch) -> None:
    fields = {
        "input_ids": batch.input_ids,
        "attention_mask": batch.attention_mask,
        "action_mask": batch.action_mask,
        "rollout_logp": batch.rollout_logp,
        "advantages": batch.advantages,
    }
    if batch.old_logp is not None:
        fields["old_logp"] = batch.old_logp
    if batch.segment_ids is not None:
        fields["segment_ids"] = batch.segment_ids
        _checks.check_integer("segment_ids", batch.segment_ids)
    _checks.check_same_shape(fields)
    _checks.check_rank("input_ids", batch.input_ids, 2)
    _checks.check_integer("input_ids", batch.input_ids)
    for name in ("rollout_logp", "advantages") + (
        ("old_logp",) if batch.old_logp is not None else ()
    ):
        _checks.check_floating(name, fields[name])


def split_micro_batches(batch: TrainBatch, num_micro_batches: int) -> TrainBatch:
    """[B, T] fields -> [M, B/M, T]; micro-batch m holds rows m, m+M, m+2M, ...

    Strided rather than contiguous so that rows sharded in contiguous blocks over devices
    stay on their device (the reshape [B/M, M, T] keeps the block layout).
    """
    size = batch.input_ids.shape[0]
    if size % num_micro_batches:
        raise ValueError(
            f"batch size {size} (`input_ids` rows) is not divisible by "
            f"num_micro_batches={num_micro_batches}"
        )

    def split(x):
        x = x.reshape((size // num_micro_batches, num_micro_batches) + x.shape[1:])
        return jnp.swapaxes(x, 0, 1)

    return jax.tree.map(split, batch)


def split_mini_batches(
    batch: TrainBatch, num_mini_batches: int, num_micro_batches: int = 1
) -> TrainBatch:
    """[B, T] fields -> [K, B/K, T]; mini-batch k holds rows k, k+K, k+2K, ...

    The same strided split as `split_micro_batches` (rows sharded in contiguous blocks over
    devices stay on their device). Nesting: micro-batch m of mini-batch k (split again by
    `split_micro_batches`) holds batch rows k + K·m + K·M·i, i = 0, 1, ..., which is
    piece k + K·m of ``split_micro_batches(batch, K·M)``. Raises ValueError naming B, K
    and M unless B is divisible by K·M.
    """
    _check_mini_batch_rows(batch.input_ids.shape[0], num_mini_batches, num_micro_batches)
    return split_micro_batches(batch, num_mini_batches)


def _check_mini_batch_rows(size: int, num_mini_batches: int, num_micro_batches: int) -> None:
    if size % (num_mini_batches * num_micro_batches):
        raise ValueError(
            f"batch size {size} (`input_ids` rows) is not divisible by "
            f"num_mini_batches={num_mini_batches} x num_micro_batches={num_micro_batches} "
            f"= {num_mini_batches * num_micro_batches} (each mini-batch is split into "
            "micro-batches)"
        )


def _merge_rows(x: jax.Array) -> jax.Array:
    """Inverse of the strided split: [n, B/n, ...] -> [B, ...] with piece p = rows p, p+n, ..."""
    x = jnp.swapaxes(x, 0, 1)
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def make_compute_logprobs(
    model_def: ModelDef, logprob_chunk_size: int | None = None, action_logits_fraction: float | None = None,
    length_bucket: int | None = None,
) -> Callable[[Params, TrainBatch], jax.Array]:
    """Jitted `compute_logprobs(params, batch) -> [B, T]` float32 (0 off the action mask).

    One extra forward to recompute the old policy's log-probs; store the result as
    ``batch.old_logp`` (``dataclasses.replace``) before `train_step`. Pass the learner's
    `LearnerConfig.logprob_chunk_size` to avoid materialising [B, T, V] logits. With
    ``length_bucket`` the rows run one at a time, each at its used length
    (`spopp_jax.length_buckets`).
    """

    def logprobs(params: Params, batch: TrainBatch) -> jax.Array:
        return model_token_logprobs(
            model_def, params, batch.input_ids, batch.attention_mask, logprob_chunk_size,
            batch.segment_ids, batch.action_mask, action_logits_fraction,
        )

    @jax.jit
    def compute_logprobs(params: Params, batch: TrainBatch) -> jax.Array:
        _check_batch(batch)
        if length_bucket is None:
            logp = logprobs(params, batch)
        else:
            def row_logp(row: TrainBatch) -> jax.Array:
                row = jax.tree.map(lambda x: x[None], row)
                return call_at_used_length(lambda cut: logprobs(params, cut), row, row.attention_mask,
                                           length_bucket, positions_out=True)[0]
            logp = jax.lax.map(row_logp, batch)
        return jnp.where(batch.action_mask != 0, logp, 0.0)

    return compute_logprobs


# ----------------------------------------------------------------------------- steps

# A per-micro-batch loss: (logp [b, T], micro-batch) -> (loss_sum, token_count, metrics);
# metrics are additive sums except keys in the `maxed` set of `_accumulate_grads`.
TokenLossFn = Callable[[jax.Array, TrainBatch], tuple[jax.Array, jax.Array, dict[str, jax.Array]]]


def _accumulate_grads(
    model_def: ModelDef,
    params: Params,
    batch: TrainBatch,
    num_micro_batches: int,
    token_loss: TokenLossFn,
    combine: Callable[[dict, dict], dict],
    logprob_chunk_size: int | None = None,
    action_logits_fraction: float | None = None,
    length_bucket: int | None = None,
):
    """Σ_m ∇(loss_sum_m / N) and Σ_m loss_sum_m / N with N the batch's global token count.

    With ``length_bucket`` each micro-batch runs at its used length rounded up to a multiple
    of it (`spopp_jax.length_buckets`): the same loss and gradient, less work for short rows.
    Returns (loss, grads, token_count, metrics) with metrics combined by `combine`.
    """
    total_tokens = jnp.sum(batch.action_mask != 0, dtype=jnp.int32)
    denom = jnp.maximum(total_tokens, 1).astype(jnp.float32)

    def micro_loss(p, micro):
        logp = model_token_logprobs(
            model_def, p, micro.input_ids, micro.attention_mask, logprob_chunk_size,
            micro.segment_ids, micro.action_mask, action_logits_fraction,
        )
        loss_sum, count, metrics = token_loss(logp, micro)
        return loss_sum / denom, (count, metrics)

    value_and_grad = jax.value_and_grad(micro_loss, has_aux=True)

    def grad_fn(p, micro):
        return call_at_used_length(lambda m: value_and_grad(p, m), micro, micro.attention_mask, length_bucket)

    if num_micro_batches == 1:
        (loss, (count, metrics)), grads = grad_fn(params, batch)
        return loss, grads, count, metrics

    micro_batches = split_micro_batches(batch, num_micro_batches)
    first = jax.tree.map(lambda x: x[0], micro_batches)
    _, (_, metrics_shape) = jax.eval_shape(micro_loss, params, first)
    zero_metrics = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), metrics_shape)
    zero_grads = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

    def body(carry, micro):
        loss_acc, grad_acc, count_acc, metrics_acc = carry
        (loss, (count, metrics)), grads = grad_fn(params, micro)
        grad_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grad_acc, grads)
        return (loss_acc + loss, grad_acc, count_acc + count, combine(metrics_acc, metrics)), None

    init = (jnp.zeros((), jnp.float32), zero_grads, jnp.zeros((), jnp.int32), zero_metrics)
    (loss, grads, count, metrics), _ = jax.lax.scan(body, init, micro_batches)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    return loss, grads, count, metrics


def _policy_token_loss(config: LearnerConfig, old_is_current: jax.Array | None = None) -> TokenLossFn:
    """SPEC 5 per-micro-batch loss sum via `spopp_jax.losses.policy_loss`.

    ``old_is_current`` (bool scalar, traced): when true, π_old is this very forward's
    stop_gradient(logp) instead of ``micro.old_logp`` (the first PPO mini-batch, whose
    params ARE the step's starting params; see `_mini_batch_steps`).
    """

    def token_loss(logp, micro: TrainBatch):
        if micro.old_logp is not None:
            old_logp = micro.old_logp
            if old_is_current is not None:
                old_logp = jnp.where(old_is_current, jax.lax.stop_gradient(logp), old_logp)
        elif config.old_logp_source == "rollout":
            old_logp = micro.rollout_logp
        else:
            old_logp = None  # stop_gradient(logp): the step's starting params
        return policy_loss(
            logp,
            old_logp,
            micro.rollout_logp,
            micro.advantages,
            micro.action_mask,
            clip_low=config.clip_low,
            clip_high=config.clip_high,
            dual_clip=config.dual_clip,
            is_cap=config.is_cap,
        )

    return token_loss


def _sft_token_loss(logp, micro: TrainBatch):
    """Negative log-likelihood summed over action tokens."""
    mask = micro.action_mask != 0
    nll_sum = -jnp.sum(jnp.where(mask, logp, 0.0))
    return nll_sum, jnp.sum(mask, dtype=jnp.int32), {}


def _objective(config: LearnerConfig, objective: str, old_is_current: jax.Array | None = None):
    """(per-micro-batch token loss, metric combiner) of ``objective``."""
    if objective == "policy":
        return _policy_token_loss(config, old_is_current), combine_loss_metrics
    if objective == "sft":
        return _sft_token_loss, lambda a, b: {}
    raise ValueError(f"objective must be 'policy' or 'sft', got {objective!r}")


def _loss_grads_sums(
    model_def: ModelDef,
    params: Params,
    batch: TrainBatch,
    config: LearnerConfig,
    objective: str,
    old_is_current: jax.Array | None = None,
):
    """(loss, grads, token_count, metric sums) of one batch; see `loss_and_grads`."""
    _check_batch(batch)
    token_loss, combine = _objective(config, objective, old_is_current)
    return _accumulate_grads(
        model_def,
        params,
        batch,
        config.num_micro_batches,
        token_loss,
        combine,
        config.logprob_chunk_size,
        config.action_logits_fraction,
        config.length_bucket,
    )


def _batch_metrics(objective: str, loss, tokens, sums) -> dict[str, jax.Array]:
    metrics = {"loss": loss, "tokens": tokens}
    if objective == "policy":
        metrics.update(loss_metric_means(sums, tokens))
    return metrics


def loss_and_grads(
    model_def: ModelDef, params: Params, batch: TrainBatch, config: LearnerConfig, objective: str
) -> tuple[jax.Array, Params, dict[str, jax.Array]]:
    """(loss, grads, metrics) of one batch, global token-mean over micro-batches/devices.

    ``objective="policy"``: loss = Σ_{action tokens} w·(−s) / N (SPEC 5, `policy_loss`);
    ``objective="sft"``: loss = −Σ_{action tokens} log p(x_t | x_<t) / N;
    N = action tokens of the whole batch. Metrics: ``loss``, ``tokens`` (= N) and, for
    "policy", the `policy_loss` metrics aggregated over the batch (`loss_metric_means`).
    The whole batch is one gradient: `config.num_mini_batches` is not used here (it is
    the number of optimizer steps of `make_train_step`). Pure; call inside jit (see
    `make_loss_and_grad`).
    """
    loss, grads, tokens, sums = _loss_grads_sums(model_def, params, batch, config, objective)
    return loss, grads, _batch_metrics(objective, loss, tokens, sums)


def make_loss_and_grad(model_def: ModelDef, config: LearnerConfig, objective: str = "policy"):
    """Jitted `(params, batch) -> (loss, grads, metrics)`; see `loss_and_grads`."""
    return jax.jit(
        lambda params, batch: loss_and_grads(model_def, params, batch, config, objective)
    )


def update_is_finite(loss: jax.Array, grad_norm: jax.Array) -> jax.Array:
    """ok = isfinite(loss) ∧ isfinite(‖g‖₂): a NaN or ±inf anywhere in the gradient makes
    its global norm non-finite, so one scalar test covers every leaf (bool scalar)."""
    return jnp.isfinite(loss) & jnp.isfinite(grad_norm)


def _apply_update(
    optimizer, state: TrainState, grads: Params, loss: jax.Array
) -> tuple[TrainState, jax.Array, jax.Array]:
    """One optimizer step, or none when the loss, the gradient or the updated parameters
    are not finite.

    Returns (state', grad_norm, skipped) with state' = the AdamW-updated state (``step``
    + 1) when `update_is_finite` and every updated parameter is finite (a finite gradient
    times an infinite learning rate is not), else ``state`` itself, leaf for leaf (params,
    optimizer moments and count, step): a non-finite value never reaches the weights.
    ``skipped`` is an int32 0/1. Jit-safe: the choice is a `jnp.where` per leaf, no host
    sync; the caller reads ``skipped`` from the step's metrics (`SkipGuard`).
    """
    grad_norm = optax.global_norm(grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    updated = dataclasses.replace(state, params=params, opt_state=opt_state, step=state.step + 1)
    params_finite = jnp.all(jnp.stack([jnp.isfinite(p).all() for p in jax.tree.leaves(params)]))
    ok = update_is_finite(loss, grad_norm) & params_finite
    new_state = jax.tree.map(lambda new, old: jnp.where(ok, new, old), updated, state)
    return new_state, grad_norm, jnp.logical_not(ok).astype(jnp.int32)


class NonFiniteUpdatesError(RuntimeError):
    """Too many train steps in a row had a non-finite loss, gradient or update (`SkipGuard`)."""


@dataclasses.dataclass
class SkipGuard:
    """Host-side counter of skipped updates; stops a run that only produces NaN/inf.

    A train step counts as skipped when its ``skipped_updates`` metric is > 0 (with K
    mini-batches: any of its K optimizer steps was skipped). `observe` raises
    `NonFiniteUpdatesError` when ``max_consecutive`` train steps in a row were skipped;
    one clean step resets the streak. ``total`` counts every skipped optimizer step.
    """

    max_consecutive: int
    consecutive: int = 0
    total: int = 0

    @classmethod
    def from_config(cls, config: LearnerConfig) -> "SkipGuard":
        return cls(config.max_consecutive_skips)

    def __post_init__(self):
        if not (isinstance(self.max_consecutive, int) and self.max_consecutive >= 1):
            raise ValueError(f"max_consecutive must be an int >= 1, got {self.max_consecutive!r}")

    def observe(self, metrics: dict[str, Any]) -> int:
        """Reads ``metrics["skipped_updates"]`` of one train step; returns the streak."""
        skipped = int(metrics["skipped_updates"])
        self.total += skipped
        self.consecutive = self.consecutive + 1 if skipped > 0 else 0
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteUpdatesError(
                f"{self.consecutive} train steps in a row had a non-finite loss, gradient or updated parameters "
                f"(loss={float(metrics.get('loss', float('nan')))!r}, grad_norm="
                f"{float(metrics.get('grad_norm', float('nan')))!r}); their updates were "
                "skipped, parameters and optimizer state are those of the last finite step. "
                "Stopping: check the data (NaN log-probs / advantages), the learning rate "
                "and the model's dtype"
            )
        return self.consecutive


def _starting_old_logp(
    model_def: ModelDef, params: Params, mini_batches: TrainBatch, config: LearnerConfig
) -> tuple[jax.Array, jax.Array]:
    """(π_old [K, B/K, T] in `mini_batches`' layout, old_is_current [K] bool).

    π_old of every row, fixed for all K mini-batches of one train step: ``old_logp`` when
    the batch gives it, else the rollout log-probs (``old_logp_source="rollout"``), else
    (``"current"``) the log-probs under the step's STARTING `params`. Those come from one
    pass without gradient over mini-batches 2..K only, one training micro-batch of rows at
    a time (`lax.map`, so no more logits are live than in the gradient pass). Mini-batch 1
    is trained at the starting params, so its π_old is its own gradient forward's
    stop_gradient(logp): ``old_is_current[0]`` is true and its rows here are 0, which saves
    1/K of the extra forward. 0 off the action mask.
    """
    num_mini = config.num_mini_batches
    not_current = jnp.zeros((num_mini,), bool)
    if mini_batches.old_logp is not None:
        return mini_batches.old_logp, not_current
    if config.old_logp_source == "rollout":
        return mini_batches.rollout_logp, not_current

    def piece_logp(piece: TrainBatch) -> jax.Array:
        def logp(cut: TrainBatch) -> jax.Array:
            return model_token_logprobs(
                model_def, params, cut.input_ids, cut.attention_mask, config.logprob_chunk_size,
                cut.segment_ids, cut.action_mask, config.action_logits_fraction,
            )
        return call_at_used_length(logp, piece, piece.attention_mask, config.length_bucket, positions_out=True)

    def mini_logp(mini: TrainBatch) -> jax.Array:
        pieces = split_micro_batches(mini, config.num_micro_batches)
        return _merge_rows(jax.lax.map(piece_logp, pieces))

    later = jax.tree.map(lambda x: x[1:], mini_batches)
    logp = jax.lax.stop_gradient(jax.lax.map(mini_logp, later))
    first = jnp.zeros((1,) + logp.shape[1:], logp.dtype)
    logp = jnp.concatenate([first, logp], axis=0)
    return jnp.where(mini_batches.action_mask != 0, logp, 0.0), jnp.arange(num_mini) == 0


def _mini_batch_steps(model_def, config, objective, optimizer, state: TrainState, batch):
    """K = `config.num_mini_batches` sequential optimizer steps on the K mini-batches.

    Each step is exactly the K = 1 step on its mini-batch (global token-mean over its own
    N_k action tokens, micro-batch accumulation, clipping, AdamW) with ``old_logp`` the
    π_old of `_starting_old_logp`. A mini-batch without action tokens has loss 0 and an
    exactly-zero gradient (N_k is floored at 1, masked tokens add 0); its AdamW step is
    still taken and counted in ``step``: the moments decay, the bias-correction count
    advances and the params move by the remaining momentum and the weight decay (what
    `make_train_step` does on that mini-batch alone).

    Metrics over the K steps: ``tokens`` = Σ_k N_k; ``loss`` and the `policy_loss`
    fractions / means are TOKEN-weighted (Σ_k sum_k / Σ_k N_k, each token evaluated at the
    params of its own step); ``ratio_max`` = max over all steps; ``grad_norm`` = the
    unweighted mean over the K steps of the pre-clipping norm, ``grad_norm_last`` = the
    last step's.
    """
    _check_batch(batch)
    _check_mini_batch_rows(
        batch.input_ids.shape[0], config.num_mini_batches, config.num_micro_batches
    )
    _, combine = _objective(config, objective)
    mini_batches = split_mini_batches(batch, config.num_mini_batches, config.num_micro_batches)
    old_is_current = jnp.zeros((config.num_mini_batches,), bool)
    if objective == "policy":
        old_logp, old_is_current = _starting_old_logp(model_def, state.params, mini_batches, config)
        mini_batches = dataclasses.replace(mini_batches, old_logp=old_logp)

    def one_step(state: TrainState, mini: TrainBatch, current: jax.Array):
        loss, grads, tokens, sums = _loss_grads_sums(
            model_def, state.params, mini, config, objective, current
        )
        state, grad_norm, skipped = _apply_update(optimizer, state, grads, loss)
        return state, (loss, tokens, sums, grad_norm, skipped)

    first = jax.tree.map(lambda x: x[0], mini_batches)
    _, (_, _, sums_shape, _, _) = jax.eval_shape(one_step, state, first, old_is_current[0])
    zero_sums = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sums_shape)

    def body(carry, xs):
        mini, current = xs
        state, loss_sum, tokens_acc, sums_acc, norm_sum, _, skipped_acc = carry
        state, (loss, tokens, sums, grad_norm, skipped) = one_step(state, mini, current)
        # loss = Σ_k / max(N_k, 1), so loss · N_k is the mini-batch's token-sum (0 if empty).
        loss_sum = loss_sum + loss * tokens.astype(jnp.float32)
        carry = (
            state,
            loss_sum,
            tokens_acc + tokens,
            combine(sums_acc, sums),
            norm_sum + grad_norm,
            grad_norm,
            skipped_acc + skipped,
        )
        return carry, None

    zero = jnp.zeros((), jnp.float32)
    zero_int = jnp.zeros((), jnp.int32)
    init = (state, zero, zero_int, zero_sums, zero, zero, zero_int)
    (state, loss_sum, tokens, sums, norm_sum, last_norm, skipped), _ = jax.lax.scan(
        body, init, (mini_batches, old_is_current)
    )
    loss = loss_sum / jnp.maximum(tokens, 1).astype(jnp.float32)
    metrics = _batch_metrics(objective, loss, tokens, sums)
    metrics["grad_norm"] = norm_sum / config.num_mini_batches
    metrics["grad_norm_last"] = last_norm
    metrics["skipped_updates"] = skipped
    return state, metrics


def _make_step(model_def, config, objective, state_sharding, batch_sharding):
    optimizer = make_optimizer(config)

    def step(state: TrainState, batch: TrainBatch):
        if config.num_mini_batches > 1:
            return _mini_batch_steps(model_def, config, objective, optimizer, state, batch)
        loss, grads, metrics = loss_and_grads(model_def, state.params, batch, config, objective)
        new_state, grad_norm, skipped = _apply_update(optimizer, state, grads, loss)
        return new_state, {**metrics, "grad_norm": grad_norm, "skipped_updates": skipped}

    if state_sharding is None and batch_sharding is None:
        return jax.jit(step, donate_argnums=0)
    return jax.jit(
        step,
        in_shardings=(state_sharding, batch_sharding),
        out_shardings=(state_sharding, None),
        donate_argnums=0,
    )


def make_train_step(
    model_def: ModelDef,
    config: LearnerConfig,
    state_sharding: Any = None,
    batch_sharding: Any = None,
) -> Callable[[TrainState, TrainBatch], tuple[TrainState, dict[str, jax.Array]]]:
    """Jitted SPO++ `train_step(state, batch) -> (state, metrics)` (SPEC 5).

    loss = Σ_{all action tokens of the batch} w·(−s) / N (global token-mean, see module doc),
    gradient accumulated over `config.num_micro_batches` with `lax.scan`, clipped to global
    norm `config.max_grad_norm`, AdamW update; ``step`` += 1 (K = 1). The state argument is
    donated.

    The ratio is taken against ``batch.old_logp`` when given, else per
    `config.old_logp_source`. Metrics: ``loss``, ``grad_norm`` (before clipping),
    ``tokens`` (global action-token count) and the `policy_loss` metrics aggregated over
    the whole batch (fractions / means per action token, ``ratio_max``), and
    ``skipped_updates`` (int32): optimizer steps NOT taken because the loss or the gradient
    was not finite; such a step leaves params, optimizer state and ``step`` exactly as they
    were (`_apply_update`); feed the metrics to a `SkipGuard` to stop a run that only
    produces NaN/inf.

    `state_sharding` / `batch_sharding` (pytrees of `Sharding`, e.g. from
    `spopp_jax.sharding`) pin the layouts; without them the inputs' shardings propagate.

    PPO mini-batches (``config.num_mini_batches`` = K > 1): π_old of ALL rows is fixed
    first (``batch.old_logp``, the rollout log-probs, or for ``"current"`` one no-grad
    forward at the starting params over mini-batches 2..K, mini-batch 1 taking its own
    gradient forward's log-probs), then a `lax.scan` takes K optimizer steps, step k on
    mini-batch k (rows k, k+K, ...; `split_mini_batches`) with loss Σ_{its action tokens}
    w·(−s) / N_k, N_k = that mini-batch's global action-token count, w = min(π_old /
    π_rollout, is_cap); ``step`` += K. From step 2 on the ratio differs from 1, so the clip
    and dual clip act. Metrics are aggregated over the K steps (token-weighted loss and
    fractions, max ``ratio_max``, mean ``grad_norm`` plus ``grad_norm_last``; see
    `_mini_batch_steps`). K = 1 is the single step above, with no extra forward.
    """
    return _make_step(model_def, config, "policy", state_sharding, batch_sharding)


def make_sft_step(
    model_def: ModelDef,
    config: LearnerConfig,
    state_sharding: Any = None,
    batch_sharding: Any = None,
) -> Callable[[TrainState, TrainBatch], tuple[TrainState, dict[str, jax.Array]]]:
    """Jitted supervised step: cross-entropy on action tokens only, global token-mean.

    loss = −Σ_{b,t} action_mask·log p(x_t | x_<t) / Σ action_mask over the whole batch
    (SPEC 6 cold start: "loss on the final assistant message only" = its action mask).
    ``rollout_logp`` / ``advantages`` / ``old_logp`` are ignored (pass zeros). Same
    optimizer, micro-batching, mini-batching (K sequential steps, no old policy) and
    donation and non-finite guard as `make_train_step`. Metrics: ``loss``, ``grad_norm``,
    ``tokens``, ``skipped_updates`` (and ``grad_norm_last`` when K > 1).
    """
    return _make_step(model_def, config, "sft", state_sharding, batch_sharding)
