"""The Math-TIR answer check: ``math-verify`` in a separate, killable process.

    score(ground_truth, response) = 1  iff  verify(parse("$" + ground_truth + "$"),
                                                   parse(response))          else 0

``parse`` extracts the last/boxed LaTeX or plain expression of the response (math-verify's
defaults: ``\\boxed{}`` first, then any LaTeX/plain expression), ``verify`` compares
symbolically (fractions, radicals, intervals, sets, LaTeX vs plain).

Why a process: math-verify's own time-out uses ``signal.alarm``, which only works in the
main thread, and sympy can hang or eat memory on adversarial input. The verifier process
runs math-verify in ITS main thread (with its time-outs), and the caller waits at most
``timeout_s``; a process that does not answer is killed and replaced. Every error or
time-out is a failed score (0), logged, never a crash of the caller.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import threading

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class VerifierConfig:
    """``timeout_s``: the caller's bound per check (includes the process round trip);
    ``parse_timeout_s`` / ``verify_timeout_s``: math-verify's own time-outs (integers)."""

    timeout_s: float = 10.0
    parse_timeout_s: int = 5
    verify_timeout_s: int = 5
    start_timeout_s: float = 60.0

    def __post_init__(self):
        for name in ("timeout_s", "parse_timeout_s", "verify_timeout_s", "start_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"verifier.{name} must be > 0, got {getattr(self, name)}")


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


def _serve(conn, parse_timeout_s: int, verify_timeout_s: int) -> None:
    import math_verify  # noqa: F401 - import once, before the first request

    conn.send(("ready", None))
    while True:
        try:
            ground_truth, response = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", check_answer(ground_truth, response, parse_timeout_s, verify_timeout_s)))
        except Exception as exc:  # noqa: BLE001 - reported to the caller as a failed score
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class MathVerifier:
    """``score(ground_truth, response) -> 0.0 | 1.0`` through a killable verifier process.
    Thread-safe (calls are serialized). ``close()`` ends the process."""

    def __init__(self, config: VerifierConfig = VerifierConfig()):
        self.config = config
        self._lock = threading.Lock()
        self._context = multiprocessing.get_context("spawn")
        self._process = None
        self._conn = None
        self.errors = 0  # failed checks (errors and time-outs) since start

    def _start(self) -> None:
        parent, child = self._context.Pipe()
        self._process = self._context.Process(
            target=_serve, args=(child, self.config.parse_timeout_s, self.config.verify_timeout_s), daemon=True)
        self._process.start()
        child.close()
        self._conn = parent
        if not parent.poll(self.config.start_timeout_s):
            self._stop()
            raise RuntimeError(f"math-verify process did not start in {self.config.start_timeout_s}s")
        parent.recv()

    def _stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join()
            self._conn.close()
        self._process = self._conn = None

    def score(self, ground_truth: str, response: str) -> float:
        """1.0 if ``response``'s final answer equals ``ground_truth``, else 0.0 (errors and
        time-outs included, each logged)."""
        with self._lock:
            if self._process is None or not self._process.is_alive():
                self._start()
            try:
                self._conn.send((str(ground_truth), str(response)))
                if not self._conn.poll(self.config.timeout_s):
                    self._stop()
                    return self._failed(f"timed out after {self.config.timeout_s}s", ground_truth)
                kind, value = self._conn.recv()
            except (EOFError, OSError) as exc:
                self._stop()
                return self._failed(f"verifier process lost: {exc!r}", ground_truth)
        if kind == "error":
            return self._failed(value, ground_truth)
        return 1.0 if value else 0.0

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
