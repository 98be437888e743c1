"""The one generation path shared by every API: engine outputs to text pieces.

Both the OpenAI and the Anthropic handlers iterate ``Generation.pieces()``;
only their encoders differ. A piece carries the text that became safe to
emit (complete UTF-8 characters, no part of a stop string), the tokens and
logprobs that produced it, and, on the last piece, why the request ended.

A stop string ends the request here, in the frontend: leaving the
``async with aclosing(...)`` block closes the engine client's iterator,
which aborts the request in the engine. The same happens when the consumer
of ``pieces()`` is cancelled or closed (a client that went away).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import aclosing
from typing import Protocol

from api.admission import QueueBound
from api.detokenizer import StopStringMatcher, make_detokenizer
from api.errors import (
    ApiError,
    EngineDeadError,
    EngineFailedError,
    FrontendError,
    InvalidRequestError,
    http_error,
)
from api.stream_marks import STREAM_MARKS, StreamMark, encode_mark
from api.streaming import FinalFrame
from api.tokenizer import Tokenizer
from workers.protocol import EngineRequest, IngressMessage, RequestOutput, TokenLogprobs
from workers.sampling_params import SamplingParams

__all__ = [
    "EngineClientLike",
    "OpenStream",
    "OutputHook",
    "Piece",
    "PieceCutter",
    "Generation",
    "Completion",
    "RequestAbortedError",
    "StreamEncoder",
    "stream_events",
    "start_frames",
]

logger = logging.getLogger(__name__)


class OpenStream(Protocol):
    """A request whose outputs the engine client pushes (``frontends.engine_client.PushedRequest``)."""

    def close(self) -> None:
        """Abort it in the engine unless it finished."""
        ...


class EngineClientLike(Protocol):
    """What the frontends need of ``frontends.engine_client.EngineClient``."""

    # Read-only: an attribute or a property both do (the orchestrator's validator computes them).
    @property
    def max_model_len(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def eos_token_ids(self) -> Sequence[int]: ...  # read-only: a tuple or a list both do

    @property
    def is_healthy(self) -> bool: ...

    @property
    def queue(self) -> QueueBound: ...  # this frontend's share of the bound on queued requests

    def unavailable_error(self) -> Exception: ...  # why new requests are refused while not healthy

    def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, arrival_time: float | None = None,
        make_message: Callable[[EngineRequest], IngressMessage] | None = None, x_request_id: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]: ...

    async def abort(self, request_id: int) -> None: ...


class OutputHook(Protocol):
    """What a request that is more than a plain generation changes in its run: the message that
    carries it to the engine, each engine output before it is read, and the cached prompt tokens
    its usage reports. A disaggregated leg is one (``api.disaggregation.DisaggLeg``)."""

    def message(self, request: EngineRequest) -> IngressMessage: ...

    def on_output(self, output: RequestOutput) -> RequestOutput: ...

    def usage_cached_tokens(self, own: int) -> int: ...  # ``own``: this engine's prefix-cache hits

    def early_tokens(self) -> tuple[list[int], list[TokenLogprobs] | None] | None:
        """Output tokens (and logprobs) known before the engine reports any: they go to the client at
        once, and ``on_output`` does not report them again. None: none (asked once, before the run)."""
        ...

    def replay_tokens(self) -> list[int]:
        """Output tokens the client already holds (a migrated stream's): replayed through the
        cutter and the encoder with their frames dropped (``start_frames``); empty: none."""
        ...


class RequestAbortedError(FrontendError):
    """The engine ended the request without an answer (it was aborted on its side)."""

    status = 503
    openai_type = "service_unavailable_error"
    anthropic_type = "api_error"
    code = "request_aborted"


def rejection(output: RequestOutput, error: str) -> FrontendError:
    """The error of an output the engine ended with ``error``: the request's own fault (a known
    ``RejectReason``) a 400, any other the engine's, a 500 (its traceback is in the engine's log)."""
    reason = output.reject_reason
    if reason is not None and reason.is_client_error:
        return InvalidRequestError(error)
    logger.error("request %d: the engine failed it (%s): %s", output.request_id, reason, error)
    return EngineFailedError(f"the engine failed the request: {error}")


class Piece:
    """Text safe to emit and what produced it. ``finish_reason`` only on the last piece:
    ``stop`` (EOS, a stop token or ``stop_string``) or ``length``."""

    __slots__ = ("text", "token_ids", "logprobs", "finish_reason", "stop_string")

    def __init__(
        self,
        text: str,
        token_ids: list[int],
        logprobs: list[TokenLogprobs] | None,
        finish_reason: str | None = None,
        stop_string: str | None = None,
    ) -> None:
        self.text = text
        self.token_ids = token_ids
        self.logprobs = logprobs
        self.finish_reason = finish_reason
        self.stop_string = stop_string


class Generation:
    """One request's run through the engine; counts tokens for usage."""

    def __init__(
        self,
        client: EngineClientLike,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        params: SamplingParams,
        stop_strings: tuple[str, ...] = (),
        arrival_time: float | None = None,
        hook: OutputHook | None = None,
        x_request_id: str | None = None,
    ) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.stop_strings = stop_strings
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        self.hook = hook
        self.x_request_id = x_request_id  # the HTTP request's header (or a batch request's id): its perf record's
        # Called once, at the engine's first output (the prompt is prefilled then): api.choices.
        self.on_engine_output: Callable[[], None] | None = None
        # Asked for (``SamplingParams.prompt_logprobs``): the engine's first output's, or a gen leg's
        # carried from its ctx leg (``api.prepare``); prompt tokens 1.. (api.prompt_logprobs).
        self.prompt_logprobs: list[TokenLogprobs] | None = None

    @property
    def num_usage_cached_tokens(self) -> int:
        """Cached prompt tokens as usage reports them (the hook's say, when there is one)."""
        return self.num_cached_tokens if self.hook is None else self.hook.usage_cached_tokens(self.num_cached_tokens)

    def open_stream(self, on_output: Callable[[RequestOutput | EngineDeadError], None]) -> OpenStream:
        """Send the request with its outputs pushed to ``on_output`` (``api.push_stream``)."""
        make_message = None if self.hook is None else self.hook.message
        stream: OpenStream = self.client.open_stream(  # type: ignore[attr-defined]  # the engine client's alone
            self.prompt_token_ids, self.params, on_output, self.arrival_time, make_message, self.x_request_id)
        return stream

    async def pieces(self, cutter: PieceCutter | None = None) -> AsyncIterator[Piece]:
        """``cutter``: the stream's own (it marks and replays with it); a fresh one by default."""
        cutter = PieceCutter(self) if cutter is None else cutter
        early = cutter.cut_early()
        if early is not None:
            yield early
            if early.finish_reason is not None:
                return  # a stop string in the early tokens: the engine never sees the request
        make_message = None if self.hook is None else self.hook.message
        outputs = self.client.generate(self.prompt_token_ids, self.params, self.arrival_time, make_message,
                                       x_request_id=self.x_request_id)
        async with aclosing(outputs) as stream:
            async for output in stream:
                piece = cutter.cut(output)
                if piece is not None:
                    yield piece
                    if piece.finish_reason is not None:
                        return  # a stop string: leaving aclosing aborts the request in the engine
        raise RequestAbortedError("the engine stream ended without a finished output")

    async def collect(self) -> Completion:
        """Run to the end; the whole answer (non-streaming requests)."""
        texts: list[str] = []
        logprobs: list[TokenLogprobs] | None = [] if self.params.logprobs is not None else None
        last: Piece | None = None
        async for piece in self.pieces():
            texts.append(piece.text)
            if logprobs is not None and piece.logprobs:
                logprobs.extend(piece.logprobs)
            last = piece
        assert last is not None  # pieces() ends with a finishing piece or raises
        return Completion("".join(texts), logprobs, last.finish_reason, last.stop_string)


