"""Common random numbers in evaluations: an episode seed fixes every random number of an
episode (the env's action orders, each turn's samples), whatever the engine's own seed,
its other requests, the order episodes start in or how many episodes came before. So two
policies evaluated with one ``crn_seed`` meet the same random numbers per (task, round)."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from rollout_bridge.agent import AgentConfig, ChatFormat, derived_seed, run_episode
from rollout_bridge.engine.base import SamplingParams
from rollout_bridge.engine.fake import FakeEngine, ScriptedReply
from rollout_bridge.engine.jax_engine import JaxEngine
from rollout_bridge.envs.base import ThreadedEnvironment
from rollout_bridge.envs.textworld_env import ObservationStyle, TextWorldEnv, TextWorldTasks
from rollout_bridge.envs.textworld_games import GameSetSpec, generate_game_set
from rollout_bridge.evaluation import evaluation_seed
from rollout_bridge.prior import rollout_successes
from rollout_bridge.tokenizer import build_tiny_tokenizer
from rollout_bridge.trajectory import DispatchStamp
from spopp_jax.models import ModelConfig, init_model

SPEC = GameSetSpec("crn", num_games=2, base_seed=11, world_size=2, nb_objects=3, quest_length=2)
STYLE = ObservationStyle(max_feedback_chars=80, shuffle_actions=True, actions_per_line=True)
AGENT = AgentConfig(max_turns=3, max_total_tokens=1024, sampling=SamplingParams(max_new_tokens=6))


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    files = generate_game_set(SPEC, tmp_path_factory.mktemp("games"))
    return TextWorldTasks(files, files[0].parent, max_turns=3, style=STYLE)


@pytest.fixture(scope="module")
def chat(tasks, tmp_path_factory):
    corpus = [o + "\n" + a for t in range(tasks.num_tasks) for o, a in tasks.demonstration(t)]
    return ChatFormat.from_tokenizer(build_tiny_tokenizer(corpus, tmp_path_factory.mktemp("tok"), vocab_size=300))


@pytest.fixture(scope="module")
def model(chat):
    config = ModelConfig(vocab_size=len(chat.tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    return init_model(config, seed=0)   # random weights: near-uniform replies, every sample differs


def _engine(model, seed: int) -> JaxEngine:
    return JaxEngine(model, num_slots=4, max_len=1024, steps_per_call=4, seed=seed)


def test_derived_seed_is_a_fixed_63_bit_function_of_its_parts():
    seeds = {derived_seed(0, t, r) for t in range(20) for r in range(5)}
    assert len(seeds) == 100 and all(0 <= s < 2**63 for s in seeds)
    assert derived_seed(3, "heldout", 7) == derived_seed(3, "heldout", 7)
    assert derived_seed(3, "heldout") != derived_seed(3, "train")
    assert evaluation_seed(0, "train") != evaluation_seed(1, "train")


def test_a_seeded_episode_shows_the_same_action_orders_after_any_other_episodes(tasks):
    def first_observation(env, seed):
        env.set_episode_seed(seed)
        return env.reset(0)

    fresh, used = TextWorldEnv(tasks), TextWorldEnv(tasks)
    for _ in range(3):
        used.reset(0)          # unseeded episodes advance the task set's episode counter
    assert first_observation(fresh, 5) == first_observation(used, 5)
    orders = {first_observation(fresh, seed) for seed in range(8)}
    assert len(orders) > 1     # the seed does choose the order
    assert fresh.last_episode._shuffle_seed == (STYLE.shuffle_seed, 7, 1)
    fresh.reset(0)             # the seed holds for one reset only: back to the task set's counter
    assert fresh.last_episode._shuffle_seed == (STYLE.shuffle_seed, 3)   # unseeded 0-2 were used's
    fresh.close(), used.close()


def test_a_seeded_request_samples_as_generate_seed_whatever_the_engine_seed(model, chat):
    prompt = chat.prompt_ids("You are in a room.")
    params = SamplingParams(max_new_tokens=8, seed=1234)

    async def run(engine_seed, params, **kwargs):
        engine = _engine(model, engine_seed)
        try:
            return (await engine.generate(prompt, params, **kwargs)).token_ids
        finally:
            await engine.close()

    by_params = asyncio.run(run(0, params))
    assert by_params == asyncio.run(run(99, params))
    assert by_params == asyncio.run(run(7, SamplingParams(max_new_tokens=8), seed=1234))
    unseeded = {asyncio.run(run(s, SamplingParams(max_new_tokens=8))) for s in range(4)}
    assert len(unseeded) > 1   # without a seed the engine's own seed decides


def _episodes(model, chat, tasks, engine_seed, episode_seeds, threaded=False):
    """Token ids of one episode of task 0 per episode seed, all played at once on one engine."""
    async def run():
        engine = _engine(model, engine_seed)
        try:
            envs = [TextWorldEnv(tasks) for _ in episode_seeds]
            envs = [ThreadedEnvironment(env) for env in envs] if threaded else envs
            results = await asyncio.gather(*(
                run_episode(engine, env, chat, DispatchStamp(i, 0, 0, 0.0, 0.5, 0.0), AGENT, seed)
                for i, (env, seed) in enumerate(zip(envs, episode_seeds))))
            return [tuple(r.token_ids.tolist()) for r in results]
        finally:
            await engine.close()
    return asyncio.run(run())


def test_an_episode_seed_fixes_the_whole_episode(model, chat, tasks):
    first = _episodes(model, chat, tasks, 0, [10, 11, 12])
    # another engine seed, another order of start, other episodes beside it: the same episodes
    again = _episodes(model, chat, tasks, 41, [12, 99, 10, 11], threaded=True)
    assert (again[2], again[3], again[0]) == tuple(first)
    assert len(set(first)) == 3            # different seeds, different episodes
    unseeded = _episodes(model, chat, tasks, 0, [None]), _episodes(model, chat, tasks, 41, [None])
    assert unseeded[0] != unseeded[1]      # the control: without episode seeds the engine decides


def _seeded_walkthrough(chat, tasks):
    """A scripted policy that plays the walkthrough's next command unless its turn seed
    is a multiple of 3 (then it types junk): wins depend on the seeds only."""
    demos = [[reply for _, reply in tasks.demonstration(t)] for t in range(tasks.num_tasks)]
    firsts = [tasks.episode(t).reset().split("\n")[0] for t in range(tasks.num_tasks)]
    stop = chat.turn_close_ids[0]

    def script(request):
        text = chat.tokenizer.decode(list(request.prompt_ids))
        task = next(t for t, first in enumerate(firsts) if first in text)
        turn = text.count("<|im_start|>assistant") - 1
        good = request.params.seed is not None and request.params.seed % 3 != 0
        reply = demos[task][min(turn, len(demos[task]) - 1)] if good else "xyzzy"
        return ScriptedReply(tuple(chat.encode(reply)) + (stop,))

    return script


def test_rollout_successes_with_one_crn_seed_agree_across_concurrency(chat, tasks):
    script = _seeded_walkthrough(chat, tasks)

    def counts(concurrency, crn_seed):
        config = AgentConfig(max_turns=4, max_total_tokens=4096, sampling=SamplingParams(max_new_tokens=32))
        successes, trials = asyncio.run(rollout_successes(FakeEngine(script), lambda: TextWorldEnv(tasks), chat,
                                                          tasks.num_tasks, 6, config, concurrency, crn_seed=crn_seed))
        assert trials.tolist() == [6, 6]
        return tuple(successes.tolist())

    assert counts(4, crn_seed=7) == counts(1, crn_seed=7)
    assert len({counts(2, crn_seed=seed) for seed in range(6)}) > 1   # the seeds decide the wins
    assert counts(2, crn_seed=None) == (0, 0)                          # unseeded: junk, never a win

    # a subset of the tasks (evaluation.train_games) plays exactly those tasks' episodes
    config = AgentConfig(max_turns=4, max_total_tokens=4096, sampling=SamplingParams(max_new_tokens=32))
    subset = [asyncio.run(rollout_successes(FakeEngine(script), lambda: TextWorldEnv(tasks), chat, tasks.num_tasks,
                                            6, config, 2, crn_seed=seed, task_ids=[1])) for seed in range(6)]
    for seed, (successes, trials) in enumerate(subset):
        assert trials.tolist() == [0, 6]
        assert successes.tolist() == [0, counts(2, crn_seed=seed)[1]]
    for bad in ([], [2], [-1], [1, 1]):
        with pytest.raises(ValueError, match="task_ids"):
            asyncio.run(rollout_successes(FakeEngine(script), lambda: TextWorldEnv(tasks), chat, tasks.num_tasks,
                                          1, config, 2, task_ids=bad))


def test_evaluations_sharing_their_episodes_in_flight_count_as_each_alone(chat, tasks):
    """Two evaluations on one engine under one semaphore (the evaluations after RL): each
    set's counts are those it gets alone, and no more episodes than the semaphore's are
    ever in flight together."""
    script = _seeded_walkthrough(chat, tasks)
    config = AgentConfig(max_turns=4, max_total_tokens=4096, sampling=SamplingParams(max_new_tokens=32))
    open_envs, most = [0], [0]

    class CountedEnv(TextWorldEnv):
        def __init__(self, *args):
            super().__init__(*args)
            open_envs[0] += 1
            most[0] = max(most[0], open_envs[0])

        def close(self):  # reset closes too, before its episode
            open_envs[0] -= self.last_episode is not None
            super().close()

    def evaluation(engine, crn_seed, semaphore=None, task_ids=None):
        return rollout_successes(engine, lambda: CountedEnv(tasks), chat, tasks.num_tasks, 5, config, 3,
                                 crn_seed=crn_seed, task_ids=task_ids, semaphore=semaphore)

    alone = [asyncio.run(evaluation(FakeEngine(script), seed, task_ids=ids)) for seed, ids in ((3, [1]), (8, None))]
    most[0] = 0

    async def together():
        engine = FakeEngine(script)
        shared = asyncio.Semaphore(3)
        return await asyncio.gather(evaluation(engine, 3, shared, [1]), evaluation(engine, 8, shared))

    for (successes, trials), (alone_successes, alone_trials) in zip(asyncio.run(together()), alone):
        assert successes.tolist() == alone_successes.tolist() and trials.tolist() == alone_trials.tolist()
    assert most[0] == 3 and open_envs[0] == 0
