"""The embedded engine's prefill programs by shape, compiled off the scheduler thread.

A prefill call (``slot_decode.admit``) is one XLA program per shape (rows, width, window):
the requests admitted together, their new tokens and the cache positions they attend, each
rounded up to a bucket. A multi-turn job meets a hundred or more such shapes, and the first
call of each compiles it (~0.5-0.7 s on 2 CPU cores; tracing and lowering alone, when the
persistent compilation cache holds the executable, still ~0.15 s). On the scheduler thread
that compile stops every slot from decoding.

``PrefillPrograms`` keeps the compiled programs by shape and compiles a new shape on a
background thread. Until it is ready, a call runs on the cheapest compiled shape that
covers it (at least as many rows, as wide, as long a window), provided that shape's work
(rows x width x window) is at most ``max_work_ratio`` times the wanted shape's; the extra
rows are padding rows (dropped) and the extra positions padding positions (position -1: no
cache write, masked keys), so the sampled tokens are the same up to float rounding. With no
such shape the caller compiles it (or waits for the compile already running). Without a
background compiler (``submit=None``) every new shape compiles on the caller.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import queue
import threading
from typing import Any, Callable

Shape = tuple[int, int, int]  # (rows, width, window)


@dataclasses.dataclass
class PrefillCompileStats:
    """Prefill calls by how their program was found: ``exact`` (compiled at its own shape),
    ``padded`` (run on a larger compiled shape while its own compiled in the background),
    ``waited`` (waited for a background compile of its shape), ``compiled_inline``
    (compiled on the caller); ``compiled_background`` programs compiled off it."""

    exact: int = 0
    padded: int = 0
    waited: int = 0
    compiled_inline: int = 0
    compiled_background: int = 0


def work(shape: Shape) -> int:
    """rows x width x window: the attention work of a prefill call of ``shape``."""
    rows, width, window = shape
    return rows * width * window


def covers(big: Shape, small: Shape) -> bool:
    """True if a call of shape ``small`` can run padded to ``big`` (every axis at least as large)."""
    return all(b >= s for b, s in zip(big, small, strict=True))


class _BackgroundCompiler:
    """One daemon thread per process running compile jobs in order (a job is a callable).
    At interpreter exit it runs no further job and the exit waits for the one running (a
    compile still inside XLA while the process tears down could crash it)."""

    def __init__(self):
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="JaxEngine-compile", daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def stop(self, timeout: float = 60.0) -> None:
        self._stopping = True
        self._jobs.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None or self._stopping:
                return
            job()


_compiler: _BackgroundCompiler | None = None
_compiler_lock = threading.Lock()


def background_compiler() -> _BackgroundCompiler:
    """The process's background compile thread (started on first use)."""
    global _compiler
    with _compiler_lock:
        if _compiler is None:
            _compiler = _BackgroundCompiler()
        return _compiler


class PrefillPrograms:
    """Compiled prefill programs by shape (see the module docstring).

    Args:
      compile_shape: shape -> a compiled program (``jax.jit(...).lower(...).compile()``),
        called as ``program(*args)`` with the call's arguments.
      submit: runs a compile job off the caller (default: the process's compile thread);
        None compiles every new shape on the caller.
      max_work_ratio: the largest work of a padded stand-in relative to the wanted shape.
    """

    def __init__(self, compile_shape: Callable[[Shape], Callable[..., Any]],
                 submit: Callable[[Callable[[], None]], None] | None = None, max_work_ratio: float = 8.0):
        if max_work_ratio < 1:
            raise ValueError(f"max_work_ratio must be >= 1, got {max_work_ratio}")
        self._compile_shape = compile_shape
        self._submit = submit
        self._max_work_ratio = float(max_work_ratio)
        self._ready: dict[Shape, Callable[..., Any]] = {}
        self._building: dict[Shape, concurrent.futures.Future] = {}
        self._failed: set[Shape] = set()  # a background compile failed: compile on the caller (and raise)
        self._lock = threading.Lock()
        self.stats = PrefillCompileStats()

    @property
    def compiled_shapes(self) -> list[Shape]:
        with self._lock:
            return sorted(self._ready)

    def program(self, shape: Shape) -> tuple[Shape, Callable[..., Any]]:
        """(the shape to call, its compiled program) for a call of ``shape``: its own program
        if compiled, else a covering compiled one while its own compiles in the background,
        else its own, compiled now (or when its background compile, already running, ends)."""
        shape = tuple(int(n) for n in shape)
        with self._lock:
            program = self._ready.get(shape)
            if program is not None:
                self.stats.exact += 1
                return shape, program
            building = self._building.get(shape)
            if building is None and self._submit is not None and shape not in self._failed:
                building = self._building[shape] = concurrent.futures.Future()
                self._submit(lambda: self._build(shape, building))
            stand_in = self._stand_in(shape) if building is not None else None
            if stand_in is not None:
                self.stats.padded += 1
                return stand_in, self._ready[stand_in]
        if building is not None:
            if building.cancel():  # still queued behind other compiles: compile it here instead
                with self._lock:
                    self._building.pop(shape, None)
            else:
                program = building.result()  # its compile's error, if it failed, is raised here
                with self._lock:
                    self.stats.waited += 1
                return shape, program
        program = self._compile_shape(shape)
        with self._lock:
            self._ready[shape] = program
            self.stats.compiled_inline += 1
        return shape, program

    def _stand_in(self, shape: Shape) -> Shape | None:
        """The compiled shape of least work covering ``shape``, within the work ratio."""
        limit = self._max_work_ratio * work(shape)
        candidates = [s for s in self._ready if covers(s, shape) and work(s) <= limit]
        return min(candidates, key=lambda s: (work(s), s)) if candidates else None

    def _build(self, shape: Shape, future: concurrent.futures.Future) -> None:
        if not future.set_running_or_notify_cancel():  # the caller compiled it itself
            return
        try:
            program = self._compile_shape(shape)
        except BaseException as error:  # noqa: BLE001 - handed to whoever waits for it
            with self._lock:
                del self._building[shape]
                self._failed.add(shape)
            future.set_exception(error)
            return
        with self._lock:
            self._ready[shape] = program
            del self._building[shape]
            self.stats.compiled_background += 1
        future.set_result(program)
