"""``disagg serve MODEL_DIR``: one worker (a launcher, its engine and K frontends).

The same command runs both roles. Without ``DISAGG_ATTACH_FILE`` it is the
launcher (frontend 0): it checks the port, starts the engine, re-executes
this command K-1 times as attached frontends, serves HTTP itself and prints
the URL once every frontend is ready. With it, it is an attached frontend.
For the synthetic engine MODEL_DIR still supplies the tokenizer (and the
vocabulary size and context length, from its config.json).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import shlex
import shutil
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from api.body_limit import DEFAULT_MAX_REQUEST_BYTES
from api.tool_parsers import TOOL_CALL_PARSERS
from common.log_format import LOG_FORMATS, configure_logging, stdout_line
from disagg.disagg_options import (
    DISAGG_OPTIONS,
    engine_disagg_spec,
    frontend_disagg_config,
    key_from_file,
    start_registration,
)
from disagg.model_names import ModelNotFoundError, default_served_name, resolve_model
from disagg.serve_settings import ServeSettings
from workers.attach import attach_file_from_env, read_attach_file
from workers.config import (
    DECODE_ATTENTION_MODES,
    WEIGHT_MODES,
    CacheConfig,
    ConfigError,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
    SyntheticConfig,
)
from workers.engine.model.deepseek_v4.config import is_deepseek_v4_dir
from workers.ipc import ENGINE_SILENCE_LIMIT, ENGINE_WEDGED_SECONDS, HEARTBEAT_SECONDS
from workers.rank_env import from_environ

__all__ = ["add_serve_arguments", "run_serve", "build_engine_config", "resolve_num_frontends", "READY_MESSAGE"]

log = logging.getLogger("disagg.serve")

MAX_AUTO_FRONTENDS = 8
FRONTEND_WATCH_SECONDS = 0.5
READY_MESSAGE = "disagg serve: ready on"  # the line tools wait for: "<READY_MESSAGE> http://HOST:PORT ..."

# (flag, argparse kwargs): one table, so attached frontends get the same options back.
_OPTIONS: list[tuple[str, dict[str, Any]]] = [
    ("--host", dict(default="127.0.0.1")),
    ("--port", dict(type=int, default=8000)),
    ("--num-frontends", dict(type=int, default=None,
                             help=f"HTTP processes on the port (default: the CPUs available, at most "
                                  f"{MAX_AUTO_FRONTENDS}; 1 = the launcher alone)")),
    ("--engine", dict(choices=("torch", "synthetic"), default="torch")),
    ("--tensor-parallel-size", dict(type=int, default=1,
                                    help="engine ranks of this worker (local: the launcher spawns them; under "
                                         "srun each task runs this command and DISAGG_TP_* say which rank)")),
    ("--role", dict(choices=("both", "ctx", "gen"), default="both")),
    ("--block-size", dict(type=int, default=16)),
    ("--num-blocks", dict(type=int, default=None)),
    ("--max-num-seqs", dict(type=int, default=64)),
    ("--max-num-batched-tokens", dict(type=int, default=2048)),
    ("--stream-interval", dict(type=int, default=1,
                               help="tokens per streamed output (SSE event) after the first; a request's "
                                    "stream_interval overrides it")),
    ("--max-model-len", dict(type=int, default=None)),
    ("--dtype", dict(choices=("float32", "bfloat16", "float16"), default="float32")),
    ("--device", dict(default="auto")),
    ("--synthetic-decode-step-seconds", dict(type=float, default=0.0,
                                             help="synthetic engine: seconds per decode step (load tests)")),
    ("--synthetic-prefill-seconds-per-token", dict(type=float, default=0.0)),
    ("--synthetic-onboard-seconds-per-block", dict(type=float, default=0.0,
                                                   help="synthetic engine: seconds per block brought back from "
                                                        "the host or disk tier")),
    ("--kv-host-tier-bytes", dict(type=int, default=0,
                                  help="host-memory KV tier under the pool (pinned beside a GPU); 0: no tiers")),
    ("--kv-disk-tier-path", dict(default=None, help="directory of the disk KV tier under the host tier")),
    ("--kv-disk-tier-bytes", dict(type=int, default=0, help="disk KV tier budget (0: no disk tier)")),
    ("--served-model-name", dict(default=None, help="the model name clients send (default: a short name as "
                                                    "written, a path's last component)")),
    ("--tool-call-parser", dict(default=None, choices=sorted(TOOL_CALL_PARSERS),
                                help="the model's tool-call format (default: detected from its chat template)")),
    ("--grace-seconds", dict(type=float, default=30.0, help="how long in-flight requests may finish at shutdown")),
    ("--decode-attention", dict(default="auto", choices=DECODE_ATTENTION_MODES,
                                help="torch engine: native C kernel over the paged KV, or gather + SDPA")),
    ("--num-speculative-tokens", dict(type=int, default=0,
                                      help="torch engine: prompt-lookup draft tokens verified per decode step of a "
                                           "greedy request (0: speculative decoding off)")),
    ("--prompt-lookup-max", dict(type=int, default=4, help="the longest n-gram a draft lookup matches")),
    ("--prompt-lookup-min", dict(type=int, default=2, help="the shortest n-gram a draft lookup matches")),
    ("--weights", dict(default="dequantize", choices=WEIGHT_MODES,
                       help="torch engine, GGUF model: dequantize at load, or keep Q4_0/Q4_1/Q4_K/Q8_0 "
                            "linear weights quantized (float32 CPU; docs/quantization.md)")),
    ("--engine-threads", dict(type=int, default=None,
                              help="torch engine: intra-op threads (default: torch's, one per available core; "
                                   "`disagg up` gives engines sharing a machine a share each)")),
    ("--profile-dir", dict(default=None, help="where POST /start_profile writes the engine's torch traces")),
    ("--state-dir", dict(default=None, help="the launcher's persistent state, e.g. the Message Batches database "
                                            "(default: ~/.cache/disagg/HOST-PORT)")),
    ("--max-request-bytes", dict(type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                                 help="request bodies over this get a 413 before they are buffered")),
    ("--max-concurrent-requests", dict(type=int, default=None,
                                       help="generation requests the worker serves at once, shared evenly by its "
                                            "frontends; more get 429 with Retry-After (default: 4 x "
                                            "--max-num-seqs; 0: no limit)")),
    ("--max-queued-requests", dict(type=int, default=None,
                                   help="requests sent to the engine without a first token yet, shared evenly "
                                        "by the frontends; more get 429 (Anthropic: 529) with Retry-After "
                                        "(default and 0: no bound)")),
    ("--max-queued-prompt-tokens", dict(type=int, default=None,
                                        help="prompt tokens of those queued requests, shared the same way; a "
                                             "request alone in the queue is never refused (default and 0: no "
                                             "bound)")),
    ("--access-log", dict(action=argparse.BooleanOptionalAction, default=False,
                          help="one INFO line per HTTP request (client, method, path, status)")),
    ("--strict-request-fields", dict(action=argparse.BooleanOptionalAction, default=False,
                                     help="an unknown top-level field of a request body is a 400 naming it "
                                          "(default: ignored, named in a Warning header)")),
    ("--max-perf-records", dict(type=int, default=None,
                                help="per-request perf records the launcher keeps unread for GET /perf_metrics "
                                     "(default 10,000; the oldest go first)")),
    ("--perf-record-seconds", dict(type=float, default=None,
                                   help="unread perf records older than this are dropped (default 600)")),
    ("--admin-timeout", dict(type=float, default=30.0,
                             help="seconds an attached frontend waits for the launcher on a forwarded route")),
    ("--engine-start-timeout", dict(type=float, default=600.0)),
    ("--engine-wedged-seconds", dict(type=float, default=ENGINE_WEDGED_SECONDS,
                                     help="an engine silent this long is dead and the worker stops; a shorter "
                                          "silence only makes /health answer 503 until it answers again")),
    ("--frontend-start-timeout", dict(type=float, default=60.0)),
    ("--frontend-command", dict(default=None, help="the command attached frontends run, the serve arguments "
                                                   "appended (default: this interpreter, `-m disagg.cli serve`)")),
    ("--log-level", dict(choices=("debug", "info", "warning", "error"), default="info")),
    ("--log-format", dict(choices=LOG_FORMATS, default="text",
                          help="text, or json: one object a line (every process of the worker, the engine too)")),
    ("--otlp-endpoint", dict(default=None, help="export OpenTelemetry spans of each request over OTLP/HTTP to this "
                                                "collector URL, e.g. http://127.0.0.1:4318 (default: no tracing)")),
    ("--trace-service-name", dict(default="disagg-worker", help="the service.name of this worker's spans")),
    *DISAGG_OPTIONS,
]


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", metavar="MODEL",
                        help="a Hugging Face model directory, a .gguf file or the short name of an installed "
                             "model (smollm2-135m-instruct); for the synthetic engine: the tokenizer")
    for flag, kwargs in _OPTIONS:
        aliases = kwargs.get("aliases", ())
        parser.add_argument(flag, *aliases, **{k: v for k, v in kwargs.items() if k != "aliases"})


def _serve_argv(args: ServeSettings, num_frontends: int) -> list[str]:
    """The command an attached frontend runs: the same settings, rendered as flags."""
    prefix = shlex.split(args.frontend_command) if args.frontend_command else [sys.executable, "-m", "disagg.cli"]
    return args.argv(prefix, num_frontends)


def resolve_num_frontends(requested: int | None) -> int:
    if requested is not None:
        if requested < 1:
            raise ConfigError("num_frontends", f"must be >= 1, got {requested}")
        return requested
    return max(1, min(MAX_AUTO_FRONTENDS, len(os.sched_getaffinity(0))))


def build_engine_config(args: ServeSettings) -> EngineConfig:
    if args.kv_host_tier_bytes and args.tensor_parallel_size > 1:
        # A tier holds what rank 0 exports: the other ranks' heads would not come back.
        raise ConfigError("kv_host_tier_bytes", "the KV tiers need tensor_parallel_size 1 (each rank holds "
                                                "its own heads' KV)")
    model_dir = Path(args.model_dir)
    synthetic = SyntheticConfig(decode_step_base_seconds=args.synthetic_decode_step_seconds,
                                prefill_seconds_per_token=args.synthetic_prefill_seconds_per_token,
                                onboard_seconds_per_block=args.synthetic_onboard_seconds_per_block)
    if args.engine == "synthetic":
        # Synthetic tokens must be ids the model's tokenizer can decode.
        synthetic = _synthetic_model_shape(model_dir, synthetic)
    return EngineConfig(
        model=str(model_dir),
        kind=args.engine,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        # A DeepSeek-V4 engine has no prefix caching yet (docs/deepseek_v4.md): served without it.
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                          enable_prefix_caching=not (args.engine == "torch" and is_deepseek_v4_dir(model_dir)),
                          host_tier_bytes=args.kv_host_tier_bytes, disk_tier_path=args.kv_disk_tier_path,
                          disk_tier_bytes=args.kv_disk_tier_bytes),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                  stream_interval=args.stream_interval),
        synthetic=synthetic,
        profile_dir=args.profile_dir,
        decode_attention=args.decode_attention,
        speculative=SpeculativeConfig(num_speculative_tokens=args.num_speculative_tokens,
                                      prompt_lookup_max=args.prompt_lookup_max,
                                      prompt_lookup_min=args.prompt_lookup_min),
        num_threads=args.engine_threads,
        weights=args.weights,
    ).validate()


def _synthetic_model_shape(model: Path, synthetic: SyntheticConfig) -> SyntheticConfig:
    """The vocabulary size and context length of ``model`` (config.json or GGUF metadata), if it has them."""
    if model.suffix == ".gguf" and model.is_file():
        from workers.engine.model.gguf_metadata import gguf_context_length, gguf_vocab_size, open_gguf

        reader = open_gguf(model)
        return dataclasses.replace(synthetic, vocab_size=gguf_vocab_size(reader),
                                   max_model_len=gguf_context_length(reader))
    config_json = model / "config.json"
    if not config_json.is_file():
        return synthetic
    hf = json.loads(config_json.read_text())
    return dataclasses.replace(synthetic, vocab_size=int(hf.get("vocab_size", synthetic.vocab_size)),
                               max_model_len=int(hf.get("max_position_embeddings", synthetic.max_model_len)))


def _frontend_config(args: ServeSettings, frontend_id: int, engine_info: Any = None):
    from api.admission import default_max_concurrent_requests, per_frontend_limit
    from api.tokenizer import Tokenizer
    from frontends.app import FrontendConfig

    name = args.served_model_name or default_served_name(args.model_dir)
    worker_limit = args.max_concurrent_requests
    if worker_limit is None:
        worker_limit = default_max_concurrent_requests(args.max_num_seqs)
    disagg = None if engine_info is None else frontend_disagg_config(args, engine_info)
    num_frontends = resolve_num_frontends(args.num_frontends)
    config = FrontendConfig(served_model_name=name, frontend_id=frontend_id, disagg=disagg,
                            tool_call_parser=args.tool_call_parser, max_request_bytes=args.max_request_bytes,
                            max_concurrent_requests=per_frontend_limit(worker_limit, num_frontends),
                            max_queued_requests=per_frontend_limit(args.max_queued_requests, num_frontends),
                            max_queued_prompt_tokens=per_frontend_limit(args.max_queued_prompt_tokens,
                                                                        num_frontends),
                            max_perf_records=args.max_perf_records, perf_record_seconds=args.perf_record_seconds,
                            otlp_endpoint=args.otlp_endpoint, trace_service_name=args.trace_service_name,
                            role=args.role, strict_request_fields=args.strict_request_fields,
                            worker_key=key_from_file(args.worker_key_file, "worker_key_file"))
    return Tokenizer.from_model_path(args.model_dir), config


def _make_launcher_app_factory(args: ServeSettings, group: Any):
    from frontends.worker_app import make_launcher_app

    info = group.engine_info
    tokenizer, config = _frontend_config(args, 0, info)
    labels = {"model": config.served_model_name, "engine": info.kind, "num_frontends": str(group.num_frontends),
              "block_size": str(info.block_size), "num_blocks": str(info.num_blocks),
              "max_model_len": str(info.max_model_len)}
    state_dir = resolve_state_dir(args)
    return lambda client: make_launcher_app(client, tokenizer, config, group.attach_info(0), group.control, labels,
                                            state_dir)


def resolve_state_dir(args: ServeSettings) -> Path:
    """Where the launcher keeps what must survive a restart (the Message Batches database).
    The default names host and port: two workers on one shared home never collide."""
    if args.state_dir:
        return Path(args.state_dir)
    return Path.home() / ".cache" / "disagg" / f"{socket.gethostname()}-{args.port}"


def _make_attached_app_factory(args: ServeSettings, attach: Any):
    from frontends.worker_app import make_attached_app

    tokenizer, config = _frontend_config(args, attach.frontend_id, attach.engine)
    return lambda client: make_attached_app(client, tokenizer, config, attach, admin_timeout=args.admin_timeout)


def _serve_options(args: ServeSettings):
    from frontends.worker_server import ServeOptions

    return ServeOptions(grace_seconds=args.grace_seconds, log_level=args.log_level, access_log=args.access_log)


class _Terminated(Exception):
    """SIGTERM arrived while the launcher was starting (outside the event loop)."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated(signal.Signals(signum).name)


