"""/tokenize, /detokenize and GET /v1/models/{id} on a worker frontend (in-process engine,
the official openai client on a real uvicorn for the model card)."""

from __future__ import annotations

import openai
import pytest
from http_harness import MAX_MODEL_LEN

pytestmark = pytest.mark.asyncio

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"}]


async def test_tokenize_prompt_and_messages(harness):
    tokenizer = harness.tokenizer
    response = await harness.http.post("/tokenize", json={"model": "tiny-test", "prompt": "Hello world"})
    assert response.status_code == 200, response.text
    ids = tokenizer.encode("Hello world")
    assert response.json() == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids, "token_strs": None}
    plain = (await harness.http.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False,
                                                        "return_token_strs": True})).json()
    assert plain["tokens"] == tokenizer.encode("Hello world", add_special_tokens=False)
    assert "".join(plain["token_strs"]) == tokenizer.decode(plain["tokens"], skip_special_tokens=False)

    chat = (await harness.http.post("/tokenize", json={"model": "tiny-test", "messages": CHAT})).json()
    assert chat["tokens"] == tokenizer.encode_chat(CHAT) and chat["count"] == len(chat["tokens"])
    no_prompt = (await harness.http.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False})).json()
    assert no_prompt["tokens"] == tokenizer.encode_chat(CHAT, add_generation_prompt=False) != chat["tokens"]
    # The count is what a chat completion of the same messages reports as prompt_tokens.
    completion = await harness.http.post("/v1/chat/completions",
                                         json={"model": "tiny-test", "messages": CHAT, "max_tokens": 1})
    assert completion.json()["usage"]["prompt_tokens"] == chat["count"]


async def test_detokenize_round_trip(harness):
    ids = harness.tokenizer.encode("Hello world, again")
    response = await harness.http.post("/detokenize", json={"model": "tiny-test", "tokens": ids})
    assert response.status_code == 200, response.text
    assert response.json() == {"prompt": harness.tokenizer.decode(ids, skip_special_tokens=False)}
    assert (await harness.http.post("/detokenize", json={"tokens": []})).json() == {"prompt": ""}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"model": "tiny-test"}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt"),
    ("/tokenize", {"prompt": 3}, "prompt"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("/tokenize", {"messages": CHAT, "add_special_tokens": True}, "add_special_tokens"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [10 ** 9]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {}, None),
])
async def test_bad_bodies_are_400_naming_the_parameter(harness, path, body, param):
    response = await harness.http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


async def test_unknown_model_and_malformed_json(harness):
    response = await harness.http.post("/tokenize", json={"model": "nope", "prompt": "x"})
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    response = await harness.http.post("/detokenize", content=b"{not json")
    assert response.status_code == 400 and "malformed JSON" in response.json()["error"]["message"]


async def test_retrieve_model_with_the_official_client(live_server):
    client = openai.AsyncOpenAI(base_url=str(live_server.http.base_url).rstrip("/") + "/v1", api_key="unused",
                                max_retries=0, timeout=10)
    model = await client.models.retrieve("tiny-test")
    assert model.id == "tiny-test" and model.object == "model"
    assert model.model_extra["max_model_len"] == MAX_MODEL_LEN
    with pytest.raises(openai.NotFoundError) as excinfo:
        await client.models.retrieve("other/model")
    assert excinfo.value.code == "model_not_found" and excinfo.value.body["param"] == "model"
