"""One request phase's attempts: what failed, whether to try again, and where.

Every leg (ctx, gen, streaming gen) goes through ``Flow.attempt`` with one of these: the
workers tried so far (excluded from routing; ``max_retries`` counts them), the failures
counted, the 429s, and the workers whose connection was lost once before anything was
relayed. With ``Flow.decide`` it is the whole retry policy, in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from orchestrator.errors import LegFailed
from workers.http_protocol import Phase

if TYPE_CHECKING:
    from orchestrator.registry import WorkerRecord

__all__ = ["Attempts"]


@dataclass
class Attempts:
    phase: Phase
    max_retries: int
    tried: set[str] = field(default_factory=set)
    lost_once: set[str] = field(default_factory=set)  # connection lost once before anything was relayed
    refusals: int = 0  # 429s: every worker tried busy is a 429 to the client, not a 502
    unavailable: int = 0  # 503s (and 429s): every worker tried saying so is a 503 to the client, not a 502

    def start(self, worker: WorkerRecord) -> None:
        self.tried.add(worker.worker_id)

    def failed(self, worker: WorkerRecord, exc: LegFailed) -> tuple[bool, bool]:
        """Book a failed attempt: (suspect the worker, try it again once). A connection lost before
        anything reached the client is, the first time, one lost frontend process (killed
        mid-answer), not a lost worker: the same worker once more (the next connection reaches
        another of its frontends), not suspected."""
        self.refusals += exc.refused
        self.unavailable += exc.refused or exc.unavailable
        again = exc.connection_lost and worker.worker_id not in self.lost_once
        if again:
            self.lost_once.add(worker.worker_id)
        return exc.unanswered and not again, again

    def may_retry(self) -> bool:
        """``max_retries`` counts the workers that failed, not a same-worker repeat nor a worker that
        refused (429/529: busy, not broken): the leg goes on to every worker of its phase before the
        client is refused for overload."""
        return len(self.tried) - self.refusals <= self.max_retries

    def all_refused(self) -> bool:
        """Every worker tried answered 429: busy, not broken."""
        return self.refusals == len(self.tried)

    def all_unavailable(self) -> bool:
        """Every worker tried answered 429 or 503: each said it cannot serve now, none broke a leg."""
        return self.unavailable >= len(self.tried)
