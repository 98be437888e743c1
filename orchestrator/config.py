"""The orchestrator's configuration: frozen, typed, errors that name the key.

``disagg up`` renders it from the deployment YAML into ``<run dir>/orchestrator.json``;
``disagg orchestrator --config FILE`` reads that file (JSON or YAML, the keys below).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from api.api_key import KeyFileError, read_key_file
from api.body_limit import DEFAULT_MAX_REQUEST_BYTES
from common.log_format import LOG_FORMATS
from orchestrator.typed import ConfigError, from_mapping, to_mapping

__all__ = [
    "RouterConfig", "ConditionalDisaggConfig", "KVPoolConfig", "HealthConfig", "TimeoutConfig", "TracingConfig", "StaticWorker",
    "OrchestratorSettings", "OrchestratorConfig", "load_orchestrator_config", "ROUTER_POLICIES", "WORKER_ROLES",
    "DEFAULT_MAX_CONCURRENT_REQUESTS", "DEFAULT_MAX_UPLOAD_BYTES", "LiveSettings", "LOG_LEVELS",
    "check_worker_key_file",
]

DEFAULT_MAX_UPLOAD_BYTES = 200 * 1024 * 1024  # OpenAI's limit on a batch input file
DEFAULT_MAX_CONCURRENT_REQUESTS = 2048  # per process: far above a worker pool's batches, far below exhaustion
ROUTER_POLICIES = ("round_robin", "least_load", "kv_cache_aware", "session")
WORKER_ROLES = ("ctx", "gen", "both")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


@dataclass(frozen=True)
class RouterConfig:
    policy: str = "round_robin"
    """round_robin | least_load | kv_cache_aware | session."""
    load_metric: str = "requests"
    """What least_load (and the load term of kv_cache_aware) counts in flight: requests | tokens."""
    load_weight: float = 1.0
    """kv_cache_aware: score = matched prefix blocks - load_weight * load (load in blocks for
    tokens, in requests otherwise)."""
    tier_weight: float = 0.5
    """kv_cache_aware: what a matched block in a worker's host or disk KV tier counts for, against 1
    for one in its pool (it is copied back, not recomputed: cheaper than a miss, dearer than a hit)."""

    def validate(self, prefix: str) -> None:
        if self.policy not in ROUTER_POLICIES:
            raise ConfigError(f"{prefix}.policy", f"must be one of {', '.join(ROUTER_POLICIES)}, got {self.policy!r}")
        if self.load_metric not in ("requests", "tokens"):
            raise ConfigError(f"{prefix}.load_metric", f"must be requests or tokens, got {self.load_metric!r}")
        if self.load_weight < 0:
            raise ConfigError(f"{prefix}.load_weight", f"must be >= 0, got {self.load_weight}")
        if not 0 <= self.tier_weight <= 1:
            raise ConfigError(f"{prefix}.tier_weight", f"must be in [0, 1], got {self.tier_weight}")


@dataclass(frozen=True)
class ConditionalDisaggConfig:
    """When to skip the ctx leg and send a normal request to the gen worker."""

    enabled: bool = True
    max_local_prefill_tokens: int = 32
    """Skip the ctx leg when the prompt tokens the gen worker does not hold are at most this."""
    min_cached_fraction: float = 0.8
    """Skip the ctx leg when the gen worker holds at least this fraction of the prompt's blocks."""

    def validate(self, prefix: str) -> None:
        if self.max_local_prefill_tokens < 0:
            raise ConfigError(f"{prefix}.max_local_prefill_tokens", "must be >= 0")
        if not 0.0 < self.min_cached_fraction <= 1.0:
            raise ConfigError(f"{prefix}.min_cached_fraction", f"must be in (0, 1], got {self.min_cached_fraction}")


