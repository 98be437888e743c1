"""One request shape and one stream parser per API: OpenAI chat, Anthropic messages, OpenAI Responses.

``ApiClient.body(conversation, max_tokens)`` renders a ``workload.Conversation``; ``parse(event, data)``
turns one SSE event into a ``StreamDelta``: the text it carries (content, tool-call arguments,
reasoning: anything the model generated), the usage it reports, or an error. The parsers read
plain dicts from ``json.loads``: the client runs against any compatible server, ours or a peer's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from disagg.bench.workload import Conversation, Message

__all__ = ["StreamDelta", "Usage", "ApiClient", "OpenAIChat", "OpenAICompletions", "AnthropicMessages",
           "OpenAIResponses", "API_CLIENTS"]


@dataclass
class Usage:
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None

    def merge(self, other: Usage) -> None:
        for name in ("prompt_tokens", "output_tokens", "cached_tokens"):
            if getattr(other, name) is not None:
                setattr(self, name, getattr(other, name))


@dataclass
class StreamDelta:
    text: str = ""
    usage: Usage | None = None
    error: str | None = None
    done: bool = False


class ApiClient:
    name = ""
    path = ""

    def __init__(self, model: str, ignore_eos: bool = False, api_key: str | None = None) -> None:
        self.model = model
        self.ignore_eos = ignore_eos
        self.api_key = api_key

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, conversation: Conversation, max_tokens: int) -> dict[str, Any]:
        raise NotImplementedError

    def parse(self, event: str, data: str) -> StreamDelta:
        raise NotImplementedError


def _error_text(payload: Any) -> str:
    error = payload.get("error", payload) if isinstance(payload, dict) else payload
    if isinstance(error, dict):
        return str(error.get("type") or error.get("code") or "error") + ": " + str(error.get("message", ""))[:200]
    return str(error)[:200]


class OpenAIChat(ApiClient):
    name = "openai"
    path = "/v1/chat/completions"

    def body(self, conversation: Conversation, max_tokens: int) -> dict[str, Any]:
        messages: list[dict[str, Any]] = [{"role": "system", "content": conversation.system}] \
            if conversation.system else []
        for message in conversation.messages:
            messages += self._messages(message)
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if conversation.send_tools:
            body["tools"] = [tool.openai() for tool in conversation.tools]
        return body

    @staticmethod
    def _messages(message: Message) -> list[dict[str, Any]]:
        ex = message.exchange
        if ex is None:
            return [{"role": message.role, "content": message.text}]
        call = {"id": ex.call_id, "type": "function", "function": {"name": ex.tool.name, "arguments": ex.arguments}}
        return [{"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": ex.call_id, "content": ex.result}]

    def parse(self, event: str, data: str) -> StreamDelta:
        return _openai_chunk(data, self._choice_text)

    @staticmethod
    def _choice_text(choice: dict[str, Any]) -> str:
        d = choice.get("delta") or {}
        text = (d.get("content") or "") + (d.get("reasoning_content") or "")
        for call in d.get("tool_calls") or ():
            function = call.get("function") or {}
            text += (function.get("name") or "") + (function.get("arguments") or "")
        return text


def _openai_chunk(data: str, choice_text: Any) -> StreamDelta:
    """One chunk of an OpenAI stream (chat or text completions): its choices' text and its usage."""
    if data == "[DONE]":
        return StreamDelta(done=True)
    payload = json.loads(data)
    if "error" in payload:
        return StreamDelta(error=_error_text(payload))
    delta = StreamDelta(text="".join(choice_text(choice) for choice in payload.get("choices") or ()))
    usage = payload.get("usage")
    if usage:
        details = usage.get("prompt_tokens_details") or {}
        delta.usage = Usage(usage.get("prompt_tokens"), usage.get("completion_tokens"), details.get("cached_tokens"))
    return delta