class PieceCutter:
    """One generation's engine outputs cut into pieces, one output at a time (synchronous:
    ``pieces()`` and the pushed stream, ``api.push_stream``, both run it)."""

    __slots__ = ("generation", "detokenizer", "matcher", "want_logprobs", "pending_ids", "pending_logprobs",
                 "unmarked")

    def __init__(self, generation: Generation) -> None:
        self.generation = generation
        self.detokenizer = make_detokenizer(generation.tokenizer, generation.prompt_token_ids)
        self.matcher = StopStringMatcher(generation.stop_strings) if generation.stop_strings else None
        self.want_logprobs = generation.params.logprobs is not None
        # Tokens whose text is still held back travel with the next piece.
        self.pending_ids: list[int] = []
        self.pending_logprobs: list[TokenLogprobs] | None = [] if self.want_logprobs else None
        # A marked stream (``api.stream_marks``): every token consumed since the last write's mark.
        self.unmarked: list[int] | None = [] if STREAM_MARKS.get() else None

    def mark(self, error: int | None = None) -> bytes:
        """The mark that ends a write (b"" on an unmarked stream): the tokens consumed since the last."""
        if self.unmarked is None:
            return b""
        tokens, self.unmarked = self.unmarked, []
        return encode_mark(StreamMark(tokens, error))

    def replay(self, token_ids: list[int]) -> Piece | None:
        """Consume tokens the client already holds (a migrated stream's): the piece they would have
        made; they are in no mark (the orchestrator carries them already)."""
        piece = self._add(token_ids, None, None)
        if piece is not None and piece.finish_reason is not None:
            raise InvalidRequestError("the output tokens to resume after already end the request (a stop string)",
                                      param="disaggregated_params.output_token_ids")
        if self.unmarked is not None:
            self.unmarked = []
        return piece

    def cut_early(self) -> Piece | None:
        """The piece of the hook's early tokens (a gen leg's first token), None without them or
        while their text is held back; call it once, before any ``cut``."""
        hook = self.generation.hook
        early = None if hook is None else hook.early_tokens()
        return None if early is None else self._add(early[0], early[1], None)

    def cut(self, output: RequestOutput) -> Piece | None:
        """The piece this output completes (the last one has a finish reason), or None while
        its text is held back. Raises for an output that aborted the request."""
        generation = self.generation
        if generation.hook is not None:
            output = generation.hook.on_output(output)
        if output.finish_reason == "abort":
            if output.error:
                raise rejection(output, output.error)
            raise RequestAbortedError("the engine aborted the request")
        if output.prompt_logprobs is not None:  # (before the gate below: the other choices read them)
            generation.prompt_logprobs = output.prompt_logprobs
        if generation.on_engine_output is not None:
            generation.on_engine_output()
            generation.on_engine_output = None
        if output.num_cached_tokens > generation.num_cached_tokens:  # a comparison: max() is a call an output
            generation.num_cached_tokens = output.num_cached_tokens
        return self._add(output.new_token_ids, output.new_logprobs, output.finish_reason)

    def _add(self, token_ids: list[int], logprobs: list[TokenLogprobs] | None, finish_reason: str | None) -> Piece | None:
        self.generation.num_output_tokens += len(token_ids)
        if self.unmarked is not None:
            self.unmarked.extend(token_ids)
        self.pending_ids.extend(token_ids)
        if self.pending_logprobs is not None and logprobs:
            self.pending_logprobs.extend(logprobs)
        finished = finish_reason is not None
        text = self.detokenizer.add(token_ids)
        if finished:
            text += self.detokenizer.flush()
        matcher = self.matcher
        if matcher is not None:
            text, stop_string = matcher.feed(text)
            if stop_string is not None:
                return Piece(text, self.pending_ids, self.pending_logprobs, "stop", stop_string)
            if finished:
                text += matcher.flush()
        if not text and not finished:
            return None
        piece = Piece(text, self.pending_ids, self.pending_logprobs, finish_reason)
        self.pending_ids = []
        self.pending_logprobs = [] if self.want_logprobs else None
        return piece


