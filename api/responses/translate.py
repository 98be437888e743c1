"""A Responses request as the chat request it runs as, and errors named in Responses terms.

There is one request-preparation path (the chat-completions handler's): a
/v1/responses request becomes a Chat Completions body, with the
conversation as ``messages`` (``instructions`` first, as the system
message; then the stored history of ``previous_response_id``; then this
request's ``input``), ``tools`` and ``tool_choice`` in their chat shape,
``text.format`` as ``response_format`` and ``max_output_tokens`` as
``max_completion_tokens``. Workers run that body through their chat
handler; the orchestrator runs it through its disaggregated chat flow.

As in the reference, ``instructions`` are not carried over by
``previous_response_id``: each request states its own.

An assistant message last in ``input`` is continued (prefill, as on
/v1/messages): the chat body's ``continue_final_message``. ``include:
["message.output_text.logprobs"]`` (with ``top_logprobs``) is the chat
body's ``logprobs``; the other ``include`` values name items this server
never makes and change nothing. A ``conversation`` object is a 400.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from api.errors import FrontendError, InvalidRequestError
from api.responses.schemas import (
    OUTPUT_TEXT_LOGPROBS,
    ContentPart,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    Item,
    MessageItem,
    Refusal,
    ResponsesRequest,
    TextFormatJsonObject,
    TextFormatJsonSchema,
    ToolChoiceFunction,
)

__all__ = ["parse_input", "validate_request", "continues_final_message", "chat_body", "responses_param", "rename_param", "rename_fields"]

# Chat body fields (as the chat path names them in errors) -> the Responses field that set them.
_PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "continue_final_message": "input",
}


def parse_input(value: str | list[Any]) -> list[Item]:
    """``input`` as items; a string is one user message. Errors name ``input[i]...``."""
    if isinstance(value, str):
        return [MessageItem(role="user", content=value)]
    items: list[Item] = []
    for index, raw in enumerate(value):
        if isinstance(raw, dict) and "type" not in raw and "role" in raw:
            raw = {**raw, "type": "message"}  # the reference's "easy input message" has no type
        try:
            items.append(msgspec.convert(raw, Item))
        except msgspec.ValidationError as exc:
            text = str(exc)
            where = text.rsplit("at `$", 1)[1].rstrip("`") if "at `$" in text else ""
            raise InvalidRequestError(f"invalid input item: {text.split(' - at ', 1)[0]}",
                                      param=f"input[{index}]{where}") from None
    return items


def validate_request(body: ResponsesRequest, items: list[Item], history: Sequence[Item] = ()) -> None:
    """What the chat path cannot check (it validates tools and tool_choice itself, and its errors
    are renamed into Responses terms: ``rename_param``)."""
    if not items:
        raise InvalidRequestError("input must not be empty", param="input")
    if body.background:
        raise InvalidRequestError("background responses are not supported", param="background")
    if body.conversation is not None:
        raise InvalidRequestError("conversation objects are not supported; continue a conversation with "
                                  "previous_response_id", param="conversation")
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise InvalidRequestError(f"max_output_tokens must be at least 1, got {body.max_output_tokens}",
                                  param="max_output_tokens")
    call_ids = {item.call_id for item in history if isinstance(item, FunctionCallItem)}
    for index, item in enumerate(items):
        if isinstance(item, FunctionCallItem):
            call_ids.add(item.call_id)
        elif isinstance(item, FunctionCallOutputItem) and item.call_id not in call_ids:
            raise InvalidRequestError(f"no function_call with call_id {item.call_id!r} precedes this output",
                                      param=f"input[{index}].call_id")


def _text(content: str | list[ContentPart]) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(part.refusal if isinstance(part, Refusal) else part.text for part in content)


def _messages(instructions: str | None, items: list[Item]) -> list[dict[str, Any]]:
    """Chat messages: consecutive function calls (and the text before them) are one assistant turn."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        # reasoning items: dropped (see ReasoningItem)
    return messages


def _function(tool: FunctionTool) -> dict[str, Any]:
    fields = {"name": tool.name, "description": tool.description, "parameters": tool.parameters,
              "strict": tool.strict}
    return {k: v for k, v in fields.items() if v is not None}


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, ToolChoiceFunction):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = body.text.format if body.text is not None else None
    if isinstance(fmt, TextFormatJsonObject):
        return {"type": "json_object"}
    if isinstance(fmt, TextFormatJsonSchema):
        schema = {"name": fmt.name, "schema": fmt.schema, "strict": fmt.strict, "description": fmt.description}
        return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}
    return None


def continues_final_message(items: Sequence[Item]) -> bool:
    """An assistant message last in a request's input is continued (prefill, as /v1/messages does):
    the output text is what the model writes after it."""
    return bool(items) and isinstance(items[-1], MessageItem) and items[-1].role == "assistant"


def chat_body(body: ResponsesRequest, conversation: list[Item], continue_final: bool = False) -> dict[str, Any]:
    """The Chat Completions body this request runs as (usage always on: the response reports it);
    ``continue_final``: the conversation's last message is continued (``continues_final_message``)."""
    chat: dict[str, Any] = {"model": body.model, "messages": _messages(body.instructions, conversation),
                            "stream": body.stream}
    if continue_final:
        chat["continue_final_message"], chat["add_generation_prompt"] = True, False
    if OUTPUT_TEXT_LOGPROBS in (body.include or ()):
        chat["logprobs"] = True
        if body.top_logprobs is not None:
            chat["top_logprobs"] = body.top_logprobs
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    if body.tools:
        chat["tools"] = [{"type": "function", "function": _function(tool)} for tool in body.tools]
        chat["parallel_tool_calls"] = body.parallel_tool_calls
    if body.tools or body.tool_choice != "auto":  # the chat path says what is wrong with a choice
        chat["tool_choice"] = _tool_choice(body.tool_choice)
    response_format = _response_format(body)
    if response_format is not None:
        chat["response_format"] = response_format
    for name, value in (("max_completion_tokens", body.max_output_tokens), ("temperature", body.temperature),
                        ("top_p", body.top_p), ("user", body.user)):
        if value is not None:
            chat[name] = value
    return chat


def responses_param(param: str | None) -> str | None:
    """The Responses name of a chat field named in an error."""
    if param is None:
        return None
    if param.startswith("messages"):
        return "input"
    if param.startswith("tools") or param.startswith("tool_choice"):
        return param.replace(".function", "", 1)
    head = param.split(".", 1)[0].split("[", 1)[0]
    return _PARAMS.get(head, param) if head in _PARAMS else param


def rename_param(exc: FrontendError) -> FrontendError:
    """``exc`` in Responses terms: its param, and the chat field names its message quotes."""
    exc.param = responses_param(exc.param)
    exc.message = rename_fields(exc.message)
    return exc


def rename_fields(message: str) -> str:
    for chat, responses in (("max_completion_tokens", "max_output_tokens"), ("response_format", "text.format")):
        message = message.replace(chat, responses)
    return message

