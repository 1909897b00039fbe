"""The multi-turn agent loop: verbatim token ids, action masks, limits, failures; packing."""

import numpy as np
import pytest

from rollout_bridge.agent import AgentConfig, ChatFormat, run_episode
from rollout_bridge.engine.base import SamplingParams
from rollout_bridge.engine.fake import FakeEngine, ScriptedReply, run_virtual
from rollout_bridge.envs.synthetic import AsyncSyntheticEnv, SyntheticEnv, make_task
from rollout_bridge.tokenizer import build_tiny_tokenizer
from rollout_bridge.trajectory import DispatchStamp, Trajectory, pack_train_arrays

CORPUS = ["Round 1 of 3, say: apple river stone cloud tiger lemon piano rocket garden"] * 30

# A Qwen2.5-like template: a default system turn when none is given.
QWEN_LIKE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tiny_tokenizer(CORPUS, tmp_path_factory.mktemp("tok"), vocab_size=400)


def _stamp(task_id=0):
    return DispatchStamp(request_id=7, task_id=task_id, policy_event=3, z=0.4, frozen_baseline=0.25, dispatch_time=0.0)


def char_ids(tokenizer, word):
    """One byte-level token per character: a valid, NON-canonical encoding of ``word``."""
    return [tokenizer.convert_tokens_to_ids(c) for c in word]


def answering_script(tokenizer, chat, latency=1.0, wrong_rounds=()):
    """Reply with the target word of the latest observation, spelled char by char."""

    def script(request):
        text = tokenizer.decode(list(request.prompt_ids))
        word = text.rsplit("say: ", 1)[1].split("<|im_end|>")[0]
        if request.index in wrong_rounds:
            word = "zebra"
        ids = char_ids(tokenizer, word) + [chat.stop_token_ids[0]]
        logprobs = [-0.1 * (request.index + 1) - 0.01 * k for k in range(len(ids))]
        return ScriptedReply(tuple(ids), tuple(logprobs), latency=latency * (request.index + 1))

    return script


def test_chat_format_pieces_come_from_the_template(tokenizer):
    chat = ChatFormat.from_tokenizer(tokenizer)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert chat.stop_token_ids == (im_end,)
    assert tokenizer.decode(list(chat.turn_close_ids)) == "<|im_end|>\n"
    assert tokenizer.decode(chat.observation_turn_ids("hi")) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert chat.close_ids([5, im_end]) == list(chat.turn_close_ids[1:])
    assert chat.close_ids([5]) == list(chat.turn_close_ids)


@pytest.mark.parametrize("template", [None, QWEN_LIKE], ids=["chatml", "qwen-default-system"])
def test_history_is_the_exact_concatenation_of_ids_never_retokenized(tokenizer, template):
    if template is not None:
        tokenizer = build_tiny_tokenizer(CORPUS, "/tmp/agent_test_tok_qwen_like", vocab_size=400)
        tokenizer.chat_template = template
    chat = ChatFormat.from_tokenizer(tokenizer)
    engine = FakeEngine(answering_script(tokenizer, chat))
    env = SyntheticEnv(num_tasks=8, max_turns=3)
    traj = run_virtual(run_episode(engine, env, chat, _stamp(task_id=2), AgentConfig(max_turns=5)))
    task = make_task(2, max_turns=3)
    assert traj.reward == 1.0 and not (traj.failed or traj.truncated or traj.aborted)
    assert traj.num_turns == 3

    # Rebuild the expected stream by hand from the pieces the loop must use.
    observations = [SyntheticEnv(num_tasks=8, max_turns=3).reset(2)]
    replies = [char_ids(tokenizer, w) + [chat.stop_token_ids[0]] for w in task.words]
    for r in range(1, 3):
        observations.append("Correct. " + _round_text(2, r))
    messages = [{"role": "user", "content": observations[0]}]
    expected = list(_ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)))
    expected_mask = [False] * len(expected)
    prompts = [list(expected)]
    for turn, reply in enumerate(replies):
        expected += reply
        expected_mask += [True] * len(reply)
        if turn + 1 < len(replies):
            context = list(chat.turn_close_ids[1:]) + chat.observation_turn_ids(observations[turn + 1])
            expected += context
            expected_mask += [False] * len(context)
            prompts.append(list(expected))
    assert list(traj.token_ids) == expected
    assert list(traj.action_mask) == expected_mask
    assert [list(r.request.prompt_ids) for r in engine.records] == prompts
    # The sampled ids are non-canonical: re-tokenizing the decoded text would change them.
    assert tokenizer.encode(tokenizer.decode(expected), add_special_tokens=False) != expected

    # The stream renders exactly like the template over the whole conversation.
    for turn, word in enumerate(task.words):
        messages.append({"role": "assistant", "content": word})
        if turn + 1 < len(task.words):
            messages.append({"role": "user", "content": observations[turn + 1]})
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    assert tokenizer.decode(list(traj.token_ids)) + "\n" == full


