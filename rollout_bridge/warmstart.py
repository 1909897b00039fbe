"""Cold-start SFT on teacher demonstrations, loss on the action tokens only.

Teacher demonstrations are the walkthroughs of a game set DISJOINT from the training tasks
(`textworld_games.generate_disjoint_game_set`): the warm start teaches the action format
(one admissible command, then the end-of-turn token) and general skill, never the answers
of the training tasks, so RL has room to work.

A demonstration is tokenized exactly as the agent loop (`rollout_bridge.agent.run_episode`)
would have produced it had the policy typed the teacher's commands:

    prompt_ids(obs_0) + [cmd_0 ids, stop] + close_ids + observation_turn_ids(obs_1) + ...

with action_mask = 1 exactly on `[cmd_k ids, stop]` (what the policy samples) for every k
(`loss_on="all_assistant"`), or only for the LAST reply (`loss_on="final_message"`, the
paper's Math-TIR cold start, SPEC 6: earlier replies and tool outputs are context), or on
every token but the first (`loss_on="all_tokens"`: language modelling of the observations
too, which teaches a tiny random model to copy names from its context far sooner than the
few reply tokens alone; RL still trains only the replies). The SFT
step (`spopp_jax.learner.make_sft_step`) minimises
    -Σ action_mask · log p(x_t | x_<t) / Σ action_mask     (global token-mean)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterator, Sequence

import numpy as np

LOSS_ON = ("final_message", "all_assistant", "all_tokens")


@dataclasses.dataclass(frozen=True)
class SFTExample:
    """One tokenized demonstration: ids and the mask of the tokens the policy would type."""

    token_ids: tuple[int, ...]
    action_mask: tuple[bool, ...]

    def __post_init__(self):
        if len(self.token_ids) != len(self.action_mask):
            raise ValueError("token_ids and action_mask must have equal length")
        if self.action_mask and self.action_mask[0]:
            raise ValueError("action_mask[0] must be False")


def check_loss_on(loss_on: str) -> str:
    if loss_on not in LOSS_ON:
        raise ValueError(f"warmstart.loss_on must be one of {LOSS_ON}, got {loss_on!r}")
    return loss_on


def demonstration_example(chat, pairs: Sequence[tuple[str, str]],
                          loss_on: str = "all_assistant") -> SFTExample:
    """Tokenize (observation, command) turns the way the agent loop builds a trajectory;
    the loss mask covers every reply, only the last one, or every token (``loss_on``)."""
    if not pairs:
        raise ValueError("pairs is empty")
    check_loss_on(loss_on)
    stop_id = chat.turn_close_ids[0] if chat.turn_close_ids else chat.stop_token_ids[0]
    ids = list(chat.prompt_ids(pairs[0][0]))
    mask = [False] * len(ids)
    for k, (_, command) in enumerate(pairs):
        if k > 0:
            context = chat.close_ids(reply) + chat.observation_turn_ids(pairs[k][0])
            ids += context
            mask += [False] * len(context)
        reply = chat.encode(command) + [stop_id]
        ids += reply
        trained = loss_on == "all_assistant" or k == len(pairs) - 1
        mask += [trained] * len(reply)
    if loss_on == "all_tokens":
        mask = [False] + [True] * (len(ids) - 1)
    return SFTExample(tuple(ids), tuple(mask))


def sft_examples(tasks, chat, task_ids: Sequence[int] | None = None,
                 max_length: int | None = None, loss_on: str = "all_assistant") -> list[SFTExample]:
    """One example per task's walkthrough (longer than `max_length` tokens: dropped)."""
    task_ids = range(tasks.num_tasks) if task_ids is None else task_ids
    examples = [demonstration_example(chat, tasks.demonstration(t), loss_on) for t in task_ids]
    if max_length is not None:
        examples = [e for e in examples if len(e.token_ids) <= max_length]
    if not examples:
        raise ValueError("no demonstration fits warmstart.max_length")
    return examples


def pack_sft_batch(examples: Sequence[SFTExample], pad_id: int, width: int | None = None,
                   pad_to_multiple: int = 32) -> dict[str, np.ndarray]:
    """Right-padded `TrainBatch` arrays [B, width]; rollout_logp and advantages are zeros
    (unused by the SFT step). `width` None = the longest example rounded up to
    `pad_to_multiple`."""
    if not examples:
        raise ValueError("examples is empty")
    longest = max(len(e.token_ids) for e in examples)
    if width is None:
        width = padded_width(longest, pad_to_multiple)
    if width < longest:
        raise ValueError(f"width={width} < longest example ({longest} tokens)")
    batch = len(examples)
    input_ids = np.full((batch, width), pad_id, np.int32)
    attention_mask = np.zeros((batch, width), bool)
    action_mask = np.zeros((batch, width), bool)
    for row, example in enumerate(examples):
        n = len(example.token_ids)
        input_ids[row, :n] = example.token_ids
        attention_mask[row, :n] = True
        action_mask[row, :n] = example.action_mask
    zeros = np.zeros((batch, width), np.float32)
    return dict(input_ids=input_ids, attention_mask=attention_mask, action_mask=action_mask,
                rollout_logp=zeros, advantages=zeros.copy())


