"""``disagg simulate CONFIG --trace FILE``: a trace replayed on a deployment in simulated time.

The deployment YAML gives the topology (pools and instances), every engine's settings (block size,
pool size, batch limits, the synthetic timing model: a torch engine is simulated with it too) and the
orchestrator's routers; the trace options are ``disagg bench --trace``'s, and so is the results file
(one run of mode ``trace``, the cache against the window's ceiling), so ``disagg bench compare`` puts a
simulation beside a real replay of the same window.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from disagg.bench.api_clients import OpenAICompletions
from disagg.bench.metrics import summarize
from disagg.bench.runner import LevelResult
from disagg.bench.trace_replay import TracePlan
from disagg.deploy_config import DeployConfig, EngineSettings
from disagg.sim.cluster import SimCluster, SimTiming
from workers.config import CacheConfig, EngineConfig, SchedulerConfig, SyntheticConfig

__all__ = ["engine_config", "simulate_trace", "add_simulate_arguments", "run_simulate_command"]


def engine_config(settings: EngineSettings) -> EngineConfig:
    """The engine a worker of these settings runs, as the synthetic engine (serve's defaults for unset keys)."""
    scheduler, cache = SchedulerConfig(), CacheConfig()
    synthetic = SyntheticConfig(prefill_seconds_per_token=settings.synthetic_prefill_seconds_per_token or 0.0,
                                decode_step_base_seconds=settings.synthetic_decode_step_seconds or 0.0,
                                onboard_seconds_per_block=settings.synthetic_onboard_seconds_per_block or 0.0,
                                max_model_len=settings.max_model_len or SyntheticConfig.max_model_len)
    return EngineConfig(
        kind="synthetic", max_model_len=settings.max_model_len, synthetic=synthetic,
        cache=CacheConfig(block_size=settings.block_size or cache.block_size, num_blocks=settings.num_blocks,
                          host_tier_bytes=settings.host_tier_bytes or 0, disk_tier_path=settings.disk_tier_path,
                          disk_tier_bytes=settings.disk_tier_bytes or 0),
        scheduler=SchedulerConfig(max_num_seqs=settings.max_num_seqs or scheduler.max_num_seqs,
                                  max_num_batched_tokens=settings.max_num_batched_tokens
                                  or scheduler.max_num_batched_tokens)).validate()


def simulate_trace(config: DeployConfig, plan: TracePlan, timing: SimTiming | None = None) -> LevelResult:
    """Every request of ``plan`` through a simulated ``config``; the level as a real replay reports it."""
    engines = {"ctx": engine_config(config.engine_for("ctx")), "gen": engine_config(config.engine_for("gen"))}
    cluster = SimCluster(config, engines, timing or SimTiming())
    blocks: dict[int, list[int]] = {}
    for index, request in enumerate(plan.requests):
        cluster.submit(request.timestamp / 1e3 * plan.time_scale, index,
                       plan.token_map.prompt(request, blocks), plan.max_tokens(request))
    duration = cluster.run()
    records = sorted(cluster.records, key=lambda r: r.session_id)
    return LevelResult(summarize(records, "trace", plan.time_scale, duration, plan.slo or {}), records)


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    from disagg.bench.cli import add_trace_arguments

    parser.add_argument("config", help="the deployment YAML whose topology, engines and routers are simulated")
    add_trace_arguments(parser, required=True)
    parser.add_argument("--slo", default=None, help="goodput bounds, e.g. ttft=2s,tpot=50ms")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-requests", type=int, default=None, help="the window's first N requests")
    parser.add_argument("--hop-ms", type=float, default=SimTiming.hop_seconds * 1e3,
                        help="one leg's trip through the orchestrator and a frontend (default 2)")
    parser.add_argument("--transfer-gbps", type=float, default=SimTiming.transfer_bytes_per_second * 8e-9,
                        help="KV transfer bandwidth in Gbit/s (default 8)")
    parser.add_argument("--kv-bytes-per-token", type=int, default=SimTiming.kv_bytes_per_token)
    parser.add_argument("--out", default=".", help="directory for the JSON (default: cwd)")
    parser.add_argument("--name", default=None, help="file stem (default sim-<UTC time>)")


def run_simulate_command(args: argparse.Namespace) -> int:
    from common.config_errors import ConfigError
    from disagg.bench.cli import build_trace_plan
    from disagg.bench.report import summary_lines, write_result
    from disagg.bench.trace_replay import trace_lines, trace_result
    from disagg.deploy_config import load_deploy_config

    try:
        config = load_deploy_config(args.config)
        args.url, args.api, args.api_key, args.timeout = f"sim:{args.config}", "openai", None, 600.0
        plan = dataclasses.replace(build_trace_plan(args, config.served_model_name),
                                   api=OpenAICompletions(config.served_model_name, True))
    except (ConfigError, ValueError) as exc:
        print(f"disagg simulate: {exc}", file=sys.stderr)
        return 2
    timing = SimTiming(hop_seconds=args.hop_ms * 1e-3, transfer_bytes_per_second=args.transfer_gbps / 8e-9,
                       kv_bytes_per_token=args.kv_bytes_per_token)
    started = time.process_time()
    level = simulate_trace(config, plan, timing)
    result: dict[str, Any] = trace_result(plan, level)
    result["simulation"] = {"cpu_seconds": time.process_time() - started, **dataclasses.asdict(timing)}
    print("\n".join(summary_lines(result["runs"][0]) + trace_lines(result)))
    stem = args.name or f"sim-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    print(f"results: {write_result(result, Path(args.out) / f'{stem}.json')} "
          f"({result['simulation']['cpu_seconds']:.1f} CPU seconds)")
    return 0