def _round_text(task_id, round_index):
    from rollout_bridge.envs.synthetic import render_observation

    return render_observation(make_task(task_id, max_turns=3), round_index)


def _ids(encoded):
    return encoded["input_ids"] if hasattr(encoded, "keys") else encoded


def test_action_mask_and_logprobs_align_with_sampled_tokens(tokenizer):
    chat = ChatFormat.from_tokenizer(tokenizer)
    engine = FakeEngine(answering_script(tokenizer, chat))
    traj = run_virtual(run_episode(engine, AsyncSyntheticEnv(num_tasks=8, max_turns=3), chat, _stamp(1)))
    sampled = [tok for rec in engine.records for tok in rec.result.token_ids]
    logprobs = [lp for rec in engine.records for lp in rec.result.logprobs]
    mask = np.array(traj.action_mask)
    assert list(np.array(traj.token_ids)[mask]) == sampled
    assert np.allclose(np.array(traj.rollout_logp)[mask], logprobs)
    assert np.all(np.array(traj.rollout_logp)[~mask] == 0.0)
    assert traj.num_action_tokens == len(sampled)
    assert traj.prompt_length == len(engine.records[0].request.prompt_ids)
    assert traj.turn_latencies == (1.0, 2.0)  # scripted latency: 1 s x request index + 1
    assert traj.turn_policy_events == (0, 0) and traj.finish_reasons == ("stop", "stop")
    assert (traj.task_id, traj.policy_event, traj.z, traj.frozen_baseline) == (1, 3, 0.4, 0.25)


def test_max_turns_truncates_with_zero_reward(tokenizer):
    chat = ChatFormat.from_tokenizer(tokenizer)
    engine = FakeEngine(answering_script(tokenizer, chat))
    traj = run_virtual(
        run_episode(engine, SyntheticEnv(num_tasks=8, max_turns=3), chat, _stamp(2), AgentConfig(max_turns=2))
    )
    assert traj.truncated and traj.reward == 0.0 and traj.num_turns == 2 and not traj.failed


def test_max_total_tokens_caps_the_stream(tokenizer):
    chat = ChatFormat.from_tokenizer(tokenizer)
    engine = FakeEngine(answering_script(tokenizer, chat))
    prompt_len = len(chat.prompt_ids(SyntheticEnv(num_tasks=8, max_turns=3).reset(2)))
    limit = prompt_len + 3  # room for 3 sampled tokens only
    config = AgentConfig(max_turns=5, max_total_tokens=limit, sampling=SamplingParams(max_new_tokens=64))
    traj = run_virtual(run_episode(engine, SyntheticEnv(num_tasks=8, max_turns=3), chat, _stamp(2), config))
    assert engine.records[0].request.params.max_new_tokens == 3
    assert len(traj.token_ids) <= limit
    assert traj.finish_reasons == ("length",)
    assert traj.reward == 0.0 and traj.truncated


def test_wrong_answer_ends_episode_with_reward_zero(tokenizer):
    chat = ChatFormat.from_tokenizer(tokenizer)
    engine = FakeEngine(answering_script(tokenizer, chat, wrong_rounds=(1,)))
    traj = run_virtual(run_episode(engine, SyntheticEnv(num_tasks=8, max_turns=3), chat, _stamp(2)))
    assert traj.reward == 0.0 and traj.num_turns == 2 and not traj.truncated and not traj.failed


def test_env_fault_is_a_recorded_failure(tokenizer):
    chat = ChatFormat.from_tokenizer(tokenizer)
    env = SyntheticEnv(num_tasks=8, max_turns=3, fault=lambda task, call: call == 1)
    traj = run_virtual(run_episode(FakeEngine(answering_script(tokenizer, chat)), env, chat, _stamp(2)))
    assert traj.failed and traj.reward == 0.0 and "EnvFault" in traj.error and "call 1" in traj.error
    assert traj.num_action_tokens > 0  # the reply before the fault is kept for inspection


def test_env_timeout_is_a_recorded_failure(tokenizer):
    chat = ChatFormat.from_tokenizer(tokenizer)
    env = AsyncSyntheticEnv(num_tasks=8, latency=lambda task, call: 100.0 if call == 0 else 0.0)
    config = AgentConfig(env_timeout_s=5.0)
    traj = run_virtual(run_episode(FakeEngine(answering_script(tokenizer, chat)), env, chat, _stamp(0), config))
    assert traj.failed and "timed out" in traj.error and traj.token_ids.size == 0
    assert traj.env_latencies == (5.0,)


def test_engine_abort_marks_trajectory_aborted(tokenizer):
    chat = ChatFormat.from_tokenizer(tokenizer)
    engine = FakeEngine(answering_script(tokenizer, chat, latency=50.0))

    async def main():
        import asyncio

        episode = asyncio.ensure_future(run_episode(engine, SyntheticEnv(num_tasks=8), chat, _stamp(0)))
        await asyncio.sleep(10.0)
        await engine.abort_all()
        return await episode

    traj = run_virtual(main())
    assert traj.aborted and not traj.usable and traj.finish_reasons == ("abort",)


