"""Prometheus metrics of a worker: ``GET /prometheus/metrics`` on every frontend.

Multiprocess mode: the launcher sets ``PROMETHEUS_MULTIPROC_DIR`` (inside the
worker's IPC directory) before it spawns anything, so every process of the
worker writes its samples there and any frontend's scrape sums them: request
counters and latency histograms of all K frontends add up in every scrape.
The engine gauges and ``disagg_config_info`` are written by the launcher
alone (``LauncherMetrics``), so each appears once per scrape; the launcher
refreshes them every second and before each scrape it answers itself. When a
frontend dies the launcher marks its files dead (``mark_process_dead``).

Without the variable (a single in-process app, as in the unit tests) the
process's own registry is rendered. prometheus_client chooses its mode when
it is first imported, so nothing here imports it at module level and
``disagg serve`` sets the variable before anything could import it.
"""

from __future__ import annotations

import os
from typing import Any

from api.admission import Limit
from api.metric_batch import MetricBatch
from api.piece_cache import PieceCache, count_lookups
from api.process_metrics import ProcessMetrics
from workers.engine.kv_tiers import TierStats
from workers.protocol import PerfRecord

__all__ = ["MULTIPROC_ENV", "FrontendMetrics", "LauncherMetrics", "render", "mark_process_dead", "CONTENT_TYPE"]

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
# Counted requests reach the shared files within this (or at once when the frontend is idle).
FLUSH_SECONDS = 0.1
_RATE_BUCKETS = tuple(float(10 ** e) for e in range(5, 12))  # bytes per second: 100 kB/s .. 100 GB/s


def _multiproc_dir() -> str | None:
    return os.environ.get(MULTIPROC_ENV) or None


