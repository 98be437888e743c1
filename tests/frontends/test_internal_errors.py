"""A bug is a logged 500 in the API's error shape; only typed validation errors are 400s.

An engine invariant (the scheduler's or the block manager's) raises a bare
``ValueError``: it must not reach the client as an unlogged 400 that blames
the request.
"""

from __future__ import annotations

import importlib
import logging

import anthropic
import openai
import pytest

import api.errors
from api.errors import FrontendError, http_error
from workers.protocol import EngineRequest
from workers.sampling_params import ParamError, SamplingParams

INVARIANT = "request id 1 is already in the engine"


def test_bare_value_error_is_a_500():
    error = http_error(ValueError(INVARIANT))
    assert (error.status, error.openai_type, error.anthropic_type) == (500, "internal_error", "api_error")
    assert error.message == "internal error: ValueError"  # the bug's text stays in the log, not the body


def test_param_error_is_a_400_naming_the_param():
    with pytest.raises(ParamError) as caught:
        SamplingParams(top_p=0.0).validate()
    error = http_error(caught.value)
    assert (error.status, error.param, error.openai_type) == (400, "top_p", "invalid_request_error")
    assert error.message == "top_p must be in (0, 1], got 0.0"


def break_engine(harness, monkeypatch):
    """The engine breaks an invariant on the next request, as ``EngineCore.add_request`` does on a duplicate id."""
    def add_request(request: EngineRequest, *args: object, **kwargs: object) -> None:
        raise ValueError(INVARIANT)

    monkeypatch.setattr(harness.core, "add_request", add_request)
    return harness


@pytest.fixture
def broken_engine(harness, monkeypatch):
    return break_engine(harness, monkeypatch)


@pytest.fixture
def broken_server(live_server, monkeypatch):
    return break_engine(live_server, monkeypatch)


def assert_logged(caplog) -> None:
    records = [r for r in caplog.records if r.levelno >= logging.ERROR and r.exc_info]
    assert records, "the 500 was not logged"
    exc = records[-1].exc_info[1]
    assert isinstance(exc, ValueError) and str(exc) == INVARIANT
    assert "add_request" in caplog.text.split("Traceback", 1)[1]  # the traceback reaches the raise


@pytest.mark.asyncio
async def test_engine_value_error_is_a_logged_500_openai(broken_engine, caplog):
    body = {"model": "tiny-test", "prompt": "Hello", "max_tokens": 4}
    response = await broken_engine.http.post("/v1/completions", json=body)
    assert response.status_code == 500, response.text
    assert response.json() == {"error": {"message": "internal error: ValueError", "type": "internal_error",
                                         "param": None, "code": None}}
    assert_logged(caplog)


@pytest.mark.asyncio
async def test_engine_value_error_is_a_logged_500_sdks(broken_server, caplog):
    url = str(broken_server.http.base_url).rstrip("/")
    oai = openai.AsyncOpenAI(api_key="unused", base_url=f"{url}/v1", max_retries=0)
    with pytest.raises(openai.InternalServerError) as caught:
        await oai.chat.completions.create(model="tiny-test", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4)
    assert caught.value.status_code == 500
    assert_logged(caplog)
    caplog.clear()
    ant = anthropic.AsyncAnthropic(api_key="unused", base_url=url, max_retries=0)
    with pytest.raises(anthropic.InternalServerError) as caught_a:
        await ant.messages.create(model="tiny-test", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert caught_a.value.status_code == 500
    assert caught_a.value.body == {"type": "error", "error": {"type": "api_error",
                                                              "message": "internal error: ValueError"}}
    assert_logged(caplog)
    await oai.close()
    await ant.close()


# Every module that defines a FrontendError subclass: imported so that __subclasses__ sees them all.
ERROR_MODULES = ("api.admission", "api.disaggregation", "api.generation", "api.header_limit",
                 "api.responses.api", "orchestrator.errors")


def test_the_error_tree_docstring_lists_every_class():
    for name in ERROR_MODULES:
        importlib.import_module(name)

    def subclasses(cls: type) -> set[type]:
        return {cls, *(sub for direct in cls.__subclasses__() for sub in subclasses(direct))}

    doc = api.errors.__doc__ or ""
    missing = sorted(cls.__name__ for cls in subclasses(FrontendError) | {ParamError} if f" {cls.__name__} " not in doc)
    assert not missing, f"api/errors.py's docstring does not list {missing}"
