"""The multi-turn agent loop: token ids in, token ids out, an action mask per token.

The history is NEVER decoded and re-tokenized (huggingface/trl#5224, verl#3720: that
changes ids and breaks rollout/learner log-prob agreement). The loop keeps one token list:
  * the chat template renders the initial prompt (``apply_chat_template``);
  * the engine's sampled ids are appended verbatim (action mask 1, their log-probs);
  * the template's turn-closing tokens after a reply (e.g. ``"\\n"`` after
    ``<|im_end|>``) and each observation, rendered as a new user turn plus the generation
    prompt, are appended with action mask 0.
The turn-closing and observation-turn ids are derived from the tokenizer's own template by
rendering two conversations that differ by one message and taking the text difference, so
users' real HF tokenizers (Qwen2/Qwen3 ChatML) work the same way as the tiny one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import zlib
from typing import Any, Sequence

import numpy as np

from rollout_bridge.engine.base import RolloutEngine, SamplingParams
from rollout_bridge.envs.base import AnyEnvironment, as_async
from rollout_bridge.trajectory import DispatchStamp, Trajectory

_MARK_USER = "U"
_MARK_REPLY = "QzXreplyMARKqZ"


def _as_id_list(encoded: Any) -> list[int]:
    """``apply_chat_template(tokenize=True)`` returns a list or a BatchEncoding (v5)."""
    if hasattr(encoded, "keys") and "input_ids" in encoded:
        encoded = encoded["input_ids"]
    return [int(t) for t in encoded]


@dataclasses.dataclass(frozen=True)
class ChatFormat:
    """Token-level chat pieces derived once from a tokenizer's chat template.

    turn_close_ids: ids the template puts after an assistant reply's content (e.g.
    ``<|im_end|>\\n``); its first id is the stop token the model samples.
    stop_token_ids: ids that end a reply (turn-close stop id and the tokenizer's eos).
    """

    tokenizer: Any
    turn_close_ids: tuple[int, ...]
    stop_token_ids: tuple[int, ...]
    system_prompt: str | None = None
    template_kwargs: tuple[tuple[str, Any], ...] = ()
    user_base_text: str = ""  # the template over [system?, user "U"], rendered once

    @classmethod
    def from_tokenizer(cls, tokenizer, system_prompt: str | None = None, **template_kwargs) -> "ChatFormat":
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("tokenizer must have a chat_template")
        fmt = cls(tokenizer, (), (), system_prompt, tuple(sorted(template_kwargs.items())))
        rendered = fmt.render(
            [{"role": "user", "content": _MARK_USER}, {"role": "assistant", "content": _MARK_REPLY}], False
        )
        if _MARK_REPLY not in rendered:
            raise ValueError("chat template does not render assistant content verbatim")
        close_text = rendered[rendered.rindex(_MARK_REPLY) + len(_MARK_REPLY):]
        close_ids = tuple(fmt.encode(close_text))
        stops = []
        if close_ids and close_ids[0] in set(tokenizer.all_special_ids):
            stops.append(close_ids[0])
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in stops:
            stops.append(int(tokenizer.eos_token_id))
        if not stops:
            raise ValueError("could not determine a stop token from the chat template or eos_token")
        user_base = fmt.render([{"role": "user", "content": _MARK_USER}], False)
        return dataclasses.replace(
            fmt, turn_close_ids=close_ids, stop_token_ids=tuple(stops), user_base_text=user_base
        )

    def _with_system(self, messages: list[dict]) -> list[dict]:
        if self.system_prompt is None:
            return messages
        return [{"role": "system", "content": self.system_prompt}, *messages]

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            self._with_system(messages),
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **dict(self.template_kwargs),
        )

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def prompt_ids(self, observation: str) -> list[int]:
        """Initial prompt: the template over ``[system?, user: observation]`` + generation prompt."""
        messages = self._with_system([{"role": "user", "content": observation}])
        return _as_id_list(
            self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, **dict(self.template_kwargs)
            )
        )

    def observation_turn_ids(self, observation: str) -> list[int]:
        """Ids of one more user turn carrying ``observation``, then the generation prompt."""
        base = self.user_base_text
        full = self.render(
            [{"role": "user", "content": _MARK_USER}, {"role": "user", "content": observation}], True
        )
        if not full.startswith(base):
            raise ValueError("chat template does not render an appended turn as a suffix")
        return self.encode(full[len(base):])

    def close_ids(self, reply_ids: Sequence[int]) -> list[int]:
        """Template tokens closing the assistant turn after ``reply_ids`` (not sampled)."""
        if reply_ids and reply_ids[-1] in self.stop_token_ids:
            return list(self.turn_close_ids[1:])
        return list(self.turn_close_ids)

    def action_text(self, reply_ids: Sequence[int]) -> str:
        """The reply as text for the environment (special tokens dropped)."""
        return self.tokenizer.decode(list(reply_ids), skip_special_tokens=True)


@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
    """The episode limits of the run config's ``rollout`` section
    (`rollout_bridge.config.RolloutSection` extends this class). ``max_total_tokens`` bounds
    prompt + all turns (the per-turn ``max_new_tokens`` is lowered to fit); ``env_timeout_s``
    bounds each env call (None: no limit)."""

    max_total_tokens: int = 2048
    env_timeout_s: float | None = 60.0

    def __post_init__(self):
        if self.max_total_tokens < 2:
            raise ValueError(f"max_total_tokens must be >= 2, got {self.max_total_tokens}")


@dataclasses.dataclass(frozen=True)
class AgentConfig(EpisodeLimits):
    """How one episode is run: the `EpisodeLimits`, the env kind's ``max_turns`` and the
    decoding of every turn (``sampling``: the run config's rollout decoding fields)."""

    max_turns: int = dataclasses.field(default=8, metadata={"from": "the env kind's bundle (env.max_turns)"})
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams,
                                                 metadata={"from": "rollout (its Decoding fields)"})

    def __post_init__(self):
        EpisodeLimits.__post_init__(self)
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")


class _History:
    """The growing token stream (append-only): one list of ids (the engine's next prompt)
    and the sampled segments; the action mask and log-probs become arrays once, at the end
    (``arrays``), with no per-token Python work."""

    def __init__(self, prompt_ids: Sequence[int]):
        self.token_ids: list[int] = list(prompt_ids)
        self._actions: list[tuple[int, Sequence[float]]] = []  # (start, log-probs) per reply

    def add_context(self, ids: Sequence[int]) -> None:
        self.token_ids += ids

    def add_actions(self, ids: Sequence[int], logprobs: Sequence[float]) -> None:
        if len(ids):
            self._actions.append((len(self.token_ids), logprobs))
        self.token_ids += ids

    @property
    def prompt_length(self) -> int:
        """Tokens before the first sampled one (all of them when nothing was sampled)."""
        return self._actions[0][0] if self._actions else len(self.token_ids)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(token_ids int32, action_mask bool, rollout_logp float32, 0 off actions)."""
        n = len(self.token_ids)
        mask = np.zeros(n, np.bool_)
        logp = np.zeros(n, np.float32)
        for start, logprobs in self._actions:
            end = start + len(logprobs)
            mask[start:end] = True
            logp[start:end] = logprobs
        arrays = (np.array(self.token_ids, np.int32), mask, logp)
        for array in arrays:
            array.flags.writeable = False  # final: Trajectory keeps them without a copy
        return arrays


@functools.lru_cache(maxsize=1024)
def _turn_params(sampling: SamplingParams, stop_token_ids: tuple[int, ...], max_new_tokens: int) -> SamplingParams:
    """The sampling params of one turn: the episode's remaining token budget and the chat's
    stop tokens added (cached: the same few budgets recur for every episode)."""
    return dataclasses.replace(
        sampling,
        max_new_tokens=min(sampling.max_new_tokens, max_new_tokens),
        stop_token_ids=tuple(dict.fromkeys(sampling.stop_token_ids + stop_token_ids)),
    )


async def _env_call(awaitable, timeout_s: float | None):
    if timeout_s is None:
        return await awaitable
    return await asyncio.wait_for(awaitable, timeout_s)


async def _timed_env_call(awaitable, timeout_s: float | None, loop, latencies: list[float]):
    """``_env_call`` with its loop-time latency appended to ``latencies`` (even on error)."""
    start = loop.time()
    try:
        return await _env_call(awaitable, timeout_s)
    finally:
        latencies.append(loop.time() - start)


def derived_seed(*parts: int | str) -> int:
    """A 63-bit seed determined by ``parts`` (ints >= 0 and strings), independent of the
    process (numpy's SeedSequence hashing; strings enter as their CRC-32)."""
    entropy = [zlib.crc32(part.encode()) if isinstance(part, str) else int(part) for part in parts]
    return int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0] >> np.uint64(1))


