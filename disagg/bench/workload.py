"""The agentic workload: sessions whose context grows turn by turn, API-neutral.

Every session shares one system prompt (instructions, the tool definitions as JSON, filler text
up to ``system_tokens``), as a coding agent's do. Each turn appends a user message; the answer the
server streams back is appended as the assistant message before the next turn, so turn k's
prompt holds turns 0..k-1 and a prefix cache can serve all of it but the new user text. Before a
turn a session may also append a tool exchange (an assistant tool call and its result), which
agents send between user turns. A session of one turn is a plain single-turn request.

The ``api_clients`` module renders a ``Conversation`` for each API.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

from disagg.bench.lengths import LengthDist
from disagg.bench.text import TextSource

__all__ = ["ToolSpec", "ToolExchange", "Message", "Conversation", "TurnPlan", "SessionPlan", "Workload",
           "WorkloadConfig", "TOOLS"]


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict

    def openai(self) -> dict:
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


def _schema(**props: str) -> dict:
    return {"type": "object", "properties": {k: {"type": v} for k, v in props.items()}, "required": list(props)}


TOOLS = (
    ToolSpec("read_file", "Read a file of the repository.", _schema(path="string")),
    ToolSpec("write_file", "Replace a file's content.", _schema(path="string", content="string")),
    ToolSpec("search_code", "Search the repository for a regular expression.", _schema(pattern="string")),
    ToolSpec("run_tests", "Run the test suite or one test file.", _schema(target="string")),
    ToolSpec("list_directory", "List a directory.", _schema(path="string")),
    ToolSpec("apply_patch", "Apply a unified diff.", _schema(diff="string")),
)


@dataclass(frozen=True)
class ToolExchange:
    """An assistant tool call and the tool's result, as an agent loop appends them."""

    call_id: str
    tool: ToolSpec
    arguments: str
    result: str


@dataclass(frozen=True)
class Message:
    role: str  # "user" or "assistant" (text), or "tool" (``exchange`` set)
    text: str = ""
    exchange: ToolExchange | None = None


@dataclass
class Conversation:
    system: str
    tools: tuple[ToolSpec, ...]
    messages: list[Message] = field(default_factory=list)
    send_tools: bool = False
    """Send the tool definitions as the API's ``tools`` parameter too (only when tool exchanges are in
    the history: several APIs refuse tool messages without them)."""


@dataclass(frozen=True)
class TurnPlan:
    user_tokens: int
    max_tokens: int
    tool_result_tokens: int  # > 0: a tool exchange precedes this turn's user message


@dataclass(frozen=True)
class SessionPlan:
    session_id: int
    turns: tuple[TurnPlan, ...]


@dataclass(frozen=True)
class WorkloadConfig:
    system_tokens: int = 1000
    """The shared system prompt: instructions and the tool definitions (their size under the
    server's tokenizer is a floor), then filler text up to this many tokens; 0: no system prompt."""
    isl: LengthDist = LengthDist(200)
    """Tokens of each user message."""
    osl: LengthDist = LengthDist(64)
    """max_tokens of each request."""
    turns: LengthDist = LengthDist(4)
    """Turns per multi-turn session."""
    single_turn_fraction: float = 0.0
    """Sessions that are one plain turn (the single-turn mix)."""
    tool_turn_fraction: float = 0.0
    """Turns after the first that a tool exchange precedes."""
    tool_result_tokens: int = 100
    seed: int = 0

    def validate(self) -> None:
        for name in ("single_turn_fraction", "tool_turn_fraction"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"--{name.replace('_', '-')}: must be in [0, 1], got {value}")
        if self.system_tokens < 0 or self.tool_result_tokens < 1:
            raise ValueError("--system-tokens must be >= 0 and --tool-result-tokens >= 1")


class Workload:
    """Session plans and their text, deterministic in ``config.seed``."""

    def __init__(self, config: WorkloadConfig, text: TextSource, stream: int = 0) -> None:
        """``stream`` picks an independent sequence of sessions (one per sweep level and one for the
        warm-up, so a level never finds the previous level's turns cached); the system prompt is the
        same for all."""
        self.config = config
        self.text = text
        self._stream_seed = config.seed * 1_000_003 + stream
        self._rng = random.Random(self._stream_seed)
        self._next_session = 0
        self.system = self._system_prompt()

    def _system_prompt(self) -> str:
        if self.config.system_tokens == 0:
            return ""  # plain chat, no system message: what single-turn tools (aiperf, genai-perf) send
        head = ("You are a coding agent working in a software repository. Use the tools to read, search, "
                "edit and test code; answer briefly.\n\nTools:\n" + json.dumps([t.openai() for t in TOOLS]))
        filler_tokens = self.config.system_tokens - round(len(head.split()) * self.text.tokens_per_word * 2)
        filler = self.text.make(filler_tokens, random.Random(self.config.seed + 1)) if filler_tokens > 0 else ""
        return f"{head}\n\nProject notes: {filler}" if filler else head

    def next_session(self) -> SessionPlan:
        rng, cfg = self._rng, self.config
        single = rng.random() < cfg.single_turn_fraction
        num_turns = 1 if single else cfg.turns.sample(rng)
        turns = tuple(TurnPlan(cfg.isl.sample(rng), cfg.osl.sample(rng),
                               cfg.tool_result_tokens if i and rng.random() < cfg.tool_turn_fraction else 0)
                      for i in range(num_turns))
        self._next_session += 1
        return SessionPlan(self._next_session - 1, turns)

    def session_rng(self, session: SessionPlan) -> random.Random:
        """The random source of one session's text: distinct per stream and session, so no two
        levels send the same prompts."""
        return random.Random(self._stream_seed * 1_000_003 + session.session_id)

    def start(self) -> Conversation:
        return Conversation(self.system, TOOLS)

    def add_turn(self, conversation: Conversation, session: SessionPlan, index: int, rng: random.Random) -> None:
        """Append turn ``index``'s tool exchange (if planned) and user message."""
        turn = session.turns[index]
        if turn.tool_result_tokens:
            tool = rng.choice(TOOLS)
            arguments = json.dumps({k: self.text.make(4, rng) for k in tool.parameters["properties"]})
            conversation.messages.append(Message("tool", exchange=ToolExchange(
                f"call_{session.session_id}_{index}", tool, arguments, self.text.make(turn.tool_result_tokens, rng))))
            conversation.send_tools = True
        conversation.messages.append(Message("user", self.text.make(turn.user_tokens, rng)))
