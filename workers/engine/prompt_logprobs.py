"""Prompt logprobs: each prompt token's logprob given its prefix, and the top-n alternatives.

The runner returns, after a step's sampled rows, the logits of the prompt
positions that requests with ``SamplingParams.prompt_logprobs`` asked for
(``ScheduledRequest.prompt_logprob_rows``, ``executor.logit_rows``): the row
at position ``p`` scores prompt token ``p + 1``. Like sampled logprobs they
are those of the model's raw distribution. Rows are taken in slices so that
a long prompt's log-softmax never holds more than one slice beside its
logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workers.engine.executor import ScheduledRequest
from workers.protocol import TokenLogprobs

__all__ = ["prompt_logprobs"]

_SLICE_ROWS = 1024


def prompt_logprobs(requests: Sequence[ScheduledRequest], logits: torch.Tensor
                    ) -> list[list[TokenLogprobs] | None]:
    """Per entry of ``requests``, its rows' ``TokenLogprobs`` (None where it has none), from
    ``logits`` (the prompt rows alone, in ``logit_rows``' order)."""
    out: list[list[TokenLogprobs] | None] = []
    row = 0
    for request in requests:
        num_rows = request.prompt_logprob_rows
        if not num_rows:
            out.append(None)
            continue
        start = request.start_position
        targets = request.prompt_token_ids[start + 1 : start + 1 + num_rows]
        top_n = request.sampling_params.prompt_logprobs or 0
        entries: list[TokenLogprobs] = []
        for first in range(0, num_rows, _SLICE_ROWS):
            part = logits[row + first : row + min(first + _SLICE_ROWS, num_rows)]
            entries.extend(_score(part, targets[first : first + _SLICE_ROWS], top_n))
        out.append(entries)
        row += num_rows
    return out


def _score(logits: torch.Tensor, targets: list[int], top_n: int) -> list[TokenLogprobs]:
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (R, V)
    target = torch.tensor(targets, dtype=torch.long, device=logits.device).unsqueeze(1)
    chosen_tensor = logprobs.gather(1, target)  # (R, 1)
    ranks = ((logprobs > chosen_tensor).sum(dim=-1) + 1).tolist()
    chosen = chosen_tensor.squeeze(1).tolist()
    top_ids: list[list[int]] = [[] for _ in targets]
    top_values: list[list[float]] = [[] for _ in targets]
    if top_n:
        top_value_tensor, top_id_tensor = logprobs.topk(top_n, dim=-1)
        top_values, top_ids = top_value_tensor.tolist(), top_id_tensor.tolist()
    return [TokenLogprobs(token_id, logprob, ids, values, rank)
            for token_id, logprob, ids, values, rank in zip(targets, chosen, top_ids, top_values, ranks)]
