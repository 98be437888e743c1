"""The response object and its event stream, rendered from a chat completion.

A /v1/responses request runs as a chat request (``api.responses.translate``),
so its answer arrives as a chat completion (one JSON body) or as chat
completion chunks (SSE). ``ResponseTurn`` renders the first as a response
object; ``ResponseEventStream`` turns the second into the reference's event
sequence, each event with its ``sequence_number``::

    response.created, response.in_progress
    per text item:  output_item.added, content_part.added, output_text.delta*,
                    output_text.done, content_part.done, output_item.done
    per call:       output_item.added, function_call_arguments.delta*,
                    function_call_arguments.done, output_item.done
    response.completed | response.incomplete (max_output_tokens) | response.failed

Function calls are the chat path's parsed ``tool_calls``, never re-parsed
here. Workers and the orchestrator render with this same code: chunks may
arrive split anywhere (the orchestrator relays TCP reads), so SSE is
re-framed on blank lines first.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec

from api.responses.items import new_id, with_ids
from api.responses.schemas import (
    OUTPUT_TEXT_LOGPROBS,
    FunctionCallItem,
    Item,
    MessageItem,
    OutputText,
    ResponsesRequest,
)
from api.responses.translate import chat_body, continues_final_message
from api.streaming import FinalFrame

__all__ = ["ResponseTurn", "ResponseEventStream", "usage_from_chat"]

_encode = msgspec.json.encode
OnDone = Callable[[bytes, list[Item]], Awaitable[None]]


def usage_from_chat(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not usage:
        return None
    details = usage.get("prompt_tokens_details") or {}
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": details.get("cached_tokens") or 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.get("total_tokens", prompt + completion)}


def _message(text: str, item_id: str | None = None, status: str = "completed") -> MessageItem:
    return MessageItem(id=item_id or new_id("msg"), status=status, role="assistant", content=[OutputText(text)])


def _call(call_id: str | None, name: str, arguments: str, item_id: str | None = None,
          status: str = "completed") -> FunctionCallItem:
    return FunctionCallItem(id=item_id or new_id("fc"), call_id=call_id or new_id("call"), name=name,
                            arguments=arguments, status=status)


class ResponseTurn:
    """One /v1/responses request: its body, the conversation it continues, the response it makes."""

    def __init__(self, body: ResponsesRequest, history: list[Item], items: list[Item]) -> None:
        self.body = body
        self.conversation = [*history, *with_ids(items)]
        self.continue_final = continues_final_message(items)
        self.wants_logprobs = OUTPUT_TEXT_LOGPROBS in (body.include or ())
        self.id = new_id("resp")
        self.created_at = int(time.time())

    @property
    def session_id(self) -> str:
        """The same for every turn of a conversation (its first item's id): for session affinity."""
        return self.conversation[0].id or self.id

    def chat_body(self) -> dict[str, Any]:
        return chat_body(self.body, self.conversation, self.continue_final)

    def response(self, status: str, output: list[Item], usage: dict[str, Any] | None = None,
                 incomplete: str | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        body = self.body
        text = msgspec.to_builtins(body.text) if body.text is not None else {"format": {"type": "text"}}
        tool_choice = body.tool_choice if isinstance(body.tool_choice, str) else msgspec.to_builtins(body.tool_choice)
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "error": error, "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": body.model,
            "output": msgspec.to_builtins(output), "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id, "reasoning": body.reasoning or {"effort": None},
            "store": body.store, "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": text, "tool_choice": tool_choice, "tools": msgspec.to_builtins(body.tools or []),
            "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": body.truncation,
            "usage": usage, "user": body.user, "metadata": body.metadata or {},
        }

    def from_chat(self, completion: dict[str, Any]) -> tuple[dict[str, Any], list[Item]]:
        """The response object (and its output items) of a non-streaming chat completion."""
        choice = completion["choices"][0]
        message = choice.get("message") or {}
        calls = message.get("tool_calls") or []
        output: list[Item] = []
        if message.get("content") or not calls:
            output.append(_message(message.get("content") or ""))
        for call in calls:
            function = call.get("function") or {}
            output.append(_call(call.get("id"), function.get("name", ""), function.get("arguments", "")))
        incomplete = "max_output_tokens" if choice.get("finish_reason") == "length" else None
        status = "incomplete" if incomplete else "completed"
        response = self.response(status, output, usage_from_chat(completion.get("usage")), incomplete)
        logprobs = (choice.get("logprobs") or {}).get("content")
        if logprobs is not None and isinstance(output[0], MessageItem):
            _add_logprobs(response["output"][0], logprobs)
        return response, output

    def conversation_after(self, output: list[Item]) -> list[Item]:
        """What a follow-up with ``previous_response_id`` = this response continues."""
        return [*self.conversation, *output]


def _add_logprobs(message: dict[str, Any], logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    """A rendered message item with its output_text's token logprobs (asked by ``include``; the
    stored item, the next turn's input, does not keep them)."""
    message["content"][0]["logprobs"] = logprobs
    return message


class _OpenItem:
    __slots__ = ("item_id", "index", "parts", "call_id", "name")

    def __init__(self, item_id: str, index: int, call_id: str | None = None, name: str | None = None) -> None:
        self.item_id = item_id
        self.index = index
        self.parts: list[str] = []
        self.call_id = call_id
        self.name = name


class ResponseEventStream:
    """Chat completion chunks in, Responses events out (both as SSE bytes).

    ``on_done(response_json, output)`` runs before the final event goes out (the store:
    a client that continues the conversation the moment the stream ends must find it)."""

    def __init__(self, turn: ResponseTurn, on_done: OnDone | None = None) -> None:
        self.turn = turn
        self.on_done = on_done
        self.sequence = 0
        self.output: list[Item] = []
        self.text: _OpenItem | None = None
        self.call: _OpenItem | None = None
        self.calls_seen: set[int] = set()
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.logprobs: list[dict[str, Any]] = []  # the open text's, not yet in a delta event
        self.text_logprobs: list[dict[str, Any]] = []  # the open text's, all of them
        self.item_logprobs: dict[int, list[dict[str, Any]]] = {}  # output index -> its text's (when asked)

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + _encode(payload) + b"\n\n"

    def _lifecycle(self, kind: str, response_json: bytes) -> bytes:
        head = b'{"type":"' + kind.encode() + b'","sequence_number":' + str(self.sequence).encode()
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + head + b',"response":' + response_json + b"}\n\n"

    async def run(self, chunks: AsyncIterator[bytes]) -> AsyncGenerator[bytes, None]:
        """The whole event stream; closing it closes ``chunks`` (and so aborts the request)."""
        started = _encode(self.turn.response("in_progress", []))
        yield self._lifecycle("response.created", started) + self._lifecycle("response.in_progress", started)
        buffer = b""
        try:
            async for chunk in chunks:
                buffer += chunk
                *frames, buffer = buffer.split(b"\n\n")
                out = b"".join(self.frame(frame) for frame in frames)
                if out:
                    yield out
                if self.error is not None:
                    break
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()
        yield FinalFrame(await self.finish())  # one write with the end of the response

    def frame(self, frame: bytes) -> bytes:
        for line in frame.split(b"\n"):
            if line.startswith(b"data:"):
                data = line[5:].strip()
                if data and data != b"[DONE]":
                    return self.chunk(msgspec.json.decode(data))
        return b""

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        if "error" in chunk:
            error = chunk["error"] or {}
            self.error = {"code": error.get("code") or error.get("type") or "server_error",
                          "message": error.get("message", "the generation failed")}
            return b""
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        out = b""
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            logprobs = (choice.get("logprobs") or {}).get("content")
            if logprobs:  # asked by include; a chunk may carry them before its text is out
                self.logprobs.extend(logprobs)
            if delta.get("content"):
                out += self._text(delta["content"])
            for call in delta.get("tool_calls") or ():
                out += self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return out

    def _open_text(self) -> bytes:
        self.text = _OpenItem(new_id("msg"), len(self.output))
        item = {**msgspec.to_builtins(_message("", self.text.item_id, "in_progress")), "content": []}
        return (self.event("response.output_item.added", output_index=self.text.index, item=item)
                + self.event("response.content_part.added", item_id=self.text.item_id, output_index=self.text.index,
                             content_index=0, part={"type": "output_text", "text": "", "annotations": []}))

    def _text(self, text: str) -> bytes:
        out = self._close_call()
        if self.text is None:
            out += self._open_text()
        assert self.text is not None
        self.text.parts.append(text)
        logprobs, self.logprobs = self.logprobs, []
        self.text_logprobs.extend(logprobs)
        return out + self.event("response.output_text.delta", item_id=self.text.item_id,
                                output_index=self.text.index, content_index=0, delta=text, logprobs=logprobs)

    def _close_text(self) -> bytes:
        open_text, self.text = self.text, None
        if open_text is None:
            return b""
        text = "".join(open_text.parts)
        logprobs, self.text_logprobs = self.text_logprobs, []
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
        item = _message(text, open_text.item_id)
        self.output.append(item)
        rendered = msgspec.to_builtins(item)
        if self.turn.wants_logprobs:
            part["logprobs"] = self.item_logprobs[open_text.index] = logprobs
            _add_logprobs(rendered, logprobs)
        return (self.event("response.output_text.done", item_id=open_text.item_id, output_index=open_text.index,
                           content_index=0, text=text, logprobs=logprobs)
                + self.event("response.content_part.done", item_id=open_text.item_id,
                             output_index=open_text.index, content_index=0, part=part)
                + self.event("response.output_item.done", output_index=open_text.index, item=rendered))

    def _call(self, call: dict[str, Any]) -> bytes:
        out = b""
        function = call.get("function") or {}
        index = call.get("index", 0)
        if index not in self.calls_seen:  # a new call: chat streams id and name first
            self.calls_seen.add(index)
            out += self._close_text() + self._close_call()
            self.call = _OpenItem(new_id("fc"), len(self.output), call.get("id") or new_id("call"),
                                  function.get("name") or "")
            item = _call(self.call.call_id, self.call.name or "", "", self.call.item_id, "in_progress")
            out += self.event("response.output_item.added", output_index=self.call.index,
                              item=msgspec.to_builtins(item))
        if self.call is not None and function.get("arguments"):
            self.call.parts.append(function["arguments"])
            out += self.event("response.function_call_arguments.delta", item_id=self.call.item_id,
                              output_index=self.call.index, delta=function["arguments"])
        return out

    def _close_call(self) -> bytes:
        open_call, self.call = self.call, None
        if open_call is None:
            return b""
        arguments = "".join(open_call.parts)
        item = _call(open_call.call_id, open_call.name or "", arguments, open_call.item_id)
        self.output.append(item)
        return (self.event("response.function_call_arguments.done", item_id=open_call.item_id,
                           output_index=open_call.index, name=open_call.name, arguments=arguments)
                + self.event("response.output_item.done", output_index=open_call.index,
                             item=msgspec.to_builtins(item)))

    async def finish(self) -> bytes:
        if self.error is None and self.finish_reason is None:  # the chat stream broke off
            self.error = {"code": "stream_ended", "message": "the generation ended before it finished"}
        if self.error is not None:  # what was generated so far stays in the failed response
            self.text = self.call = None
            response = _encode(self.turn.response("failed", self.output, usage_from_chat(self.usage),
                                                  error=self.error))
            return self._lifecycle("response.failed", response)
        out = self._close_text() + self._close_call()
        if not self.output:  # nothing generated (an immediate end): one empty message, as non-streaming
            out += self._open_text() + self._close_text()
        incomplete = "max_output_tokens" if self.finish_reason == "length" else None
        status = "incomplete" if incomplete else "completed"
        completed = self.turn.response(status, self.output, usage_from_chat(self.usage), incomplete)
        for index, logprobs in self.item_logprobs.items():
            _add_logprobs(completed["output"][index], logprobs)
        response = _encode(completed)
        if self.on_done is not None:
            try:
                await self.on_done(response, self.output)
            except Exception as exc:  # noqa: BLE001 - not stored: a follow-up could not continue it
                self.error = {"code": "response_not_stored", "message": f"the response could not be stored: {exc}"}
                return out + await self.finish()
        return out + self._lifecycle(f"response.{status}", response)

