"""The progress of ``disagg up``: a live line on a terminal, one line per state change otherwise.

On a terminal the line is rewritten in place (``\\r``); into a pipe or a log
file every rewrite would pile up on one long line, so there each distinct
state is printed once, on its own line, and repeats are dropped.
"""

from __future__ import annotations

import sys
from typing import TextIO

__all__ = ["ProgressLine"]

_WIDTH = 100


class ProgressLine:
    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty()
        self._shown: str | None = None
        self._open = False
        """A live line is on the terminal without its newline."""

    def update(self, text: str) -> None:
        if text == self._shown:
            return
        self._shown = text
        if self.live:
            self.stream.write(f"\r{text}".ljust(_WIDTH))
            self._open = True
        else:
            self.stream.write(f"{text}\n")
        self.stream.flush()

    def finish(self) -> None:
        """End the live line, so the next output starts on a line of its own."""
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False
