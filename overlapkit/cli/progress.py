"""A dependency-free progress bar for the long command-line jobs.

On a terminal it redraws one line (``\\r``); in a log (CI, a pipe) it prints a line at
every tenth of the work instead, so logs stay short and still show that work goes on.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """Shows ``label [####      ] 12/30  <info>`` for ``total`` units of work."""

    def __init__(self, total: int, label: str, *, stream: TextIO | None = None,
                 enabled: bool = True, width: int = 24) -> None:
        self.total = max(total, 1)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.width = width
        self.done = 0
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_tenth = -1
        self._started = time.monotonic()

    def update(self, n: int = 1, info: str = "") -> None:
        """Advance by ``n`` units; ``info`` is shown after the counter."""
        self.done = min(self.done + n, self.total)
        if not self.enabled:
            return
        filled = self.width * self.done // self.total
        bar = "#" * filled + " " * (self.width - filled)
        line = f"{self.label} [{bar}] {self.done}/{self.total}"
        if info:
            line += f"  {info}"
        if self._tty:
            self.stream.write("\r" + line.ljust(79)[:200])
            if self.done == self.total:
                self.stream.write("\n")
        else:
            tenth = 10 * self.done // self.total
            if tenth != self._last_tenth:
                self._last_tenth = tenth
                self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Finish the line on a terminal if the work stopped early."""
        if self.enabled and self._tty and self.done < self.total:
            self.stream.write("\n")
            self.stream.flush()
