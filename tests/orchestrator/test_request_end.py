"""orchestrator.request_end: the completion tokens an access line reads from an answer's usage."""

from __future__ import annotations

import pytest

from orchestrator.request_end import output_tokens


@pytest.mark.parametrize("tail, tokens", [
    (b'{"id": "x", "usage": {"prompt_tokens": 3, "completion_tokens": 4}}', 4),  # OpenAI JSON
    (b'{"id": "x", "usage": {"input_tokens": 3, "output_tokens": 5}}', 5),  # Anthropic JSON
    (b'data: {"choices": [], "usage": {"completion_tokens": 6}}\n\ndata: [DONE]\n\n', 6),  # include_usage
    (b'event: message_delta\ndata: {"type": "message_delta", "usage": {"output_tokens": 7}}\n\n'
     b'event: message_stop\ndata: {"type": "message_stop"}\n\n', 7),  # an Anthropic stream's end
    (b'data: {"choices": [{"delta": {}}]}\n\ndata: [DONE]\n\n', None),  # a stream without usage
    (b'data: {"usage": "garbled"}\n\n', None),
    (b'{"usage": null}', None),
    (b"", None),
])
def test_completion_tokens_come_from_the_last_usage_or_are_unknown(tail, tokens):
    assert output_tokens(tail) == tokens


def test_with_tracing_off_a_request_gets_no_span_and_its_legs_no_traceparent():
    import time
    from collections import deque

    from orchestrator.request_end import RequestEnds
    from orchestrator.state_protocol import RequestTrace

    class Link:
        perf_queue: deque = deque()

    ends = RequestEnds(Link(), access_log=False, tracing=None)
    record = RequestTrace(request_id="r", api="chat", arrival=time.time())
    ends.begin(record, "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    headers = {"x-request-id": "r-ctx"}
    assert ends.open_leg(record, "ctx", "w", time.time(), headers) is None
    assert headers == {"x-request-id": "r-ctx"}
    ends.end(record, 200)
    assert list(Link.perf_queue) == [record] and ends._spans == {}


def test_sample_ratio_zero_traces_only_what_a_client_asked_to_be_traced():
    pytest.importorskip("opentelemetry.sdk")  # the [tracing] extra (make setup installs it)
    import time
    from collections import deque

    from api.tracing import Tracing
    from orchestrator.request_end import RequestEnds
    from orchestrator.state_protocol import RequestTrace

    class Link:
        perf_queue: deque = deque()

    tracing = Tracing("http://127.0.0.1:9", "test", sample_ratio=0.0)  # a closed port: nothing leaves
    ends = RequestEnds(Link(), access_log=False, tracing=tracing)
    try:
        for traceparent, traced in ((None, False), ("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00", False),
                                    ("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", True)):
            record = RequestTrace(request_id="r", api="chat", arrival=time.time())
            ends.begin(record, traceparent)
            headers = {"x-request-id": "r-gen"}
            span = ends.open_leg(record, "gen", "w", time.time(), headers)
            assert (span is not None) == traced
            if traced:  # the leg's own span, in the client's trace
                assert headers["traceparent"].startswith("00-0af7651916cd43dd8448eb211c80319c-")
                assert headers["traceparent"].endswith("-01") and "b7ad6b7169203331" not in headers["traceparent"]
                ends.keep_gen_leg(record, span)
            else:
                assert "traceparent" not in headers
            record.end = time.time()
            ends.end(record, 200)
        assert ends._spans == {}
    finally:
        tracing.shutdown()
