"""/v1/responses on one frontend (real uvicorn, in-process synthetic engine) with the official
``openai`` client: text, streaming, store / retrieve / delete, previous_response_id, errors."""

from __future__ import annotations

import asyncio

import openai
import pytest
import pytest_asyncio
from http_harness import live_harness, make_harness
from test_http_clients import wait_for_abort

pytestmark = pytest.mark.asyncio

TOOL = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
# Half the vocabulary ends the answer: greedy answers are short and end with "stop" (status completed).
EOS = frozenset(range(256, 512))


@pytest_asyncio.fixture
async def server(tiny_model_dir, tokenizer):
    app, h = await make_harness(tiny_model_dir, tokenizer, eos=EOS)
    async with live_harness(app, h):
        yield h


def client_of(h) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(h.http.base_url).rstrip("/") + "/v1", api_key="unused", max_retries=0,
                              timeout=10)


async def test_create_stream_retrieve_delete(server):
    client = client_of(server)
    kwargs = dict(model="tiny-test", instructions="Be brief.", input="Hello there", max_output_tokens=12,
                  temperature=0)
    first = await client.responses.create(**kwargs)
    assert first.status in ("completed", "incomplete") and first.object == "response"
    assert first.usage.input_tokens > 0 and first.usage.output_tokens >= 1
    assert first.usage.input_tokens_details.cached_tokens >= 0
    assert (first.status == "incomplete") == (first.usage.output_tokens == 12)

    events = [event async for event in await client.responses.create(stream=True, **kwargs)]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:4]] == ["response.created", "response.in_progress",
                                            "response.output_item.added", "response.content_part.added"]
    assert events[-1].type == f"response.{first.status}"
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == first.output_text  # greedy: the same answer either way
    done = [e.text for e in events if e.type == "response.output_text.done"]
    assert done == [first.output_text]

    stored = await client.responses.retrieve(first.id)
    assert stored.id == first.id and stored.output_text == first.output_text
    assert stored.model_dump() == first.model_dump()
    await client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.delete(first.id)

    # null means the default, as clients that send every field write it
    nulls = {"tool_choice": None, "parallel_tool_calls": None, "store": None, "truncation": None, "text": None}
    raw = await server.http.post("/v1/responses", json={"input": "hi", **kwargs, **nulls, "stream": None})
    assert raw.status_code == 200 and raw.json()["store"] is True and raw.json()["tool_choice"] == "auto"

    unstored = await client.responses.create(store=False, **kwargs)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(unstored.id)


async def test_previous_response_id_continues_the_conversation(server):
    client = client_of(server)
    first = await client.responses.create(model="tiny-test", input="What is two plus two?", max_output_tokens=8,
                                          temperature=0)
    second = await client.responses.create(model="tiny-test", input="And three plus three?", max_output_tokens=8,
                                           temperature=0, previous_response_id=first.id)
    assert second.previous_response_id == first.id
    # The second prompt renders the first turn (question and answer) before its own question.
    alone = await client.responses.create(model="tiny-test", input="And three plus three?", max_output_tokens=8,
                                          temperature=0, store=False)
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    async with client.responses.stream(model="tiny-test", input="And four?", max_output_tokens=8, temperature=0,
                                       previous_response_id=second.id) as stream:
        async for _ in stream:
            pass
        if second.status == "completed":
            third = await stream.get_final_response()
            assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens


@pytest.mark.parametrize("body, status, param", [
    ({"input": "x", "previous_response_id": "resp_nope"}, 400, "previous_response_id"),
    ({"input": "x", "max_output_tokens": 100000}, 400, "max_output_tokens"),
    ({"input": "x", "temperature": -1}, 400, "temperature"),
    ({"input": "x", "top_p": 7}, 400, "top_p"),
    ({"input": []}, 400, "input"),
    ({"input": 5}, 400, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, 400,
     "input[0].content[0].type"),
    ({"input": "x", "text": {"format": {"type": "nonsense"}}}, 400, "text.format.type"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, 400, "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {
        "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}}, 400, "text.format"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"input": "x", "tool_choice": "required"}, 400, "tool_choice"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "f"}}, 400, "tool_choice"),
    ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "g"}}, 400, "tool_choice.name"),
    ({"input": "x", "tools": [TOOL, TOOL]}, 400, "tools[1].name"),
    ({"input": "x", "tools": [{**TOOL, "parameters": {"type": "array"}}]}, 400, "tools[0].parameters"),
    ({"input": "x", "model": "nope"}, 404, "model"),
])
async def test_invalid_requests(server, body, status, param):
    response = await server.http.post("/v1/responses", json={"model": "tiny-test", **body})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]
    assert "response_format" not in error["message"] and "max_completion_tokens" not in error["message"]
    if param == "previous_response_id":
        assert error["code"] == "previous_response_not_found"
    response = await server.http.post("/v1/responses", content=b"{not json")
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    server.assert_engine_idle()


async def test_disconnects_abort_in_engine(live_server):
    request = {"model": "tiny-test", "input": "Hello", "max_output_tokens": 200, "stream": True}
    async with live_server.http.stream("POST", "/v1/responses", json=request) as response:
        assert response.status_code == 200
        async for chunk in response.aiter_raw():
            if b"response.output_text.delta" in chunk:
                break  # the client goes away while the engine is decoding
    assert live_server.core.has_unfinished()
    await wait_for_abort(live_server, 1)
    task = asyncio.create_task(live_server.http.post("/v1/responses", json={**request, "stream": False}))
    while not live_server.core.has_unfinished():
        await asyncio.sleep(0.005)
    task.cancel()  # closes the connection of a non-streaming request
    await asyncio.gather(task, return_exceptions=True)
    await wait_for_abort(live_server, 2)
    live_server.assert_engine_idle()


async def test_input_items_list_the_conversation(server):
    client = client_of(server)
    first = await client.responses.create(model="tiny-test", instructions="Be brief.", max_output_tokens=4,
                                          input=[{"role": "user", "content": "one"},
                                                 {"type": "message", "role": "user", "content": "two"}])
    second = await client.responses.create(model="tiny-test", input="three", max_output_tokens=4,
                                           previous_response_id=first.id)
    page = await client.responses.input_items.list(second.id)
    texts = [item.content[0].text for item in page.data]
    assert texts == ["three", first.output_text, "two", "one"]  # newest first; no instructions
    assert page.data[1].id == first.output[0].id and all(item.id for item in page.data)
    ascending = await client.responses.input_items.list(second.id, order="asc", limit=2)
    assert [item.id for item in ascending.data] == [item.id for item in page.data[::-1][:2]]
    assert ascending.has_more
    rest = await client.responses.input_items.list(second.id, order="asc", after=ascending.data[-1].id)
    assert [item.id for item in rest.data] == [item.id for item in page.data[::-1][2:]] and not rest.has_more
    for query, param in (("limit=0", "limit"), ("limit=x", "limit"), ("order=sideways", "order"),
                         ("after=nope", "after")):
        response = await server.http.get(f"/v1/responses/{second.id}/input_items?{query}")
        assert response.status_code == 400 and response.json()["error"]["param"] == param
    assert (await server.http.get("/v1/responses/resp_nope/input_items")).status_code == 404
