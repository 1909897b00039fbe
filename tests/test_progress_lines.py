"""Progress of long stages: a tqdm bar only on a terminal, tenth-lines (and no bar) when
stderr is a file or a pipe (nohup, CI), so that a log holds lines, not bar updates."""

import io
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from rollout_bridge.progress_lines import show_bar, stderr_is_terminal


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Closed(io.StringIO):
    def isatty(self) -> bool:
        raise ValueError("I/O operation on closed file")


@pytest.mark.parametrize("stream, terminal", [(_Terminal(), True), (io.StringIO(), False), (_Closed(), False),
                                              (object(), False)])
def test_stderr_is_terminal_only_for_a_tty(monkeypatch, stream, terminal):
    monkeypatch.setattr(sys, "stderr", stream)
    assert stderr_is_terminal() is terminal
    assert show_bar(True) is terminal
    assert show_bar(False) is False  # --progress false: never a bar


@pytest.mark.parametrize("terminal", [False, True])
def test_game_generation_draws_a_bar_or_logs_tenths_never_both(monkeypatch, terminal):
    from rollout_bridge.envs.kinds import GenerationBar

    stderr = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    lines = []
    bar = GenerationBar("training games", enabled=True, log=lines.append)
    for done in range(0, 21):
        bar(done, 20)
    bar.close()
    if terminal:
        assert lines == [] and "generating training games" in stderr.getvalue()
    else:
        assert len(lines) == 10 and lines[-1].startswith("generating training games: 20/20")
        assert stderr.getvalue() == ""  # no carriage-return bar in the log file


@pytest.mark.parametrize("terminal", [False, True])
def test_rl_and_warm_start_bars_only_on_a_terminal_their_lines_always(monkeypatch, capsys, terminal):
    from rollout_bridge.rl_stage import UpdateLogger
    from rollout_bridge.warmstart_stage import SFTProgress

    stderr = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    writer = SimpleNamespace(write=lambda step, row: None, close=lambda: None)
    logger = UpdateLogger(writer, steps=10, start_step=0, progress=True)
    trajectory = SimpleNamespace(num_action_tokens=1, token_ids=np.zeros(2), reward=1.0, truncated=False, num_turns=1)
    for update in range(1, 11):
        logger(SimpleNamespace(update=update, policy_event=update, trajectories=(trajectory,),
                               policy_lag=np.zeros(1), diagnostics={}, learner_metrics={}, start_time=0.0, end_time=0.0))
    logger.close()
    sft = SFTProgress(total_steps=10, epochs=1, progress=True)
    for step in range(10):
        sft.step(step, {"loss": 1.0})
    sft.close()
    out = capsys.readouterr().out
    assert out.count("RL: update") == 10 and out.count("warm start: step") == 10
    assert ("RL" in stderr.getvalue() and "warm start (SFT)" in stderr.getvalue()) is terminal
    if not terminal:
        assert stderr.getvalue() == ""


def test_evaluation_rollouts_log_tenths_without_a_terminal(monkeypatch, capsys):
    import asyncio

    from rollout_bridge import evaluation

    async def fake_rollouts(engine, env_factory, chat, num_tasks, n, agent, concurrency, on_done, crn_seed,
                            task_ids, semaphore=None):
        for _ in range(num_tasks * n):
            on_done(None)
        return np.zeros(num_tasks), np.full(num_tasks, n)

    monkeypatch.setattr(evaluation, "rollout_successes", fake_rollouts)
    for terminal in (False, True):
        stderr = _Terminal() if terminal else io.StringIO()
        monkeypatch.setattr(sys, "stderr", stderr)
        env = SimpleNamespace(num_tasks=20, env_factory=None)
        asyncio.run(evaluation.success_rollouts(None, env, None, None, 4, 2, "prior", progress=True))
        out = capsys.readouterr().out
        assert (out.count("prior: ") == 10) is not terminal
        assert (stderr.getvalue() == "") is not terminal
