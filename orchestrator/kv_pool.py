"""The deployment-wide KV pool: a ctx leg gets the leading blocks of its prompt from the worker that
holds them (docs/operations.md, "The KV pool").

Every worker's prefix cache is one pool. When another worker (ctx or gen: a gen worker also holds
the earlier turns' answers) holds more of the prompt's leading blocks than the ctx worker the router
chose, and moving the difference costs less than computing it (``worth_fetching``), the
orchestrator first sends the holder an *export* leg: a context_only completions request over
exactly those blocks' tokens (``prefix_export``, served whatever the holder's role), which parks
their KV there (its prefill computes only the last block; the rest hit its cache) and answers with
signed params. The ctx leg carries them as ``disaggregated_params.kv_prefix``: its engine pulls the
blocks it lacks over the KV-transfer path, as a gen engine pulls a prompt, caches them, and
prefills only the rest. The output is the same (the same model's KV over the same tokens). Any
failure on the way (the export fails, the holder's blocks are gone, the pull fails) costs only the
saving: the ctx engine then computes the prefix itself.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from common.block_hash import compute_block_hashes
from orchestrator.config import KVPoolConfig
from orchestrator.http_client import HttpClient, UpstreamError
from orchestrator.kv_index import KVIndex
from orchestrator.prompt import ParsedRequest
from orchestrator.registry import WorkerRecord
from orchestrator.view import ClusterView
from workers.disagg_params import DisaggParams, RequestType
from workers.http_protocol import CtxAnswer, Phase, PrefixExportLeg

__all__ = ["KVPool", "PrefixSource", "choose_prefix", "worth_fetching"]

log = logging.getLogger("disagg.orchestrator.kv_pool")

_ANSWER = msgspec.json.Decoder(CtxAnswer)

# The prefill speed's moving average: each ctx leg's measurement weighs this much.
_SMOOTHING = 0.2
# A ctx leg that computed fewer tokens than this says more about latency than about speed.
_MIN_MEASURED_TOKENS = 64


@dataclass(frozen=True)
class PrefixSource:
    """Where the first ``num_tokens`` of a prompt (whole blocks) are cached and the ctx worker lacks them."""

    holder: WorkerRecord
    num_tokens: int
    gain_tokens: int  # of them, those the ctx worker does not hold


def worth_fetching(gain_tokens: int, overhead_seconds: float, prefill_tps: float, transfer_tps: float) -> bool:
    """Moving ``gain_tokens``' KV is cheaper than computing it. A speed not known yet (0) gives the
    fetch the benefit of the doubt: its leg measures it."""
    if prefill_tps <= 0:
        return True
    transfer_seconds = gain_tokens / transfer_tps if transfer_tps > 0 else 0.0
    return gain_tokens / prefill_tps > overhead_seconds + transfer_seconds


def choose_prefix(config: KVPoolConfig, kv: KVIndex, hashes: Sequence[int], num_prompt_tokens: int, block_size: int,
                  ctx_id: str, holder_ids: Sequence[str], prefill_tps: float, transfer_tps: float
                  ) -> tuple[str, int, int] | None:
    """The pool's decision for a ctx leg on ``ctx_id``: (holder, prompt tokens to fetch, of them those
    the ctx worker lacks), or None. The holder holds the most leading blocks of the prompt (``hashes``,
    the first holder in order on a tie); shared with the simulator (``disagg.sim``)."""
    if not config.enabled:
        return None
    usable = (num_prompt_tokens - 1) // block_size  # the last token is computed on the ctx worker
    # Blocks in any tier count: a holder's export onboards its host and disk blocks as any hit does,
    # and the ctx engine copies in its own before it pulls the rest.
    own = min(kv.match(ctx_id, hashes)[0], usable)
    best: tuple[int, str] | None = None
    for holder_id in holder_ids:
        held = min(kv.match(holder_id, hashes)[0], usable)
        if best is None or held > best[0]:
            best = held, holder_id
    if best is None or best[0] - own < config.min_blocks:
        return None
    gain = (best[0] - own) * block_size
    if not worth_fetching(gain, config.overhead_seconds, prefill_tps, transfer_tps):
        return None
    return best[1], best[0] * block_size, gain


def _average(old: float, tokens: int, seconds: float) -> float:
    """The moving average of a speed in tokens per second, with one more measurement."""
    if tokens < _MIN_MEASURED_TOKENS or seconds <= 0:
        return old
    rate = tokens / seconds
    return rate if old <= 0 else old + _SMOOTHING * (rate - old)


class KVPool:
    """One orchestrator process's side of the pool: where a prefix is, and the export leg."""

    def __init__(self, view: ClusterView, upstream: HttpClient) -> None:
        self.view = view
        self.upstream = upstream
        self.measured_prefill_tps = 0.0  # tokens per second; 0: not measured yet
        self.measured_transfer_tps = 0.0
        self.num_fetches = 0  # export legs that parked a prefix for a ctx leg
        self.num_failed = 0

    def observe_ctx_leg(self, worker: WorkerRecord, num_prompt_tokens: int, params: DisaggParams,
                        seconds: float) -> None:
        """Measure the cost model's two speeds on a ctx answer's params: a leg that pulled a prefix
        measures the transfer path (its engine's pull), any other the prefill (the tokens it computed,
        in the leg's time, queueing included)."""
        if params.kv_pulled_blocks is not None and params.kv_pull_seconds is not None:
            tokens = params.kv_pulled_blocks * self.view.hashing(worker)[0]
            self.measured_transfer_tps = _average(self.measured_transfer_tps, tokens, params.kv_pull_seconds)
        else:
            tokens = num_prompt_tokens - (params.num_cached_tokens or 0)
            self.measured_prefill_tps = _average(self.measured_prefill_tps, tokens, seconds)

    def source(self, config: KVPoolConfig, request: ParsedRequest, ctx: WorkerRecord) -> PrefixSource | None:
        """The worker to fetch the prompt's prefix from, or None (nobody holds more, or not worth it)."""
        if not config.enabled:
            return None
        key = self.view.hashing(ctx)
        hashes = request.block_hashes.get(key)
        if hashes is None:
            hashes = request.block_hashes[key] = list(compute_block_hashes(request.prompt_ids, *key))
        holders = {w.worker_id: w for w in self._holders(ctx, key)}
        prefill = config.prefill_tokens_per_second or self.measured_prefill_tps
        transfer = config.transfer_tokens_per_second or self.measured_transfer_tps
        found = choose_prefix(config, self.view.kv, hashes, len(request.prompt_ids), key[0], ctx.worker_id,
                              sorted(holders), prefill, transfer)
        if found is None:
            return None
        holder_id, num_tokens, gain = found
        return PrefixSource(holders[holder_id], num_tokens, gain)

    def _holders(self, ctx: WorkerRecord, key: tuple[int, int]) -> list[WorkerRecord]:
        """Healthy workers of either role that serve legs and hash blocks as the ctx worker does."""
        seen = {w.worker_id: w for phase in Phase for w in self.view.healthy(phase)}
        return [w for worker_id, w in sorted(seen.items())
                if worker_id != ctx.worker_id and w.kv_endpoint is not None and self.view.hashing(w) == key]

    async def export(self, source: PrefixSource, request: ParsedRequest, request_id: str) -> DisaggParams | None:
        """Park the prefix on its holder; the ``kv_prefix`` params for the ctx leg, None on any failure."""
        model = request.body.get("model")
        body = PrefixExportLeg(model if isinstance(model, str) else None, request.prompt_ids[:source.num_tokens],
                               DisaggParams(RequestType.CONTEXT_ONLY, prefix_export=True))
        headers = {"x-request-id": f"{request_id}-kvpool", "content-type": "application/json"}
        holder = source.holder.worker_id
        try:
            status, content = await self.upstream.call("POST", source.holder.url + "/v1/completions",
                                                       msgspec.json.encode(body), headers)
        except UpstreamError as exc:
            self._failed(request_id, holder, f"{type(exc).__name__}: {exc}")
            return None
        if status != 200:
            self._failed(request_id, holder, f"answered {status}: {content[:200]!r}")
            return None
        try:
            answer = _ANSWER.decode(content)
        except msgspec.DecodeError as exc:  # ValidationError too
            self._failed(request_id, holder, f"an unreadable answer: {exc}")
            return None
        params, prompt = answer.disaggregated_params, answer.prompt_token_ids
        if params is None or not params.signature or prompt is None:
            self._failed(request_id, holder, "nothing was parked")
            return None
        self.num_fetches += 1
        log.debug("request %s: %d prompt tokens' KV parked on %s for the ctx leg (%d it lacks)", request_id,
                  source.num_tokens, holder, source.gain_tokens)
        return msgspec.structs.replace(params, request_type=RequestType.CONTEXT_ONLY, prompt_token_ids=prompt)

    def _failed(self, request_id: str, holder: str, why: str) -> None:
        self.num_failed += 1
        log.warning("request %s: no KV-pool export from %s (%s); the ctx worker computes the prefix", request_id,
                    holder, why)
