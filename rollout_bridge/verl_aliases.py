"""verl knob names on our command line: a pure argv -> argv rewrite (docs/CONVENTIONS.md).

    python train.py --actor_rollout_ref.actor.clip_ratio_low 0.2 --actor.clip_ratio_c 3
    python train.py actor_rollout_ref.actor.clip_ratio_high=0.28      # Hydra style

Each verl key is accepted in three spellings: the full path
(`--actor_rollout_ref.actor.clip_ratio_low 0.2`), the path without `actor_rollout_ref.`
(`--actor.clip_ratio_low 0.2`), and verl's own Hydra form without dashes
(`actor_rollout_ref.actor.clip_ratio_low=0.2`, also `+key=value`). Each becomes the flag(s)
of ours with the same meaning; arguments that are not verl aliases pass through unchanged
and in order.

A verl key whose meaning differs from every knob of ours is refused with
`AliasError` naming the key, what differs and what to use instead; so is a value that
asks for behaviour we do not have (e.g. `loss_agg_mode=seq-mean-token-mean`: our loss is
always the token mean over the whole batch, SPEC 5). A value verl and we share as a
fixed behaviour (`loss_agg_mode=token-mean`, `ppo_epochs=1`, `rollout_is=token`) is
accepted and dropped. Giving one knob twice (as a verl alias and as our flag, or as two
aliases) is refused rather than letting the later one win silently.

Batch sizes: verl counts `data.train_batch_size` and `ppo_mini_batch_size` in prompts,
with `rollout.n` responses each; we count trajectories per update (`rollout.batch_size`)
and the number of mini-batches (`optim.num_mini_batches`). So `data.train_batch_size=B`
with `rollout.n=n` becomes `--rollout.batch_size B*n` (and `--method.group_size n`, a group method's G), and
`ppo_mini_batch_size=M` becomes `--optim.num_mini_batches B/M`, which needs
`data.train_batch_size` in the same command line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

__all__ = ["AliasError", "Alias", "ALIASES", "VERL_PREFIX", "rewrite_verl_aliases",
           "alias_table"]

VERL_PREFIX = "actor_rollout_ref."
HYDRA_APPEND = "+"


class AliasError(ValueError):
    """A verl alias that cannot be translated (differs in meaning, bad value, given twice)."""


@dataclasses.dataclass(frozen=True)
class Alias:
    """One verl key. `ours`: our flag(s) receiving the (converted) value; `fixed`: values
    that are already our only behaviour (accepted, nothing emitted); `differs`: why the
    key cannot be translated (refused whatever the value)."""

    verl: str
    ours: tuple[str, ...] = ()
    convert: Callable[[str], str] | None = None
    fixed: tuple[str, ...] = ()
    differs: str | None = None


def _positive_float(value: str) -> str:
    number = float(value)
    if number <= 0:
        raise ValueError("must be > 0")
    return value


def _is_cap(value: str) -> str:
    if float(value) <= 0:
        raise ValueError("verl's -1 / 0 turn the cap off; our rollout importance weight is "
                         "always truncated (SPEC 5): give a cap > 0, e.g. 2")
    return value


# Batch-size keys resolved together (see module docstring); not in ALIASES' simple table.
TRAIN_BATCH = "data.train_batch_size"
ROLLOUT_N = "actor_rollout_ref.rollout.n"
MINI_BATCH = "actor_rollout_ref.actor.ppo_mini_batch_size"
OUR_BATCH = "rollout.batch_size"
OUR_GROUP = "method.group_size"
OUR_MINI_BATCHES = "optim.num_mini_batches"

ALIASES: tuple[Alias, ...] = (
    Alias("actor_rollout_ref.actor.clip_ratio_low", ("loss.clip_low",)),
    Alias("actor_rollout_ref.actor.clip_ratio_high", ("loss.clip_high",)),
    Alias("actor_rollout_ref.actor.clip_ratio", ("loss.clip_low", "loss.clip_high")),
    Alias("actor_rollout_ref.actor.clip_ratio_c", ("method.dual_clip",), _positive_float),
    Alias("algorithm.rollout_correction.rollout_is_threshold", ("loss.is_cap",), _is_cap),
    Alias("actor_rollout_ref.actor.tis_imp_ratio_cap", ("loss.is_cap",), _is_cap),
    Alias("algorithm.rollout_correction.rollout_is", fixed=("token",),
          differs="our rollout importance weight is per token, truncated at loss.is_cap "
                  "(verl rollout_is=token); sequence-level weights do not exist here"),
    Alias("actor_rollout_ref.actor.loss_agg_mode", fixed=("token-mean",),
          differs="our loss is always the token mean over all action tokens of the "
                  "update, global count (verl loss_agg_mode=token-mean, SPEC 5)"),
    Alias("actor_rollout_ref.actor.ppo_epochs", fixed=("1",),
          differs="each update makes one pass over its batch (SPEC 5); more optimizer "
                  "steps per batch: --optim.num_mini_batches"),
    Alias("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
          differs="verl gives the rows per micro-batch per GPU; we give the number of "
                  "micro-batches per mini-batch: --optim.num_micro_batches = rows per "
                  "device per mini-batch / that size"),
    Alias("actor_rollout_ref.actor.ppo_micro_batch_size",
          differs="verl gives the rows per micro-batch; we give their number: "
                  "--optim.num_micro_batches"),
    Alias("actor_rollout_ref.rollout.temperature", ("rollout.temperature",)),
    Alias("actor_rollout_ref.rollout.top_p", ("rollout.top_p",)),
    Alias("actor_rollout_ref.rollout.top_k", ("rollout.top_k",)),
    Alias("data.max_response_length",
          differs="verl bounds the whole response; we bound each turn "
                  "(--rollout.max_new_tokens) and the whole trajectory, prompt and every "
                  "turn included (--rollout.max_total_tokens)"),
    Alias("data.max_prompt_length",
          differs="we have no separate prompt bound: --rollout.max_total_tokens bounds prompt "
                  "plus all turns"),
    Alias("actor_rollout_ref.actor.optim.lr", ("optim.learning_rate",)),
    Alias("actor_rollout_ref.actor.optim.weight_decay", ("optim.weight_decay",)),
    Alias("actor_rollout_ref.actor.grad_clip", ("optim.max_grad_norm",)),
    Alias("actor_rollout_ref.model.path", ("model.path",)),
    Alias("trainer.total_training_steps", ("steps",)),
    Alias("trainer.save_freq", ("checkpoint_every",)),
    Alias("trainer.default_local_dir", ("output_dir",)),
)
BATCH_KEYS = (TRAIN_BATCH, ROLLOUT_N, MINI_BATCH)


def _spellings(verl_key: str) -> tuple[str, ...]:
    if verl_key.startswith(VERL_PREFIX):
        return verl_key, verl_key[len(VERL_PREFIX):]
    return (verl_key,)


def _lookup() -> dict[str, str]:
    """{accepted spelling: canonical verl key}"""
    keys = [a.verl for a in ALIASES] + list(BATCH_KEYS)
    return {spelling: key for key in keys for spelling in _spellings(key)}


_BY_SPELLING = _lookup()
_BY_KEY = {a.verl: a for a in ALIASES}


@dataclasses.dataclass(frozen=True)
class _Given:
    key: str        # canonical verl key
    spelled: str    # as the user wrote it
    value: str


def _split(argv: Sequence[str]) -> tuple[list[str | _Given], list[str]]:
    """argv -> items (pass-through strings and verl aliases in order), our flags given."""
    items: list[str | _Given] = []
    ours_given: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        name, has_value, value = token.partition("=")
        bare = name.lstrip("-")
        if name.startswith("--") and bare in _BY_SPELLING:
            if not has_value:
                if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                    raise AliasError(f"{name} (verl alias) needs a value")
                value, i = argv[i + 1], i + 1
            items.append(_Given(_BY_SPELLING[bare], name, value))
        elif not name.startswith("-") and has_value and name.removeprefix(HYDRA_APPEND) in _BY_SPELLING:
            items.append(_Given(_BY_SPELLING[name.removeprefix(HYDRA_APPEND)], name, value))
        else:
            if name.startswith("--"):
                ours_given.append(bare)
            items.append(token)
        i += 1
    return items, ours_given


def _simple(given: _Given) -> list[tuple[str, str]]:
    """(our flag, value) pairs of a non-batch alias; AliasError if it cannot translate."""
    alias = _BY_KEY[given.key]
    if given.value in alias.fixed:
        return []
    if alias.differs is not None:
        shown = f" (accepted: {', '.join(alias.fixed)})" if alias.fixed else ""
        raise AliasError(f"{given.spelled}={given.value}: no equivalent here{shown}: "
                         f"{alias.differs}")
    value = given.value
    if alias.convert is not None:
        try:
            value = alias.convert(value)
        except ValueError as error:
            raise AliasError(f"{given.spelled}={given.value}: {error}") from None
    return [(flag, value) for flag in alias.ours]


def _int_value(given: _Given) -> int:
    try:
        number = int(given.value)
    except ValueError:
        raise AliasError(f"{given.spelled}={given.value}: must be an integer") from None
    if number < 1:
        raise AliasError(f"{given.spelled}={given.value}: must be >= 1")
    return number


def _batch(batch_given: dict[str, _Given]) -> list[tuple[str, str]]:
    """(our flag, value) pairs for verl's prompt-counted batch keys (module docstring)."""
    out: list[tuple[str, str]] = []
    n = _int_value(batch_given[ROLLOUT_N]) if ROLLOUT_N in batch_given else 1
    if ROLLOUT_N in batch_given:
        out.append((OUR_GROUP, str(n)))
    if TRAIN_BATCH in batch_given:
        out.append((OUR_BATCH, str(_int_value(batch_given[TRAIN_BATCH]) * n)))
    if MINI_BATCH in batch_given:
        mini = batch_given[MINI_BATCH]
        if TRAIN_BATCH not in batch_given:
            raise AliasError(f"{mini.spelled}: verl counts it in prompts of "
                             f"{TRAIN_BATCH}; give {TRAIN_BATCH} in the same command, or "
                             f"use --{OUR_MINI_BATCHES} (the number of mini-batches)")
        prompts = _int_value(batch_given[TRAIN_BATCH])
        size = _int_value(mini)
        if prompts % size:
            raise AliasError(f"{mini.spelled}={size} does not divide {TRAIN_BATCH}={prompts}")
        out.append((OUR_MINI_BATCHES, str(prompts // size)))
    return out


def _refuse_duplicates(pairs: list[tuple[str, str, str]], ours_given: list[str]) -> None:
    """pairs: (our flag, value, spelled by); a flag set twice is refused."""
    seen: dict[str, str] = {}
    for flag, _, source in pairs:
        if flag in ours_given:
            raise AliasError(f"{source} sets --{flag}, which is also given as --{flag}: "
                             "give it once")
        if flag in seen and seen[flag] != source:
            raise AliasError(f"{source} and {seen[flag]} both set --{flag}: give it once")
        seen[flag] = source


def rewrite_verl_aliases(argv: Sequence[str]) -> list[str]:
    """argv with every verl alias replaced by `--<our flag> <value>` at its place (the
    batch-size keys, resolved together, at the place of the first of them)."""
    items, ours_given = _split(argv)
    batch_given = {x.key: x for x in items if isinstance(x, _Given) and x.key in BATCH_KEYS}
    repeated = [x.spelled for x in items if isinstance(x, _Given)]
    keys = [x.key for x in items if isinstance(x, _Given)]
    for key in set(keys):
        if keys.count(key) > 1:
            spelled = [s for s, k in zip(repeated, keys) if k == key]
            raise AliasError(f"{' and '.join(spelled)} are the same verl key: give it once")
    pairs: list[tuple[str, str, str]] = []
    out: list[str] = []
    batch_done = False
    for item in items:
        if isinstance(item, str):
            out.append(item)
            continue
        if item.key in BATCH_KEYS:
            if batch_done:
                continue
            translated, batch_done = _batch(batch_given), True
            source = " / ".join(x.spelled for x in batch_given.values())
        else:
            translated, source = _simple(item), item.spelled
        for flag, value in translated:
            pairs.append((flag, value, source))
            out += [f"--{flag}", value]
    _refuse_duplicates(pairs, ours_given)
    return out


def alias_table() -> list[tuple[str, str]]:
    """(verl key, what it becomes) for the docs and `--help` texts."""
    rows = []
    for alias in ALIASES:
        if alias.ours:
            rows.append((alias.verl, ", ".join(f"--{flag}" for flag in alias.ours)))
        else:
            accepted = f"accepted: {', '.join(alias.fixed)}; " if alias.fixed else ""
            rows.append((alias.verl, f"refused ({accepted}{alias.differs})"))
    rows += [(TRAIN_BATCH, f"--{OUR_BATCH} (x {ROLLOUT_N})"), (ROLLOUT_N, f"--{OUR_GROUP}"),
             (MINI_BATCH, f"--{OUR_MINI_BATCHES} = {TRAIN_BATCH} / it")]
    return rows
