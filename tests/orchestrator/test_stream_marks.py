"""The orchestrator's reading of a marked stream (api.stream_marks, orchestrator.migration):
whole writes only, marks stripped, however the bytes are cut; a 5xx error event is not relayed."""

from __future__ import annotations

import random

from api.stream_marks import MarkReader, StreamMark, encode_mark

WRITES = [(b'data: {"a":1}\n\ndata: {"b":2}\n\n', [5, 6]), (b'data: {"c":": disagg x"}\n\n', [7]),
          (b"", [8, 9]), (b'data: {"d":4}\n\ndata: [DONE]\n\n', [])]


def stream() -> bytes:
    return b"".join(write + encode_mark(StreamMark(tokens)) for write, tokens in WRITES)


def test_whole_writes_and_their_tokens_however_the_bytes_come():
    data = stream()
    rng = random.Random(1)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(data)), rng.randint(0, 12)))
        reader = MarkReader()
        got = []
        for start, end in zip([0, *cuts], [*cuts, len(data)]):
            got.extend(reader.feed(data[start:end]))
        assert [(w, m.tokens) for w, m in got] == WRITES and reader.rest() == b""


def test_a_write_waits_for_its_mark():
    reader = MarkReader()
    assert reader.feed(b'data: {"a":1}\n\n') == []
    assert reader.rest() == b'data: {"a":1}\n\n'


def test_a_migration_reads_until_a_server_error_event():
    from orchestrator.migration import Migration

    migration = Migration.__new__(Migration)  # only its reading: no flow, no request
    migration.reader, migration.carried, migration.failed, migration.head = MarkReader(), [], None, None
    error = b'data: {"error":{"code":"engine_dead"}}\n\n' + encode_mark(StreamMark([], 503))
    out = migration.read(WRITES[0][0] + encode_mark(StreamMark([5, 6])) + error + b"data: late\n\n")
    assert out == WRITES[0][0] and migration.carried == [5, 6]
    assert migration.take_failure() == "its error event, status 503" and migration.failed is None
    client_error = b'data: {"error":{"code":"bad"}}\n\n'
    assert migration.head is not None and migration.head.id is None  # not an OpenAI chunk
    migration.head = None
    chunk = b'data: {"id":"chatcmpl-7","object":"chat.completion.chunk","created":17,"choices":[]}\n\n'
    migration.read(chunk + encode_mark(StreamMark([1])))
    assert (migration.head.id, migration.head.created) == ("chatcmpl-7", 17)
    assert migration.read(client_error + encode_mark(StreamMark([], 400))) == client_error  # the client's: relayed
