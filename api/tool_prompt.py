"""Tools and tool calls in the prompt of a model whose chat template does not write them.

Many small chat models (SmolLM2's ChatML template, for one) have templates
that know nothing of tools: they drop ``tools``, fail on an assistant turn
whose content is null, and write a ``tool`` turn under a role the model never
saw. For such a template the conversation is rewritten before rendering, in
the model's call format (``api.tool_parsers``): the tools as a system
prompt that shows the call syntax, each assistant call as the text the model
would have written, and tool results as a user turn (Hermes:
``<tool_response>``). A template that mentions ``tools`` / ``tool_calls``
renders them itself and is left alone.

The orchestrator renders prompts with the same function (it routes by prefix),
so both sides see the same prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from api.tokenizer import Tokenizer
from api.tool_parsers import CallSyntax, detect_tool_syntax

__all__ = ["adapt_conversation", "PromptContext", "PromptSource"]


class PromptSource(Protocol):
    """What the prompt functions (``chat_prompt_ids``, ``message_prompt_ids``) read: a
    ``ServingContext`` or, in the orchestrator, a ``PromptContext``."""

    @property
    def tokenizer(self) -> Tokenizer: ...
    @property
    def tool_syntax(self) -> CallSyntax | None: ...


@dataclass(frozen=True)
class PromptContext:
    """What rendering a chat prompt reads from a ``ServingContext``: for the orchestrator, which
    renders prompts with the frontends' functions but serves no model itself."""

    tokenizer: Tokenizer
    tool_syntax: CallSyntax | None

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer) -> PromptContext:
        return cls(tokenizer, detect_tool_syntax(tokenizer.chat_template_source))


def adapt_conversation(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                       template_source: str | None, syntax: CallSyntax | None) -> list[dict[str, Any]]:
    """``messages`` as the template can render them (the same list when it needs nothing)."""
    if syntax is None or not template_source:
        return messages
    writes_calls = "tool_calls" in template_source
    writes_tools = "tools" in template_source
    if writes_calls and (writes_tools or not tools):
        return messages
    adapted = list(messages) if writes_calls else _plain_turns(messages, syntax)
    if tools and not writes_tools:
        prompt = syntax.tools_prompt(tools)
        if adapted and adapted[0]["role"] == "system":
            adapted[0] = {**adapted[0], "content": f"{adapted[0].get('content') or ''}\n\n{prompt}".lstrip()}
        else:
            adapted.insert(0, {"role": "system", "content": prompt})
    return adapted


def _plain_turns(messages: list[dict[str, Any]], syntax: CallSyntax) -> list[dict[str, Any]]:
    """String content only, and only the roles every template knows: calls become the assistant's
    text, a round of tool results one user turn."""
    turns: list[dict[str, Any]] = []
    after_result = False
    for message in messages:
        if message["role"] == "tool":
            result = syntax.render_result(message.get("content") or "")
            if after_result:
                turns[-1] = {**turns[-1], "content": turns[-1]["content"] + "\n" + result}
            else:
                turns.append({"role": "user", "content": result})
            after_result = True
            continue
        after_result = False
        turn = {key: value for key, value in message.items() if key != "tool_calls"}
        text = message.get("content") or ""
        if message.get("tool_calls"):
            calls = syntax.render_calls([(call["function"]["name"], call["function"]["arguments"])
                                         for call in message["tool_calls"]])
            text = f"{text}\n{calls}" if text else calls
        turn["content"] = text
        turns.append(turn)
    return turns