def run_serve(parsed: argparse.Namespace) -> int:
    try:  # once: everything below gets the typed settings, never the namespace
        args = ServeSettings.from_args(parsed)
        key_from_file(args.worker_key_file, "worker_key_file")  # a bad key file: refused before anything starts
    except ConfigError as exc:
        print(f"disagg serve: {exc}", file=sys.stderr)
        return 2
    attach_file = attach_file_from_env()
    try:  # an attached frontend never is a rank: its launcher removed the variables
        rank_env = from_environ() if attach_file is None else None
    except ValueError as exc:
        print(f"disagg serve: {exc}", file=sys.stderr)
        return 2
    role = "launcher" if attach_file is None else "frontend"
    if rank_env is not None and rank_env.rank > 0:
        role = f"rank{rank_env.rank}"  # an engine follower only: ranks started by srun
    configure_logging(args.log_level, args.log_format, role)
    if args.log_level != "debug":  # httpx logs every forwarded admin call (the KV-event polls: ~50 a minute)
        logging.getLogger("httpx").setLevel(logging.WARNING)
    if attach_file is not None:
        return _run_attached(args, attach_file)
    try:
        # Once, here: the attached frontends get the resolved path and the id back as flags.
        args = dataclasses.replace(args, served_model_name=args.served_model_name or default_served_name(args.model_dir),
                                   model_dir=str(resolve_model(args.model_dir)))
    except ModelNotFoundError as exc:
        print(f"disagg serve: {exc}", file=sys.stderr)
        return 2
    if rank_env is not None and rank_env.rank > 0:
        return _run_follower(args, rank_env)
    return _run_launcher(args, rank_env)