def _traj(n_prompt, n_reply, reward, logp=-0.5):
    ids = tuple(range(1, n_prompt + n_reply + 1))
    mask = (False,) * n_prompt + (True,) * n_reply
    lp = (0.0,) * n_prompt + (logp,) * n_reply
    return Trajectory(_stamp(), ids, mask, lp, n_prompt, reward, finish_time=1.0)


def test_pack_train_arrays_pads_and_aligns():
    trajs = [_traj(3, 2, 1.0, -0.5), _traj(2, 4, 0.0, -1.5)]
    arrays = pack_train_arrays(trajs, [0.7, -0.7], pad_to_multiple=4, pad_id=9)
    assert {k: v.shape for k, v in arrays.items()} == {k: (2, 8) for k in arrays}
    assert arrays["input_ids"].dtype == np.int32 and arrays["rollout_logp"].dtype == np.float32
    assert arrays["input_ids"][0].tolist() == [1, 2, 3, 4, 5, 9, 9, 9]
    assert arrays["attention_mask"][1].tolist() == [True] * 6 + [False] * 2
    assert arrays["action_mask"][0].tolist() == [False] * 3 + [True] * 2 + [False] * 3
    assert arrays["rollout_logp"][1].tolist() == [0, 0, -1.5, -1.5, -1.5, -1.5, 0, 0]
    assert np.allclose(arrays["advantages"][0], [0.7] * 5 + [0] * 3)
    assert not arrays["action_mask"][:, 0].any()


def test_pack_train_arrays_validates_inputs():
    trajs = [_traj(3, 2, 1.0)]
    with pytest.raises(ValueError, match="advantages"):
        pack_train_arrays(trajs, [0.1, 0.2])
    with pytest.raises(ValueError, match="advantages"):
        pack_train_arrays(trajs, [np.nan])
    with pytest.raises(ValueError, match="max_length"):
        pack_train_arrays(trajs, [0.1], max_length=4)
    with pytest.raises(ValueError, match="non-empty"):
        pack_train_arrays([], [])
    with pytest.raises(ValueError, match="position 0"):
        Trajectory(_stamp(), (1, 2), (True, False), (0.0, 0.0), 0, 0.0, 0.0)


def test_env_is_closed_after_the_episode(tokenizer):
    closed = []

    class Closing(SyntheticEnv):
        def close(self):
            closed.append(True)

    chat = ChatFormat.from_tokenizer(tokenizer)
    engine = FakeEngine(answering_script(tokenizer, chat))
    run_virtual(run_episode(engine, Closing(num_tasks=8), chat, _stamp(0)))
    faulty = Closing(num_tasks=8, fault=lambda task, call: call == 1)
    traj = run_virtual(run_episode(engine, faulty, chat, _stamp(0)))
    assert traj.failed and closed == [True, True]


def test_sync_env_timeout_on_a_real_loop_is_a_recorded_failure(tokenizer):
    import time

    class Slow(SyntheticEnv):
        def step(self, action_text):
            time.sleep(0.3)
            return super().step(action_text)

    chat = ChatFormat.from_tokenizer(tokenizer)
    engine = FakeEngine(answering_script(tokenizer, chat, latency=0.0))
    import asyncio

    traj = asyncio.run(run_episode(engine, Slow(num_tasks=8), chat, _stamp(0), AgentConfig(env_timeout_s=0.05)))
    assert traj.failed and "timed out after 0.05s" in traj.error and traj.num_turns == 1


def test_engine_contract_types_validate_their_fields():
    from rollout_bridge.engine.base import GenerationResult

    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="equal length"):
        GenerationResult((1, 2), (0.0,), "stop", 0)
    with pytest.raises(ValueError, match="finish_reason"):
        GenerationResult((), (), "done", 0)
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


def test_fake_engine_applies_stop_tokens_length_and_abort():
    engine = FakeEngine(lambda request: ScriptedReply((5, 6, 7, 8), (-1.0, -2.0, -3.0, -4.0), latency=2.0))

    async def main():
        import asyncio

        stop = await engine.generate([1], SamplingParams(stop_token_ids=(7,)))
        length = await engine.generate([1], SamplingParams(max_new_tokens=2))
        pending = asyncio.ensure_future(engine.generate([1], SamplingParams()))
        await asyncio.sleep(1.0)
        await engine.abort_all()
        await engine.publish("w", 4)
        later = await engine.generate([1], SamplingParams())
        return stop, length, await pending, later

    stop, length, aborted, later = run_virtual(main())
    assert (stop.token_ids, stop.logprobs, stop.finish_reason) == ((5, 6, 7), (-1.0, -2.0, -3.0), "stop")
    assert (length.token_ids, length.finish_reason) == ((5, 6), "length")
    assert (aborted.token_ids, aborted.finish_reason, aborted.policy_event) == ((), "abort", 0)
    assert later.policy_event == 4 and engine.published == [(4, "w")]
    assert [r.finish_time - r.start_time for r in engine.records] == [2.0, 2.0, 1.0, 2.0]
