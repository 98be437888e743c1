"""``n`` > 1: several choices of one request, its prompt prefilled once.

Choice 0 runs first, as any request does (on a gen leg choice 0 is the leg: it
pulls the ctx worker's KV and starts from the ctx leg's token). The other
choices go to the engine once choice 0's first output has arrived: its
prompt's full blocks are computed by then and registered in the engine's
prefix cache (``BlockManager.cache_full_blocks``; a gen engine registers the
blocks it pulled), so every other choice hits them and computes only the
prompt's last, partial block (at least one token: a step needs logits to
sample). Sent together, every choice would prefill the whole prompt: a block
is registered only once its KV is computed, never at allocation. Sharing the
partial block too (copy on write) would save those few tokens per choice at
the price of a KV copy in the executor and a fork in the scheduler; not done.
Without prefix caching (``engine.enable_prefix_caching: false``) each choice
prefills the whole prompt.

Prompt logprobs are asked of the engine by choice 0 alone (the prompt is the
same; a request asking for them skips the prefix cache, so each choice would
prefill the whole prompt again): every choice reports choice 0's.

Seeds: choice ``i`` samples with ``seed + i`` (vLLM's rule), so each choice is
reproducible by itself and choice 0 is exactly the ``n = 1`` answer.

``best_of`` is accepted only equal to ``n`` (or absent): ranking more
candidates than are returned needs every candidate's logprobs, for an answer
that clients rarely ask for.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

import msgspec

from api.errors import ApiError, InvalidRequestError, http_error
from api.generation import Completion, Generation, StreamEncoder
from api.request_limits import MAX_N
from api.streaming import FinalFrame

__all__ = ["check_choices", "choice_seed", "choice_generations", "collect_choices", "stream_choices"]

logger = logging.getLogger(__name__)

_SEED_RANGE = 2**63  # SamplingParams.validate's


def check_choices(n: int, best_of: int | None = None) -> None:
    if not 1 <= n <= MAX_N:
        raise InvalidRequestError(f"n must be in [1, {MAX_N}], got {n}", param="n")
    if best_of is not None and best_of != n:
        raise InvalidRequestError(f"best_of must equal n ({n}) when given, got {best_of}: ranking more candidates "
                                  "than are returned is not supported; ask for n choices and rank them yourself",
                                  param="best_of")


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice ``index``'s seed: ``seed + index`` (in the seed's range), None without a seed."""
    return None if seed is None else (seed + index) % _SEED_RANGE


def choice_generations(first: Generation, n: int) -> list[Generation]:
    """``first`` and ``n - 1`` more on its prompt: plain requests (a leg's hook is choice 0's alone),
    each with its own seed, none asking for prompt logprobs (module doc)."""
    params = first.params
    return [first] + [
        Generation(first.client, first.tokenizer, first.prompt_token_ids,
                   msgspec.structs.replace(params, seed=choice_seed(params.seed, index), prompt_logprobs=None), first.stop_strings,
                   first.arrival_time, None, first.x_request_id)
        for index in range(1, n)
    ]


def _first_output_gate(first: Generation) -> asyncio.Event:
    """Set when ``first``'s engine reported its first output (its prompt's blocks are cached then)."""
    gate = asyncio.Event()
    first.on_engine_output = gate.set
    return gate


def _cancel(tasks: Sequence[asyncio.Future[Any]]) -> None:
    """Cancel what still runs (closing a choice's generation aborts it in the engine); failures of the
    others than the one reported are retrieved, so none is logged as never retrieved."""
    for task in tasks:
        task.cancel()
        task.add_done_callback(lambda done: done.cancelled() or done.exception())


async def collect_choices(generations: list[Generation]) -> list[Completion]:
    """Every choice run to its end (non-streaming requests); the first failure fails the request."""
    gate = _first_output_gate(generations[0])
    tasks = [asyncio.ensure_future(generations[0].collect())]
    tasks[0].add_done_callback(lambda _: gate.set())  # it ended without output (an error, an early stop)
    try:
        await gate.wait()
        tasks += [asyncio.ensure_future(generation.collect()) for generation in generations[1:]]
        return list(await asyncio.gather(*tasks))
    finally:
        _cancel(tasks)


async def stream_choices(generations: list[Generation], encoders: list[StreamEncoder],
                         tail: Callable[[], list[bytes]],
                         error_frames: Callable[[ApiError], list[bytes]]) -> AsyncGenerator[bytes, None]:
    """The choices' frames as each is ready (each encoder writes its choice's ``index``), then
    ``tail()`` (usage, ``[DONE]``); the first failure ends the stream with ``error_frames``.
    Closing this generator cancels every choice (aborting each in the engine)."""
    frames: asyncio.Queue[bytes | Exception | None] = asyncio.Queue()  # None: one choice finished
    gate = _first_output_gate(generations[0])

    async def run(generation: Generation, encoder: StreamEncoder, after_first: bool) -> None:
        try:
            start = b"".join(encoder.start(generation))
            if start:
                frames.put_nowait(start)
            if after_first:
                await gate.wait()
            last = None
            async for piece in generation.pieces():
                last = piece
                frame = encoder.piece(piece)
                if frame is not None:
                    frames.put_nowait(frame)
            assert last is not None  # pieces() ends with a finishing piece or raises
            frames.put_nowait(b"".join(encoder.finish(generation, last)))
            frames.put_nowait(None)
        except Exception as exc:  # noqa: BLE001 - reported in the stream, once
            frames.put_nowait(exc)
        finally:
            gate.set()

    tasks = [asyncio.ensure_future(run(generation, encoder, index > 0))
             for index, (generation, encoder) in enumerate(zip(generations, encoders))]
    try:
        running = len(tasks)
        while running:
            item = await frames.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                error = http_error(item)
                if error.status >= 500:
                    logger.error("stream failed", exc_info=item)
                yield FinalFrame(b"".join(error_frames(error)))
                return
            else:
                yield item
        yield FinalFrame(b"".join(tail()))
    finally:
        _cancel(tasks)
