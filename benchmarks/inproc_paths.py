"""The Python share of the hot paths, in one process: CPU-seconds (process_time) per request.

``benchmarks/hot_paths.py`` measures the real processes; on a shared 2-core
machine their figures move by tens of percent from run to run. This script
runs the same Python code without processes, sockets or HTTP server, so its
figures are steady enough to tell one commit from the next (run it with
PYTHONPATH on each tree):

  - engine: ``EngineCore.step`` (synthetic, zero step cost) with ``concurrency``
    requests of 16 tokens in flight over 4 lanes, each step's outputs batched
    per lane and encoded as ``engine_proc`` does (a new request for each that
    finishes);
  - frontend: the worker's ASGI app (``frontends.app.build_app``) called
    through uvicorn's own request cycle (its ``send``, and the direct body that the
    server protocol offers: ``api.direct_body``) over a stand-in transport that
    counts the writes, for streamed chat completions, 64 at a time, fed by a stand-in
    engine client that delivers one token per request per step through the
    real ``OutputCollector`` (``generate()``) or pushed as the real client's lane reader
    does (``open_stream()``, the streamed route's path). Per write beyond the first:
    16 tokens against 1.

    python benchmarks/inproc_paths.py [--concurrency 512] [--skip engine,frontend] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

LANES = 4
_GC_DEFAULTS = gc.get_threshold()
PROMPT = list(range(1, 30))


def engine_ms_per_request(concurrency: int, num_requests: int) -> float:
    from workers import engine_proc
    from workers.config import CacheConfig, EngineConfig, SchedulerConfig, SyntheticConfig
    from workers.engine.core import EngineCore
    from workers.ipc import FrameCodec
    from workers.protocol import EngineRequest, OutputBatch
    from workers.sampling_params import SamplingParams

    core = EngineCore(EngineConfig(kind="synthetic", cache=CacheConfig(block_size=16, num_blocks=16 * concurrency),
                                   scheduler=SchedulerConfig(max_num_seqs=concurrency,
                                                             max_num_batched_tokens=64 * concurrency),
                                   synthetic=SyntheticConfig(vocab_size=512)))
    codec = FrameCodec(b"k" * 32, OutputBatch, "bench")
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    added = finished = 0

    def add() -> None:
        nonlocal added
        core.add_request(EngineRequest(((added % LANES) << 48) | added, PROMPT, params, time.time()))
        added += 1

    def run(until: int) -> None:
        nonlocal finished
        while finished < until:
            batches: list[list] = [[] for _ in range(LANES)]
            for output in core.step():
                batches[output.request_id >> 48].append(output)
                if output.finish_reason is not None:
                    finished += 1
                    add()
            now = time.time()
            for batch in batches:
                if batch:
                    codec.encode(OutputBatch(batch, now))

    threshold = getattr(engine_proc, "GC_GEN0_THRESHOLD", None)
    if threshold is not None:  # as the engine process sets the collector at ready (older trees: the defaults)
        gc.collect()
        gc.freeze()
        gc.set_threshold(threshold, 10, 10)
    try:
        for _ in range(concurrency):
            add()
        run(num_requests // 5)  # warm-up
        started, first = time.process_time(), finished
        run(finished + num_requests)
        return (time.process_time() - started) / (finished - first) * 1e3
    finally:
        gc.unfreeze()
        gc.set_threshold(*_GC_DEFAULTS)


class _CountingTransport:
    """The server side of every connection: counts the writes uvicorn's cycle (or the direct
    body) makes. (A keep-alive request without ``expect: 100-continue``, never paused: the
    cycle calls nothing else on it but ``close``, for the requests cancelled at the end.)"""

    writes = 0

    def write(self, data: bytes) -> None:
        self.writes += 1

    def close(self) -> None:
        pass


class _Pushed:
    def __init__(self, active: dict, request_id: int) -> None:
        self.active, self.request_id = active, request_id

    def close(self) -> None:
        self.active.pop(self.request_id, None)


class _SteppedClient:
    """An engine client whose ``step()`` gives every open request its next token."""

    max_model_len, vocab_size, eos_token_ids, is_healthy = 2048, 512, (), True

    def __init__(self) -> None:
        from api.admission import QueueBound

        self.active: dict[int, list] = {}
        self.queue = QueueBound(None, None, "this benchmark's engine")
        self.next_id = 0
        self.sink_cpu_s = 0.0
        self.num_outputs = 0

    def unavailable_error(self) -> Exception:
        return RuntimeError("never")

    async def abort(self, request_id: int) -> None:
        pass

    async def generate(self, prompt_token_ids, params, arrival_time=None, make_message=None, x_request_id=None):
        from frontends.engine_client import OutputCollector

        request_id, self.next_id = self.next_id, self.next_id + 1
        collector = OutputCollector()
        self.active[request_id] = [collector.put_nowait, params.max_tokens, 0]
        try:
            while True:
                output = await collector.get()
                yield output
                if output.finish_reason is not None:
                    return
        finally:
            self.active.pop(request_id, None)

    def open_stream(self, prompt_token_ids, params, on_output, arrival_time=None, make_message=None,
                    x_request_id=None):
        """As ``EngineClient.open_stream``: ``step()`` calls ``on_output`` itself."""
        request_id, self.next_id = self.next_id, self.next_id + 1
        self.active[request_id] = [on_output, params.max_tokens, 0]
        return _Pushed(self.active, request_id)

    def step(self) -> None:
        from workers.protocol import RequestOutput

        outputs = []
        for request_id, state in list(self.active.items()):
            sink, max_tokens, done = state
            state[2] = done = done + 1
            token = (request_id * 7 + done * 13) % 400 + 50  # ids whose bytes split characters, as models do
            outputs.append((sink, RequestOutput(request_id, [token], "length" if done >= max_tokens else None,
                                                num_prompt_tokens=len(PROMPT) if done == 1 else 0)))
        if not outputs:
            return
        # The lane reader's share: what handing the outputs over costs (pushed: the whole SSE event);
        # a process_time() is a system call (~2 us here): two a step, not two an output.
        started = time.process_time()
        for sink, output in outputs:
            sink(output)
        self.sink_cpu_s += time.process_time() - started
        self.num_outputs += len(outputs)


async def _frontend_run(model_dir: Path, max_tokens: int, num_requests: int, concurrency: int = 64
                        ) -> tuple[float, float, float]:
    from uvicorn.protocols.http.flow_control import FlowControl
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

    from api.serving import FrontendConfig
    from api.tokenizer import Tokenizer
    from frontends.app import build_app
    try:
        from api.direct_body import offer_direct_body
    except ImportError:  # a tree before it
        offer_direct_body = None  # type: ignore[assignment]

    from api import server

    client = _SteppedClient()
    app = build_app(client, Tokenizer.from_model_path(model_dir), FrontendConfig.for_model_dir(model_dir))
    if hasattr(server, "settle_gc"):  # as a frontend sets the collector before it serves (older trees: defaults)
        server.settle_gc()
    body = json.dumps({"model": model_dir.name, "messages": [{"role": "user", "content": "Tell me a story."}],
                       "max_tokens": max_tokens, "stream": True, "ignore_eos": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    done = 0
    transport = _CountingTransport()
    flow = FlowControl(transport)  # type: ignore[arg-type]
    log = logging.getLogger("inproc_paths")

    async def one_request() -> None:
        nonlocal done
        request_scope = dict(scope)
        cycle = RequestResponseCycle(request_scope, transport, flow, log, log, False, [],  # type: ignore[arg-type]
                                     asyncio.Event(), False, True, lambda: None)
        cycle.body, cycle.more_body = bytearray(body), False
        cycle.message_event.set()
        if offer_direct_body is not None:  # as the server protocol offers it (older trees: none)
            offer_direct_body(request_scope, cycle)
        await cycle.run_asgi(app)
        done += 1

    running = True

    async def connection() -> None:
        while running:  # uvicorn's run_asgi swallows the cancellation of a request
            await one_request()

    async def engine() -> None:
        while True:
            client.step()
            await asyncio.sleep(0)

    tasks = [asyncio.create_task(engine())] + [asyncio.create_task(connection()) for _ in range(concurrency)]
    while done < num_requests // 5:  # warm-up
        await asyncio.sleep(0.01)
    started, first, first_writes = time.process_time(), done, transport.writes
    client.sink_cpu_s = client.num_outputs = 0
    while done < first + num_requests:
        await asyncio.sleep(0.01)
    cpu, requests = time.process_time() - started, done - first
    running = False
    log.disabled = True  # uvicorn's cycle logs each cancelled request as an error
    for task in tasks:
        task.cancel()
    gc.unfreeze()
    gc.set_threshold(*_GC_DEFAULTS)
    # A steady window: as many heads written as requests done (each request's head is a write of its own).
    return (cpu / requests * 1e3, (transport.writes - first_writes) / requests - 1,
            client.sink_cpu_s / client.num_outputs * 1e6)


def frontend_figures(num_requests: int, rounds: int = 1) -> dict:
    """The 16-token and 1-token runs alternated ``rounds`` times; the least CPU of each (on a
    shared machine, other processes only ever add to it)."""
    from api.server import run_event_loop  # uvloop, as a frontend runs
    from workers.engine.model.tiny import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="inproc-paths-") as tmp:
        model_dir = Path(tmp) / "tiny-test"
        make_tiny_model(model_dir, size="test")
        runs16, runs1 = [], []
        for _ in range(rounds):
            runs16.append(run_event_loop(_frontend_run(model_dir, 16, num_requests)))
            runs1.append(run_event_loop(_frontend_run(model_dir, 1, 2 * num_requests)))
        (ms16, writes16, _), (ms1, writes1, _) = min(runs16), min(runs1)
    return {"ms_per_request_16": round(ms16, 4), "writes_per_request_16": round(writes16, 2),
            "ms_per_request_1": round(ms1, 4), "us_per_write": round((ms16 - ms1) / (writes16 - writes1) * 1e3, 2),
            "reader_us_per_output_16": round(min(run[2] for run in runs16), 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=lambda t: [int(x) for x in t.split(",")], default=[64, 512])
    parser.add_argument("--requests", type=int, default=10_000, help="engine requests measured per concurrency")
    parser.add_argument("--frontend-requests", type=int, default=2_000)
    parser.add_argument("--rounds", type=int, default=1, help="frontend runs alternated; the least CPU of each kept")
    parser.add_argument("--skip", type=lambda t: t.split(","), default=[], help="engine, frontend")
    args = parser.parse_args(argv)
    if "engine" not in args.skip:
        for concurrency in args.concurrency:
            ms = engine_ms_per_request(concurrency, args.requests)
            print(f"engine (in process, {LANES} lanes) c={concurrency}: {ms:.4f} ms CPU per request", flush=True)
    if "frontend" not in args.skip:
        figures = frontend_figures(args.frontend_requests, args.rounds)
        print(f"frontend (in process, c=64): {figures['ms_per_request_16']:.4f} ms CPU per 16-token request "
              f"({figures['writes_per_request_16']} writes), {figures['ms_per_request_1']:.4f} ms at 1 token, "
              f"{figures['us_per_write']:.2f} us per write beyond the first; the lane reader's share "
              f"{figures['reader_us_per_output_16']:.2f} us per output (16 tokens: cut, encode, write)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
