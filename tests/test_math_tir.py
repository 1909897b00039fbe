"""Math-TIR: tool-call format, DAPO parquet loader, teacher filter, the
final-message loss mask token by token, and episodes through the agent loop with the real
sandbox and verifier."""

from __future__ import annotations

import asyncio
import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollout_bridge.agent import AgentConfig, ChatFormat, run_episode
from rollout_bridge.engine.fake import FakeEngine, ScriptedReply
from rollout_bridge.envs.kinds.math_tir import MathTIRConfig, math_tir_evaluations
from rollout_bridge.envs.math_tir import EpisodeRules, MathTIREnv, build_math_tir
from rollout_bridge.envs.math_tir.arithmetic import (
    ArithmeticSpec,
    expression_of,
    generate_problems,
    teacher_trajectories,
)
from rollout_bridge.envs.math_tir.tasks import MathTask, MathTaskSet, load_dapo_math
from rollout_bridge.envs.math_tir.teacher import demonstration_pairs, filter_teacher, structure_error
from rollout_bridge.envs.math_tir.tool_format import parse_call, render_call, render_response
from rollout_bridge.tokenizer import build_tiny_tokenizer
from rollout_bridge.tools import SandboxConfig, SandboxUnavailable
from rollout_bridge.trajectory import DispatchStamp
from rollout_bridge.warmstart import demonstration_example

# ---------------------------------------------------------------------------- tool format


@pytest.mark.parametrize("fmt", ["qwen", "plain"])
def test_tool_call_round_trip(fmt):
    code = 'x = {"a": 1}\nprint(x["a"] * 2)'
    reply = "Let me compute.\n" + render_call(code, fmt) + "\ntrailing"
    assert parse_call(reply, fmt).code == code
    assert parse_call("The answer is \\boxed{2}", fmt) is None


def test_qwen_tool_call_is_the_hermes_json_block():
    text = render_call("print(1)", "qwen")
    assert text == '<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>'
    assert parse_call('<tool_call>\n{"name": "python", "arguments": "{\\"code\\": \\"print(3)\\"}"}\n</tool_call>',
                      "qwen").code == "print(3)"


@pytest.mark.parametrize("reply, why", [
    ("<tool_call>\nprint(1)", "missing"),
    ("<tool_call>\nprint(1)\n</tool_call>", "not valid JSON"),
    ('<tool_call>\n{"name": "bash", "arguments": {"code": "ls"}}\n</tool_call>', "unknown tool"),
    ('<tool_call>\n{"name": "python", "arguments": {}}\n</tool_call>', "arguments.code"),
])
def test_malformed_qwen_calls_are_errors(reply, why):
    call = parse_call(reply, "qwen")
    assert call.code is None and why in call.error


# ---------------------------------------------------------------------------- DAPO loader


def write_dapo_parquet(path, rows):
    """A parquet file with DAPO-Math-17K's public schema."""
    table = pa.table({
        "data_source": ["math_dapo"] * len(rows),
        "prompt": [[{"content": p, "role": "user"}] for p, _, _ in rows],
        "ability": ["MATH"] * len(rows),
        "reward_model": [{"ground_truth": g, "style": "rule-lighteval/MATH_v2"} for _, g, _ in rows],
        "extra_info": [{"index": i} for _, _, i in rows],
    })
    pq.write_table(table, path)


DAPO_ROWS = [(f"Solve problem {k}. Remember to put your answer after \"Answer:\".", str(k * 7), f"id-{k}")
             for k in range(10)]


def test_dapo_loader_reads_the_public_schema(tmp_path):
    write_dapo_parquet(tmp_path / "dapo-math-17k.parquet", DAPO_ROWS + DAPO_ROWS[:3])  # the file repeats prompts
    everything = load_dapo_math(tmp_path, 0, seed=0)
    assert everything.num_tasks == 10  # duplicates dropped
    assert everything[3] == MathTask(DAPO_ROWS[3][0], "21", "id-3")
    chosen = load_dapo_math(tmp_path, 4, seed=5)
    again = load_dapo_math(tmp_path / "dapo-math-17k.parquet", 4, seed=5)
    assert chosen == again and chosen.num_tasks == 4
    keys = [t.key for t in chosen.tasks]
    assert keys == sorted(keys, key=lambda k: int(k.split("-")[1]))  # file order kept
    assert load_dapo_math(tmp_path, 4, seed=6) != chosen


