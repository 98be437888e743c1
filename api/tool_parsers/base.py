"""The streaming tool-call parser shared by every call format.

A format (``CallSyntax``) says where a call may begin in the model's text,
how to read one complete call, and which characters are filler between
calls; ``ToolCallParser`` runs the one state machine over the text pieces
of a generation and yields ``TextDelta``, ``ParsedCall`` and ``CutCall`` events.

Invariants (what clients can rely on, streamed or not: the events of one
output add up to the same text and calls however it is split):

- text before a call streams as text as soon as it cannot be the start of
  a call (only a possible opener prefix, e.g. ``<tool_ca``, is held back);
- a call is reported only once it is complete and valid (its JSON parses,
  its name is one of the request's tools, its arguments are an object), so
  a partial call never leaks as text and a reported call is never
  retracted: name and arguments reach the API encoder together, which sends
  the name first and then the arguments;
- except with ``stream_arguments`` (streamed forced calls, whose grammar
  guarantees the call's form): ``CallHead`` as soon as the name is read,
  then the arguments' text as it comes (``ArgumentsDelta``), then
  ``ParsedCall`` or, when the output ends inside it, ``CutCall``;
- a call the end of the output cuts (``finish(cut=True)``: ``max_tokens``;
  or any end inside a forced call) is a ``CutCall`` once its name is
  written: its arguments are the JSON text written so far. A call cut
  before its name is complete (or inside its opener) is dropped: the
  format's markup never reaches the answer as text. Either way a debug
  line is logged;
- a call that turns out malformed (bad JSON, unknown tool, an unforced call
  the model itself ended early) is reported as text, verbatim;
- filler (whitespace, a format's separators) right before a call, and after
  the last call, is dropped.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from api.tool_parsers.json_text import CallPrefix, ObjectEnd
from api.tool_parsers.partial_json import partial_object

__all__ = [
    "TextDelta",
    "ParsedCall",
    "CallHead",
    "ArgumentsDelta",
    "CutCall",
    "ParserEvent",
    "NeedMore",
    "Malformed",
    "Complete",
    "ScanResult",
    "CallSyntax",
    "ToolCallParser",
]


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ParsedCall:
    index: int  # 0, 1, ... in the order the model wrote the calls
    name: str
    arguments: dict[str, Any]

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass(frozen=True)
class CallHead:
    """A call's name, before its arguments (``stream_arguments`` only)."""

    index: int
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    """Raw text of a started call's arguments object; all of them concatenated are its JSON."""

    index: int
    text: str


@dataclass(frozen=True)
class CutCall:
    """A call the end of the output cut: its name and the arguments' JSON text written so far
    (unfinished, or "" when the output ends before the arguments start)."""

    index: int
    name: str
    arguments_text: str

    @property
    def arguments(self) -> dict[str, Any]:
        """The complete values of the arguments so far, as the SDKs assemble a streamed call's."""
        return partial_object(self.arguments_text)

    @property
    def arguments_json(self) -> str:
        """As a whole call's: the text the API's arguments string holds (unfinished here)."""
        return self.arguments_text


ParserEvent = TextDelta | CallHead | ArgumentsDelta | ParsedCall | CutCall

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NeedMore:
    """The call is not complete yet."""


@dataclass(frozen=True)
class Malformed:
    """Not a call: the first ``length`` characters are text."""

    length: int


@dataclass(frozen=True)
class Complete:
    name: str
    arguments: dict[str, Any]
    length: int  # characters the call took, opener and closer included


ScanResult = NeedMore | Malformed | Complete


