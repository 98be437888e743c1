"""``disagg bench URL`` and ``disagg bench compare A.json B.json``: argument parsing and the run.

Argument errors print one ``disagg bench: ...`` line and exit 2; a server that cannot be reached
exits 1. matplotlib and rich come with the ``bench`` extra; without them the command says how to
install them (exit 2) before doing anything else.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["add_bench_arguments", "add_trace_arguments", "run_bench_command", "build_plan", "build_trace_plan"]

INSTALL_HINT = "disagg bench: needs matplotlib and rich: pip install 'disagg[bench]' (or `make setup`)"


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", help="the server's base URL (http://HOST:PORT), or `compare`")
    parser.add_argument("files", nargs="*", help="compare: the two results files A.json B.json")
    parser.add_argument("--api", choices=("openai", "anthropic", "responses"), default="openai",
                        help="/v1/chat/completions, /v1/messages or /v1/responses (default openai)")
    parser.add_argument("--model", default=None, help="default: the first model of GET /v1/models")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--concurrency", default=None, help="closed-loop sessions in flight, e.g. 1,4,16")
    parser.add_argument("--rate", default=None, help="open-loop Poisson session arrivals per second, e.g. 0.5,2")
    parser.add_argument("--num-requests", type=int, default=None, help="requests per level (default 100 "
                                                                         "unless --duration)")
    parser.add_argument("--duration", type=float, default=None, help="seconds per level")
    parser.add_argument("--warmup", type=int, default=2, help="unrecorded requests before the first level")
    parser.add_argument("--system-tokens", type=int, default=1000, help="the shared system prompt + tools")
    parser.add_argument("--isl", default="200", help="tokens per user turn: MEAN or MEAN:STDDEV")
    parser.add_argument("--osl", default="64", help="max_tokens per request: MEAN or MEAN:STDDEV")
    parser.add_argument("--turns", default="4", help="turns per session: MEAN or MEAN:STDDEV (1: single-turn)")
    parser.add_argument("--single-turn-fraction", type=float, default=0.0, help="sessions that are one turn")
    parser.add_argument("--tool-turn-fraction", type=float, default=0.0,
                        help="turns preceded by a tool call and its result in the history")
    parser.add_argument("--tool-result-tokens", type=int, default=100)
    parser.add_argument("--ignore-eos", action="store_true", help="openai: generate max_tokens every time")
    parser.add_argument("--slo", default=None, help="goodput bounds, e.g. ttft=2s,itl=50ms,e2e=10s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--out", default=".", help="directory for the JSON and PNG files (default: cwd)")
    parser.add_argument("--name", default=None, help="file stem (default bench-<api>-<UTC time>)")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--force", action="store_true",
                        help="compare: go on when A and B ran different workloads (printed as warnings)")
    add_trace_arguments(parser)


def add_trace_arguments(parser: argparse.ArgumentParser, required: bool = False) -> None:
    """The trace-replay options, shared with ``disagg simulate``."""
    trace = parser.add_argument_group("trace replay", "replay a Mooncake-format trace (JSON lines of timestamp, "
                                      "input_length, output_length, hash_ids) instead of agentic sessions")
    trace.add_argument("--trace", default=None, required=required, metavar="FILE",
                       help="the trace to replay (openai completions, prompts as token ids, ignore_eos)")
    trace.add_argument("--time-scale", type=float, default=1.0, help="trace time x this = replay time "
                       "(2: half the trace's rate; default 1)")
    trace.add_argument("--window", default=None, metavar="START:END", help="seconds of the trace to replay "
                       "(default: all of it)")
    trace.add_argument("--block-tokens", type=int, default=None, help="tokens per hash id in the replay "
                       "(default: the trace's own, --trace-block-tokens); fewer shrinks every prompt alike")
    trace.add_argument("--trace-block-tokens", type=int, default=512, help="tokens per hash id in the trace (512)")
    trace.add_argument("--token-ids", default="100:500", metavar="LOW:HIGH", help="prompt token ids are drawn "
                       "from [LOW, HIGH): inside the model's vocabulary, clear of its special tokens")
    trace.add_argument("--max-output-tokens", type=int, default=None, help="cap each request's output length")


def _numbers(text: str | None, kind: type, option: str) -> tuple[Any, ...]:
    if text is None:
        return ()
    try:
        values = tuple(kind(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{option}: expected comma-separated numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"{option}: every value must be > 0, got {text!r}")
    return values


def build_plan(args: argparse.Namespace, model: str) -> Any:
    """The run the arguments ask for; ValueError naming the option when they are wrong."""
    from disagg.bench.api_clients import API_CLIENTS
    from disagg.bench.lengths import parse_length
    from disagg.bench.metrics import parse_slo
    from disagg.bench.runner import BenchPlan
    from disagg.bench.workload import WorkloadConfig

    workload = WorkloadConfig(system_tokens=args.system_tokens, isl=parse_length(args.isl, "--isl"),
                              osl=parse_length(args.osl, "--osl"), turns=parse_length(args.turns, "--turns"),
                              single_turn_fraction=args.single_turn_fraction,
                              tool_turn_fraction=args.tool_turn_fraction,
                              tool_result_tokens=args.tool_result_tokens, seed=args.seed)
    workload.validate()
    num_requests = args.num_requests if args.num_requests is not None else (None if args.duration else 100)
    return BenchPlan(url=args.url.rstrip("/"), api=API_CLIENTS[args.api](model, args.ignore_eos, args.api_key),
                     workload=workload, concurrencies=_numbers(args.concurrency, int, "--concurrency"),
                     rates=_numbers(args.rate, float, "--rate"), num_requests=num_requests,
                     duration=args.duration, warmup=args.warmup, timeout=args.timeout, slo=parse_slo(args.slo))


def _check_args(args: argparse.Namespace) -> None:
    if not args.url.startswith(("http://", "https://")):
        raise ValueError(f"URL: expected http://HOST:PORT or `compare`, got {args.url!r}")
    if args.files:
        raise ValueError(f"unexpected arguments after the URL: {' '.join(args.files)}")
    if args.trace is not None:
        _check_trace_args(args)
    elif args.concurrency is None and args.rate is None:
        args.concurrency = "1"
    for name in ("num_requests", "duration", "timeout"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')}: must be > 0, got {value:g}")
    if args.warmup < 0:
        raise ValueError(f"--warmup: must be >= 0, got {args.warmup}")


def _check_trace_args(args: argparse.Namespace) -> None:
    if args.concurrency is not None or args.rate is not None:
        raise ValueError("--trace: the trace sets the arrivals; drop --concurrency and --rate")
    if args.api != "openai":
        raise ValueError(f"--trace: replays through the OpenAI completions API (prompts as token ids), "
                         f"not --api {args.api}")


def build_trace_plan(args: argparse.Namespace, model: str) -> Any:
    """The replay the arguments ask for, its trace loaded; ValueError naming the option when wrong."""
    from disagg.bench.api_clients import OpenAICompletions
    from disagg.bench.metrics import parse_slo
    from disagg.bench.trace import TokenMap, load_trace, parse_window
    from disagg.bench.trace_replay import TracePlan

    for name in ("time_scale", "block_tokens", "trace_block_tokens", "max_output_tokens"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')}: must be > 0, got {value:g}")
    low, colon, high = args.token_ids.partition(":")
    if not (colon and low.strip().isdigit() and high.strip().isdigit() and int(low) < int(high)):
        raise ValueError(f"--token-ids: expected LOW:HIGH with 0 <= LOW < HIGH, got {args.token_ids!r}")
    token_map = TokenMap(block_tokens=args.block_tokens or args.trace_block_tokens,
                         trace_block=args.trace_block_tokens, low=int(low), high=int(high), seed=args.seed)
    window = parse_window(args.window)
    requests = load_trace(args.trace, window, args.num_requests)
    return TracePlan(url=args.url.rstrip("/"), api=OpenAICompletions(model, True, args.api_key),
                     path=Path(args.trace), window=window, requests=requests, token_map=token_map,
                     time_scale=args.time_scale, max_output_tokens=args.max_output_tokens, timeout=args.timeout,
                     slo=parse_slo(args.slo))


def _served_model(url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(f"{url.rstrip('/')}/v1/models", headers=headers, timeout=10.0)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def _compare(args: argparse.Namespace) -> int:
    from disagg.bench.compare import compare_lines, compare_stem, workload_differences
    from disagg.bench.plots import plot_compare
    from disagg.bench.report import load_result

    if len(args.files) != 2:
        print("disagg bench compare: expected two results files, A.json B.json", file=sys.stderr)
        return 2
    try:
        a, b = (load_result(f) for f in args.files)
    except ValueError as exc:
        print(f"disagg bench compare: {exc}", file=sys.stderr)
        return 2
    differences = workload_differences(a, b)
    if differences and not args.force:
        print("disagg bench compare: A and B ran different workloads; compare like with like, or pass --force:",
              *(f"  {line}" for line in differences), sep="\n", file=sys.stderr)
        return 2
    for line in differences:
        print(f"disagg bench compare: warning: the workloads differ: {line}", file=sys.stderr)
    names = (Path(args.files[0]).stem, Path(args.files[1]).stem)
    print("\n".join(compare_lines(a, b, names)))
    if not args.no_plots:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        print(f"plot: {plot_compare(a, b, names, out / (compare_stem(*args.files) + '.png'))}")
    return 0


def run_bench_command(args: argparse.Namespace) -> int:
    try:
        import matplotlib  # noqa: F401
        import rich  # noqa: F401
    except ImportError:
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    if args.url == "compare":
        return _compare(args)
    try:
        _check_args(args)
        # argument errors (and an unreadable trace) before any request
        plan_of = build_trace_plan if args.trace is not None else build_plan
        checked = plan_of(args, "check")
    except ValueError as exc:
        print(f"disagg bench: {exc}", file=sys.stderr)
        return 2
    try:
        model = args.model or _served_model(args.url, args.api_key)
    except Exception as exc:  # noqa: BLE001 - any failure here means: no usable server at URL
        print(f"disagg bench: cannot list the models of {args.url} ({exc}); is it up? (or pass --model)",
              file=sys.stderr)
        return 1
    if args.trace is not None:
        from disagg.bench.api_clients import OpenAICompletions

        return _run_trace(args, dataclasses.replace(checked, api=OpenAICompletions(model, True, args.api_key)))
    return _run(args, build_plan(args, model))


def _write(args: argparse.Namespace, result: dict[str, Any], api: str) -> Path:
    from disagg.bench.plots import write_plots
    from disagg.bench.report import write_result

    out = Path(args.out)
    stem = args.name or f"bench-{api}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    path = write_result(result, out / f"{stem}.json")
    print(f"results: {path}")
    if not args.no_plots:
        for plot in write_plots(result, out, stem):
            print(f"plot: {plot}")
    return path


def _run_trace(args: argparse.Namespace, plan: Any) -> int:
    from disagg.bench.progress import make_progress
    from disagg.bench.report import summary_lines
    from disagg.bench.server_info import server_info
    from disagg.bench.trace_replay import replay_trace, trace_lines, trace_result

    server = server_info(plan.url, plan.api.headers())  # before the run: the configuration it ran on
    print(f"disagg bench: replaying {len(plan.requests)} requests of {plan.path} (window {plan.window}, "
          f"time scale {plan.time_scale:g})", file=sys.stderr)
    level = asyncio.run(replay_trace(plan, make_progress()))
    result = {**trace_result(plan, level), "server": server}
    print("\n".join(summary_lines(result["runs"][0]) + trace_lines(result)))
    _write(args, result, "trace")
    return 0 if level.summary.num_ok else 1


def _run(args: argparse.Namespace, plan: Any) -> int:
    from disagg.bench.progress import make_progress
    from disagg.bench.report import build_result, summary_lines
    from disagg.bench.runner import run_bench
    from disagg.bench.server_info import server_info

    server = server_info(plan.url, plan.api.headers())  # before the run: the configuration it ran on
    results, text = asyncio.run(run_bench(plan, make_progress()))
    result = build_result(plan, results, text, server)
    for run in result["runs"]:
        print("\n".join(summary_lines(run)))
    _write(args, result, plan.api.name)
    return 0 if all(r.summary.num_ok for r in results) else 1