def _run_follower(args: ServeSettings, rank_env: Any) -> int:
    """Ranks > 0 of an externally started group: the engine follower only (no launcher, no HTTP)."""
    from disagg.disagg_options import cluster_key
    from workers.rank_follower import FollowerSpec, run_rank_follower
    from workers.rank_group import rank_link_key

    try:
        if args.tensor_parallel_size not in (1, rank_env.world_size):
            raise ConfigError("tensor_parallel_size", f"{args.tensor_parallel_size}, but DISAGG_TP_SIZE says "
                                                      f"{rank_env.world_size}")
        key = cluster_key(args)
        if key is None:
            raise ConfigError("cluster_key_file", "ranks started externally (DISAGG_TP_SIZE) authenticate their "
                                                  "link with the cluster key: pass --cluster-key-file")
        spec = FollowerSpec(rank_env, rank_link_key(key).hex(), build_engine_config(args),
                            disagg=engine_disagg_spec(args))
    except ConfigError as exc:
        print(f"disagg serve: {exc}", file=sys.stderr)
        return 2
    return run_rank_follower(spec)


def _run_launcher(args: ServeSettings, rank_env: Any = None) -> int:
    from workers.launcher import LaunchError, WorkerGroup, check_port_free

    try:
        check_port_free(args.host, args.port)  # before loading anything
        num_frontends = resolve_num_frontends(args.num_frontends)
        if args.engine_wedged_seconds <= ENGINE_SILENCE_LIMIT * HEARTBEAT_SECONDS:
            raise ConfigError("engine_wedged_seconds", f"must exceed the {ENGINE_SILENCE_LIMIT * HEARTBEAT_SECONDS:g} s "
                                                       f"after which an engine is unresponsive, got {args.engine_wedged_seconds:g}")
        _check_limits(args)
        config = build_engine_config(args)
        disagg_spec = engine_disagg_spec(args)  # role, KV endpoint, cluster key (from its 0600 file)
    except (LaunchError, ConfigError) as exc:
        print(f"disagg serve: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, LaunchError) else 2
    from frontends.prometheus import MULTIPROC_ENV

    signal.signal(signal.SIGTERM, _raise_terminated)
    group = WorkerGroup(config, num_frontends, args.host, args.port, grace_seconds=args.grace_seconds,
                        log_level=args.log_level, log_format=args.log_format, disagg=disagg_spec,
                        engine_wedged_seconds=args.engine_wedged_seconds,
                        tensor_parallel_size=args.tensor_parallel_size, rank_env=rank_env)
    # Before anything imports prometheus_client or is spawned: every process of the worker writes here.
    os.environ[MULTIPROC_ENV] = str(group.paths.prometheus_dir)
    try:
        group.start_engine(args.engine_start_timeout)
        group.spawn_frontends(_serve_argv(args, num_frontends))
        make_app = _make_launcher_app_factory(args, group)
        exit_code = _serve_launcher(args, group, make_app)
        if exit_code != 0:
            group.engine_failed = True  # frontend 0 stopped because the engine died or hung
        return exit_code
    except (LaunchError, _Terminated, KeyboardInterrupt) as exc:
        print(f"disagg serve: {exc or type(exc).__name__}", file=sys.stderr)
        return 1
    except Exception as exc:  # e.g. the engine died while frontend 0 connected: still clean up
        log.exception("the launcher failed")
        print(f"disagg serve: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        # A second signal must not cut the cleanup short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        group.shutdown()


def _check_limits(args: ServeSettings) -> None:
    for name in ("max_concurrent_requests", "max_queued_requests", "max_queued_prompt_tokens"):
        value = getattr(args, name)
        if value is not None and value < 0:
            raise ConfigError(name, f"must be >= 0 (0: no limit), got {value}")
    if args.max_perf_records is not None and args.max_perf_records < 1:
        raise ConfigError("max_perf_records", f"must be >= 1, got {args.max_perf_records}")
    if args.perf_record_seconds is not None and args.perf_record_seconds <= 0:
        raise ConfigError("perf_record_seconds", f"must be > 0, got {args.perf_record_seconds}")
    if args.otlp_endpoint is not None:
        from api.tracing import require_sdk

        require_sdk("otlp_endpoint")


def _serve_launcher(args: ServeSettings, group: Any, make_app: Any) -> int:
    from api.server import run_event_loop
    from frontends.worker_server import serve_frontend

    clients: list[Any] = []  # frontend 0's engine client: its verdict on the engine gates respawns
    background: list[Any] = []  # tasks of the launcher's loop (asyncio keeps only weak references)

    def make_app_keeping_client(client: Any) -> Any:
        clients.append(client)
        return make_app(client)

    async def on_ready() -> None:
        await asyncio.to_thread(group.wait_frontends_ready, args.frontend_start_timeout)
        info = group.engine_info
        print(stdout_line(f"{READY_MESSAGE} http://{args.host}:{args.port} ({group.num_frontends} frontends, "
                          f"{info.kind} engine, max_model_len {info.max_model_len})", args.log_format, "launcher"),
              flush=True)
        def engine_alive() -> bool:  # an unresponsive engine is alive: its frontends still get respawned
            return all(c.dead_reason is None for c in clients)

        asyncio.get_running_loop().create_task(_watch_frontends(group, engine_alive))
        background.append(start_registration(args, info))  # --register-url: join an orchestrator, heartbeat

    return run_event_loop(serve_frontend(group.attach_info(0), make_app_keeping_client, _serve_options(args),
                                         on_ready=on_ready, on_signal=group.request_stop))


async def _watch_frontends(group: Any, engine_alive: Callable[[], bool]) -> None:
    """Respawn an attached frontend that died while serving (the others keep the port served).
    Not once the engine is dead: then every frontend is leaving and the group shuts down."""
    from frontends.prometheus import mark_process_dead

    while not group.stopping and engine_alive():
        group.respawn_exited_frontends(on_exit=mark_process_dead)
        await asyncio.sleep(FRONTEND_WATCH_SECONDS)


def _run_attached(args: ServeSettings, attach_file: str) -> int:
    import zmq

    from api.server import run_event_loop
    from common.processes import pid_alive
    from frontends.worker_server import serve_frontend
    from workers.ipc import FrameCodec
    from workers.protocol import FrontendFailed, FrontendReady, StatusMessage

    attach = read_attach_file(attach_file)
    os.unlink(attach_file)  # it holds the key; nobody needs it once read
    ctx = zmq.Context()
    status = ctx.socket(zmq.PUSH)
    status.setsockopt(zmq.LINGER, 2000)
    status.connect(attach.paths.status)
    codec: FrameCodec = FrameCodec(attach.key, StatusMessage, f"frontend {attach.frontend_id} status")

    async def on_ready() -> None:
        status.send_multipart(codec.encode(FrontendReady(attach.frontend_id, os.getpid())))

    try:
        make_app = _make_attached_app_factory(args, attach)
        return run_event_loop(serve_frontend(attach, make_app, _serve_options(args), on_ready=on_ready))
    except Exception as exc:
        log.exception("frontend %d failed", attach.frontend_id)
        status.send_multipart(codec.encode(FrontendFailed(attach.frontend_id, f"{type(exc).__name__}: {exc}")))
        return 1
    finally:
        status.close()
        ctx.term()
        if not pid_alive(attach.launcher_pid):
            # The launcher was killed and cannot clean up: whoever of the group leaves last does.
            shutil.rmtree(attach.ipc_dir, ignore_errors=True)