class CallSyntax(Protocol):
    """One model family's way of writing tool calls (one module per format)."""

    name: str

    def call_start(self, text: str, at_boundary: bool) -> int:
        """Index of the first complete call opener in ``text``, or -1. ``at_boundary``:
        ``text`` starts where a call may begin (start of output, after a call, ...)."""

    def held_suffix(self, text: str) -> int:
        """Index from which the end of ``text`` may be an incomplete opener (len: none)."""

    def scan(self, text: str, final: bool, tool_names: frozenset[str], objects: ObjectEnd) -> ScanResult:
        """Read one call at the start of ``text`` (which starts with an opener); ``objects`` finds
        the end of its JSON (one per call: ``text`` only grows while the call is read). NeedMore
        while the call is unfinished, even when ``final`` (the parser decides what a cut call is)."""

    def call_prefix(self, text: str) -> CallPrefix | None:
        """How far the call at the start of ``text`` is written, name first (its name, where its
        arguments object starts); None when it is not written name first."""

    def is_filler(self, text: str) -> bool:
        """Whether ``text`` is only what may separate calls (whitespace, separators)."""

    def filler_start(self, text: str) -> int:
        """Index from which ``text`` ends in filler (len: it does not)."""

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        """The system prompt that offers ``tools`` (OpenAI function tools) in this format, for
        templates that do not write tools themselves (``api.tool_prompt``)."""

    def render_calls(self, calls: list[tuple[str, Any]]) -> str:
        """Calls (name, arguments object or JSON text) as the model writes them."""

    def render_result(self, content: str) -> str:
        """A tool's result as a user turn shows it."""

    def grammar(self, tools: list[tuple[str, dict[str, Any]]], parallel: bool) -> str:
        """An llguidance Lark grammar that admits exactly well-formed calls of ``tools``
        (name, JSON schema of the arguments): one call, or several when ``parallel``."""