async def run_episode(
    engine: RolloutEngine,
    env: AnyEnvironment,
    chat: ChatFormat,
    stamp: DispatchStamp,
    config: AgentConfig = AgentConfig(),
    episode_seed: int | None = None,
) -> Trajectory:
    """Play task ``stamp.task_id`` to the end; return its :class:`Trajectory`.

    ``episode_seed`` (evaluations) fixes every random number of the episode: the
    environment's (``set_episode_seed``) and turn t's samples (``derived_seed(episode_seed,
    t)``), whatever the engine's own seed, its other requests or the order of episodes.
    Two policies played with the same episode seeds see common random numbers, so the
    noise of their paired difference shrinks; None: the engine and env draw their own.

    Environment exceptions and time-outs end the episode as ``failed`` (reward 0, error
    text recorded); an engine abort ends it as ``aborted``; hitting ``max_turns`` or
    ``max_total_tokens`` before the environment finishes ends it ``truncated`` (reward 0).
    Cancellation (the orchestrator aborting) closes the environment, then propagates.
    """
    loop = asyncio.get_running_loop()
    env = as_async(env)
    turns: list[tuple[float, int, int, str]] = []  # (latency, first event, last event, finish reason)
    env_latencies: list[float] = []
    history: _History | None = None
    outcome = dict(reward=0.0, truncated=False, failed=False, aborted=False, error=None)
    timeout_s = config.env_timeout_s
    try:
        if episode_seed is not None:
            env.set_episode_seed(derived_seed(episode_seed, "env"))
        reset = env.reset(stamp.task_id)
        observation = _observation_text(await _timed_env_call(reset, timeout_s, loop, env_latencies))
        history = _History(_fitting_prompt(chat.prompt_ids(observation), config.max_total_tokens))
        for turn in range(config.max_turns):
            budget = config.max_total_tokens - len(history.token_ids)
            if budget < 1:
                outcome["truncated"] = True
                break
            params = _turn_params(config.sampling, chat.stop_token_ids, budget)
            if episode_seed is not None:
                params = dataclasses.replace(params, seed=derived_seed(episode_seed, turn))
            start = loop.time()
            result = await engine.generate(list(history.token_ids), params)
            turns.append((loop.time() - start, result.policy_event, result.event_span[1], result.finish_reason))
            if result.finish_reason == "abort":
                outcome["aborted"] = True
                break
            history.add_actions(result.token_ids, result.logprobs)
            if result.finish_reason == "length" and len(history.token_ids) >= config.max_total_tokens:
                outcome["truncated"] = True  # the reply was cut by the episode's token budget
                break
            action = chat.action_text(result.token_ids)
            step = await _timed_env_call(env.step(action), timeout_s, loop, env_latencies)
            if step.done:
                outcome["reward"] = float(step.reward)
                break
            if turn == config.max_turns - 1:
                outcome["truncated"] = True
                break
            observation = _observation_text(step.observation)
            context = chat.close_ids(result.token_ids) + chat.observation_turn_ids(observation)
            if len(history.token_ids) + len(context) >= config.max_total_tokens:
                outcome["truncated"] = True
                break
            history.add_context(context)
    except asyncio.CancelledError:
        # the orchestrator aborted this episode (close(), drain abort, max_policy_lag):
        # release the environment before the cancellation propagates
        await _close_quietly(env, timeout_s)
        raise
    except asyncio.TimeoutError:
        outcome.update(failed=True, reward=0.0, error=f"environment timed out after {timeout_s}s")
    except Exception as exc:  # noqa: BLE001 - any env/engine failure is recorded, never fatal
        outcome.update(failed=True, reward=0.0, error=f"{type(exc).__name__}: {exc}")
    if not (outcome["failed"] and "timed out" in (outcome["error"] or "")):
        await _close_quietly(env, timeout_s)  # a timed-out env may still be busy
    if history is None:
        history = _History(())
    if outcome["reward"] not in (0.0, 1.0):
        outcome.update(failed=True, error=f"non-binary reward {outcome['reward']}", reward=0.0)
    token_ids, action_mask, rollout_logp = history.arrays()
    latencies, events, last_events, reasons = (tuple(column) for column in zip(*turns)) if turns else ((),) * 4
    return Trajectory(
        stamp=stamp,
        token_ids=token_ids,
        action_mask=action_mask,
        rollout_logp=rollout_logp,
        prompt_length=history.prompt_length,
        finish_time=loop.time(),
        turn_latencies=latencies,
        env_latencies=tuple(env_latencies),
        turn_policy_events=events,
        turn_last_policy_events=last_events,
        finish_reasons=reasons,
        **outcome,
    )


def _observation_text(observation: Any) -> str:
    """An environment's observation, which must be a str (else TypeError naming its type)."""
    if not isinstance(observation, str):
        raise TypeError(f"observation must be str, got {type(observation).__name__}")
    return observation


def _fitting_prompt(prompt_ids: list[int], max_total_tokens: int) -> list[int]:
    """The initial prompt, refused (ValueError) when it leaves no room for a reply, so an
    over-long first observation never becomes an over-long trajectory."""
    if len(prompt_ids) >= max_total_tokens:
        raise ValueError(
            f"observation of {len(prompt_ids)} tokens does not fit "
            f"max_total_tokens={max_total_tokens}"
        )
    return prompt_ids


async def _close_quietly(env, timeout_s: float | None) -> None:
    """Release the episode's environment; a failing close never fails the trajectory."""
    try:
        await _env_call(env.close(), timeout_s)
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001
        pass
