"""Does a warm-started policy read the ALFWorld action list? Teacher-forced reply accuracy
on demonstrations of games it never trained on (cheap: one forward pass per game, no
rollouts), with transformers' PyTorch model as the reference implementation.

    python benchmarks/alfworld_reply_accuracy.py --model runs/aw_cmdnum/warmstart_model \
        --games artifacts/alfworld_games/alfworld_heldout_... [--command_numbers]

For every turn of every game's walkthrough, given the teacher's history (tokenized as the
agent loop does, `rollout_bridge.warmstart.demonstration_example`), the greedy reply is
the argmax token at every reply position. Printed (fractions of turns):

  reply exact      every reply token is the argmax (the turn would be played right);
  command part     with `--command_numbers`: the tokens before " = <k>" all right;
  number           the number's tokens right (teacher-forced after the teacher's command);
  number & command both; "number | command" = that over the turns with the command right:
                   the copy of the number listed after that command (an induction-head copy);
  number chance    mean over turns of 1 / (commands listed): a policy that ignores the list.

A number-only format (`numbered_actions`) has no command part: its number accuracy is the
reply accuracy, and chance is what a prompt-blind policy gets.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
from _hardware import cpu_model

from rollout_bridge.envs.alfworld_env import NUMBER_SEPARATOR, AlfworldTasks
from rollout_bridge.envs.textworld_env import ObservationStyle


def reply_spans(action_mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of True in `action_mask` (one reply + its stop token)."""
    spans, start = [], None
    for i, on in enumerate(list(action_mask) + [False]):
        if on and start is None:
            start = i
        elif not on and start is not None:
            spans.append((start, i))
            start = None
    return spans


def number_start(tokenizer, reply_ids: list[int]) -> int:
    """Index of the first token of the number in a "<command> = <k>" reply's ids (the
    shortest prefix whose text ends with the separator); len(reply_ids) if none."""
    for i in range(1, len(reply_ids) + 1):
        if tokenizer.decode(reply_ids[:i]).endswith(NUMBER_SEPARATOR.rstrip()):
            return i
    return len(reply_ids)


def game_counts(model, chat, tasks, task_id: int, command_numbers: bool) -> np.ndarray:
    """[turns, reply exact, command right, number right, number right & command right,
    sum of 1/len(list)] for one game's walkthrough."""
    import torch

    from rollout_bridge.warmstart import demonstration_example

    pairs = tasks.demonstration(task_id)
    example = demonstration_example(chat, pairs)
    ids = torch.tensor([example.token_ids])
    with torch.no_grad():
        predicted = model(ids).logits[0].argmax(-1).numpy()
    targets = np.asarray(example.token_ids)
    counts = np.zeros(6)
    for (start, end), (observation, _) in zip(reply_spans(np.asarray(example.action_mask)), pairs):
        right = predicted[start - 1:end - 1] == targets[start:end]    # position t predicts t+1
        reply = list(targets[start:end - 1])                          # without the stop token
        split = number_start(chat.tokenizer, reply) if command_numbers else 0
        command_ok, number_ok = bool(right[:split].all()), bool(right[split:].all())
        listed = observation.rsplit("Actions: ", 1)[-1].count(" | ") + 1
        counts += [1, right.all(), command_ok, number_ok, number_ok and command_ok, 1.0 / listed]
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a warm-start model folder (HF format)")
    parser.add_argument("--games", required=True, help="a folder of game.tw-pddl games")
    parser.add_argument("--command_numbers", action="store_true")
    parser.add_argument("--max_feedback_chars", type=int, default=240)
    parser.add_argument("--max_turns", type=int, default=12)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout_bridge.agent import ChatFormat

    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    chat = ChatFormat.from_tokenizer(AutoTokenizer.from_pretrained(args.model))
    tasks = AlfworldTasks.from_folder(Path(args.games), args.max_turns,
                                      ObservationStyle(args.max_feedback_chars, numbered_actions=True),
                                      command_numbers=args.command_numbers)
    per_game = np.stack([game_counts(model, chat, tasks, t, args.command_numbers)
                         for t in range(tasks.num_tasks)])
    turns = per_game[:, 0].sum()
    print(f"{cpu_model()}, {os.cpu_count()} cores, "
          f"1-min load average {os.getloadavg()[0]:.1f}")
    print(f"{args.model} on {tasks.num_tasks} games, {int(turns)} teacher turns "
          f"({'command = number' if args.command_numbers else 'number'} replies)")
    names = ("reply exact", "command part", "number", "number & command", "number chance")
    for column, name in enumerate(names, start=1):
        rates = per_game[:, column] / per_game[:, 0]
        se = rates.std(ddof=1) / np.sqrt(len(rates))
        print(f"  {name:17s} {per_game[:, column].sum() / turns:.3f} ± {se:.3f} (SE over games)")
    commands_right = per_game[:, 2].sum()
    if args.command_numbers and commands_right:
        print(f"  number | command  {per_game[:, 4].sum() / commands_right:.3f} "
              f"({int(commands_right)} turns with the command right)")


if __name__ == "__main__":
    main()
