"""The frontend HTTP test harness: the app over an in-process synthetic engine."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from dataclasses import dataclass
from typing import AsyncIterator

import httpx
import uvicorn

from frontends.app import build_app
from frontends.serving import FrontendConfig
from frontends.tokenizer import Tokenizer
from inproc_engine import InprocEngineClient, make_synthetic_core
from workers.engine.core import EngineCore
from workers.protocol import EngineRequest
from workers.sampling_params import SamplingParams

MAX_MODEL_LEN = 256
FRONTEND_ID = 7


@dataclass
class Harness:
    core: EngineCore
    client: InprocEngineClient
    http: httpx.AsyncClient
    tokenizer: Tokenizer
    model: str

    def assert_engine_idle(self) -> None:
        """No request left in the engine and no KV block held by one."""
        assert not self.core.has_unfinished()
        assert self.core.block_manager.num_used_blocks == 0
        self.core.check_integrity()


def engine_output_ids(prompt_ids: list[int], params: SamplingParams, eos: frozenset[int] = frozenset()) -> list[int]:
    """What a fresh engine of the harness's configuration generates on its own."""
    core = make_synthetic_core(max_model_len=MAX_MODEL_LEN, eos_token_ids=eos)
    core.add_request(EngineRequest(1, prompt_ids, params))
    tokens: list[int] = []
    while core.has_unfinished():
        for output in core.step():
            tokens.extend(output.new_token_ids)
    return tokens


async def make_harness(tiny_model_dir, tokenizer, decode_step_seconds: float = 0.0,
                       eos: frozenset[int] = frozenset()):
    core = make_synthetic_core(max_model_len=MAX_MODEL_LEN, eos_token_ids=eos,
                               decode_step_seconds=decode_step_seconds)
    client = InprocEngineClient(core)
    await client.start()
    app = build_app(client, tokenizer, FrontendConfig.for_model_dir(tiny_model_dir, frontend_id=FRONTEND_ID))
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://frontend", timeout=10)
    return app, Harness(core, client, http, tokenizer, "tiny-test")


@contextlib.asynccontextmanager
async def live_harness(app, h) -> AsyncIterator:
    """The harness's app on a real uvicorn at 127.0.0.1 (same event loop as the engine task),
    ``h.http`` pointed at it; everything stopped and closed on exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    h.http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}", timeout=10)
    try:
        yield h
    finally:
        await h.http.aclose()
        server.should_exit = True
        await task
        sock.close()
        await h.client.close()