class Completion:
    __slots__ = ("text", "logprobs", "finish_reason", "stop_string")

    def __init__(self, text: str, logprobs: list[TokenLogprobs] | None, finish_reason: str | None,
                 stop_string: str | None) -> None:
        self.text = text
        self.logprobs = logprobs
        self.finish_reason = finish_reason
        self.stop_string = stop_string


class StreamEncoder(Protocol):
    """How one API writes a generation as SSE frames (pre-encoded bytes)."""

    def start(self, generation: Generation) -> list[bytes]: ...

    def piece(self, piece: Piece) -> bytes | None: ...

    def finish(self, generation: Generation, last: Piece) -> list[bytes]: ...

    def error(self, error: ApiError) -> list[bytes]: ...


def start_frames(generation: Generation, encoder: StreamEncoder, cutter: PieceCutter) -> bytes:
    """The start frames, which go out with the first piece's. A resumed stream's are b"": the
    client has them, and the tokens it holds are replayed through ``cutter`` and ``encoder``
    (their frames dropped), leaving both where the failed worker's were."""
    frames = b"".join(encoder.start(generation))
    replayed = [] if generation.hook is None else generation.hook.replay_tokens()
    if not replayed:
        return frames
    piece = cutter.replay(replayed)
    if piece is not None:
        encoder.piece(piece)
    return b""


async def stream_events(generation: Generation, encoder: StreamEncoder) -> AsyncGenerator[bytes, None]:
    """The one streaming loop: every API's SSE stream is this loop and an encoder.

    An error after the stream has started goes to the client in band (the
    status line is already sent); closing this generator aborts the request.
    Frames that are ready together go out as one write: the start frames
    with the first piece's frame, the finishing piece's frame with the
    finish frames (a ``FinalFrame``, after ``pieces()`` has ended, so a stop
    string's abort reaches the engine first). On a marked stream each write
    ends with its mark (``api.stream_marks``).
    """
    cutter = PieceCutter(generation)
    error_status: int | None = None
    pending = b""
    try:
        pending = start_frames(generation, encoder, cutter)
        last: Piece | None = None
        async for piece in generation.pieces(cutter):
            frame = encoder.piece(piece)
            last = piece
            if frame is None:
                continue
            if piece.finish_reason is not None:  # the last piece: pieces() ends right after it
                pending += frame
            else:
                yield pending + frame + cutter.mark()
                pending = b""
        assert last is not None
        frames = encoder.finish(generation, last)
    except Exception as exc:  # reported to the client in the stream
        error = http_error(exc)
        if error.status >= 500:
            logger.error("stream failed", exc_info=exc)
        frames = encoder.error(error)
        error_status = error.status
    yield FinalFrame(pending + b"".join(frames) + cutter.mark(error_status))
