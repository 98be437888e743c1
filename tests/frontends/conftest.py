"""Frontend fixtures: the tiny model's tokenizer and the app over an in-process engine."""

from __future__ import annotations

import pytest
import pytest_asyncio
from http_harness import live_harness, make_harness

from api.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_model_dir(tiny_model_dir)


@pytest_asyncio.fixture
async def harness(tiny_model_dir, tokenizer):
    app, h = await make_harness(tiny_model_dir, tokenizer)
    yield h
    await h.http.aclose()
    await h.client.close()


@pytest_asyncio.fixture
async def live_server(tiny_model_dir, tokenizer):
    """The app on a real uvicorn at 127.0.0.1 (same event loop as the engine task);
    decode steps take 2 ms so that a stream is still running when a test disconnects."""
    app, h = await make_harness(tiny_model_dir, tokenizer, decode_step_seconds=0.002)
    async with live_harness(app, h):
        yield h


@pytest.fixture(scope="module")
def torch_worker(tiny_model_dir):
    """A real worker (one frontend, the tiny model on the torch engine: real tokens) for the module."""
    from worker_process import start_worker, stop_worker

    url, proc = start_worker(tiny_model_dir, num_frontends=1, engine="torch")
    yield url
    assert stop_worker(proc) == 0


@pytest.fixture()
def torch_openai(torch_worker):
    """The official openai client of ``torch_worker``."""
    import openai

    return openai.OpenAI(base_url=torch_worker + "/v1", api_key="unused", max_retries=0, timeout=60)
