"""Disaggregated TTFT against aggregated, same prompts, same run, with the breakdown of where it goes.

The tiny ``bench`` Llama on the torch engine. Aggregated: one ``both``
worker, requests straight to it. Disaggregated: ``disagg orchestrator`` in
front of a ctx and a gen worker (cluster key, conditional disaggregation off,
so every request takes both legs). Threads: the aggregated engine and the ctx
engine run torch's default (every core: both prefill the same prompts); the gen
engine, whose steps are a token per request, runs one thread (``--gen-threads``):
with torch's default its OpenMP threads fought the ctx engine's prefill for the
same cores and its first step took ~240 ms instead of ~7 ms (512 tokens, c=8,
2 cores). Every request is a streamed
``/v1/completions`` whose prompt is a list of token ids of exactly N tokens
(512 to 8,192; distinct per request, so no prefix-cache hit anywhere),
``max_tokens`` 2. TTFT is the client's: request sent to the first streamed
token received. Sequential (one at a time) and at concurrency 8; lengths
alternate aggregated and disaggregated so both see the same machine.

Concurrency 8 is a closed loop: each of 8 clients sends its next request as
soon as its last one ended. There TTFT also depends on what a request does
after its first token, because that decides how soon its client is back in the
queue (Little's law: 8 = first-token rate x (TTFT + after first token)).
Aggregated, the second token waits for the engine's next step (a whole prefill
of other prompts: 200-550 ms at 2,048 tokens on 2 cores); disaggregated, the gen
engine makes it in 20-40 ms, so at the same throughput the disaggregated clients
wait that step in front of their first token instead. Each row prints the time
after the first token (``after_first``) and the first-token rate, and each
length a line with the end-to-end latency (TTFT + after first token) of both,
which the loop holds equal at equal throughput. ``--waves`` adds rows where
each 8 requests are sent together and the next 8 once all ended (no feedback,
but the orchestrator's hop spreads a wave's arrivals, so the ctx engine may
start a step before the wave's last prompts are in).

Breakdown (all ``time.time()`` on this host; the orchestrator's
``/perf_metrics`` joins its record with both workers', the workers' own
``/perf_metrics`` for the aggregated path). Disaggregated, consecutive
segments of client send (t0) to client first token (t1):

- ``orchestrator``: t0 -> ctx leg sent (HTTP in, parse, tokenize, route) plus
  ctx answer -> gen leg sent;
- ``ctx_prefill``: the ctx leg as the orchestrator saw it (worker HTTP,
  engine queue and prefill, answer); ``ctx_engine`` is its engine part;
- ``kv_transfer``: the gen engine's KV pull (its perf record);
- ``gen_first_step``: gen leg sent -> gen engine's first token, less the pull;
- ``relay``: gen engine's first token -> client (worker frontend, orchestrator).

When the gen leg streams the ctx leg's first token before its engine's
(``api.disaggregation``: as soon as the leg is handed to the engine),
``kv_transfer`` and ``gen_first_step`` come after the first token: reported,
not summed, and the segments after ``ctx_prefill`` are ``gen_leg`` (gen leg
sent -> handed to the gen engine, the worker's ``tokenized`` stamp) and
``relay`` (-> client).

Aggregated: ``frontend`` (t0 -> engine arrival), ``prefill`` (engine arrival ->
first token), ``relay`` (first token -> client). ``unaccounted`` is the total
less the segments' sum (non-zero only where a stamp is missing).

Targets (PASS/FAIL): disaggregated TTFT p50 <= 1.1x aggregated + 3 ms at every
length (sequential and at concurrency 8, closed loop); |unaccounted| <= 1 ms (median).

    python benchmarks/disagg_ttft.py [--lengths 512,1024,2048,4096,8192] [--requests 8]
        [--concurrency 1,8] [--waves] [--agg-threads N] [--ctx-threads N] [--gen-threads N]
        [--out benchmarks/results/disagg_ttft.json]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from frontend_scaling import Server
from orchestrator_overhead import HOST, free_port, report_targets, start_orchestrator

WORKER_READY = "disagg serve: ready on"
RATIO_TARGET, SLACK_MS, SUM_TOLERANCE_MS = 1.1, 3.0, 1.0
MODEL = "tiny-bench"


def start_worker(model_dir: Path, role: str, port: int, work: Path, args: argparse.Namespace,
                 key_file: Path | None) -> Server:
    max_len = max(args.lengths) + 64
    argv = [sys.executable, "-m", "disagg.cli", "serve", str(model_dir), "--engine", "torch", "--role", role,
            "--num-frontends", "1", "--host", HOST, "--port", str(port), "--log-level", "warning",
            "--max-model-len", str(max_len), "--max-num-batched-tokens", str(max_len),
            "--num-blocks", str(max(args.concurrency) * max_len // 16 + 64)]
    if key_file is not None:
        argv += ["--cluster-key-file", str(key_file), "--kv-port", "0"]
    threads = {"both": args.agg_threads, "ctx": args.ctx_threads, "gen": args.gen_threads}[role]
    if threads:
        argv += ["--engine-threads", str(threads)]
    return Server(argv, WORKER_READY, work, f"ttft-{role}-{port}", timeout=300)


def prompt(length: int, serial: int) -> list[int]:
    return [(serial * 7919 + i * 31) % 2000 + 3 for i in range(length)]  # distinct from the first token on


async def one_request(client: httpx.AsyncClient, url: str, length: int, serial: int, tag: str) -> dict:
    body = {"model": MODEL, "prompt": prompt(length, serial), "max_tokens": 2, "temperature": 0,
            "ignore_eos": True, "stream": True}
    request_id = f"{tag}-{serial}"
    t0 = time.time()
    first = None
    async with client.stream("POST", f"{url}/v1/completions", json=body,
                             headers={"x-request-id": request_id}) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: {response.status_code} {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.time()
    end = time.time()
    if first is None:
        raise RuntimeError(f"{url}: no token streamed for {request_id}")
    return {"request_id": request_id, "t0": t0, "t1": first, "t2": end, "ttft_ms": (first - t0) * 1e3,
            "after_first_ms": (end - first) * 1e3}


async def run_batch(url: str, length: int, concurrency: int, count: int, tag: str, serial0: int,
                    loop: bool) -> list[dict]:
    """``count`` requests, ``concurrency`` at a time: in waves (all of a wave sent together), or
    in a closed loop (``loop``: each client sends its next request when its last one ended)."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await one_request(client, url, 16, serial0 + 10_000, f"{tag}-warm")  # a warm connection per batch
        queue = list(range(serial0, serial0 + count))
        results: list[dict] = []

        async def lane() -> None:
            while queue:
                results.append(await one_request(client, url, length, queue.pop(0), tag))

        if loop:
            await asyncio.gather(*(lane() for _ in range(concurrency)))
            return results
        for start in range(0, count, concurrency):
            wave = queue[start:start + concurrency]
            results += await asyncio.gather(*(one_request(client, url, length, serial, tag) for serial in wave))
    return results


