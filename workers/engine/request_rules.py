"""The rules over one request: what is rejected, when it stops, what it reports.

Pure functions; the scheduler applies them and makes the state transitions.

Stopping. ``max_tokens`` beyond the model length is not an error: generation
stops when prompt + output reaches ``max_model_len``, with finish reason
``length``. A stop token is checked before the length limits, so a stop
token sampled as the last allowed token reports ``stop``; the stop token
itself is part of the output (frontends leave it out of the text).
``min_tokens``: EOS and stop token ids only stop a request once more than
``min_tokens`` tokens exist (the sampler also masks them before that).
Guided decoding: a request stops (``stop``) as soon as its grammar is
complete, whatever ``min_tokens`` and ``ignore_eos`` say.
"""

from __future__ import annotations

from workers.engine.request import FINISH_REASONS, Request, RequestStatus
from workers.protocol import RejectReason, RequestOutput, TokenLogprobs

__all__ = ["admission_error", "stop_filter", "stop_status", "request_output", "token_slice"]


def admission_error(request: Request, max_model_len: int) -> tuple[RejectReason, str] | None:
    """Why the request can never run, in words, or None."""
    if not request.prompt_token_ids:
        return RejectReason.EMPTY_PROMPT, "prompt is empty"
    if request.num_prompt_tokens > max_model_len:
        return RejectReason.PROMPT_TOO_LONG, (
            f"prompt has {request.num_prompt_tokens} tokens, more than the model's limit "
            f"of {max_model_len} tokens (max_model_len)"
        )
    try:
        request.sampling_params.validate()
    except ValueError as exc:
        return RejectReason.INVALID_SAMPLING_PARAMS, f"invalid sampling parameters: {exc}"
    return None


def stop_status(
    request: Request, token_id: int, eos_token_ids: frozenset[int], max_model_len: int
) -> RequestStatus | None:
    """The finished state once ``token_id`` (already appended) was sampled, or None to go on."""
    params = request.sampling_params
    if request.error is not None:  # the grammar rejected the token (never when the mask was applied)
        return RequestStatus.FINISHED_ABORTED
    num_output_tokens = len(request.output_token_ids)  # not the properties: this runs per token
    if num_output_tokens > params.min_tokens and (
        token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos_token_ids)
    ):
        return RequestStatus.FINISHED_STOPPED
    if request.grammar is not None and request.grammar.is_stopped():
        return RequestStatus.FINISHED_STOPPED  # nothing but EOS could follow: end now
    if num_output_tokens >= params.max_tokens or num_output_tokens + len(request.prompt_token_ids) >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None


_NONE: frozenset[int] = frozenset()


def stop_filter(request: Request, eos_token_ids: frozenset[int], max_model_len: int) -> None:
    """Precompute, at admission, what lets the per-token loop skip ``stop_status``: a sampled token
    outside ``request.stop_ids`` while the output is shorter than ``request.length_limit``, with
    no error and no grammar, certainly does not stop the request (``stop_status`` returns None:
    the stop and EOS ids are in the set, whatever ``min_tokens`` says, and both length caps are in
    the limit). Anything else asks ``stop_status``, the one place the rules are decided."""
    params = request.sampling_params
    stop_ids = frozenset(params.stop_token_ids) if params.stop_token_ids else _NONE
    request.stop_ids = stop_ids if params.ignore_eos or not eos_token_ids else (stop_ids | eos_token_ids)
    request.length_limit = min(params.max_tokens, max_model_len - len(request.prompt_token_ids))


def request_output(
    request: Request, new_token_ids: list[int], is_first: bool, logprobs: list[TokenLogprobs] | None = None
) -> RequestOutput:
    """``num_prompt_tokens`` and ``num_cached_tokens`` go on a request's first output only."""
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=new_token_ids,
        finish_reason=FINISH_REASONS.get(request.status),
        new_logprobs=logprobs,
        num_prompt_tokens=request.num_prompt_tokens if is_first else 0,
        num_cached_tokens=request.num_cached_tokens if is_first else 0,
        error=request.error,
        reject_reason=request.reject_reason,
    )


def token_slice(request: Request, start: int, end: int) -> list[int]:
    """``request.all_token_ids[start:end]`` without building the whole list (decode is the hot path)."""
    num_prompt = request.num_prompt_tokens
    if start >= num_prompt:
        return request.output_token_ids[start - num_prompt : end - num_prompt]
    if end <= num_prompt:
        return request.prompt_token_ids[start:end]
    return request.prompt_token_ids[start:] + request.output_token_ids[: end - num_prompt]
