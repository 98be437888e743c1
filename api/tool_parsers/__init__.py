"""Tool-call formats: parse a model's calls out of its text, and force them with a grammar.

One module per format; ``TOOL_CALL_PARSERS`` names them (the values of
``--tool-call-parser`` and of the deployment YAML's ``tool_call_parser``).
``detect_tool_syntax`` picks the format from a chat template when none is
configured: the template writes the calls of the conversation's history, so
it shows the format the model was trained to produce.
"""

from __future__ import annotations

from api.tool_parsers.base import (
    ArgumentsDelta,
    CallHead,
    CallSyntax,
    CutCall,
    ParsedCall,
    ParserEvent,
    TextDelta,
    ToolCallParser,
)
from api.tool_parsers.hermes import HermesSyntax
from api.tool_parsers.llama3_json import Llama3JsonSyntax

__all__ = [
    "CallSyntax",
    "CallHead",
    "ArgumentsDelta",
    "ParsedCall",
    "CutCall",
    "ParserEvent",
    "TextDelta",
    "ToolCallParser",
    "TOOL_CALL_PARSERS",
    "tool_syntax",
    "detect_tool_syntax",
]

TOOL_CALL_PARSERS: dict[str, type] = {
    "hermes": HermesSyntax,  # also Qwen2/2.5/3 and ChatML templates (SmolLM2)
    "llama3_json": Llama3JsonSyntax,
}


def tool_syntax(name: str) -> CallSyntax:
    """The format named ``name``; ValueError listing the known names otherwise."""
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(TOOL_CALL_PARSERS))}")
    syntax: CallSyntax = TOOL_CALL_PARSERS[name]()
    return syntax


def detect_tool_syntax(chat_template: str | None) -> CallSyntax | None:
    """The format a chat template writes tool calls in, or None when it shows none."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return HermesSyntax()
    if "<|python_tag|>" in chat_template or '"parameters"' in chat_template or "\\\"parameters\\\"" in chat_template:
        return Llama3JsonSyntax()
    if "<|im_start|>" in chat_template:  # ChatML without a tool section: Hermes is ChatML's call format
        return HermesSyntax()
    return None