@dataclass(frozen=True)
class KVPoolConfig:
    """The deployment-wide KV pool (``orchestrator.kv_pool``): a ctx leg pulls the leading blocks of
    its prompt that another worker holds, when moving them is cheaper than computing them."""

    enabled: bool = False
    min_blocks: int = 2
    """Fetch only when the holder has at least this many more leading blocks than the ctx worker."""
    transfer_tokens_per_second: float = 0.0
    """How many tokens' KV the transfer path moves per second (its bandwidth / KV bytes per token);
    0: measured from the pulls of the fetches (a moving average)."""
    overhead_seconds: float = 0.01
    """A fetch's fixed cost: the export leg to the holder (an HTTP round trip, one block's prefill)."""
    prefill_tokens_per_second: float = 0.0
    """The ctx workers' prefill speed; 0: measured from the ctx legs (a moving average)."""

    def validate(self, prefix: str) -> None:
        if self.min_blocks < 1:
            raise ConfigError(f"{prefix}.min_blocks", f"must be >= 1, got {self.min_blocks}")
        if self.transfer_tokens_per_second < 0:
            raise ConfigError(f"{prefix}.transfer_tokens_per_second",
                              f"must be >= 0 (0: measured), got {self.transfer_tokens_per_second}")
        if self.overhead_seconds < 0:
            raise ConfigError(f"{prefix}.overhead_seconds", f"must be >= 0, got {self.overhead_seconds}")
        if self.prefill_tokens_per_second < 0:
            raise ConfigError(f"{prefix}.prefill_tokens_per_second",
                              f"must be >= 0 (0: measured), got {self.prefill_tokens_per_second}")