class OpenAICompletions(ApiClient):
    """``/v1/completions`` with the prompt as token ids (trace replay: a trace has no text)."""

    name = "completions"
    path = "/v1/completions"

    def body(self, conversation: Conversation, max_tokens: int) -> dict[str, Any]:
        raise TypeError("a completions client sends token ids (prompt_body), not conversations")

    def prompt_body(self, token_ids: list[int], max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "prompt": token_ids, "max_tokens": max_tokens, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body

    def parse(self, event: str, data: str) -> StreamDelta:
        return _openai_chunk(data, lambda choice: choice.get("text") or "")


class AnthropicMessages(ApiClient):
    name = "anthropic"
    path = "/v1/messages"

    def headers(self) -> dict[str, str]:
        return {"anthropic-version": "2023-06-01", **({"x-api-key": self.api_key} if self.api_key else {})}

    def body(self, conversation: Conversation, max_tokens: int) -> dict[str, Any]:
        messages: list[dict[str, Any]] = []
        pending: list[dict[str, Any]] = []  # tool results join the next user message (roles alternate)
        for message in conversation.messages:
            ex = message.exchange
            if ex is not None:
                messages.append({"role": "assistant", "content": [
                    {"type": "tool_use", "id": ex.call_id, "name": ex.tool.name, "input": json.loads(ex.arguments)}]})
                pending.append({"type": "tool_result", "tool_use_id": ex.call_id, "content": ex.result})
            elif message.role == "user" and pending:
                messages.append({"role": "user", "content": [*pending, {"type": "text", "text": message.text}]})
                pending = []
            else:
                messages.append({"role": message.role, "content": message.text})
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "stream": True}
        if conversation.system:
            body["system"] = conversation.system
        if conversation.send_tools:
            body["tools"] = [{"name": t.name, "description": t.description, "input_schema": t.parameters}
                             for t in conversation.tools]
        return body

    def parse(self, event: str, data: str) -> StreamDelta:
        payload = json.loads(data)
        kind = payload.get("type", event)
        if kind == "content_block_delta":
            d = payload.get("delta") or {}
            return StreamDelta(text=d.get("text") or d.get("partial_json") or d.get("thinking") or "")
        if kind == "message_start":
            usage = (payload.get("message") or {}).get("usage") or {}
            return StreamDelta(usage=Usage(prompt_tokens=_anthropic_prompt(usage),
                                           cached_tokens=usage.get("cache_read_input_tokens")))
        if kind == "message_delta":
            usage = payload.get("usage") or {}  # cache reads may be known only at the end of the stream
            return StreamDelta(usage=Usage(prompt_tokens=_anthropic_prompt(usage), output_tokens=usage.get("output_tokens"),
                                           cached_tokens=usage.get("cache_read_input_tokens")))
        if kind == "message_stop":
            return StreamDelta(done=True)
        if kind == "error":
            return StreamDelta(error=_error_text(payload))
        return StreamDelta()


def _anthropic_prompt(usage: dict[str, Any]) -> int | None:
    # Anthropic counts cached prompt tokens apart from input_tokens; the total is their sum.
    if usage.get("input_tokens") is None:
        return None
    return usage["input_tokens"] + (usage.get("cache_read_input_tokens") or 0) + \
        (usage.get("cache_creation_input_tokens") or 0)


class OpenAIResponses(ApiClient):
    name = "responses"
    path = "/v1/responses"

    def body(self, conversation: Conversation, max_tokens: int) -> dict[str, Any]:
        items: list[dict[str, Any]] = []
        for message in conversation.messages:
            ex = message.exchange
            if ex is None:
                items.append({"type": "message", "role": message.role, "content": message.text})
            else:
                items += [{"type": "function_call", "call_id": ex.call_id, "name": ex.tool.name,
                           "arguments": ex.arguments},
                          {"type": "function_call_output", "call_id": ex.call_id, "output": ex.result}]
        body: dict[str, Any] = {"model": self.model, "input": items, "max_output_tokens": max_tokens, "stream": True,
                                "store": False}
        if conversation.system:
            body["instructions"] = conversation.system
        if conversation.send_tools:
            body["tools"] = [{"type": "function", "name": t.name, "description": t.description,
                              "parameters": t.parameters} for t in conversation.tools]
        return body

    def parse(self, event: str, data: str) -> StreamDelta:
        payload = json.loads(data)
        kind = payload.get("type", event)
        if kind in ("response.output_text.delta", "response.function_call_arguments.delta",
                    "response.reasoning_text.delta", "response.refusal.delta"):
            return StreamDelta(text=payload.get("delta") or "")
        if kind == "response.completed":
            usage = (payload.get("response") or {}).get("usage") or {}
            details = usage.get("input_tokens_details") or {}
            return StreamDelta(usage=Usage(usage.get("input_tokens"), usage.get("output_tokens"),
                                           details.get("cached_tokens")), done=True)
        if kind in ("response.failed", "response.incomplete", "error"):
            response = payload.get("response") or {}
            if kind == "response.incomplete":  # max_output_tokens reached: a normal end for a benchmark
                usage = response.get("usage") or {}
                return StreamDelta(usage=Usage(usage.get("input_tokens"), usage.get("output_tokens")), done=True)
            return StreamDelta(error=_error_text(response.get("error") or payload))
        return StreamDelta()


API_CLIENTS: dict[str, type[ApiClient]] = {c.name: c for c in (OpenAIChat, AnthropicMessages, OpenAIResponses)}
