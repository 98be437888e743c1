"""Bounds on what one request may carry, checked before any tokenizing or engine work.

Documented once, here (workers and the orchestrator run the same checks):

- ``stop`` / ``stop_sequences``: at most ``MAX_STOP_STRINGS`` strings, none
  empty, each at most ``MAX_STOP_STRING_CHARS`` characters. OpenAI documents
  up to 4 and vLLM sets no limit; 16 leaves room for agent clients while
  bounding the per-token matching work (``api.detokenizer``).
- ``messages``: at most ``MAX_MESSAGES`` per conversation.
- ``tools``: at most ``MAX_TOOLS`` per request (OpenAI's own limit).
- ``stop_token_ids``: at most ``MAX_STOP_TOKEN_IDS``; ``logit_bias``: at most
  ``MAX_LOGIT_BIAS`` entries; a guided ``choice``: at most ``MAX_CHOICES``
  alternatives. Each is work per decoded token (or a grammar to compile) that
  a 16 MiB body could otherwise make a million entries long.
- ``n``: 1 to ``MAX_N`` choices (OpenAI's own limit); each choice is one
  engine request (``api.choices``).
- OpenAI chat messages need ``content``, except an assistant message that
  carries ``tool_calls`` (OpenAI's rule); a message without either is a 400
  naming ``messages[i].content``, not an empty turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from api.errors import InvalidRequestError

__all__ = ["MAX_STOP_STRINGS", "MAX_STOP_STRING_CHARS", "MAX_MESSAGES", "MAX_TOOLS", "MAX_STOP_TOKEN_IDS",
           "MAX_LOGIT_BIAS", "MAX_CHOICES", "MAX_N", "stop_strings", "check_messages", "check_tools", "check_chat_contents",
           "check_count"]

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_MESSAGES = 4096
MAX_TOOLS = 128
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024
MAX_CHOICES = 1024
MAX_N = 128


def stop_strings(stop: str | Sequence[str] | None, param: str) -> tuple[str, ...]:
    """The request's stop strings as a tuple, or a 400 naming ``param``."""
    if stop is None:
        return ()
    strings = (stop,) if isinstance(stop, str) else tuple(stop)
    if len(strings) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"{param} has {len(strings)} strings; at most {MAX_STOP_STRINGS} are allowed",
                                  param=param)
    for i, string in enumerate(strings):
        where = param if isinstance(stop, str) else f"{param}[{i}]"
        if not string:
            raise InvalidRequestError("a stop string must not be empty", param=where)
        if len(string) > MAX_STOP_STRING_CHARS:
            raise InvalidRequestError(f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters, "
                                      f"got {len(string)}", param=where)
    return strings


def check_messages(num_messages: int) -> None:
    if num_messages == 0:
        raise InvalidRequestError("messages must not be empty", param="messages")
    if num_messages > MAX_MESSAGES:
        raise InvalidRequestError(f"messages has {num_messages} entries; at most {MAX_MESSAGES} are allowed",
                                  param="messages")


def check_count(values: Sequence[object] | dict[str, object] | None, limit: int, param: str) -> None:
    """A 400 naming ``param`` when ``values`` has more than ``limit`` entries."""
    if values is not None and len(values) > limit:
        raise InvalidRequestError(f"{param} has {len(values)} entries; at most {limit} are allowed", param=param)


def check_tools(num_tools: int) -> None:
    if num_tools > MAX_TOOLS:
        raise InvalidRequestError(f"tools has {num_tools} entries; at most {MAX_TOOLS} are allowed", param="tools")


def check_chat_contents(messages: Sequence[Any]) -> None:
    """OpenAI chat messages (``schemas_openai.ChatMessage``): content present unless tool calls stand in."""
    for i, message in enumerate(messages):
        if message.content is None and not (message.role == "assistant" and message.tool_calls):
            raise InvalidRequestError(f"a {message.role} message needs content"
                                      + (" or tool_calls" if message.role == "assistant" else ""),
                                      param=f"messages[{i}].content")