def perf_records(url: str) -> list[dict]:
    payload = httpx.get(f"{url}/perf_metrics", timeout=60).json()
    return payload.get("records", payload.get("data", [])) if isinstance(payload, dict) else payload


def breakdown_agg(result: dict, record: dict | None) -> dict:
    if record is None or record.get("first_token") is None:
        return {}
    parts = {"frontend": record["engine_arrival"] - result["t0"],
             "prefill": record["first_token"] - record["engine_arrival"],
             "relay": result["t1"] - record["first_token"]}
    return {k: v * 1e3 for k, v in parts.items()}


def breakdown_disagg(result: dict, record: dict | None) -> dict:
    if record is None or not record.get("ctx") or not record.get("gen") or not record.get("gen_worker"):
        return {}
    ctx, gen, gen_worker = record["ctx"], record["gen"], record["gen_worker"]["record"]
    ctx_worker = (record.get("ctx_worker") or {}).get("record") or {}
    kv = gen_worker.get("kv_transfer_seconds") or 0.0
    parts = {"orchestrator": (ctx["start"] - result["t0"]) + (gen["start"] - ctx["end"]),
             "ctx_prefill": ctx["end"] - ctx["start"],
             "kv_transfer": kv,
             "gen_first_step": gen_worker["first_token"] - gen["start"] - kv}
    if result["t1"] < gen_worker["first_token"]:  # the gen leg streamed the ctx leg's token before its engine's
        parts["gen_leg"] = gen_worker["tokenized"] - gen["start"]  # HTTP in, checks, handed to the engine
        parts["relay"] = result["t1"] - gen_worker["tokenized"]  # the first event written, relayed, read
    else:
        parts["relay"] = result["t1"] - gen_worker["first_token"]
    if ctx_worker.get("first_token") and ctx_worker.get("engine_arrival"):  # inside ctx_prefill
        parts["ctx_to_engine"] = ctx_worker["engine_arrival"] - ctx["start"]
        parts["ctx_engine"] = ctx_worker["first_token"] - ctx_worker["engine_arrival"]
        parts["ctx_answer"] = ctx["end"] - ctx_worker["first_token"]
    if gen_worker.get("engine_arrival") and gen_worker.get("first_scheduled"):  # inside gen_first_step + kv
        parts["gen_to_engine"] = gen_worker["engine_arrival"] - gen["start"]
        parts["gen_to_scheduled"] = gen_worker["first_scheduled"] - gen_worker["engine_arrival"]
        parts["gen_scheduled_to_token"] = gen_worker["first_token"] - gen_worker["first_scheduled"]
    return {k: v * 1e3 for k, v in parts.items()}


