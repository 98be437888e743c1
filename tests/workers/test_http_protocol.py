"""The orchestrator↔worker HTTP protocol: what each side writes is what the other reads."""

from __future__ import annotations

import msgspec
import pytest

from workers.disagg_params import DisaggParams, RequestType
from workers.engine.kv_events import BlockRemoved, BlockStored, KVEvent, Tier
from workers.http_protocol import (
    CtxAnswer,
    CtxLegFields,
    GenLegFields,
    Role,
    WorkerInfo,
    client_answer,
    decode_kv_events,
    with_fields,
)

PARAMS = DisaggParams(RequestType.CONTEXT_ONLY, "7", "tcp://127.0.0.1:1", 3, 65, 1e10, "ab" * 32)


def test_with_fields_appends_to_the_clients_own_bytes():
    raw = b'{"model": "m",\n "prompt": "hi"}\n'
    body = with_fields(raw, GenLegFields(PARAMS))
    assert body.startswith(b'{"model": "m",\n "prompt": "hi"')  # untouched, spacing and all
    assert msgspec.json.decode(body) == {"model": "m", "prompt": "hi",
                                         "disaggregated_params": msgspec.to_builtins(PARAMS)}
    assert msgspec.json.decode(with_fields(b"{ }", GenLegFields(PARAMS))) == {
        "disaggregated_params": msgspec.to_builtins(PARAMS)}
    with pytest.raises(ValueError):
        with_fields(b"[1]", GenLegFields(PARAMS))


def test_the_ctx_leg_sets_one_token_no_stream_and_the_prompt_ids_in_its_params():
    params = DisaggParams(RequestType.CONTEXT_ONLY, prompt_token_ids=[1, 2])
    chat = msgspec.json.decode(with_fields(b'{"messages": []}', CtxLegFields(params)))
    assert chat == {"messages": [], "max_tokens": 1, "stream": False,
                    "disaggregated_params": {"request_type": "context_only", "prompt_token_ids": [1, 2]}}


def test_a_ctx_answer_is_read_for_two_fields_and_passed_on_as_bytes():
    raw = (b'{"id": "cmpl-1", "choices": [{"text": "\\u00e9", "index": 0}], "usage": {"prompt_tokens": 3},'
           b' "disaggregated_params": ' + msgspec.json.encode(PARAMS) + b', "prompt_token_ids": [1, 2, 3]}')
    answer = msgspec.json.decode(raw, type=CtxAnswer)
    assert answer.disaggregated_params == PARAMS and answer.prompt_token_ids == [1, 2, 3]
    gen = answer.gen_params()
    assert gen is not None and gen.request_type == RequestType.GENERATION_ONLY and gen.prompt_token_ids == [1, 2, 3]
    assert gen.signature == PARAMS.signature
    # The client's answer: the rest, each value's bytes as the worker wrote them (its escapes too).
    assert client_answer(raw) == (b'{"id":"cmpl-1","choices":[{"text": "\\u00e9", "index": 0}],'
                                  b'"usage":{"prompt_tokens": 3}}')
    finished = CtxAnswer(DisaggParams(RequestType.CONTEXT_ONLY, finished=True), [1])
    assert finished.gen_params() is None and CtxAnswer().gen_params() is None


def test_a_ctx_answer_without_echoed_ids_takes_the_ids_the_leg_was_sent():
    answer = CtxAnswer(msgspec.structs.replace(PARAMS, prompt_token_ids=None))
    assert answer.gen_params() is None  # no ids at all: no gen leg can be built
    gen = answer.gen_params([4, 5, 6])
    assert gen is not None and gen.prompt_token_ids == [4, 5, 6] and gen.signature == PARAMS.signature
    echoed = CtxAnswer(PARAMS, [1, 2, 3])  # an older worker echoes them: its own win
    assert echoed.gen_params([4, 5, 6]).prompt_token_ids == [1, 2, 3]


def test_worker_info_keeps_its_wire_layout_and_reads_a_partial_one():
    info = WorkerInfo(role=Role.GEN, model="m", kv_endpoint=None, block_size=16, hash_seed=0, max_model_len=256,
                      vocab_size=512, server_time=1.5)
    assert msgspec.json.encode(info) == (b'{"role":"gen","model":"m","kv_endpoint":null,"block_size":16,'
                                         b'"hash_seed":0,"max_model_len":256,"vocab_size":512,"server_time":1.5}')
    assert msgspec.json.decode(b'{"server_time": 2}', type=WorkerInfo) == WorkerInfo(server_time=2.0)


def test_kv_events_are_read_as_the_engine_writes_them_or_in_an_object():
    page = msgspec.json.encode([KVEvent(0, 0.0, BlockStored([1, 2], None, [5] * 8, 4)),
                                KVEvent(1, 0.0, BlockRemoved([2], Tier.HOST))])
    stored, removed = decode_kv_events(page)
    assert (stored.event_id, stored.event.type, stored.event.block_hashes, stored.event.tier) == (
        0, "BlockStored", [1, 2], "pool")
    assert (removed.event.type, removed.event.tier) == ("BlockRemoved", "host")
    assert decode_kv_events(b'{"events": ' + page + b"}") == [stored, removed]
    with pytest.raises(msgspec.ValidationError):
        decode_kv_events(b'[{"event_id": 1}]')
