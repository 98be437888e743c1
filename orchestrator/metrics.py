"""The orchestrator's Prometheus metrics, summed over its K_o processes.

``orchestrator.server`` exports ``PROMETHEUS_MULTIPROC_DIR`` (a fresh
directory under the state dir) before any process imports prometheus_client,
so every process writes its own files and ``render()`` in any process
collects all of them. Phases: ``ctx`` (the context_only leg, to its answer),
``gen`` (the generation leg, to its last byte; first byte separately),
``e2e`` (the client's request, arrival to last byte), ``ttft`` (a streamed
answer: the client's request, arrival to the first byte relayed to it).

The label values that a dashboard plots are created at zero up front
(``_KNOWN_LABELS``), so "no retries yet" is a 0 series, not a missing one.

Batched writes: in multiprocess mode every ``inc`` is a write to a shared
file (and a ``getpid``), a dozen per streamed request (a histogram
observation is two), a tenth of the orchestrator's CPU per request. The
request path counts in memory instead (``count_leg``, ``count_served``,
``observe``) and ``flush()`` writes the sums: within ``FLUSH_SECONDS``, at
once when the process has nothing in flight (``Flow.finish``: a lone request
is in the next scrape), before this process renders, and at shutdown. Error
and retry counters are written as they happen (rare).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from api.admission import Limit
from api.metric_batch import MetricBatch
from api.piece_cache import PieceCache, count_lookups
from api.process_metrics import ProcessMetrics
from api.streaming import ClientDisconnected

__all__ = ["Metrics", "CONTENT_TYPE", "FLUSH_SECONDS"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# (phase) and (phase, kind) values the flow uses; exception names under phase "request" come on top.
_KNOWN_PHASES = ("ctx", "gen")
_KNOWN_ERRORS = (("ctx", "upstream"), ("ctx", "leg_refused"), ("ctx", "overloaded"), ("gen", "upstream"),
                 ("gen", "overloaded"), ("gen", "unavailable"), ("gen", "timeout"), ("gen", "stream"))
FLUSH_SECONDS = 0.1
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Metrics:
    """``piece_cache``: the validator's tokenizer's (``Tokenizer.piece_cache``), whose lookups it exports."""

    def __init__(self, piece_cache: PieceCache | None = None) -> None:
        # Own registry: the default one would also export this process's own
        # (non-multiprocess) collectors, double counting under K_o > 1.
        self.registry = CollectorRegistry()
        prefix = "disagg_orchestrator"
        self.requests = Counter(f"{prefix}_requests", "Client requests by API and how they were served",
                                ["api", "mode"], registry=self.registry)
        self.phase_seconds = Histogram(f"{prefix}_phase_seconds", "Latency per phase (ctx, gen, gen_first_byte, ttft, e2e)",
                                       ["phase"], buckets=_BUCKETS, registry=self.registry)
        self.legs = Counter(f"{prefix}_legs", "Legs sent to workers (ctx, gen), retries included", ["phase"],
                            registry=self.registry)
        self.retries = Counter(f"{prefix}_retries", "Legs retried on another worker", ["phase"],
                               registry=self.registry)
        self.errors = Counter(f"{prefix}_errors", "Requests that failed, by phase and kind", ["phase", "kind"],
                              registry=self.registry)
        # A client that leaves is no failure of ours: counted here, never in ``errors``.
        self.disconnects = Counter(f"{prefix}_client_disconnects", "Client requests the client left before their "
                                   "end (phase request: before the answer started; gen: mid-stream)", ["phase"],
                                   registry=self.registry)
        for phase in ("request", "gen"):
            self.disconnects.labels(phase)
        self.kv_pool_fetches = Counter(f"{prefix}_kv_pool_fetches", "KV-pool exports for a ctx leg: parked on "
                                       "the holder, or failed (the ctx worker computed the prefix)", ["outcome"],
                                       registry=self.registry)
        for outcome in ("parked", "failed"):
            self.kv_pool_fetches.labels(outcome)
        self.kv_pool_tokens = Counter(f"{prefix}_kv_pool_fetched_tokens", "Prompt tokens whose KV a ctx leg was "
                                      "sent to pull from the KV pool instead of computing", registry=self.registry)
        # Rare, written as they happen: a stream moved to another gen worker mid-answer, or not.
        self.migrations = Counter(f"{prefix}_migrations", "Streams whose gen worker failed mid-answer, by outcome: "
                                  "moved (resumed on another gen worker), failed (no worker took it), "
                                  "refused (past migration.limit or max_carried_tokens, or the deadline)",
                                  ["outcome"], registry=self.registry)
        for outcome in ("moved", "failed", "refused"):
            self.migrations.labels(outcome)
        self.refused = Counter(f"{prefix}_requests_refused", "Client requests refused for overload (429, Anthropic "
                               "529, with Retry-After), by limit: this process's concurrent_requests, the "
                               "orchestrator's queued_requests or queued_prompt_tokens, or workers (every "
                               "generation worker tried refused)", ["limit"], registry=self.registry)
        for limit in Limit.ALL:
            self.refused.labels(limit)
        for phase in _KNOWN_PHASES:
            self.retries.labels(phase)
            self.legs.labels(phase)
        for phase, kind in _KNOWN_ERRORS:
            self.errors.labels(phase, kind)
        # The labelled children the request path touches, looked up once: ``labels()`` takes a lock
        # and builds a key on every call (a few microseconds each, five or six per request).
        self._phases: dict[str, Histogram] = {}
        self._legs: dict[str, Counter] = {}
        self._served: dict[tuple[str, str], Counter] = {}
        # What the request path counted since the last flush (module docstring: batched writes).
        self._batch = MetricBatch(FLUSH_SECONDS)
        lookups = Counter(f"{prefix}_prompt_piece_cache_lookups", "Long chat-prompt pieces looked up in the "
                          "tokenizer's piece cache (hit: not tokenized again).", ["result"], registry=self.registry)
        count_lookups(piece_cache, lookups, self._batch)
        # Sampled, not counted per request (a file write each): ``Orchestrator`` sets it at every
        # sample of ``process`` and before a scrape.
        self.in_flight = Gauge(f"{prefix}_requests_in_flight", "Client requests with a leg running at a worker, "
                               "summed over the orchestrator's processes", registry=self.registry,
                               multiprocess_mode="livesum")
        self.process = ProcessMetrics(self.registry, "orchestrator")

    def count_failure(self, exc: BaseException) -> None:
        """A client request that ended with ``exc`` before its answer: a disconnect or an error."""
        if isinstance(exc, ClientDisconnected):
            self.disconnects.labels("request").inc()
        else:
            self.errors.labels("request", type(exc).__name__).inc()

    def count_refused(self, limit: str) -> None:
        """A client request refused for overload at ``limit`` (``api.admission.OnRefused``)."""
        self.refused.labels(limit).inc()

    def phase(self, name: str) -> Histogram:
        """``phase_seconds`` of one phase."""
        child = self._phases.get(name)
        if child is None:
            child = self._phases[name] = self.phase_seconds.labels(name)
        return child

    def leg(self, phase: str) -> Counter:
        """``legs`` of one phase."""
        child = self._legs.get(phase)
        if child is None:
            child = self._legs[phase] = self.legs.labels(phase)
        return child

    def served(self, api: str, mode: str) -> Counter:
        """``requests`` of one API and mode."""
        child = self._served.get((api, mode))
        if child is None:
            child = self._served[(api, mode)] = self.requests.labels(api, mode)
        return child

    # -- the request path: batched (api.metric_batch) -----------------------------------

    def count_leg(self, phase: str) -> None:
        self._batch.count(self.leg(phase))

    def count_served(self, api: str, mode: str) -> None:
        self._batch.count(self.served(api, mode))

    def observe(self, phase: str, seconds: float) -> None:
        self._batch.observe(self.phase(phase), seconds)

    def flush(self) -> None:
        """Write what the request path counted into the shared files now."""
        self._batch.flush()

    def render(self, workers: Iterable[WorkerHealth] = ()) -> bytes:
        """The exposition text; ``workers``: the registry as this process sees it (every process holds
        the owner's snapshot), rendered from memory rather than the shared files, so a worker that
        left the registry leaves no stale series."""
        self.flush()
        self.process.sample()
        health = CollectorRegistry()
        health.register(_WorkerHealthCollector(list(workers)))
        if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
            return generate_latest(self.registry) + generate_latest(health)
        collector_registry = CollectorRegistry()
        MultiProcessCollector(collector_registry)  # type: ignore[no-untyped-call]  # prometheus_client: unannotated
        return generate_latest(collector_registry) + generate_latest(health)


WorkerHealth = tuple[str, str, str, bool, bool]
"""(worker id, url, role, healthy, degraded) of one worker."""


class _WorkerHealthCollector:
    def __init__(self, workers: list[WorkerHealth]) -> None:
        self.workers = workers

    def collect(self) -> Iterator[GaugeMetricFamily]:
        # Not "role": the orchestrator's scrape target carries role="orchestrator" (orchestrator.prometheus_sd).
        labels = ["worker", "worker_url", "worker_role"]
        healthy = GaugeMetricFamily("disagg_orchestrator_worker_healthy", "1 while the orchestrator routes to "
                                    "the worker (its health checks pass), 0 otherwise", labels=labels)
        degraded = GaugeMetricFamily("disagg_orchestrator_worker_degraded", "1 while the worker serves with "
                                     "fewer frontends than configured (one left down by its restart budget)",
                                     labels=labels)
        for worker_id, url, role, is_healthy, is_degraded in self.workers:
            healthy.add_metric([worker_id, url, role], 1.0 if is_healthy else 0.0)
            degraded.add_metric([worker_id, url, role], 1.0 if is_degraded else 0.0)
        yield healthy
        yield degraded