SUMMED = {"agg": ("frontend", "prefill", "relay"),
          "disagg": ("orchestrator", "ctx_prefill", "kv_transfer", "gen_first_step", "relay"),
          "disagg-early": ("orchestrator", "ctx_prefill", "gen_leg", "relay")}


def summed(path: str, parts: dict) -> tuple[str, ...]:
    """The segments that make up TTFT: with the first token streamed early (``gen_leg`` set), the
    KV pull and the gen engine's first step come after it (reported, not summed)."""
    return SUMMED["disagg-early" if "gen_leg" in parts else path]


def summarize(path: str, length: int, concurrency: int, mode: str, results: list[dict]) -> dict:
    ttfts = sorted(r["ttft_ms"] for r in results)
    firsts = sorted(r["t1"] for r in results)
    row = {"path": path, "tokens": length, "concurrency": concurrency, "mode": mode, "requests": len(results),
           "ttft_p50_ms": round(statistics.median(ttfts), 3),
           "ttft_p99_ms": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 3),
           "after_first_p50_ms": round(statistics.median(r["after_first_ms"] for r in results), 3),
           "first_tokens_per_s": round((len(firsts) - 1) / max(firsts[-1] - firsts[0], 1e-9), 3)}
    parts = [r["breakdown"] for r in results if r["breakdown"]]
    row["joined"] = len(parts)
    if parts:
        for key in dict.fromkeys(k for p in parts for k in p):  # every segment any request had
            row[f"{key}_p50_ms"] = round(statistics.median(p[key] for p in parts if key in p), 3)
        unaccounted = [r["ttft_ms"] - sum(r["breakdown"][k] for k in summed(path, r["breakdown"]))
                       for r in results if r["breakdown"]]
        row["unaccounted_p50_ms"] = round(statistics.median(unaccounted), 3)
    return row


def measure(args: argparse.Namespace, urls: dict[str, str], rows: list[dict], raw: list[dict]) -> None:
    serial = 0
    for concurrency in args.concurrency:
        for length in args.lengths:
            count = args.requests if concurrency == 1 else max(args.requests, 2 * concurrency)
            for mode, path in itertools.product(modes(args, concurrency), ("agg", "disagg")):
                tag = f"{path}-{length}-c{concurrency}-{mode}"
                results = asyncio.run(run_batch(urls[path], length, concurrency, count, tag, serial,
                                                mode == "loop"))
                serial += count + 1
                time.sleep(0.3)  # the workers ship perf records every 50 ms
                records = {r.get("x_request_id") if path == "agg" else r.get("request_id"): r
                           for r in perf_records(urls[path])}
                join = breakdown_agg if path == "agg" else breakdown_disagg
                for result in results:
                    result["breakdown"] = join(result, records.get(result["request_id"]))
                raw.extend({"path": path, "tokens": length, "concurrency": concurrency, "mode": mode, **r}
                           for r in results)
                rows.append(summarize(path, length, concurrency, mode, results))
                print_row(rows[-1])
                if path == "disagg":
                    print_end_to_end(rows[-2], rows[-1])


def modes(args: argparse.Namespace, concurrency: int) -> list[str]:
    """The closed loop (the target's; at concurrency 1, sequential requests), then waves if asked."""
    return ["loop", "waves"] if args.waves and concurrency > 1 else ["loop"]


