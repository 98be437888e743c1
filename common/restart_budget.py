"""How often a supervised process may be restarted: a budget over a sliding window.

A process that exits is restarted while it has exited fewer than ``max_restarts``
times within the last ``window_seconds``; past that it is left down (and the
supervisor says so) while everything else keeps running. The window slides, so
a process that failed a few times last week is not one failure from being given
up today: a lifetime count (the old behaviour) eventually stops any long-lived
deployment.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

__all__ = ["RestartBudget"]


@dataclass
class RestartBudget:
    max_restarts: int
    window_seconds: float
    _exits: deque[float] = field(default_factory=deque, init=False, repr=False)

    def allow(self, now: float) -> bool:
        """Record an exit at ``now``; True when the process may be restarted."""
        self._exits.append(now)
        while self._exits and now - self._exits[0] > self.window_seconds:
            self._exits.popleft()
        return len(self._exits) <= self.max_restarts

    @property
    def recent_exits(self) -> int:
        """Exits inside the window as of the last ``allow``."""
        return len(self._exits)