def padded_width(length: int, multiple: int) -> int:
    """`length` rounded up to a multiple of `multiple` (few widths: few compiled shapes)."""
    return -(-length // multiple) * multiple


def _topped_up_permutation(num_examples: int, batch_size: int, rng: np.random.Generator) -> np.ndarray:
    """A random order of the examples, topped up from its start to whole batches."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    num_batches = max(1, math.ceil(num_examples / batch_size))
    return np.resize(rng.permutation(num_examples), num_batches * batch_size)


def epoch_batches(examples: Sequence[SFTExample], batch_size: int, rng: np.random.Generator
                  ) -> Iterator[list[SFTExample]]:
    """A shuffled pass in full batches (the last batch is topped up from the start of
    the permutation, so every step has the same number of rows: one compile)."""
    padded = _topped_up_permutation(len(examples), batch_size, rng)
    for start in range(0, len(padded), batch_size):
        yield [examples[i] for i in padded[start:start + batch_size]]


def length_grouped_batches(examples: Sequence[SFTExample], batch_size: int, rng: np.random.Generator,
                           group_batches: int = 16) -> Iterator[list[SFTExample]]:
    """A shuffled pass in full batches of similar length (the batches of `epoch_batches`,
    regrouped): the padded permutation is cut into groups of `group_batches` batches, each
    group is sorted by length (longest first) and cut into batches, and the pass visits the
    batches in a random order. Padded to their own longest example, the batches then carry
    far fewer pad tokens than batches padded to the data set's longest (HF Trainer's
    `group_by_length`); every example still appears once per pass (plus the top-up)."""
    if group_batches < 1:
        raise ValueError(f"group_batches must be >= 1, got {group_batches}")
    padded = _topped_up_permutation(len(examples), batch_size, rng)
    group = group_batches * batch_size
    batches = []
    for start in range(0, len(padded), group):
        members = padded[start:start + group]
        lengths = np.array([len(examples[i].token_ids) for i in members])
        members = members[np.argsort(-lengths, kind="stable")]
        batches += [members[b:b + batch_size] for b in range(0, len(members), batch_size)]
    for b in rng.permutation(len(batches)):
        yield [examples[i] for i in batches[b]]


def sft_batches(examples: Sequence[SFTExample], batch_size: int, rng: np.random.Generator, pad_id: int,
                group_by_length: bool = False, width_multiple: int = 128) -> Iterator[dict[str, np.ndarray]]:
    """One shuffled pass as packed batches (`pack_sft_batch`). `group_by_length` False:
    `epoch_batches`, each padded to the longest example of the data set (one compiled
    shape). True: `length_grouped_batches`, each padded to its own longest example rounded
    up to `width_multiple` tokens (a few compiled shapes, far fewer pad tokens)."""
    if group_by_length:
        for rows in length_grouped_batches(examples, batch_size, rng):
            yield pack_sft_batch(rows, pad_id, pad_to_multiple=width_multiple)
        return
    width = padded_width(max(len(e.token_ids) for e in examples), 32)
    for rows in epoch_batches(examples, batch_size, rng):
        yield pack_sft_batch(rows, pad_id, width)


def run_sft(sft_step: Callable, state, examples: Sequence[SFTExample], *, epochs: int,
            batch_size: int, pad_id: int, seed: int = 0,
            on_step: Callable[[int, dict], None] | None = None,
            start_epoch: int = 0, losses: Sequence[float] = (),
            on_epoch: Callable[[int, Any, list[float]], None] | None = None,
            group_by_length: bool = False, width_multiple: int = 128, mesh: Any = None,
            max_consecutive_skips: int = 5):
    """`epochs` shuffled passes of `sft_step(state, TrainBatch)`; returns (state, losses).
    Batches as `sft_batches` makes them (`group_by_length`, `width_multiple`); either way
    the loss per step is the global token mean over the batch's trained tokens.

    Resuming: `start_epoch` epochs are already in `state` (their `losses` given); their
    shuffles are drawn and skipped, so the run continues exactly as if uninterrupted.
    `on_epoch(epochs_done, state, losses)` is called after each epoch (to checkpoint).
    `mesh`: each batch's rows over its data x fsdp axes (the RL learner's layout).

    The step skips an update whose loss, gradient or updated parameters are not finite
    (the state is left as it was); after `max_consecutive_skips` skipped steps in a row
    `NonFiniteUpdatesError` stops the warm start (e.g. an infinite learning rate), as does
    a warm start whose every step was skipped, so no model that never trained, or a NaN
    one, is saved as its result."""
    from spopp_jax.learner import SkipGuard, TrainBatch
    from spopp_jax.sharding import place_batch

    if not 0 <= start_epoch <= epochs:
        raise ValueError(f"start_epoch must be in [0, {epochs}], got {start_epoch}")
    rng = np.random.default_rng(seed)
    guard = SkipGuard(max_consecutive_skips)
    losses = list(losses)
    steps_before = len(losses)
    step = len(losses)
    for epoch in range(epochs):
        batches = sft_batches(examples, batch_size, rng, pad_id, group_by_length, width_multiple)
        if epoch < start_epoch:
            for _ in batches:  # draw this epoch's shuffle: later epochs see the same ones
                pass
            continue
        for arrays in batches:
            batch = TrainBatch(**arrays)
            state, metrics = sft_step(state, batch if mesh is None else place_batch(batch, mesh))
            if "skipped_updates" in metrics:
                guard.observe(metrics)
            loss = float(metrics["loss"])
            losses.append(loss)
            if on_step is not None:
                on_step(step, {k: float(v) for k, v in metrics.items()})
            step += 1
        if on_epoch is not None:
            on_epoch(epoch + 1, state, losses)
    ran = step - steps_before
    if ran and guard.total >= ran:
        from spopp_jax.learner import NonFiniteUpdatesError

        raise NonFiniteUpdatesError(f"warm start: all {ran} SFT steps had a non-finite loss, gradient or "
                                    "updated parameters and were skipped (check warmstart.learning_rate)")
    return state, losses