def print_end_to_end(agg: dict, disagg: dict) -> None:
    """TTFT + time after the first token (p50s) of both paths: what a closed loop holds equal at equal
    throughput, whichever path spends it before the first token (see the docstring)."""
    agg_ms = agg["ttft_p50_ms"] + agg["after_first_p50_ms"]
    disagg_ms = disagg["ttft_p50_ms"] + disagg["after_first_p50_ms"]
    print(f"{'':6} {disagg['tokens']:>5} tok c={disagg['concurrency']} {disagg['mode']}: TTFT + after first token "
          f"p50 agg {agg_ms:.1f} ms, disagg {disagg_ms:.1f} ms ({disagg_ms / agg_ms:.3f}x); first tokens/s "
          f"disagg/agg {disagg['first_tokens_per_s'] / agg['first_tokens_per_s']:.3f}", flush=True)


def print_row(row: dict) -> None:
    parts = "  ".join(f"{k[:-7]} {v}" for k, v in row.items() if k.endswith("_p50_ms") and k != "ttft_p50_ms")
    mode = " waves" if row["mode"] == "waves" else ""
    print(f"{row['path']:<6} {row['tokens']:>5} tok c={row['concurrency']}{mode}: TTFT p50 {row['ttft_p50_ms']} ms "
          f"p99 {row['ttft_p99_ms']} ms, {row['first_tokens_per_s']} first tokens/s | p50 ms: {parts} "
          f"(joined {row['joined']}/{row['requests']})", flush=True)


def targets_of(rows: list[dict]) -> list[dict]:
    targets = []
    for row in (r for r in rows if r["path"] == "disagg" and r["mode"] == "loop"):  # waves: for the record
        agg = next(r for r in rows if r["path"] == "agg" and r["tokens"] == row["tokens"]
                   and r["concurrency"] == row["concurrency"] and r["mode"] == "loop")
        limit = RATIO_TARGET * agg["ttft_p50_ms"] + SLACK_MS
        label = f"{row['tokens']} tokens, concurrency {row['concurrency']}"
        targets.append({"target": f"disagg TTFT p50 <= {RATIO_TARGET}x agg + {SLACK_MS} ms = {limit:.1f} ms ({label})",
                        "value": row["ttft_p50_ms"], "pass": row["ttft_p50_ms"] <= limit})
    for row in rows:
        if "unaccounted_p50_ms" in row:
            waves = ", waves" if row["mode"] == "waves" else ""
            label = f"{row['path']} {row['tokens']} tokens, concurrency {row['concurrency']}{waves}"
            targets.append({"target": f"breakdown sums to TTFT within {SUM_TOLERANCE_MS} ms ({label})",
                            "value": row["unaccounted_p50_ms"],
                            "pass": abs(row["unaccounted_p50_ms"]) <= SUM_TOLERANCE_MS})
    return targets


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    def ints(text):
        return [int(x) for x in text.split(",")]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=ints, default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--concurrency", type=ints, default=[1, 8])
    parser.add_argument("--requests", type=int, default=8, help="per length and path (at least 2x concurrency)")
    parser.add_argument("--waves", action="store_true",
                        help="also run each concurrency > 1 in waves sent together (for the record, not a target)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/disagg_ttft.json"))
    for role, default in (("agg", None), ("ctx", None), ("gen", 1)):
        parser.add_argument(f"--{role}-threads", type=int, default=default,
                            help=f"torch threads of the {role} engine (default: {default or 'torch, every core'}; "
                                 f"0: torch's)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from workers.engine.model.tiny import make_tiny_model  # torch-free

    work = Path(tempfile.mkdtemp(prefix="disagg-ttft-"))
    model_dir = make_tiny_model(work / MODEL, size="bench", max_position_embeddings=max(args.lengths) + 64)
    key_file = work / "cluster.key"
    key_file.write_bytes(secrets.token_hex(32).encode())
    key_file.chmod(0o600)
    servers: list = []
    rows: list[dict] = []
    raw: list[dict] = []
    try:
        ports = {role: free_port() for role in ("both", "ctx", "gen", "orchestrator")}
        for role in ("both", "ctx", "gen"):
            servers.append(start_worker(model_dir, role, ports[role], work, args, None if role == "both" else key_file))
        workers = [{"role": role, "url": f"http://{HOST}:{ports[role]}"} for role in ("ctx", "gen")]
        servers.append(start_orchestrator(model_dir, 1, ports["orchestrator"], workers, work))
        urls = {"agg": f"http://{HOST}:{ports['both']}", "disagg": f"http://{HOST}:{ports['orchestrator']}"}
        measure(args, urls, rows, raw)
    finally:
        for server in reversed(servers):
            server.stop()
    report_targets(args, targets_of(rows), summary=rows, requests=raw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
