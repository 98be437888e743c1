"""The frontend HTTP test harness: the app over an in-process synthetic engine; the worker apps to inspect."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import uvicorn
from inproc_engine import InprocEngineClient, make_synthetic_core

from api.serving import FrontendConfig
from api.tokenizer import Tokenizer
from frontends.app import build_app
from frontends.worker_app import make_attached_app, make_launcher_app
from workers.attach import AttachInfo
from workers.engine.core import EngineCore
from workers.protocol import EngineInfo, EngineRequest
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


def worker_apps(model_dir, tokenizer: Tokenizer, tmp_path) -> dict:
    """The two apps of a worker's frontends, as ``disagg serve`` builds them, to inspect (never served:
    no engine behind them): ``{"launcher": ..., "attached": ...}``."""
    engine = EngineInfo("synthetic", 256, 512, [2], 16, 64)
    attach = AttachInfo(str(tmp_path), "00" * 32, 1, 2, os.getpid(), os.getpid(), engine, "127.0.0.1", 1)
    config = FrontendConfig.for_model_dir(model_dir)

    class NoClient:
        on_request_done = None

    launcher = make_launcher_app(NoClient(), tokenizer, config, attach, control=lambda r, t: None,
                                 config_labels={"model": "tiny"}, state_dir=tmp_path / "state")
    return {"launcher": launcher.app, "attached": make_attached_app(NoClient(), tokenizer, config, attach)}
