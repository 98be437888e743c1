"""Routing policies, one per leg (ctx and gen are configured separately).

Every policy sees the same ``Candidate`` rows (healthy workers of the leg,
sorted by worker id, the ones already tried removed) and returns one:

- ``round_robin``: the next worker in id order (a per-router counter).
- ``least_load``: fewest in-flight requests (or tokens, ``load_metric``);
  ties go round robin.
- ``kv_cache_aware``: most leading prompt blocks already cached on the worker
  (one in its host or disk tier counting ``tier_weight``) minus ``load_weight * load``
  (load in requests, or in blocks for tokens);
  ties go to the lower load, then round robin.
- ``session``: a request with a session id goes to the same worker every time,
  from every orchestrator process, with no shared table: rendezvous hashing
  (highest hash of session id + worker id) over the candidates, so a worker
  joining or leaving moves only its own sessions. Without a session id it is
  ``kv_cache_aware``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from orchestrator.config import RouterConfig

__all__ = ["Candidate", "RouteRequest", "Router", "make_router"]


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    load_requests: int = 0
    load_tokens: int = 0
    matched_blocks: int = 0  # leading prompt blocks the worker holds, in its pool or a tier below it
    block_size: int = 16
    matched_lower_blocks: int = 0  # of those, the ones in its host or disk tier


@dataclass(frozen=True)
class RouteRequest:
    num_tokens: int
    session_id: str | None = None


@dataclass
class Router:
    config: RouterConfig
    counter: int = field(default=0)

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest) -> Candidate:
        if not candidates:
            raise ValueError("no candidates")
        policy = self.config.policy
        if policy == "session" and request.session_id is not None:
            return _rendezvous(candidates, request.session_id)
        if policy == "round_robin":
            return self._rotate(candidates, candidates)
        if policy == "least_load":
            return self._best(candidates, lambda c: -self._load(c))
        return self._best(candidates, lambda c: self._matched(c) - self.config.load_weight * self._load(c),
                          tie=lambda c: -self._load(c))

    def _matched(self, candidate: Candidate) -> float:
        lower = candidate.matched_lower_blocks
        return candidate.matched_blocks - lower + self.config.tier_weight * lower

    def _load(self, candidate: Candidate) -> float:
        if self.config.load_metric == "tokens":
            return candidate.load_tokens / max(candidate.block_size, 1)
        return float(candidate.load_requests)

    def _best(self, candidates: Sequence[Candidate], score: Callable[[Candidate], float],
              tie: Callable[[Candidate], float] | None = None) -> Candidate:
        key = (lambda c: (score(c), tie(c))) if tie is not None else (lambda c: (score(c),))
        best = max(key(c) for c in candidates)
        return self._rotate(candidates, [c for c in candidates if key(c) == best])

    def _rotate(self, candidates: Sequence[Candidate], tied: Sequence[Candidate]) -> Candidate:
        # The counter walks the full candidate list, so ties rotate fairly as loads change.
        start = self.counter % len(candidates)
        self.counter += 1
        tied_ids = {c.worker_id for c in tied}
        for offset in range(len(candidates)):
            candidate = candidates[(start + offset) % len(candidates)]
            if candidate.worker_id in tied_ids:
                return candidate
        raise AssertionError("unreachable: tied is a subset of candidates")


def _rendezvous(candidates: Sequence[Candidate], session_id: str) -> Candidate:
    def weight(candidate: Candidate) -> bytes:
        return hashlib.blake2b(f"{session_id}\0{candidate.worker_id}".encode(), digest_size=8).digest()

    return max(candidates, key=weight)


def make_router(config: RouterConfig) -> Router:
    return Router(config)
