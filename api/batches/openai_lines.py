"""One OpenAI batch request: its input line read and checked, its output or error line written.

A line that cannot run (not JSON, a field missing, another ``url`` than the
batch's endpoint, a ``custom_id`` seen before) is settled when the batch is
validated: its error line goes to the batch's error file and the batch goes
on (OpenAI fails a whole batch for one bad line; one line's typo should not
cost the other 49,999). A line that runs gets an output line whatever the
endpoint answered: 200s go to the output file, 4xx and 5xx to the error file
(``OUTCOME_STATE`` of its status), each with the endpoint's own body.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import msgspec

from api.batches.executor import Outcome
from api.batches.openai_schemas import BatchUsage, InputLine, InputTokensDetails, OutputTokensDetails
from api.errors import InvalidRequestError

__all__ = ["read_line", "response_line", "error_line", "line_error_outcome", "UsageSum", "MAX_CUSTOM_ID_CHARS"]

MAX_CUSTOM_ID_CHARS = 512


def read_line(raw: bytes, endpoint: str) -> InputLine:
    """A line as a request of a batch of ``endpoint`` (raises InvalidRequestError saying what is wrong)."""
    try:
        line = msgspec.json.decode(raw, type=InputLine)
    except msgspec.ValidationError as exc:
        raise InvalidRequestError(f"not a batch request line: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidRequestError(f"not a JSON object: {exc}") from None
    if not line.custom_id or len(line.custom_id) > MAX_CUSTOM_ID_CHARS:
        raise InvalidRequestError(f"custom_id must be 1 to {MAX_CUSTOM_ID_CHARS} characters", param="custom_id")
    if line.method != "POST":
        raise InvalidRequestError(f"method must be POST, got {line.method!r}", param="method")
    if line.url != endpoint:
        raise InvalidRequestError(f"url must be the batch's endpoint {endpoint!r}, got {line.url!r}", param="url")
    if not bytes(line.body).lstrip().startswith(b"{"):
        raise InvalidRequestError("body must be a JSON object", param="body")
    return line


def _request_line_id() -> bytes:
    return msgspec.json.encode("batch_req_" + secrets.token_hex(12))


def response_line(custom_id: str, status: int, request_id: str, body: bytes) -> Outcome:
    """The line of a request that ran: ``body`` is the endpoint's JSON answer (or error body)."""
    line = (b'{"id":' + _request_line_id() + b',"custom_id":' + msgspec.json.encode(custom_id)
            + b',"response":{"status_code":' + str(status).encode() + b',"request_id":'
            + msgspec.json.encode(request_id) + b',"body":' + body + b'},"error":null}')
    return ("succeeded" if status == 200 else "errored"), line


def error_line(custom_id: str | None, code: str, message: str) -> bytes:
    """The line of a request that did not run (a bad line, a cancelled or expired batch)."""
    return (b'{"id":' + _request_line_id() + b',"custom_id":' + msgspec.json.encode(custom_id)
            + b',"response":null,"error":' + msgspec.json.encode({"code": code, "message": message}) + b"}")


def line_error_outcome(custom_id: str | None, line_number: int, exc: InvalidRequestError) -> Outcome:
    where = f" ({exc.param})" if exc.param else ""
    return "errored", error_line(custom_id, "invalid_request", f"line {line_number}{where}: {exc.message}")


class _AnswerUsage(msgspec.Struct):
    """What an output line's answer reports (chat and completions name it one way, Responses another)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    prompt_tokens_details: InputTokensDetails | None = None
    input_tokens_details: InputTokensDetails | None = None
    output_tokens_details: OutputTokensDetails | None = None
    completion_tokens_details: OutputTokensDetails | None = None


class _OutputLine(msgspec.Struct):
    response: _OutputResponse


class _OutputResponse(msgspec.Struct):
    body: _OutputBody


class _OutputBody(msgspec.Struct):
    usage: _AnswerUsage | None = None


class UsageSum:
    """The usage of output lines, summed as they pass (``counted``): the Batch object's ``usage``."""

    def __init__(self) -> None:
        self.input = self.output = self.cached = self.reasoning = 0

    def counted(self, lines: Iterator[bytes]) -> Iterator[bytes]:
        for line in lines:
            try:
                usage = msgspec.json.decode(line, type=_OutputLine).response.body.usage
            except msgspec.DecodeError:  # an answer without the usage shape counts nothing; it is still output
                usage = None
            if usage is not None:
                self.input += usage.prompt_tokens + usage.input_tokens
                self.output += usage.completion_tokens + usage.output_tokens
                cached = usage.prompt_tokens_details or usage.input_tokens_details
                self.cached += cached.cached_tokens if cached else 0
                reasoning = usage.completion_tokens_details or usage.output_tokens_details
                self.reasoning += reasoning.reasoning_tokens if reasoning else 0
            yield line

    def total(self) -> BatchUsage:
        return BatchUsage(self.input, self.output, self.input + self.output, InputTokensDetails(self.cached),
                          OutputTokensDetails(self.reasoning))
