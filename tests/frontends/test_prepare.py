"""The one preparation path (``api.prepare``), the same for every API: a disaggregated leg
is checked before the prompt is read, a gen leg runs on its signed ids, a ctx leg samples one
token, and the leg is the generation's output hook.

A real ``ServingContext`` (the tiny model's tokenizer, a cluster key) over the in-process
engine; each test runs on completions, chat and Anthropic messages alike.
"""

from __future__ import annotations

import os
import time
from contextlib import aclosing

import msgspec
import pytest
from inproc_engine import InprocEngineClient, make_synthetic_core

from api.anthropic_api import MessagesApi
from api.disaggregation import DisaggConfig
from api.errors import InvalidRequestError, PromptTooLongError
from api.openai_api import ChatApi, CompletionApi
from api.prepare import ApiRequest, check_request, prepare_request
from api.schemas_anthropic import MessagesRequest
from api.schemas_openai import ChatCompletionRequest, CompletionRequest
from api.serving import FrontendConfig, ServingContext
from workers.disagg_params import RequestType, signed_params

MODEL = "tiny"
MAX_MODEL_LEN = 256
KEY = os.urandom(32)
TEXT = "Tell me about prefix caching."
SIGNED_IDS = list(range(30, 43))  # not what TEXT tokenizes to: a gen leg must not re-tokenize
FIRST_TOKEN = 7
APIS = {
    "completions": (CompletionApi, CompletionRequest, {"prompt": TEXT}),
    "chat": (ChatApi, ChatCompletionRequest, {"messages": [{"role": "user", "content": TEXT}]}),
    "messages": (MessagesApi, MessagesRequest, {"messages": [{"role": "user", "content": TEXT}]}),
}
LONG_PROMPT = {"completions": {"prompt": "word " * 2000},
               "chat": {"messages": [{"role": "user", "content": "word " * 2000}]},
               "messages": {"messages": [{"role": "user", "content": "word " * 2000}]}}


@pytest.fixture
def ctx(tokenizer) -> ServingContext:
    core = make_synthetic_core(vocab_size=tokenizer.backend.get_vocab_size(with_added_tokens=True),
                               max_model_len=MAX_MODEL_LEN)
    disagg = DisaggConfig(role="both", cluster_key=KEY, kv_endpoint="tcp://127.0.0.1:1")
    return ServingContext(InprocEngineClient(core), tokenizer, FrontendConfig(MODEL, disagg=disagg))


def api_request(api: str, **fields) -> ApiRequest:
    adapter, struct, prompt = APIS[api]
    return adapter(msgspec.convert({"model": MODEL, "max_tokens": 8, **prompt, **fields}, struct))


def gen_params(**fields) -> dict:
    params = signed_params(KEY, "17", "tcp://127.0.0.1:1", len(SIGNED_IDS), FIRST_TOKEN, time.time() + 60,
                           SIGNED_IDS)
    return msgspec.to_builtins(msgspec.structs.replace(params, request_type=RequestType.GENERATION_ONLY, **fields))


@pytest.mark.parametrize("api", APIS)
def test_a_plain_request_has_no_leg_and_its_own_prompt(ctx, api):
    request = api_request(api)
    valid = check_request(ctx, request)
    assert valid.leg is None
    assert valid.prompt_ids == request.prompt_ids(ctx) and valid.prompt_ids != SIGNED_IDS
    assert valid.params.max_tokens == 8


@pytest.mark.parametrize("api", APIS)
def test_a_ctx_leg_samples_one_token_of_the_same_prompt(ctx, api):
    plain = check_request(ctx, api_request(api))
    valid = check_request(ctx, api_request(api, disaggregated_params={"request_type": RequestType.CONTEXT_ONLY}))
    assert valid.leg is not None and valid.leg.is_context
    assert valid.prompt_ids == plain.prompt_ids
    assert valid.params.max_tokens == 1


@pytest.mark.parametrize("api", APIS)
def test_a_gen_leg_runs_on_its_signed_ids(ctx, api):
    valid = check_request(ctx, api_request(api, disaggregated_params=gen_params()))
    assert valid.leg is not None and not valid.leg.is_context
    assert valid.prompt_ids == SIGNED_IDS
    assert valid.params.max_tokens == 8


@pytest.mark.parametrize("api", APIS)
def test_a_gen_leg_is_verified_before_its_prompt_is_read(ctx, api):
    with pytest.raises(PromptTooLongError):  # the prompt alone is refused...
        check_request(ctx, api_request(api, **LONG_PROMPT[api]))
    unsigned = gen_params(signature=None)
    with pytest.raises(InvalidRequestError) as refused:  # ...but an unsigned leg is refused first
        check_request(ctx, api_request(api, disaggregated_params=unsigned, **LONG_PROMPT[api]))
    assert refused.value.param == "disaggregated_params"


@pytest.mark.parametrize("api", APIS)
def test_a_gen_leg_needs_room_for_more_than_its_first_token(ctx, api):
    with pytest.raises(InvalidRequestError) as refused:
        check_request(ctx, api_request(api, max_tokens=1, disaggregated_params=gen_params()))
    assert refused.value.param == "max_tokens"


@pytest.mark.asyncio
@pytest.mark.parametrize("api", APIS)
async def test_the_leg_is_the_generations_output_hook(ctx, api):
    """The gen leg's hook puts the ctx leg's first token in front and reports its cached tokens;
    the in-process engine runs the leg as a plain request (it reads no engine message)."""
    client = ctx.client
    assert isinstance(client, InprocEngineClient)
    await client.start()
    try:
        plain = prepare_request(ctx, api_request(api)).generation
        assert plain.hook is None
        prepared = prepare_request(ctx, api_request(api, disaggregated_params=gen_params(num_cached_tokens=12)))
        generation = prepared.generation
        assert prepared.leg is not None and generation.hook is prepared.leg
        async with aclosing(generation.pieces()) as pieces:  # leaving it aborts the request
            first = await anext(pieces)
        assert first.token_ids[0] == FIRST_TOKEN
        assert generation.num_cached_tokens == 0 and generation.num_usage_cached_tokens == 12
        await client.wait_idle()
    finally:
        await client.close()