class ToolCallParser:
    """Feed the text of one generation; get text deltas and complete calls, in order.

    ``forced``: the request forces its calls (a grammar guarantees their form), so whatever ends
    the output inside a call cut it; ``streaming`` with ``forced``: stream the arguments."""

    def __init__(self, syntax: CallSyntax, tool_names: Iterable[str], forced: bool = False,
                 streaming: bool = False) -> None:
        self.syntax = syntax
        self.tool_names = frozenset(tool_names)
        self.forced = forced
        self.stream_arguments = forced and streaming
        self.num_calls = 0
        self._head: CallPrefix | None = None  # a streamed call's, once its CallHead is out
        self._arguments_sent = 0  # the buffer index up to which its arguments went out
        self._call_object = ObjectEnd()  # the call in progress
        self._arguments_object = ObjectEnd()  # its arguments
        self._buffer = ""  # text not yet reported: held filler, a possible opener, or a call in progress
        self._in_call = False
        self._filler = ""
        self._at_boundary = True  # the start of output, or right after a call

    def feed(self, text: str) -> list[ParserEvent]:
        self._buffer += text
        return self._advance(final=False, cut=False)

    def finish(self, cut: bool = False) -> list[ParserEvent]:
        """The end of the output; ``cut``: the token limit ended it (a call open here was cut).
        Trailing filler after calls is dropped."""
        cut = cut or self.forced
        events = self._advance(final=True, cut=cut)
        rest, self._buffer = self._buffer, ""
        if cut and self.syntax.held_suffix(rest) < len(rest):  # cut inside an opener: it goes, with its filler
            logger.debug("a tool call cut inside its opener (%r) is dropped", rest)
            rest = ""
        if rest and not (self.num_calls and self.syntax.is_filler(rest)):
            self._emit_text(events, rest)
        return events

    def parse(self, text: str, cut: bool = False) -> list[ParserEvent]:
        """A whole output's events (a non-streamed answer)."""
        return self.feed(text) + self.finish(cut)

    def _advance(self, final: bool, cut: bool) -> list[ParserEvent]:
        events: list[ParserEvent] = []
        syntax = self.syntax
        while self._buffer:
            if self._in_call:
                if self.stream_arguments:
                    self._stream_arguments(events)
                result = syntax.scan(self._buffer, final, self.tool_names, self._call_object)
                if isinstance(result, NeedMore):
                    if final:
                        self._end_unfinished(events, cut)
                    break
                self._in_call = False
                filler, self._filler = self._filler, ""
                head, self._head = self._head, None
                if isinstance(result, Complete):  # the filler before it is dropped
                    events.append(ParsedCall(self.num_calls, result.name, result.arguments))
                    self.num_calls += 1
                    self._buffer = self._buffer[result.length:]
                    self._at_boundary = True
                elif head is not None:  # malformed after its head went out: it ends as it was sent
                    self._end_cut_call(events, head, self._arguments_sent)
                    self._buffer = self._buffer[max(result.length, 1):]
                else:
                    self._emit_text(events, filler + self._buffer[:max(result.length, 1)])
                    self._buffer = self._buffer[max(result.length, 1):]
                continue
            start = syntax.call_start(self._buffer, self._at_boundary)
            if start >= 0:
                before = self._buffer[:start]
                text_end = 0 if syntax.is_filler(before) else syntax.filler_start(before)
                self._emit_text(events, before[:text_end])
                self._filler = before[text_end:]  # dropped if the call is one, text if not
                self._buffer = self._buffer[start:]
                self._in_call = True
                self._call_object, self._arguments_object = ObjectEnd(), ObjectEnd()
                continue
            # No call yet: report what cannot start one; hold a possible opener and trailing filler.
            held = len(self._buffer) if final and not cut else syntax.held_suffix(self._buffer)
            keep = syntax.filler_start(self._buffer[:held])
            if keep > 0:
                self._emit_text(events, self._buffer[:keep])
                self._buffer = self._buffer[keep:]
            break
        return events

    def _end_unfinished(self, events: list[ParserEvent], cut: bool) -> None:
        """The output ended inside a call: a cut call once its name is written, nothing while it
        may still become one; text when the end did not cut it (an unforced call the model
        ended early, or not a call after all)."""
        prefix = self._head or self.syntax.call_prefix(self._buffer)
        self._in_call, self._head = False, None
        filler, self._filler = self._filler, ""
        if cut and prefix is not None:
            if prefix.name_done and prefix.name in self.tool_names:
                end = len(self._buffer)
                if prefix.arguments_start >= 0:
                    closed = self._arguments_object.find(self._buffer, prefix.arguments_start)
                    end = end if closed < 0 else closed
                self._end_cut_call(events, prefix, end)
                self._buffer = ""
                return
            if not prefix.name_done and any(name.startswith(prefix.name) for name in self.tool_names):
                logger.debug("a tool call cut before its name was written (%d characters) is dropped",
                             len(self._buffer))
                self._buffer = ""
                return
        self._emit_text(events, filler + self._buffer)
        self._buffer = ""

    def _end_cut_call(self, events: list[ParserEvent], prefix: CallPrefix, arguments_end: int) -> None:
        start = prefix.arguments_start
        arguments = self._buffer[start:arguments_end] if start >= 0 else ""
        logger.debug("tool call %d (%s) cut after %d characters of arguments", self.num_calls, prefix.name,
                     len(arguments))
        events.append(CutCall(self.num_calls, prefix.name, arguments))
        self.num_calls += 1

    def _stream_arguments(self, events: list[ParserEvent]) -> None:
        if self._head is None:
            prefix = self.syntax.call_prefix(self._buffer)
            if prefix is None or prefix.arguments_start < 0 or prefix.name not in self.tool_names:
                return
            self._head = prefix
            self._arguments_sent = prefix.arguments_start
            events.append(CallHead(self.num_calls, prefix.name))
        end = self._arguments_object.find(self._buffer, self._head.arguments_start)
        end = len(self._buffer) if end < 0 else end
        if end > self._arguments_sent:
            events.append(ArgumentsDelta(self.num_calls, self._buffer[self._arguments_sent:end]))
            self._arguments_sent = end

    def _emit_text(self, events: list[ParserEvent], text: str) -> None:
        if not text:
            return
        self._at_boundary = False
        if events and isinstance(events[-1], TextDelta):
            events[-1] = TextDelta(events[-1].text + text)
        else:
            events.append(TextDelta(text))
