"""Progress of long stages: a tqdm bar on a terminal; where no terminal shows it
(``--progress false``, nohup, CI, a pipe) one line per tenth of the stage's work instead, so
a log file holds lines, not carriage-return bar updates."""

from __future__ import annotations

import sys
import time
from typing import Callable


def stderr_is_terminal() -> bool:
    """Whether ``sys.stderr`` (where tqdm draws) is a terminal; False for files, pipes and
    closed or replaced streams without ``isatty``."""
    isatty = getattr(sys.stderr, "isatty", None)
    try:
        return bool(isatty is not None and isatty())
    except ValueError:  # a closed stream
        return False


def show_bar(progress: bool) -> bool:
    """A tqdm bar only when asked (``progress``) and stderr is a terminal; otherwise the
    stage logs tenth-lines (``TenthLines``) instead."""
    return bool(progress) and stderr_is_terminal()


class TenthLines:
    """Logs ``"<what>: <done>/<total><unit> in <s>s"`` each time ``done`` crosses another
    tenth of ``total``; silent when ``log`` is None. ``reach(done, total)`` for callers that
    report counts (game generation), ``step()`` for those that report each item."""

    def __init__(self, what: str, log: Callable[[str], None] | None, total: int = 0, unit: str = ""):
        self.what, self.log, self.total, self.unit = what, log, total, unit
        self.done, self.logged, self.start = 0, 0, time.monotonic()

    def reach(self, done: int, total: int) -> None:
        self.done, self.total = done, total
        tenths = 10 * done // max(total, 1)
        if self.log is not None and tenths > self.logged:
            self.logged = tenths
            self.log(f"{self.what}: {done}/{total}{self.unit} in {time.monotonic() - self.start:.0f}s")

    def step(self) -> None:
        self.reach(self.done + 1, self.total)
