"""The Math-TIR answer check: ``math-verify`` in a separate, killable process.

    score(ground_truth, response) = 1  iff  verify(parse("$" + ground_truth + "$"),
                                                   parse(response))          else 0

``parse`` extracts the last/boxed LaTeX or plain expression of the response (math-verify's
defaults: ``\\boxed{}`` first, then any LaTeX/plain expression), ``verify`` compares
symbolically (fractions, radicals, intervals, sets, LaTeX vs plain).

Why a process: math-verify's own time-out uses ``signal.alarm``, which only works in the
main thread, and sympy can hang or eat memory on adversarial input. The verifier process
(``python -m rollout_bridge.envs.math_tir.verifier``, JSON lines over pipes) runs
math-verify in ITS main thread (with its time-outs), and the caller waits at most
``timeout_s``; a process that does not answer is killed and replaced. Every error or
time-out is a failed score (0), logged, never a crash of the caller.
"""

from __future__ import annotations

import json
import logging
import sys
import threading

from rollout_bridge.envs.math_tir.sections import VerifierConfig
from rollout_bridge.tools.jsonl_process import JsonLineProcess

logger = logging.getLogger(__name__)


def gold_text(ground_truth: str) -> str:
    """A DAPO ground truth (bare LaTeX such as ``\\frac{1}{2}`` or ``34``) as parseable math."""
    stripped = ground_truth.strip()
    if stripped.startswith("$") or "\\boxed" in stripped:
        return stripped
    return f"${stripped}$"


def check_answer(ground_truth: str, response: str, parse_timeout_s: int, verify_timeout_s: int) -> bool:
    """math-verify's verdict (run in the verifier process's main thread)."""
    from math_verify import parse, verify

    gold = parse(gold_text(ground_truth), parsing_timeout=parse_timeout_s, raise_on_error=True)
    answer = parse(response, parsing_timeout=parse_timeout_s, raise_on_error=True)
    if not gold:
        raise ValueError(f"ground truth does not parse: {ground_truth!r}")
    if not answer:
        return False
    return bool(verify(gold, answer, timeout_seconds=verify_timeout_s, raise_on_error=True))


def serve(parse_timeout_s: int, verify_timeout_s: int) -> None:
    """The verifier process: JSON lines ``{"ground_truth", "response"}`` on stdin, replies
    ``{"ok": bool}`` or ``{"error": str}`` on stdout."""
    import math_verify  # noqa: F401 - import once, before the first request

    out = sys.stdout
    sys.stdout = sys.stderr  # nothing else may write into the reply stream
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = {"ok": check_answer(request["ground_truth"], request["response"],
                                        parse_timeout_s, verify_timeout_s)}
        except Exception as exc:  # noqa: BLE001 - reported to the caller as a failed score
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


class MathVerifier:
    """``score(ground_truth, response) -> 0.0 | 1.0`` through a killable verifier process.
    Thread-safe (calls are serialized). ``close()`` ends the process."""

    def __init__(self, config: VerifierConfig = VerifierConfig()):
        self.config = config
        self._lock = threading.Lock()
        self._process: JsonLineProcess | None = None
        self.errors = 0  # failed checks (errors and time-outs) since start

    def _start(self) -> None:
        command = [sys.executable, "-m", __name__, str(self.config.parse_timeout_s),
                   str(self.config.verify_timeout_s)]
        self._process = JsonLineProcess(command)
        if self._process.read_reply(self.config.start_timeout_s) is None:
            err = self._process.stderr_text()
            self._stop()
            raise RuntimeError(f"math-verify process did not start: {err.strip() or 'no reply'}")

    def _stop(self) -> None:
        if self._process is not None:
            self._process.kill()
        self._process = None

    def score(self, ground_truth: str, response: str) -> float:
        """1.0 if ``response``'s final answer equals ``ground_truth``, else 0.0 (errors and
        time-outs included, each logged)."""
        with self._lock:
            if self._process is None or not self._process.alive():
                self._start()
            request = {"ground_truth": str(ground_truth), "response": str(response)}
            reply = self._process.request(request, self.config.timeout_s)
            if reply is None:
                self._stop()
                return self._failed(f"no verdict within {self.config.timeout_s}s (process killed)",
                                    ground_truth)
        if "error" in reply:
            return self._failed(reply["error"], ground_truth)
        return 1.0 if reply["ok"] else 0.0

    def _failed(self, why: str, ground_truth: str) -> float:
        self.errors += 1
        logger.warning("math-verify failed (scored 0) for ground truth %r: %s", ground_truth[:80], why)
        return 0.0

    def close(self) -> None:
        with self._lock:
            self._stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