@dataclass(frozen=True)
class HealthConfig:
    interval_seconds: float = 1.0
    """How often the leader checks every worker's /health and drains its KV events."""
    timeout_seconds: float = 2.0
    unhealthy_threshold: int = 2
    """Consecutive failed checks before a worker leaves the rotation."""
    healthy_threshold: int = 1
    """Consecutive good checks before it (re)joins."""
    registration_ttl_seconds: float = 10.0
    """A self-registered worker without a heartbeat for this long is dropped."""

    def validate(self, prefix: str) -> None:
        for name in ("interval_seconds", "timeout_seconds", "registration_ttl_seconds"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{prefix}.{name}", "must be > 0")
        for name in ("unhealthy_threshold", "healthy_threshold"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{prefix}.{name}", "must be >= 1")


@dataclass(frozen=True)
class MigrationConfig:
    """A streamed answer whose gen worker fails mid-stream (its process or engine dies, its
    connection drops, its engine stalls) goes on, token-exact, on another gen worker
    (``orchestrator.migration``, docs/operations.md "Migration")."""

    limit: int = 3
    """Moves per request (Dynamo's ``--migration-limit``); 0: a failed stream ends with the API's
    error event, and gen legs stream unmarked."""
    max_carried_tokens: int = 16384
    """A stream that already holds more output tokens than this is not moved (its resume would
    prefill them all again): it ends with the error event."""

    def validate(self, prefix: str) -> None:
        if self.limit < 0:
            raise ConfigError(f"{prefix}.limit", f"must be >= 0 (0: no migration), got {self.limit}")
        if self.max_carried_tokens < 1:
            raise ConfigError(f"{prefix}.max_carried_tokens", f"must be >= 1, got {self.max_carried_tokens}")


@dataclass(frozen=True)
class TimeoutConfig:
    connect_seconds: float = 5.0
    request_seconds: float = 600.0
    """Whole request (both legs, all retries); a stream past it ends with an error event."""
    idle_seconds: float = 120.0
    """Longest wait for the next byte from a worker."""

    def validate(self, prefix: str) -> None:
        for name in ("connect_seconds", "request_seconds", "idle_seconds"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{prefix}.{name}", "must be > 0")


@dataclass(frozen=True)
class TracingConfig:
    """OpenTelemetry spans of every request (``api.tracing``), exported over OTLP/HTTP; off
    while ``otlp_endpoint`` is unset (nothing is imported, no span is made)."""

    otlp_endpoint: str | None = None
    """The collector's OTLP/HTTP base URL, e.g. http://127.0.0.1:4318 (spans go to ``<it>/v1/traces``)."""
    service_name: str = "disagg"
    """The orchestrator's spans carry ``service.name`` ``<it>-orchestrator``, a ctx worker's
    ``<it>-ctx``, a gen worker's ``<it>-gen``."""
    sample_ratio: float = 1.0
    """The share of requests traced (by trace id), where the client sent no ``traceparent`` (one
    it sent decides: its sampled flag); the workers follow the orchestrator's decision."""

    def validate(self, prefix: str) -> None:
        if self.otlp_endpoint is not None:
            if not self.otlp_endpoint.startswith(("http://", "https://")):
                raise ConfigError(f"{prefix}.otlp_endpoint", f"must be an http(s) URL, got {self.otlp_endpoint!r}")
            from api.tracing import require_sdk

            require_sdk(f"{prefix}.otlp_endpoint")
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ConfigError(f"{prefix}.sample_ratio", f"must be in [0, 1], got {self.sample_ratio}")
        if not self.service_name or any(c.isspace() for c in self.service_name):
            raise ConfigError(f"{prefix}.service_name", f"must be a word without spaces, got {self.service_name!r}")

    @property
    def enabled(self) -> bool:
        return self.otlp_endpoint is not None


@dataclass(frozen=True)
class StaticWorker:
    role: str
    url: str

    def validate(self, prefix: str) -> None:
        if self.role not in WORKER_ROLES:
            raise ConfigError(f"{prefix}.role", f"must be one of {', '.join(WORKER_ROLES)}, got {self.role!r}")
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"{prefix}.url", f"must be an http(s) URL, got {self.url!r}")


@dataclass(frozen=True)
class LiveSettings:
    """The orchestrator's settings that change while it runs (``disagg reload``, ``POST /settings``):
    every process applies them to its next request. The fields are ``OrchestratorConfig``'s."""

    ctx_router: RouterConfig = field(default_factory=RouterConfig)
    gen_router: RouterConfig = field(default_factory=RouterConfig)
    conditional: ConditionalDisaggConfig = field(default_factory=ConditionalDisaggConfig)
    kv_pool: KVPoolConfig = field(default_factory=KVPoolConfig)
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    max_retries: int = 2
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS
    """Between two limits only: to or from 0 (no limit) needs a restart (requests admitted without a
    count would be released against one)."""
    log_level: str = "info"

    def validate(self, prefix: str) -> None:
        if self.max_retries < 0:
            raise ConfigError(f"{prefix}.max_retries", "must be >= 0")
        if self.max_concurrent_requests < 0:
            raise ConfigError(f"{prefix}.max_concurrent_requests",
                              f"must be >= 0 (0: no limit), got {self.max_concurrent_requests}")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"{prefix}.log_level", f"must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")


LIVE_FIELDS = tuple(f.name for f in dataclasses.fields(LiveSettings))


@dataclass(frozen=True)
class OrchestratorSettings:
    """The deployment YAML's ``orchestrator:`` section (``disagg.deploy_config``): every setting of the
    orchestrator a user writes, declared here once; ``OrchestratorConfig`` adds what the launcher wires."""

    host: str = "127.0.0.1"
    port: int = 8000
    processes: int = 1
    """K_o HTTP processes on the port (SO_REUSEPORT)."""
    ctx_router: RouterConfig = field(default_factory=RouterConfig)
    gen_router: RouterConfig = field(default_factory=RouterConfig)
    conditional: ConditionalDisaggConfig = field(default_factory=ConditionalDisaggConfig)
    kv_pool: KVPoolConfig = field(default_factory=KVPoolConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    max_retries: int = 2
    """Extra workers tried per leg when one fails before the client saw a byte."""
    api_key: str | None = None
    """Clients must send it (Authorization: Bearer KEY or x-api-key: KEY) on every route but /health;
    None = open."""
    served_model_name: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    """Request bodies over this are refused with 413 before they are buffered."""
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES
    """``POST /v1/files`` bodies (a batch's input file) over this are refused with 413 instead (the
    upload is held in memory once while the leader stores it)."""
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS
    """Generation requests each process serves at once (0: no limit); more get 429 with
    Retry-After at once (``api.admission``), never an unbounded queue."""
    max_queued_requests: int = 0
    """Client requests the whole orchestrator holds without a first token yet (before their ctx
    leg's answer, or their gen leg's first byte), each of its processes ceil(limit / processes);
    past it a request gets 429 (Anthropic: 529) with Retry-After at once, before any leg (0: no bound)."""
    max_queued_prompt_tokens: int = 0
    """The prompt tokens of those queued requests, shared out the same way; a request alone in its
    process's queue is never refused for its length (0: no bound)."""
    grace_seconds: float = 30.0
    """At shutdown (SIGTERM, `disagg down`) every process stops accepting and lets in-flight
    requests finish this long before cutting them (each cut one ends with the API's error).
    At least the workers' ``--grace-seconds`` (30), so that the orchestrator, stopped first,
    does not cut what the workers would still finish; the supervisor waits at least as long for
    it as for the workers (``disagg.deployment``)."""
    max_process_restarts: int = 5
    process_restart_window_seconds: float = 300.0
    """Process 0 respawns a non-zero process that died while it has died fewer than
    ``max_process_restarts`` times in the window (``common.restart_budget``)."""
    log_level: str = "info"
    """debug | info | warning | error | critical (changes live: ``disagg reload``)."""

    def validate(self, prefix: str) -> None:
        if not 1 <= self.processes <= 64:
            raise ConfigError(f"{prefix}.processes", f"must be in [1, 64], got {self.processes}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"{prefix}.port", f"must be in [0, 65535], got {self.port}")
        self.live().validate(prefix)
        if self.api_key == "":
            raise ConfigError(f"{prefix}.api_key", "must not be empty (omit it for no key)")
        if self.max_request_bytes < 1024:
            raise ConfigError(f"{prefix}.max_request_bytes", f"must be >= 1024, got {self.max_request_bytes}")
        if self.max_upload_bytes < 1024:
            raise ConfigError(f"{prefix}.max_upload_bytes", f"must be >= 1024, got {self.max_upload_bytes}")
        if not 0 < self.grace_seconds <= 3600:
            raise ConfigError(f"{prefix}.grace_seconds", f"must be in (0, 3600], got {self.grace_seconds}")
        if self.max_process_restarts < 0:
            raise ConfigError(f"{prefix}.max_process_restarts", f"must be >= 0, got {self.max_process_restarts}")
        if self.process_restart_window_seconds <= 0:
            raise ConfigError(f"{prefix}.process_restart_window_seconds",
                              f"must be > 0, got {self.process_restart_window_seconds}")
        for name in ("max_queued_requests", "max_queued_prompt_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{prefix}.{name}", f"must be >= 0 (0: no bound), got {getattr(self, name)}")

    def live(self) -> LiveSettings:
        return LiveSettings(**{name: getattr(self, name) for name in LIVE_FIELDS})


@dataclass(frozen=True, kw_only=True)
class OrchestratorConfig(OrchestratorSettings):
    """What one orchestrator runs with: its YAML section and what the launcher wires in (the model,
    the state directory, the static workers, the worker key, the deployment-wide log and request
    settings). ``disagg up`` writes it as ``<run dir>/orchestrator.json``."""

    model_dir: str
    """The model directory whose tokenizer the orchestrator loads (it tokenizes once, to route)."""
    state_dir: str
    """Runtime files: the leader's state socket and the Prometheus multiprocess directory."""
    migration: MigrationConfig = field(default_factory=MigrationConfig)
    worker_key_file: str | None = None
    """A file (mode 0600) holding the deployment's worker key, presented to every worker on every call
    (``api.api_key``); ``disagg up`` sets it to ``<run dir>/worker.key``. None: workers need none."""
    workers: tuple[StaticWorker, ...] = ()
    """Static workers; more may register themselves at run time."""
    default_block_size: int = 16
    default_hash_seed: int = 0
    """Block hashing for workers that do not report theirs in /worker_info."""
    perf_records: int = 1000
    log_format: str = "text"
    """text, or json: one object a line (``common.log_format``)."""
    tracing: TracingConfig = field(default_factory=TracingConfig)
    strict_request_fields: bool = False
    """An unknown top-level request field is a 400 naming it; False: ignored, named in a ``Warning``
    header (``api.request_fields``)."""
    access_log: bool = False
    """One INFO line per client request on the ``disagg.access`` logger (method, path, status, latency,
    workers, tokens, request id); uvicorn's access lines for the other routes, polls at DEBUG."""
    prometheus_targets_dir: str | None = None
    """Process 0 keeps Prometheus file_sd target files here (``orchestrator.prometheus_sd``):
    itself and every worker it knows; ``disagg up`` sets it to ``<run dir>/prometheus/targets``."""

    def validate(self, prefix: str) -> None:
        super().validate(prefix)
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(f"{prefix}.log_format", f"must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}")

    def with_live(self, live: LiveSettings) -> OrchestratorConfig:
        return dataclasses.replace(self, **{name: getattr(live, name) for name in LIVE_FIELDS})

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_dir).resolve().name

    @property
    def state_socket(self) -> str:
        return str(Path(self.state_dir) / "state.sock")

    def to_json(self) -> str:
        return json.dumps(to_mapping(self), indent=2)


def load_orchestrator_config(path: str | Path) -> OrchestratorConfig:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))  # JSON is YAML
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(str(path), f"cannot read: {exc}") from exc
    try:
        return from_mapping(OrchestratorConfig, data, "orchestrator")
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc.key}", str(exc).split(": ", 1)[1]) from None


def check_worker_key_file(config: OrchestratorConfig, path: str | Path) -> None:
    """At start-up, not at the first call to a worker: a worker key file that cannot be used is a
    ConfigError naming the key (``path``: the config file)."""
    if config.worker_key_file is not None:
        try:
            read_key_file(config.worker_key_file)
        except KeyFileError as exc:
            raise ConfigError(f"{path}: orchestrator.worker_key_file", str(exc)) from None
