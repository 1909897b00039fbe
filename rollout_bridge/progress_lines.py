"""Progress for logs that no terminal shows (``--progress false``, nohup, CI): one line per
tenth of a long stage's work, beside (not instead of) its tqdm bar."""

from __future__ import annotations

import time
from typing import Callable


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
