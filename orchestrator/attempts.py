"""One request phase's attempts: what failed, whether to try again, and where.

Every leg (ctx, gen, streaming gen) goes through ``Flow.attempt`` with one of these: the
workers tried so far (excluded from routing; ``max_retries`` counts them), the failures
counted, the 429s, and the workers whose connection was lost before anything was relayed.
With ``Flow.decide`` it is the whole retry policy, in one place: the leg's transport
(``orchestrator.http_client``) raises, it never tries again itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from orchestrator.errors import LegFailed
from workers.http_protocol import Phase

if TYPE_CHECKING:
    from orchestrator.registry import WorkerRecord

__all__ = ["Attempts", "SAME_WORKER_RETRIES"]

# A connection refused or lost before any answer is, up to this many times per worker, one of its K
# frontends dying, not the worker: tried again on the same worker, after a pause that grows with each
# try (``pause``): the kernel (SO_REUSEPORT) hands the next connection to a live frontend once the
# dead one's listening socket is gone, a moment after the kill.
SAME_WORKER_RETRIES = 3
SAME_WORKER_PAUSE_SECONDS = 0.02  # times the try: 20, 40, 60 ms


@dataclass
class Attempts:
    phase: Phase
    max_retries: int
    tried: set[str] = field(default_factory=set)
    lost: dict[str, int] = field(default_factory=dict)  # connections lost before anything was relayed, by worker
    refusals: int = 0  # 429s: every worker tried busy is a 429 to the client, not a 502
    unavailable: int = 0  # 503s (and 429s): every worker tried saying so is a 503 to the client, not a 502

    def start(self, worker: WorkerRecord) -> None:
        self.tried.add(worker.worker_id)

    def failed(self, worker: WorkerRecord, exc: LegFailed) -> tuple[bool, bool]:
        """Book a failed attempt: (suspect the worker, try it again). A connection lost (or refused)
        before anything reached the client is, the first ``SAME_WORKER_RETRIES`` times, one lost
        frontend process (killed mid-answer), not a lost worker: the same worker again (the next
        connection reaches another of its frontends), not suspected."""
        self.refusals += exc.refused
        self.unavailable += exc.refused or exc.unavailable
        lost = self.lost.get(worker.worker_id, 0)
        again = exc.connection_lost and lost < SAME_WORKER_RETRIES
        if again:
            self.lost[worker.worker_id] = lost + 1
        return exc.unanswered and not again, again

    def pause(self, worker: WorkerRecord) -> float:
        """Seconds to wait before trying ``worker`` again after its connection was lost."""
        return SAME_WORKER_PAUSE_SECONDS * self.lost.get(worker.worker_id, 1)

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
