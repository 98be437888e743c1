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