class FrontendMetrics:
    """Counters and histograms of one frontend process, fed by its perf records; ``piece_cache``:
    its tokenizer's (``Tokenizer.piece_cache``), whose lookups it exports."""

    def __init__(self, piece_cache: PieceCache | None = None, process: str = "frontend") -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # process_* of this process (and, for the launcher, its engine's) and disagg_build_info;
        # the app's lifespan starts its sampling thread (api.process_metrics).
        self.process = ProcessMetrics(r, process)
        # 1 per live frontend process, summed over the live ones: the frontends serving the port
        # (a dead frontend's file is dropped by ``mark_process_dead``).
        self.frontends = Gauge("disagg_frontends", "Frontend processes serving the worker's port.", registry=r,
                               multiprocess_mode="livesum")
        self.frontends.set(1)
        self.success = Counter("disagg_request_success", "Requests that finished with an answer.",
                               ["finished_reason"], registry=r)
        self.failure = Counter("disagg_request_failure",
                               "Requests that ended without an answer (abort: by the engine; incomplete: the "
                               "client left or the engine died).", ["reason"], registry=r)
        self.prompt_tokens = Counter("disagg_prompt_tokens", "Prompt tokens of ended requests.", registry=r)
        self.cached_tokens = Counter("disagg_prompt_cached_tokens", "Prompt tokens found in the prefix cache.",
                                     registry=r)
        self.generation_tokens = Counter("disagg_generation_tokens", "Generated tokens.", registry=r)
        self.ttft = Histogram("disagg_time_to_first_token_seconds", "Frontend arrival to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("disagg_e2e_request_latency_seconds", "Frontend arrival to finish.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("disagg_inter_token_latency_seconds", "Mean time between the output tokens of a "
                             "request (first token to finish over the tokens after the first).",
                             buckets=_ITL_BUCKETS, registry=r)
        self.queue = Histogram("disagg_request_queue_time_seconds", "Engine arrival to first scheduled.",
                               buckets=_LATENCY_BUCKETS, registry=r)
        self.tokenization = Histogram("disagg_tokenization_seconds", "Frontend arrival to sent to the engine.",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.kv_transfer = Histogram("disagg_kv_transfer_seconds", "Disaggregated gen leg: time to pull the "
                                     "prompt's KV from the ctx engine.", buckets=_LATENCY_BUCKETS, registry=r)
        self.kv_transfer_bytes = Counter("disagg_kv_transfer_bytes", "KV bytes pulled from ctx engines.",
                                         registry=r)
        self.kv_transfer_rate = Histogram("disagg_kv_transfer_bytes_per_second", "KV pull rate per request.",
                                          buckets=_RATE_BUCKETS, registry=r)
        self.kv_recomputed = Counter("disagg_kv_transfer_recomputed", "Disaggregated gen legs whose KV pull failed "
                                     "(ctx engine gone, parked KV expired): the gen engine prefilled the prompt "
                                     "itself.", registry=r)
        self.refused = Counter("disagg_requests_refused", "Generation requests refused at an admission limit "
                               "(429, Anthropic 529, with Retry-After; api.admission), by limit.", ["limit"],
                               registry=r)
        self._refused = {limit: self.refused.labels(limit) for limit in Limit.ALL if limit != Limit.WORKERS}
        # Created at zero ("no failures" is a 0 series, not none), and looked up once: labels()
        # takes a lock and builds a key per call.
        self._finished = {reason: self.success.labels(reason) for reason in ("stop", "length")}
        self._failed = {reason: self.failure.labels(reason) for reason in ("abort", "incomplete")}
        self._batch = MetricBatch(FLUSH_SECONDS)
        lookups = Counter("disagg_prompt_piece_cache_lookups", "Long chat-prompt pieces looked up in the "
                          "tokenizer's piece cache (hit: not tokenized again).", ["result"], registry=r)
        count_lookups(piece_cache, lookups, self._batch)

    def observe(self, record: PerfRecord) -> None:
        """Count one ended request (batched: written within ``FLUSH_SECONDS``, or by ``flush``)."""
        batch = self._batch
        reason = record.finish_reason
        counter = self._finished.get(reason) if reason is not None else None
        if counter is None:
            counter = self._failed["abort" if reason == "abort" else "incomplete"]
        batch.count(counter)
        batch.count(self.prompt_tokens, record.num_prompt_tokens)
        batch.count(self.cached_tokens, record.num_cached_tokens)
        batch.count(self.generation_tokens, record.num_output_tokens)
        arrival = record.frontend_arrival
        batch.observe(self.tokenization, max(0.0, record.tokenized - arrival))
        batch.observe(self.e2e, max(0.0, record.finished - arrival))
        first_token = record.first_token
        if first_token is not None:
            batch.observe(self.ttft, max(0.0, first_token - arrival))
            if record.num_output_tokens > 1:
                batch.observe(self.itl, max(0.0, record.finished - first_token) / (record.num_output_tokens - 1))
        if record.first_scheduled is not None and record.engine_arrival is not None:
            batch.observe(self.queue, max(0.0, record.first_scheduled - record.engine_arrival))
        if record.kv_recomputed:
            batch.count(self.kv_recomputed, 1)
        if record.kv_transfer_seconds is not None:
            batch.observe(self.kv_transfer, record.kv_transfer_seconds)
            batch.count(self.kv_transfer_bytes, record.kv_transfer_bytes)
            if record.kv_transfer_bytes_per_second is not None:
                batch.observe(self.kv_transfer_rate, record.kv_transfer_bytes_per_second)

    def count_refused(self, limit: str) -> None:
        """A request refused at ``limit`` (``api.admission.OnRefused``), written at once: a burst of
        refusals is a burst of file writes, each far cheaper than the request it spares the engine."""
        self._refused[limit].inc()

    def flush(self) -> None:
        """Write the counted requests into the (shared) metric files now."""
        self._batch.flush()

    def render(self) -> bytes:
        self.flush()
        self.process.sample()
        return render(self.registry)


class LauncherMetrics:
    """What only the launcher writes: engine gauges, config info, admin counters."""

    def __init__(self, registry: Any, config_labels: dict[str, str]) -> None:
        from prometheus_client import Counter, Gauge

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
            return Gauge(name, doc, list(labels), registry=registry, multiprocess_mode="mostrecent")

        self.running = gauge("disagg_num_requests_running", "Requests in the engine's running batch.")
        self.waiting = gauge("disagg_num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("disagg_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0..1).")
        self.kv_used = gauge("disagg_kv_cache_blocks_used", "KV-cache blocks in use.")
        self.engine_up = gauge("disagg_engine_up", "1 while the engine answers the launcher.")
        self.config = gauge("disagg_config_info", "The worker's configuration (value 1).", tuple(config_labels))
        self.config.labels(**config_labels).set(1)
        self.forwarded = Counter("disagg_admin_forwarded_requests", "Requests an attached frontend replayed "
                                 "to the launcher, by route.", ["route"], registry=registry)
        self.tier_blocks = gauge("disagg_kv_tier_blocks", "KV blocks held in the host or disk tier.", ("tier",))
        self.tier_counters = {name: Counter(f"disagg_kv_tier_{name}", doc, list(labels), registry=registry)
                              for name, doc, labels in _TIER_COUNTERS}
        self._last_tiers: TierStats | None = None
        self.spec_drafts = Counter("disagg_spec_decode_draft_tokens", "Speculative draft tokens the engine verified "
                                   "(prompt lookup, engine.num_speculative_tokens).", registry=registry)
        self.spec_accepted = Counter("disagg_spec_decode_accepted_tokens", "Speculative draft tokens the model "
                                     "confirmed (each saved a decode step).", registry=registry)
        self._last_spec = (0, 0)

    def set_engine(self, num_running: int, num_waiting: int, kv_blocks_used: int, kv_blocks_total: int) -> None:
        self.engine_up.set(1)
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.kv_used.set(kv_blocks_used)
        self.kv_usage.set(kv_blocks_used / kv_blocks_total if kv_blocks_total else 0.0)

    def set_engine_down(self) -> None:
        self.engine_up.set(0)

    def set_speculative(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """The speculative-decoding counters moved on by what the engine's cumulative figures grew
        (all of them after an engine restart, which zeroes them), as ``set_tiers`` does."""
        for counter, now, before in ((self.spec_drafts, num_draft_tokens, self._last_spec[0]),
                                     (self.spec_accepted, num_accepted_tokens, self._last_spec[1])):
            grown = now - before if now >= before else now
            if grown:
                counter.inc(grown)
        self._last_spec = (num_draft_tokens, num_accepted_tokens)

    def set_tiers(self, tiers: TierStats) -> None:
        """The tiers' gauges, and their counters moved on by what the engine's cumulative figures
        grew since the last health reply (all of them after an engine restart, which zeroes them)."""
        self.tier_blocks.labels(tier="host").set(tiers.host_blocks)
        self.tier_blocks.labels(tier="disk").set(tiers.disk_blocks)
        last = self._last_tiers
        for field, (name, labels) in _TIER_FIELDS.items():
            now, before = getattr(tiers, field), getattr(last, field) if last is not None else 0
            grown = now - before if now >= before else now
            if grown:
                counter = self.tier_counters[name]
                (counter.labels(**labels) if labels else counter).inc(grown)
        self._last_tiers = tiers


_TIER_COUNTERS = (
    ("hits", "KV blocks a prefix lookup found in the host or disk tier (brought back into the pool).", ("tier",)),
    ("misses", "Prefix lookups past the pool's hits that found nothing below it, or a damaged disk block.", ()),
    ("disk_failures", "Disk-tier blocks missing or failing their digest check when read back.", ()),
    ("evictions", "KV blocks moved out of a tier for room (host: to disk; disk: deleted).", ("tier",)),
    ("bytes", "KV bytes copied out of the pool (offloaded) and back into it (onboarded).", ("direction",)),
)
_TIER_FIELDS: dict[str, tuple[str, dict[str, str]]] = {  # TierStats field -> (counter, its labels)
    "host_hits": ("hits", {"tier": "host"}), "disk_hits": ("hits", {"tier": "disk"}),
    "misses": ("misses", {}), "disk_failures": ("disk_failures", {}),
    "host_evictions": ("evictions", {"tier": "host"}), "disk_evictions": ("evictions", {"tier": "disk"}),
    "bytes_offloaded": ("bytes", {"direction": "offloaded"}), "bytes_onboarded": ("bytes", {"direction": "onboarded"}),
}


def render(registry: Any) -> bytes:
    """The exposition text: every process's samples in multiprocess mode, else ``registry``'s."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    path = _multiproc_dir()
    if path is None:
        return generate_latest(registry)
    merged = CollectorRegistry()
    MultiProcessCollector(merged, path=path)  # type: ignore[no-untyped-call]  # prometheus_client: unannotated
    return generate_latest(merged)


def mark_process_dead(pid: int) -> None:
    """A frontend exited: drop its live-gauge files (its counters keep counting in the sum)."""
    path = _multiproc_dir()
    if path is not None:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, path)  # type: ignore[no-untyped-call]
