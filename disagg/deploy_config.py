"""The deployment YAML (``disagg up CONFIG``), validated into frozen typed objects.

    name: local                     # default: the file's stem; names the run dir
    launcher: local                 # or slurm: one sbatch job (see slurm/ and disagg.slurm_deployment)
    slurm: {partition, account, qos, time_limit, nodes, gpus_per_node, cpus_per_node, mem,
            job_name, env_setup, container: {image, mounts}, extra_sbatch, run_root}  # slurm.config
    run_dir: null                   # default: ./.disagg/<name>
    model: smollm2-135m-instruct    # a model dir, a .gguf file or a short name (disagg.model_names); served
                                    #   under this id as written; a path must exist. "tiny" ->
    tiny_model_size: bench          #   `up` writes a random-weight tiny model into the run dir first
    tiny_model_arch: llama          #   or deepseek_v4 (`disagg make-tiny-model --arch deepseek_v4`'s checkpoint)
    tool_call_parser: null          # hermes | llama3_json; default: detected from the chat template
    engine: {kind, dtype, device, max_model_len, block_size, num_blocks, max_num_seqs,
             max_num_batched_tokens, stream_interval, kv_park_seconds, kv_pull_timeout, synthetic_decode_step_seconds,
             synthetic_prefill_seconds_per_token, synthetic_onboard_seconds_per_block, decode_attention, weights, threads,
             host_tier_bytes, disk_tier_path, disk_tier_bytes, num_speculative_tokens,
             prompt_lookup_max, prompt_lookup_min}
    orchestrator: {host, port, processes, ctx_router, gen_router, conditional, kv_pool, health,
                   timeouts, max_retries, api_key}      # see orchestrator.config
    pools:
      ctx: {instances, frontends, host, base_port, role, tensor_parallel_size, gpus_per_worker,
            engine: {overrides}}
      gen: {...the same}
    startup_timeout_seconds: 600

Every error is a ConfigError whose key names the file and the dotted key,
e.g. ``configs/local.yaml: pools.gen.instances: must be >= 1, got 0``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from api.tool_parsers import TOOL_CALL_PARSERS
from common.log_format import LOG_FORMATS
from disagg.core_partition import validate_threads
from disagg.serve_settings import render_flags
from orchestrator.config import (
    OrchestratorSettings,
    TracingConfig,
)
from orchestrator.typed import ConfigError, from_mapping
from slurm.config import SlurmConfig
from workers.config import DECODE_ATTENTION_MODES, WEIGHT_MODES, SpeculativeConfig, check_tiers
from workers.sampling_params import MAX_STREAM_INTERVAL

__all__ = ["EngineSettings", "OrchestratorSettings", "PoolConfig", "PoolsConfig", "PrometheusSettings", "RestartPolicy",
           "DeployConfig", "load_deploy_config", "render_flags", "resolve_deploy_model", "check_deploy_model",
           "TINY_MODEL", "LAUNCHERS"]

TINY_MODEL = "tiny"
TINY_MODEL_ARCHS = ("llama", "deepseek_v4")
LAUNCHERS = ("local", "slurm")


@dataclass(frozen=True)
class EngineSettings:
    """Engine flags of ``disagg serve``; None = serve's default (or, in a pool, the deployment's)."""

    kind: str | None = None
    dtype: str | None = None
    device: str | None = None
    max_model_len: int | None = None
    block_size: int | None = None
    num_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    stream_interval: int | None = None
    """Tokens per streamed output (SSE event) after the first (serve's --stream-interval, default 1);
    a request's ``stream_interval`` overrides it."""
    kv_park_seconds: float | None = None
    kv_pull_timeout: float | None = None
    """gen role: a KV pull with no progress for this long fails (serve's --kv-pull-timeout, default 30);
    a pull from a ctx engine whose agent is known gone fails at once regardless. The gen engine then
    prefills the request itself."""
    synthetic_decode_step_seconds: float | None = None
    """Synthetic engine's timing model: seconds per decode step (serve's flag of the same name)."""
    synthetic_prefill_seconds_per_token: float | None = None
    synthetic_onboard_seconds_per_block: float | None = None
    """Synthetic engine's timing model: seconds per block brought back from the host or disk tier."""
    host_tier_bytes: int | None = None
    """Host-memory KV tier under each engine's pool (pinned beside a GPU); 0 or unset: no tiers."""
    disk_tier_path: str | None = None
    """Directory of the disk KV tier (each engine writes a subdirectory of its own)."""
    disk_tier_bytes: int | None = None
    """Disk KV tier budget of each engine; needs host_tier_bytes and disk_tier_path."""
    decode_attention: str | None = None
    """auto, native or sdpa: the torch engine's decode attention (serve's --decode-attention)."""
    weights: str | None = None
    """dequantize or quantized: a GGUF model's weights in the torch engine (serve's --weights)."""
    num_speculative_tokens: int | None = None
    """Prompt-lookup draft tokens verified per decode step of a greedy request (serve's
    --num-speculative-tokens, default 0: off); in a disaggregated deployment the gen pool's matter."""
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    """The longest and shortest n-gram a draft lookup matches (serve's flags, defaults 4 and 2)."""
    max_request_bytes: int | None = None
    """Workers answer larger request bodies with 413 before buffering them (serve's --max-request-bytes)."""
    max_concurrent_requests: int | None = None
    """Generation requests one worker serves at once, each of its K frontends admitting ceil(limit / K);
    more get 429 with Retry-After, and the orchestrator tries another worker (serve's
    --max-concurrent-requests; default 4 x max_num_seqs; 0: no limit)."""
    max_queued_requests: int | None = None
    """Requests one worker has sent to its engine that have no first token yet (its queue), each of its
    K frontends holding ceil(limit / K); a request past it gets 429 (Anthropic: 529) with Retry-After and
    the orchestrator tries another worker (serve's --max-queued-requests; default and 0: no bound)."""
    max_queued_prompt_tokens: int | None = None
    """The prompt tokens of those queued requests, shared out the same way; a request alone in the
    queue is never refused for its length (serve's --max-queued-prompt-tokens; default and 0: no bound)."""
    max_perf_records: int | None = None
    perf_record_seconds: float | None = None
    """The launcher keeps at most this many unread per-request perf records, none older than this
    (serve's --max-perf-records, default 10,000, and --perf-record-seconds, default 600)."""
    wedged_seconds: float | None = None
    """An engine silent this long is dead and its worker stops (serve's --engine-wedged-seconds, default
    300); a shorter silence only makes the worker's /health answer 503 until the engine answers again."""

    threads: int | str | None = None
    """torch intra-op threads per engine: auto (the default: the machine's cores shared out between
    the deployment's torch engines), torch (torch's default, every core) or an integer
    (``disagg.core_partition``)."""

    def validate(self, prefix: str) -> None:
        validate_threads(self.threads, f"{prefix}.threads")
        for name in ("synthetic_decode_step_seconds", "synthetic_prefill_seconds_per_token",
                     "synthetic_onboard_seconds_per_block", "host_tier_bytes", "disk_tier_bytes"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"{prefix}.{name}", f"must be >= 0, got {value}")
        for name in ("kv_park_seconds", "kv_pull_timeout", "perf_record_seconds"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"{prefix}.{name}", f"must be > 0, got {value}")
        if self.wedged_seconds is not None and self.wedged_seconds < 10:
            raise ConfigError(f"{prefix}.wedged_seconds", f"must be >= 10 (slow is not dead), got {self.wedged_seconds}")
        if self.kind is not None and self.kind not in ("torch", "synthetic"):
            raise ConfigError(f"{prefix}.kind", f"must be torch or synthetic, got {self.kind!r}")
        if self.dtype is not None and self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"{prefix}.dtype", f"must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.decode_attention is not None and self.decode_attention not in DECODE_ATTENTION_MODES:
            raise ConfigError(f"{prefix}.decode_attention",
                              f"must be auto, native or sdpa, got {self.decode_attention!r}")
        if self.weights is not None and self.weights not in WEIGHT_MODES:
            raise ConfigError(f"{prefix}.weights", f"must be dequantize or quantized, got {self.weights!r}")
        if self.max_request_bytes is not None and self.max_request_bytes < 1024:
            raise ConfigError(f"{prefix}.max_request_bytes", f"must be >= 1024, got {self.max_request_bytes}")
        for name in ("max_concurrent_requests", "max_queued_requests", "max_queued_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"{prefix}.{name}", f"must be >= 0 (0: no limit), got {value}")
        if self.stream_interval is not None and not 1 <= self.stream_interval <= MAX_STREAM_INTERVAL:
            raise ConfigError(f"{prefix}.stream_interval",
                              f"must be in [1, {MAX_STREAM_INTERVAL}], got {self.stream_interval}")
        for name in ("max_model_len", "block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens",
                     "max_perf_records"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{prefix}.{name}", f"must be >= 1, got {value}")
        check_tiers(self.host_tier_bytes, self.disk_tier_path, self.disk_tier_bytes, prefix)
        defaults = SpeculativeConfig()
        SpeculativeConfig(  # the engine's own bounds, named by this section's keys
            num_speculative_tokens=self.num_speculative_tokens or 0,
            prompt_lookup_max=defaults.prompt_lookup_max if self.prompt_lookup_max is None else self.prompt_lookup_max,
            prompt_lookup_min=defaults.prompt_lookup_min if self.prompt_lookup_min is None else self.prompt_lookup_min,
        ).validate(prefix)

    def serve_options(self) -> dict[str, object]:
        """These settings as ``disagg serve`` flags; None values are left to serve's defaults."""
        return {"--engine": self.kind or "torch", "--dtype": self.dtype, "--device": self.device,
                "--max-model-len": self.max_model_len, "--block-size": self.block_size,
                "--num-blocks": self.num_blocks, "--max-num-seqs": self.max_num_seqs,
                "--max-num-batched-tokens": self.max_num_batched_tokens,
                "--stream-interval": self.stream_interval,
                "--synthetic-decode-step-seconds": self.synthetic_decode_step_seconds,
                "--synthetic-prefill-seconds-per-token": self.synthetic_prefill_seconds_per_token,
                "--synthetic-onboard-seconds-per-block": self.synthetic_onboard_seconds_per_block,
                "--kv-host-tier-bytes": self.host_tier_bytes, "--kv-disk-tier-path": self.disk_tier_path,
                "--kv-disk-tier-bytes": self.disk_tier_bytes,
                "--kv-park-seconds": self.kv_park_seconds,
                "--kv-pull-timeout": self.kv_pull_timeout,
                "--decode-attention": self.decode_attention,
                "--weights": self.weights,
                "--num-speculative-tokens": self.num_speculative_tokens,
                "--prompt-lookup-max": self.prompt_lookup_max, "--prompt-lookup-min": self.prompt_lookup_min,
                "--engine-wedged-seconds": self.wedged_seconds,
                "--max-request-bytes": self.max_request_bytes,
                "--max-concurrent-requests": self.max_concurrent_requests,
                "--max-queued-requests": self.max_queued_requests,
                "--max-queued-prompt-tokens": self.max_queued_prompt_tokens,
                "--max-perf-records": self.max_perf_records, "--perf-record-seconds": self.perf_record_seconds,
                "--engine-threads": self.threads if isinstance(self.threads, int) else None}

    def merged(self, overrides: EngineSettings) -> EngineSettings:
        changes = {f.name: getattr(overrides, f.name) for f in dataclasses.fields(overrides)
                   if getattr(overrides, f.name) is not None}
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class PoolConfig:
    instances: int = 1
    frontends: int = 1
    """HTTP frontend processes per worker."""
    host: str = "127.0.0.1"
    base_port: int = 0
    """Instance i listens on base_port + i; 0 = free ports chosen at `up`."""
    engine: EngineSettings = field(default_factory=EngineSettings)
    role: str | None = None
    """The workers' --role; None = the pool's name (ctx or gen). ``both`` makes an aggregated pool."""
    tensor_parallel_size: int = 1
    """Engine ranks per worker (``disagg serve --tensor-parallel-size``); on Slurm one srun task each."""
    gpus_per_worker: int | None = None
    """None: one GPU per TP rank on GPU nodes (slurm.gpus_per_node > 0), none otherwise."""

    def validate(self, prefix: str) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"{prefix}.tensor_parallel_size", f"must be >= 1, got {self.tensor_parallel_size}")
        if self.gpus_per_worker is not None and self.gpus_per_worker < 0:
            raise ConfigError(f"{prefix}.gpus_per_worker", f"must be >= 0, got {self.gpus_per_worker}")
        if self.role is not None and self.role not in ("ctx", "gen", "both"):
            raise ConfigError(f"{prefix}.role", f"must be ctx, gen or both, got {self.role!r}")
        if self.instances < 1:
            raise ConfigError(f"{prefix}.instances", f"must be >= 1, got {self.instances}")
        if not 1 <= self.frontends <= 64:
            raise ConfigError(f"{prefix}.frontends", f"must be in [1, 64], got {self.frontends}")
        if not 0 <= self.base_port < 65536 - self.instances:
            raise ConfigError(f"{prefix}.base_port", f"must leave room for {self.instances} ports")


@dataclass(frozen=True)
class RestartPolicy:
    """How `disagg up` restarts a process that exits unexpectedly: up to ``max_restarts``
    within any ``window_seconds``; past that the process is left down and reported by
    ``disagg status`` while the rest keep serving."""

    max_restarts: int = 5
    window_seconds: float = 600.0

    def validate(self, prefix: str) -> None:
        if self.max_restarts < 0:
            raise ConfigError(f"{prefix}.max_restarts", f"must be >= 0, got {self.max_restarts}")
        if self.window_seconds <= 0:
            raise ConfigError(f"{prefix}.window_seconds", f"must be > 0, got {self.window_seconds}")


@dataclass(frozen=True)
class PrometheusSettings:
    """The ``<run dir>/prometheus.yml`` that `disagg up` writes (``orchestrator.prometheus_sd``)."""

    scrape_interval_seconds: float = 5.0

    def validate(self, prefix: str) -> None:
        if not 0 < self.scrape_interval_seconds <= 3600:
            raise ConfigError(f"{prefix}.scrape_interval_seconds",
                              f"must be in (0, 3600], got {self.scrape_interval_seconds}")


@dataclass(frozen=True)
class PoolsConfig:
    ctx: PoolConfig = field(default_factory=PoolConfig)
    gen: PoolConfig = field(default_factory=PoolConfig)


@dataclass(frozen=True)
class DeployConfig:
    model: str
    name: str = ""
    launcher: str = "local"
    """local: supervised subprocesses on this machine; slurm: one sbatch job (the ``slurm`` section)."""
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    run_dir: str | None = None
    tiny_model_size: str = "bench"
    tiny_model_arch: str = "llama"
    """The architecture of the ``model: tiny`` checkpoint: llama (``tiny_model_size`` sizes it) or
    deepseek_v4 (written through transformers: the dev extra)."""
    tool_call_parser: str | None = None
    """The model's tool-call format (``disagg serve --tool-call-parser``); None: detected from its chat template."""
    engine: EngineSettings = field(default_factory=EngineSettings)
    orchestrator: OrchestratorSettings = field(default_factory=OrchestratorSettings)
    pools: PoolsConfig = field(default_factory=PoolsConfig)
    startup_timeout_seconds: float = 600.0
    access_log: bool = False
    """One INFO line per client request in every worker's and the orchestrator's log, with its request id
    (health and metrics polls only at debug)."""
    strict_request_fields: bool = False
    """An unknown top-level request field is a 400 at the orchestrator and the workers; False: ignored,
    named in a ``Warning`` header (``api.request_fields``)."""
    log_format: str = "text"
    """text, or json (one object a line) for every process: orchestrator, launchers, frontends, engines."""
    tracing: TracingConfig = field(default_factory=TracingConfig)
    """OpenTelemetry spans of every request, over OTLP/HTTP; off while ``tracing.otlp_endpoint`` is unset."""
    restarts: RestartPolicy = field(default_factory=RestartPolicy)
    prometheus: PrometheusSettings = field(default_factory=PrometheusSettings)
    source: str = ""
    """The file this came from (set by the loader)."""

    def validate(self, prefix: str) -> None:
        if self.launcher not in LAUNCHERS:
            raise ConfigError(f"{prefix}launcher", f"must be local or slurm, got {self.launcher!r}")
        if self.tiny_model_size not in ("test", "bench"):
            raise ConfigError(f"{prefix}tiny_model_size", f"must be test or bench, got {self.tiny_model_size!r}")
        if self.tiny_model_arch not in TINY_MODEL_ARCHS:
            raise ConfigError(f"{prefix}tiny_model_arch",
                              f"must be one of {', '.join(TINY_MODEL_ARCHS)}, got {self.tiny_model_arch!r}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError(f"{prefix}tool_call_parser", f"must be one of {', '.join(sorted(TOOL_CALL_PARSERS))}, "
                                                           f"got {self.tool_call_parser!r}")
        if self.startup_timeout_seconds <= 0:
            raise ConfigError(f"{prefix}startup_timeout_seconds", "must be > 0")
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(f"{prefix}log_format", f"must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}")

    @property
    def served_model_name(self) -> str:
        """The model id clients send: ``orchestrator.served_model_name``, else ``model`` as written."""
        return self.orchestrator.served_model_name or self.model

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir) if self.run_dir else Path(".disagg") / self.name

    def engine_for(self, role: str) -> EngineSettings:
        pool = self.pools.ctx if role == "ctx" else self.pools.gen
        return self.engine.merged(pool.engine)

    def pool_specs(self) -> tuple[Any, ...]:
        """The pools as ``slurm.placement.PoolSpec``s (ctx, then gen)."""
        from slurm.placement import PoolSpec

        return tuple(PoolSpec(name=role, instances=pool.instances, frontends=pool.frontends,
                              base_port=pool.base_port, tensor_parallel_size=pool.tensor_parallel_size,
                              gpus_per_worker=pool.gpus_per_worker)
                     for role, pool in (("ctx", self.pools.ctx), ("gen", self.pools.gen)))

    def placement(self) -> tuple[Any, ...]:
        """Every worker's ``WorkerPlacement`` in the Slurm allocation; a ConfigError (key prefixed with
        the file) when the pools do not fit, its message showing the arithmetic."""
        from slurm.placement import place_workers

        try:
            return place_workers(self.pool_specs(), self.slurm.nodes, self.slurm.gpus_per_node, prefix="pools",
                                 reserved_ports={"orchestrator.port": self.orchestrator.port})
        except ConfigError as exc:
            raise ConfigError(f"{self.source}: {exc.key}", str(exc)[len(exc.key) + 2:]) from None


def resolve_deploy_model(config: DeployConfig, run_dir: Path) -> Path:
    """The model ``up`` serves. ``tiny``: ``<run_dir>/model``, a random-weight tiny model written at the
    first ``up`` (the only name that writes one: a path that does not exist is an error, never a
    random model). Anything else is resolved by ``disagg.model_names``."""
    if config.model != TINY_MODEL:
        return check_deploy_model(config)
    path = run_dir / "model"
    if not (path / "config.json").exists():
        if config.tiny_model_arch == "deepseek_v4":
            _write_tiny_dsv4(config, path)
        else:
            from workers.engine.model.tiny import make_tiny_model

            print(f"disagg: writing a random-weight {config.tiny_model_size} model to {path}", flush=True)
            make_tiny_model(path, size=config.tiny_model_size)
    return path.resolve()


def _write_tiny_dsv4(config: DeployConfig, path: Path) -> None:
    try:
        from workers.engine.model.tiny_dsv4 import make_tiny_dsv4

        print(f"disagg: writing a random-weight tiny DeepSeek-V4 model to {path}", flush=True)
        make_tiny_dsv4(path)
    except ImportError as exc:  # transformers writes it: an install without the dev extra cannot
        raise ConfigError(f"{config.source}: tiny_model_arch",
                          f"deepseek_v4 is written through transformers >= 5.24 (pip install -e '.[dev]'): {exc}; "
                          f"or set model: to a DeepSeek-V4 checkpoint directory") from None


def check_deploy_model(config: DeployConfig) -> Path:
    """The path of ``model`` (not ``tiny``: that one is written by ``resolve_deploy_model``); a
    ModelNotFoundError naming the file, the key and what is missing, so ``up`` fails before it starts anything."""
    from disagg.model_names import SHIPPED_MODELS, ModelNotFoundError, resolve_model

    try:
        return resolve_model(config.model).resolve()
    except ModelNotFoundError as exc:
        # Who wanted a random test model (what a missing path once gave) learns how to ask for one.
        hint = "" if config.model in SHIPPED_MODELS else f" (`model: {TINY_MODEL}` writes a random-weight test model)"
        raise ModelNotFoundError(f"{config.source}: {exc}{hint}") from None


def load_deploy_config(path: str | Path, run_dir: str | None = None) -> DeployConfig:
    """Read and validate; ``run_dir`` overrides the file's. Errors name the file and the key."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(str(path), f"cannot read: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(str(path), "must be a YAML mapping")
    data = {**data, "source": str(path)}
    data.setdefault("name", path.stem)
    if run_dir is not None:
        data["run_dir"] = run_dir
    try:
        config = from_mapping(DeployConfig, data, "")
    except ConfigError as exc:
        key = exc.key.lstrip(".")
        raise ConfigError(f"{path}: {key}", str(exc).split(": ", 1)[1]) from None
    if config.model != TINY_MODEL and not config.model:
        raise ConfigError(f"{path}: model", "must name a model directory, a .gguf file, a short model name or 'tiny'")
    if config.launcher == "slurm":
        config.placement()  # refuse a placement that cannot fit, with the arithmetic
    return config
