"""Warm start and prior: demonstrations tokenized exactly as the agent loop would produce
them, SFT on action tokens only, the Jeffreys prior file, success counting, metrics files."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import numpy as np
import pytest

from rollout_bridge.agent import AgentConfig, ChatFormat, run_episode
from rollout_bridge.engine.base import SamplingParams
from rollout_bridge.engine.fake import FakeEngine, ScriptedReply
from rollout_bridge.envs.textworld_env import ObservationStyle, TextWorldEnv, TextWorldTasks
from rollout_bridge.envs.textworld_games import GameSetSpec, generate_game_set
from rollout_bridge.metrics import MetricsWriter, plot_learning_curve, read_metrics, trailing_mean
from rollout_bridge.atomic_files import write_json_atomic
from rollout_bridge.prior import prior_record, read_prior_file, rollout_successes
from rollout_bridge.tokenizer import build_tiny_tokenizer
from rollout_bridge.trajectory import DispatchStamp
from rollout_bridge.warmstart import (
    demonstration_example,
    SFTExample,
    epoch_batches,
    length_grouped_batches,
    pack_sft_batch,
    run_sft,
    sft_examples,
)

SPEC = GameSetSpec("ws", num_games=2, base_seed=3, world_size=2, nb_objects=3, quest_length=2)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    files = generate_game_set(SPEC, tmp_path_factory.mktemp("games"))
    return TextWorldTasks(files, files[0].parent, max_turns=4,
                          style=ObservationStyle(max_feedback_chars=80, numbered_actions=True))


@pytest.fixture(scope="module")
def chat(tasks, tmp_path_factory):
    corpus = [o + "\n" + a for t in range(tasks.num_tasks) for o, a in tasks.demonstration(t)]
    tokenizer = build_tiny_tokenizer(corpus, tmp_path_factory.mktemp("tok"), vocab_size=400)
    return ChatFormat.from_tokenizer(tokenizer)


def _scripted_engine(chat, replies):
    """Types `replies` in order (as the tokenizer encodes them) followed by the stop token."""
    stop = chat.turn_close_ids[0]
    return FakeEngine(lambda request: ScriptedReply(tuple(chat.encode(replies[request.index])) + (stop,)))


def test_demonstration_matches_the_agent_loop_token_for_token(tasks, chat):
    for task_id in range(tasks.num_tasks):
        pairs = tasks.demonstration(task_id)
        example = demonstration_example(chat, pairs)
        engine = _scripted_engine(chat, [reply for _, reply in pairs])
        stamp = DispatchStamp(0, task_id, 0, 0.0, 0.5, 0.0)
        config = AgentConfig(max_turns=4, max_total_tokens=4096,
                             sampling=SamplingParams(max_new_tokens=32))
        trajectory = asyncio.run(run_episode(engine, TextWorldEnv(tasks), chat, stamp, config))
        assert trajectory.reward == 1.0 and not trajectory.failed
        assert example.token_ids == tuple(trajectory.token_ids.tolist())  # Trajectory holds arrays
        assert example.action_mask == tuple(trajectory.action_mask.tolist())
        # the action tokens are exactly the replies + one stop token per turn
        expected = sum(len(chat.encode(reply)) + 1 for _, reply in pairs)
        assert sum(example.action_mask) == expected == trajectory.num_action_tokens


def test_loss_on_all_tokens_trains_every_token_but_the_first(tasks, chat):
    pairs = tasks.demonstration(0)
    replies_only = demonstration_example(chat, pairs, "all_assistant")
    every = demonstration_example(chat, pairs, "all_tokens")
    assert every.token_ids == replies_only.token_ids
    assert every.action_mask == (False,) + (True,) * (len(every.token_ids) - 1)
    last_only = demonstration_example(chat, pairs, "final_message")
    assert 0 < sum(last_only.action_mask) < sum(replies_only.action_mask) < sum(every.action_mask)
    with pytest.raises(ValueError, match="loss_on"):
        demonstration_example(chat, pairs, "observations")


def test_pack_and_batches(tasks, chat):
    examples = sft_examples(tasks, chat)
    arrays = pack_sft_batch(examples, pad_id=chat.tokenizer.pad_token_id, width=512)
    assert arrays["input_ids"].shape == (len(examples), 512)
    for row, example in enumerate(examples):
        n = len(example.token_ids)
        assert arrays["attention_mask"][row].sum() == n
        assert arrays["action_mask"][row].sum() == sum(example.action_mask)
        assert not arrays["action_mask"][row, n:].any()
    with pytest.raises(ValueError, match="width"):
        pack_sft_batch(examples, pad_id=0, width=4)
    # a shuffled epoch covers every example, in full batches
    seen = [id(e) for batch in epoch_batches(examples * 3, 4, np.random.default_rng(0))
            for e in batch]
    assert len(seen) == 8 and {id(e) for e in examples} <= set(seen)


def _examples_of_lengths(lengths) -> list[SFTExample]:
    return [SFTExample(tuple(range(1, n + 1)), (False,) + (True,) * (n - 1)) for n in lengths]


def test_length_grouped_batches_cover_every_example_in_full_batches_of_similar_length():
    lengths = np.random.default_rng(1).integers(20, 900, size=45)
    examples = _examples_of_lengths(lengths)
    grouped = list(length_grouped_batches(examples, 4, np.random.default_rng(0), group_batches=4))
    assert len(grouped) == 12 and all(len(batch) == 4 for batch in grouped)   # 45 -> 48 rows: top-up
    seen = [id(e) for batch in grouped for e in batch]
    assert {id(e) for e in examples} == set(seen)
    # the same rows as the plain pass of the same seed (only regrouped)
    plain = [id(e) for batch in epoch_batches(examples, 4, np.random.default_rng(0)) for e in batch]
    assert sorted(seen) == sorted(plain)
    # fewer pad tokens: each batch padded to its own longest vs the plain batches' longest
    padded_grouped = sum(4 * max(len(e.token_ids) for e in batch) for batch in grouped)
    padded_plain = sum(4 * max(len(e.token_ids) for e in batch)
                       for batch in epoch_batches(examples, 4, np.random.default_rng(0)))
    assert padded_grouped < 0.85 * padded_plain
    # the order of the batches is shuffled (not longest first) and depends on the seed
    first_lengths = [len(batch[0].token_ids) for batch in grouped]
    assert first_lengths != sorted(first_lengths, reverse=True)
    other = list(length_grouped_batches(examples, 4, np.random.default_rng(1), group_batches=4))
    assert [id(e) for b in other for e in b] != seen
    with pytest.raises(ValueError, match="group_batches"):
        next(length_grouped_batches(examples, 4, np.random.default_rng(0), group_batches=0))
    for layout in (epoch_batches, length_grouped_batches):
        with pytest.raises(ValueError, match="batch_size"):
            next(layout(examples, 0, np.random.default_rng(0)))


def test_run_sft_grouped_by_length_pads_each_batch_to_its_longest_and_resumes_exactly():
    examples = _examples_of_lengths([40, 300, 50, 290, 45, 310, 60, 280])
    widths, firsts = [], []

    def step(state, batch):
        widths.append(batch.input_ids.shape[1])
        firsts.append(int(np.asarray(batch.attention_mask).sum()))
        return 0.5 * state + firsts[-1], {"loss": state}

    kwargs = dict(epochs=3, batch_size=2, pad_id=0, seed=5, group_by_length=True, width_multiple=64)
    saved = {}
    full_state, full_losses = run_sft(step, 0.0, examples, **kwargs,
                                      on_epoch=lambda e, s, ls: saved.setdefault(e, (s, list(ls))))
    assert widths.count(64) == widths.count(320) == 6   # short pairs and long pairs, never mixed
    assert len(full_losses) == 3 * 4
    state1, losses1 = saved[1]
    resumed_state, resumed_losses = run_sft(step, state1, examples, **kwargs, start_epoch=1, losses=losses1)
    assert resumed_losses == full_losses and resumed_state == full_state
    widths.clear()
    run_sft(step, 0.0, examples, **{**kwargs, "group_by_length": False})
    assert set(widths) == {320}                  # the data set's longest, rounded to 32


def test_stage_key_keys_group_by_length_only_for_a_warm_start_trained_with_it():
    from rollout_bridge.run_folder import stage_key
    from rollout_bridge.config import TrainConfig

    def key(**warmstart):
        cfg = TrainConfig()
        cfg = dataclasses.replace(cfg, warmstart=dataclasses.replace(cfg.warmstart, **warmstart))
        return stage_key(cfg, "warmstart", "prior")

    assert "group_by_length" in key(enabled=True, group_by_length=True)["warmstart"]
    assert "group_by_length" not in key(enabled=True, group_by_length=False)["warmstart"]
    assert "group_by_length" not in key(enabled=False, group_by_length=True)["warmstart"]
    assert key(enabled=True, group_by_length=True) != key(enabled=True, group_by_length=False)
    assert key(enabled=False, group_by_length=True) == key(enabled=False, group_by_length=False)


def _numpy_action_nll(logits, input_ids, action_mask) -> float:
    """float64 reference: -sum over action tokens of log softmax(logits[t-1])[x_t] / count."""
    logits = np.asarray(logits, np.float64)[:, :-1]
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    targets = np.asarray(input_ids)[:, 1:]
    picked = np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    mask = np.asarray(action_mask)[:, 1:]
    return float(-(picked * mask).sum() / mask.sum())


def test_sft_loss_is_action_token_nll_and_falls(tasks, chat):
    from spopp_jax.learner import LearnerConfig, TrainBatch, init_train_state, make_sft_step
    from spopp_jax.models import ModelConfig, init_model

    config = ModelConfig(vocab_size=len(chat.tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, tie_word_embeddings=True)
    learner_config = LearnerConfig(num_mini_batches=1, num_micro_batches=1, action_logits_fraction=None,
                                   learning_rate=1e-2, weight_decay=0.0)
    model_def, state = init_train_state(init_model(config, seed=0), learner_config)
    examples = sft_examples(tasks, chat)
    assert len(examples) == 2
    batch = TrainBatch(**pack_sft_batch(examples, chat.tokenizer.pad_token_id))
    logits = model_def.apply(state.params, batch.input_ids, batch.attention_mask)
    reference = _numpy_action_nll(logits, batch.input_ids, batch.action_mask)
    # batch_size 2 = both examples in every step; step 0's loss is at the initial params
    state, losses = run_sft(make_sft_step(model_def, learner_config), state, examples,
                            epochs=12, batch_size=2, pad_id=chat.tokenizer.pad_token_id)
    assert len(losses) == 12
    assert losses[0] == pytest.approx(reference, rel=1e-4)
    assert losses[-1] < 0.5 * losses[0]


def test_prior_record_is_jeffreys_with_mass_8(tmp_path):
    successes, trials = [3, 0, 8, 0], [8, 8, 8, 0]
    record = prior_record(successes, trials, mass=8.0)
    # SPEC 2: alpha0 = M (s + 1/2)/(n + 1), beta0 = M (n - s + 1/2)/(n + 1); n = 0 -> 1/2, 1/2
    assert record["alpha0"] == pytest.approx([8 * 3.5 / 9, 8 * 0.5 / 9, 8 * 8.5 / 9, 0.5])
    assert record["beta0"] == pytest.approx([8 * 5.5 / 9, 8 * 8.5 / 9, 8 * 0.5 / 9, 0.5])
    assert record["success_rate"] == pytest.approx(11 / 24)
    path = write_json_atomic(tmp_path / "prior.json", record)
    alpha0, beta0 = read_prior_file(path, 4)
    assert alpha0.dtype == np.float32 and alpha0[0] == pytest.approx(8 * 3.5 / 9)
    with pytest.raises(ValueError, match="3"):
        read_prior_file(path, 3)


def test_rollout_successes_counts_wins(tasks, chat):
    """Task 0 gets its walkthrough (wins), task 1 types junk (never wins)."""
    demo = [reply for _, reply in tasks.demonstration(0)]
    stop = chat.turn_close_ids[0]

    def script(request):
        text = chat.tokenizer.decode(list(request.prompt_ids))
        is_task0 = tasks.episode(0).reset().split("\n")[0] in text
        turn = text.count("<|im_start|>assistant") - 1
        reply = demo[min(turn, len(demo) - 1)] if is_task0 else "xyzzy"
        return ScriptedReply(tuple(chat.encode(reply)) + (stop,))

    config = AgentConfig(max_turns=4, max_total_tokens=4096,
                         sampling=SamplingParams(max_new_tokens=32))
    successes, trials = asyncio.run(rollout_successes(
        FakeEngine(script), lambda: TextWorldEnv(tasks), chat, tasks.num_tasks, 3, config,
        max_concurrency=2))
    assert trials.tolist() == [3, 3] and successes.tolist() == [3, 0]


def test_trailing_mean_against_loop():
    values = np.random.default_rng(0).random(23)
    for window in (1, 3, 5, 30):
        expected = [np.mean(values[max(0, t - window + 1):t + 1]) for t in range(len(values))]
        np.testing.assert_allclose(trailing_mean(values, window), expected, rtol=1e-12)
    with pytest.raises(ValueError, match="window"):
        trailing_mean(values, 0)


def test_metrics_writer_resume_sets_aside_rows_after_checkpoint(tmp_path, capsys):
    with MetricsWriter(tmp_path, tensorboard=True) as writer:
        for step in range(1, 6):
            writer.write(step, {"success_rate": step / 10, "flag": True, "text": "ignored",
                                "nan": float("nan")})
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[0] == {"step": 1, "success_rate": 0.1, "flag": 1}
    assert list((tmp_path / "tb").iterdir())
    # a crash after step 5, resumed from the checkpoint of step 3: steps 4, 5 are redone
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "succ')                       # torn last line
    with MetricsWriter(tmp_path, tensorboard=False, resume_step=3) as writer:
        writer.write(4, {"success_rate": 0.9})
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["success_rate"]) for r in rows] == [(1, .1), (2, .2), (3, .3), (4, .9)]
    # the rows of the work redone are kept, as written, one file per resume
    aside = tmp_path / "metrics_set_aside"
    assert read_metrics(aside / "after_step_3.jsonl") == [{"step": 4, "success_rate": 0.4, "flag": 1},
                                                          {"step": 5, "success_rate": 0.5, "flag": 1}]
    assert "rows of steps 4-5 (after checkpoint 3, about to be redone) set aside" in capsys.readouterr().out
    with MetricsWriter(tmp_path, tensorboard=False, resume_step=3):
        pass
    assert read_metrics(aside / "after_step_3-2.jsonl") == [{"step": 4, "success_rate": 0.9}]
    with MetricsWriter(tmp_path, tensorboard=False, resume_step=3):   # nothing after step 3: no file
        pass
    assert sorted(p.name for p in aside.iterdir()) == ["after_step_3-2.jsonl", "after_step_3.jsonl"]
    with MetricsWriter(tmp_path, tensorboard=False):   # RL starts over (no checkpoint): every row
        pass
    assert [r["step"] for r in read_metrics(aside / "after_step_0.jsonl")] == [1, 2, 3]
    assert "rows of steps 1-3 (no checkpoint: RL starts over, about to be redone)" in capsys.readouterr().out
    assert read_metrics(tmp_path / "metrics.jsonl") == []
    png = plot_learning_curve(rows, tmp_path / "curve.png",
                              reference_lines={"before": 0.25, "after": 0.5, "none": None})
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no rows"):
        plot_learning_curve([{"step": 1}], tmp_path / "x.png")
    json.dumps(rows)


def test_run_sft_resumed_after_an_epoch_continues_exactly(tasks, chat):
    """A toy step whose state depends on the order of the rows: resuming after epoch 2
    with that epoch's state and losses gives the uninterrupted run's state and losses."""
    examples = sft_examples(tasks, chat) * 3  # 6 examples, batches of 4: shuffles matter

    def step(state, batch):
        first = float(np.asarray(batch.input_ids)[:, :8].sum())
        return 0.5 * state + first, {"loss": state}

    kwargs = dict(epochs=4, batch_size=4, pad_id=chat.tokenizer.pad_token_id, seed=3)
    saved = {}
    full_state, full_losses = run_sft(step, 0.0, examples, **kwargs,
                                      on_epoch=lambda e, s, ls: saved.setdefault(e, (s, list(ls))))
    state2, losses2 = saved[2]
    resumed_state, resumed_losses = run_sft(step, state2, examples, **kwargs, start_epoch=2, losses=losses2)
    assert resumed_losses == full_losses and resumed_state == full_state
    assert len(full_losses) == 4 * 2
    wrong_state, _ = run_sft(step, state2, examples, **kwargs, start_epoch=0, losses=losses2)
    assert wrong_state != full_state  # the check can fail: restarting the shuffles differs
    with pytest.raises(ValueError, match="start_epoch"):
        run_sft(step, 0.0, examples, **kwargs, start_epoch=5)


def test_sft_checkpoints_restore_the_saved_epoch_and_drop_other_settings(tasks, chat, tmp_path):
    import jax

    from rollout_bridge.warmstart_stage import SFTCheckpoints
    from spopp_jax.learner import LearnerConfig, init_train_state, make_sft_step
    from spopp_jax.models import ModelConfig, init_model

    config = ModelConfig(vocab_size=len(chat.tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, tie_word_embeddings=True)
    learner_config = LearnerConfig(num_micro_batches=1, learning_rate=1e-2, weight_decay=0.0, num_mini_batches=1, action_logits_fraction=None)
    model_def, _ = init_train_state(init_model(config, seed=0), learner_config)

    def fresh_state():  # the SFT step donates its input state
        return init_train_state(init_model(config, seed=0), learner_config)[1]

    sft_step = make_sft_step(model_def, learner_config)
    examples = sft_examples(tasks, chat)
    kwargs = dict(epochs=3, batch_size=1, pad_id=chat.tokenizer.pad_token_id)
    full_state, full_losses = run_sft(sft_step, fresh_state(), examples, **kwargs)

    saved = SFTCheckpoints(tmp_path / "ckpt", "key-a", every_s=0.0)
    assert saved.restore(fresh_state(), 3)[1:] == ([], 0)  # nothing saved yet

    def crash_after_epoch_2(epochs_done, state, losses):
        saved.maybe_save(epochs_done, state, losses)
        if epochs_done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_sft(sft_step, fresh_state(), examples, **kwargs, on_epoch=crash_after_epoch_2)
    saved.close()
    again = SFTCheckpoints(tmp_path / "ckpt", "key-a")
    state, losses, done = again.restore(fresh_state(), 3)
    assert done == 2 and losses == pytest.approx(full_losses[:4])
    state, losses = run_sft(sft_step, state, examples, **kwargs, start_epoch=done, losses=losses)
    again.close()
    assert losses == pytest.approx(full_losses)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(full_state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)

    other = SFTCheckpoints(tmp_path / "ckpt", "key-b")  # other warm-start settings
    assert other.restore(fresh_state(), 3)[1:] == ([], 0)
    assert not (tmp_path / "ckpt").exists()