def test_dapo_loader_errors_name_the_file_and_field(tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*.parquet"):
        load_dapo_math(tmp_path, 1, 0)
    pq.write_table(pa.table({"prompt": [[{"content": "x", "role": "user"}]]}), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="bad.parquet: missing column.*reward_model"):
        load_dapo_math(tmp_path, 1, 0)
    (tmp_path / "bad.parquet").unlink()
    write_dapo_parquet(tmp_path / "ok.parquet", DAPO_ROWS[:2])
    with pytest.raises(ValueError, match="env.num_games=5"):
        load_dapo_math(tmp_path, 5, 0)


def test_dapo_heldout_prompts_avoid_training_and_teacher_prompts(tmp_path):
    from rollout_bridge.envs.math_tir.env import TeacherDemonstrations, dapo_seen_prompts
    from rollout_bridge.envs.math_tir.tasks import load_dapo_heldout

    write_dapo_parquet(tmp_path / "dapo.parquet", DAPO_ROWS)
    train = load_dapo_math(tmp_path, 4, seed=1)
    demonstrated = next(p for p, _, _ in DAPO_ROWS if p not in {t.prompt for t in train.tasks})
    teacher = [{"key": "k", "ground_truth": "0",
                "messages": [{"role": "user", "content": demonstrated},
                             {"role": "assistant", "content": "Answer: 0"}]}]
    seen = dapo_seen_prompts(train, TeacherDemonstrations(teacher, "plain"))
    assert len(seen) == 5 and demonstrated in seen
    held = load_dapo_heldout(tmp_path, 5, seed=2, exclude_prompts=seen)
    assert held.num_tasks == 5 and not {t.prompt for t in held.tasks} & seen   # all 5 that are left
    assert load_dapo_heldout(tmp_path, 3, 2, seen) == load_dapo_heldout(tmp_path, 3, 2, seen)
    with pytest.raises(ValueError, match="env.heldout_games=6 held-out prompts asked for.*5 distinct"):
        load_dapo_heldout(tmp_path, 6, 2, seen)


# ---------------------------------------------------------------------------- arithmetic + teacher


def test_arithmetic_problems_are_seeded_and_disjoint():
    spec = ArithmeticSpec(min_operand=10, max_operand=999, operators=("*", "+"))
    train = generate_problems(20, 0, spec)
    assert train == generate_problems(20, 0, spec)
    warm = generate_problems(50, 1, spec, disjoint_from=train.tasks)
    assert not {t.prompt for t in train.tasks} & {t.prompt for t in warm.tasks}
    for task in train.tasks:
        assert str(eval(expression_of(task))) == task.ground_truth


def _python_stdout(code: str) -> str:
    """The teacher's tool stand-in for pure-logic tests (``print(a*b)`` only; a slipped
    digit may make a leading zero, which int() accepts)."""
    a, b = code[len("print("):-1].split("*")
    return str(int(a) * int(b))


def test_teacher_direct_answers_are_valid_records_and_only_the_slipped_ones_are_dropped():
    spec = ArithmeticSpec(slip_rate=0.2, direct_rate=0.4)
    tasks = generate_problems(400, 3, spec)
    records = teacher_trajectories(tasks, _python_stdout, "plain", 1, seed=0, slip_rate=spec.slip_rate,
                                   direct_rate=spec.direct_rate)
    direct = [r for r in records if len(r["messages"]) == 2]
    assert 0.3 < len(direct) / len(records) < 0.5  # 400 draws at 0.4: 5 standard errors either side
    assert all(structure_error(r, "plain", 2) is None for r in records)
    exact = lambda truth, text: float(text == f"\\boxed{{{truth}}}")  # noqa: E731
    right = [r for r in direct if exact(r["ground_truth"], r["messages"][-1]["content"])]
    assert 0.7 < len(right) / len(direct) < 0.9  # a slip always changes one digit
    train, held, report = filter_teacher(records, exact, "plain", max_tool_calls=2, held_out_fraction=0.0, seed=0)
    kept_direct = [r for r in train if len(r["messages"]) == 2]
    assert len(kept_direct) == len(right) and report.invalid == 0


def test_zero_direct_rate_leaves_the_teacher_stream_unchanged():
    """direct_rate 0 draws nothing extra: the records of earlier seeds are reproduced."""
    tasks = generate_problems(50, 1, ArithmeticSpec())
    old = teacher_trajectories(tasks, _python_stdout, "plain", 1, seed=5, slip_rate=0.3)
    assert old == teacher_trajectories(tasks, _python_stdout, "plain", 1, seed=5, slip_rate=0.3, direct_rate=0.0)
    assert all(len(r["messages"]) == 4 for r in old)
    with pytest.raises(ValueError, match="direct_rate"):
        ArithmeticSpec(direct_rate=1.5)


def _record(key, truth, code_output, final, fmt="plain"):
    return {"key": key, "ground_truth": truth, "messages": [
        {"role": "user", "content": "Compute 2*3."},
        {"role": "assistant", "content": render_call("print(2*3)", fmt)},
        {"role": "tool", "content": code_output},
        {"role": "assistant", "content": final}]}


def test_teacher_filter_keeps_valid_positive_records_and_splits_by_prompt():
    exact = lambda truth, text: float(text == f"\\boxed{{{truth}}}")  # noqa: E731
    records = [_record(f"p{k}", "6", "6", "\\boxed{6}") for k in range(10) for _ in range(2)]
    records += [_record("p0", "6", "7", "\\boxed{7}")]  # verifier-negative
    no_tool = _record("p1", "6", "6", "\\boxed{6}")
    no_tool["messages"] = no_tool["messages"][:1] + no_tool["messages"][3:]  # user, final answer
    broken = _record("p2", "6", "6", render_call("print(6)", "plain"))  # final message is a call
    train, held, report = filter_teacher(records + [broken], exact, "plain", max_tool_calls=8,
                                         held_out_fraction=0.2, seed=0)
    assert (report.read, report.invalid, report.verifier_negative) == (22, 1, 1)
    assert report.train_prompts == 8 and report.held_out_prompts == 2
    assert not {r["key"] for r in train} & {r["key"] for r in held}
    assert len(train) + len(held) == 20
    assert structure_error(no_tool, "plain", 8) is None  # answering without a tool is allowed
    too_many = _record("p3", "6", "6", "\\boxed{6}")
    too_many["messages"][1:1] = too_many["messages"][1:3]
    assert "2 tool calls > max_turns=1" in structure_error(too_many, "plain", 1)


def test_tool_calls_field_is_rendered_into_the_text_block():
    record = _record("k", "6", "6", "\\boxed{6}", fmt="qwen")
    record["messages"][1] = {"role": "assistant", "content": "",
                             "tool_calls": [{"type": "function", "function": {
                                 "name": "python", "arguments": json.dumps({"code": "print(2*3)"})}}]}
    assert structure_error(record, "qwen", 8) is None
    assert demonstration_pairs(record, "qwen")[0][1] == render_call("print(2*3)", "qwen")


# ---------------------------------------------------------------------------- loss mask


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    corpus = [f"Compute {a}*{b}.\n{render_call(f'print({a}*{b})', 'plain')}\n{render_response(str(a * b))}"
              f"\n\\boxed{{{a * b}}}" for a in range(100, 130) for b in (7, 11, 13)]
    tokenizer = build_tiny_tokenizer(corpus, tmp_path_factory.mktemp("tok"), vocab_size=400)
    return ChatFormat.from_tokenizer(tokenizer)


def test_final_message_loss_mask_token_by_token(chat):
    pairs = [("Compute 123*7.", render_call("print(123*7)", "plain")),
             (render_response("861"), "Check: " + render_call("print(861//7)", "plain")),
             (render_response("123"), "\\boxed{861}")]
    final = demonstration_example(chat, pairs, loss_on="final_message")
    every = demonstration_example(chat, pairs, loss_on="all_assistant")
    assert final.token_ids == every.token_ids
    stop = chat.turn_close_ids[0]
    # the expected stream, built piece by piece as the agent loop would
    pieces = [(chat.prompt_ids(pairs[0][0]), False, False)]
    for k, (_, reply) in enumerate(pairs):
        if k > 0:
            pieces.append((chat.close_ids(previous) + chat.observation_turn_ids(pairs[k][0]), False, False))
        previous = chat.encode(reply) + [stop]
        pieces.append((previous, k == len(pairs) - 1, True))
    ids = [t for piece, _, _ in pieces for t in piece]
    mask_final = [m for piece, m, _ in pieces for _ in piece]
    mask_all = [m for piece, _, m in pieces for _ in piece]
    assert list(final.token_ids) == ids
    for position, (got, want) in enumerate(zip(final.action_mask, mask_final)):
        assert got == want, f"final_message mask wrong at token {position}"
    assert list(every.action_mask) == mask_all
    trained = [t for t, m in zip(final.token_ids, final.action_mask) if m]
    assert chat.tokenizer.decode(trained) == "\\boxed{861}<|im_end|>"
    with pytest.raises(ValueError, match="warmstart.loss_on"):
        demonstration_example(chat, pairs, loss_on="last")


# ---------------------------------------------------------------------------- episodes


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    env = MathTIRConfig(data_dir=str(tmp_path_factory.mktemp("data")), num_games=4, game_seed=0, max_turns=2,
                        max_feedback_chars=40, warmstart_games=6, warmstart_seed=100, heldout_games=3, heldout_seed=7,
                        arithmetic=ArithmeticSpec(slip_rate=0.5),
                        sandbox=SandboxConfig(num_workers=2, wall_s=2.0, cpu_s=1))
    try:
        built = build_math_tir(env, seed=0)
    except SandboxUnavailable as exc:
        pytest.skip(f"bubblewrap sandbox unavailable here: {exc}")
    yield built
    built.close()


def test_teacher_demonstrations_are_verified(setup):
    demos = setup.demonstrations
    assert demos.num_tasks >= 1
    for i in range(demos.num_tasks):
        (prompt, call), (observation, answer) = demos.demonstration(i)
        value = eval(expression_of(MathTask(prompt, "", "")))
        assert call == render_call(f"print({expression_of(MathTask(prompt, '', ''))})", "plain")
        assert observation == render_response(str(value)) and answer == f"\\boxed{{{value}}}"


def _play(env, replies):
    async def go():
        observations = [await env.reset(0)]
        results = []
        for reply in replies:
            results.append(await env.step(reply))
        return observations, results
    return asyncio.run(go())


def test_held_out_problems_are_disjoint_and_evaluated_with_and_without_the_tool(setup):
    held = setup.held_out
    assert held is not None and held.num_tasks == 3
    seen = {t.prompt for t in setup.train.tasks} | {r["messages"][0]["content"] for r in setup.demonstrations.records}
    assert not {t.prompt for t in held.tasks} & seen
    evals = math_tir_evaluations(setup)
    assert set(evals) == {"no_tool", "heldout", "heldout_no_tool"}
    tasks, factory = evals["heldout"]
    env = factory()
    assert tasks is held and env.tasks is held and env.rules.tools_enabled
    assert not evals["heldout_no_tool"][1]().rules.tools_enabled
    task = held[0]
    (obs,), (called, answered) = _play(env, [render_call(f"print({expression_of(task)})", "plain"),
                                             f"\\boxed{{{task.ground_truth}}}"])
    assert obs == task.prompt and called.observation == render_response(task.ground_truth)
    assert answered.done and answered.reward == 1.0


def test_episode_tool_call_then_answer(setup):
    task = setup.train[0]
    env = setup.env_factory()()
    call = render_call(f"print({expression_of(task)})", "plain")
    first, (tool, answer) = _play(env, [call, f"So \\boxed{{{task.ground_truth}}}"])
    assert first == [task.prompt]
    assert tool.observation == render_response(task.ground_truth) and not tool.done and tool.reward == 0.0
    assert answer.done and answer.reward == 1.0
    _, (wrong,) = _play(env, ["\\boxed{0}"])
    assert wrong.done and wrong.reward == 0.0


def test_tool_budget_and_disabled_tool(setup):
    env = setup.env_factory()()
    _, results = _play(env, [render_call("print(1)", "plain")] * 3)
    assert [r.done for r in results] == [False, False, True] and results[-1].reward == 0.0
    off = setup.env_factory(tools_enabled=False)()
    _, (result,) = _play(off, [render_call("print(1)", "plain")])
    assert result.observation == render_response("[tool disabled]")


def test_tool_output_is_truncated_and_errors_are_shown(setup):
    env = setup.env_factory()()
    _, (flood, crash) = _play(env, [render_call("print('x' * 5000)", "plain"), render_call("1/0", "plain")])
    body = flood.observation[len("<tool_response>\n"):-len("\n</tool_response>")]
    assert len(body) <= setup.rules.max_feedback_chars and body.endswith("[truncated]")
    assert "ZeroDivisionError" in crash.observation or "truncated" in crash.observation


def test_agent_loop_keeps_tool_output_out_of_the_actions(setup, chat):
    task = setup.train[1]
    expression = expression_of(task)

    def script(request):
        text = chat.tokenizer.decode(list(request.prompt_ids))
        if "<tool_response>" in text:
            value = re.findall(r"<tool_response>\n(\d+)", text)[-1]
            reply = f"\\boxed{{{value}}}"
        else:
            reply = render_call(f"print({expression})", "plain")
        ids = chat.encode(reply) + [chat.stop_token_ids[0]]
        return ScriptedReply(tuple(ids), tuple([-0.5] * len(ids)), latency=0.0)

    stamp = DispatchStamp(request_id=0, task_id=1, policy_event=0, z=0.0, frozen_baseline=0.0, dispatch_time=0.0)
    config = AgentConfig(max_turns=setup.rules.max_tool_calls + 1, max_total_tokens=2048)
    trajectory = asyncio.run(run_episode(FakeEngine(script), setup.env_factory()(), chat, stamp, config))
    assert trajectory.reward == 1.0 and not trajectory.failed
    ids, mask = np.array(trajectory.token_ids), np.array(trajectory.action_mask)
    actions = chat.tokenizer.decode(ids[mask].tolist())
    context = chat.tokenizer.decode(ids[~mask].tolist())
    assert "<tool_response>" not in actions and task.ground_truth in context
    assert actions == render_call(f"print({expression})", "plain") + "<|im_end|>" + f"\\boxed{{{task.ground_truth}}}<|im_end|>"


def test_episode_rules_and_env_validate():
    tasks = MathTaskSet((MathTask("Compute 1+1.", "2", "k"),))
    env = MathTIREnv(tasks, None, None, EpisodeRules("plain", 1, 10))
    with pytest.raises(ValueError, match="task_id"):
        asyncio.run(env.reset(3))
    with pytest.raises(ValueError, match="env.source"):
        MathTIRConfig(source="gsm8k")


def test_filter_teacher_command_writes_the_split(tmp_path, capsys):
    from rollout_bridge.envs.math_tir.teacher import main, read_jsonl, write_jsonl

    records = [_record(f"p{k}", "6", "6", "\\boxed{6}", fmt="qwen") for k in range(5)]
    records.append(_record("p9", "6", "7", "The answer is \\boxed{7}", fmt="qwen"))  # wrong
    write_jsonl(tmp_path / "teacher.jsonl", records)
    report = main(["filter", "--input", str(tmp_path / "teacher.jsonl"), "--out_dir", str(tmp_path / "out"),
                   "--held_out_fraction", "0.2"])
    assert (report.verifier_negative, report.train, report.held_out) == (1, 4, 1)
    assert len(read_jsonl(tmp_path / "out" / "train.jsonl")) == 4
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["train_prompts"] == 4
