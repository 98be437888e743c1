"""EngineCore: the engine's synchronous heart, schedule -> execute -> update -> outputs.

No I/O here: the engine process shell moves messages in and out and calls
``step()`` while ``has_work()`` (``has_unfinished()`` stays true while
requests only wait for pulled KV, when a step has nothing to do). The same class runs the real model
(``kind="torch"``) and the synthetic timing model (``kind="synthetic"``).

Guided decoding: each constrained request gets an llguidance matcher at
admission (``workers.guided.GrammarCompiler``: one compile per distinct
grammar, then a copy per request), advanced past the tokens it already has (a
gen leg's first token comes from the ctx leg). A grammar that does not compile
rejects the request with llguidance's message. The synthetic engine ignores
grammars and penalties: its tokens are a timing model's, meaningless either way,
and refusing them would keep tool-calling clients off load tests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from workers.config import EngineConfig
from workers.engine.block_manager import BlockManager
from workers.engine.executor import Executor, ProfilingUnsupported, SchedulerOutput
from workers.engine.factory import build_executor
from workers.engine.kv_events import KVCacheSnapshot, KVEvent, KVEventQueue
from workers.engine.kv_tiers import KVTiers
from workers.engine.request import Request
from workers.engine.scheduler import KVPull, Scheduler
from workers.engine.speculative import Speculator
from workers.engine.stats import IterationStats, StatsQueue
from workers.guided import GrammarCompiler, GrammarError, load_tokenizer
from workers.protocol import EngineRequest, EngineTiming, RejectReason, RequestOutput

__all__ = ["EngineCore", "KVPull", "ProfilingUnsupported"]

log = logging.getLogger(__name__)


class CoreLoad(NamedTuple):
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_draft_tokens: int  # speculative decoding, cumulative
    num_accepted_tokens: int


class EngineCore:
    """One engine: an executor, its block pool and the scheduler in front of it.

    Single-threaded: every method is called from the engine loop. Outputs of
    requests aborted or rejected between steps come out of the next ``step()``.
    """

    def __init__(self, config: EngineConfig, executor: Executor | None = None, inline_onboarding: bool = False) -> None:
        """``inline_onboarding``: copy tier hits back into the pool at once instead of on a thread
        (the cluster simulation, whose clock charges the copy in the timing model)."""
        self.config = config.validate()
        if executor is None:
            executor = build_executor(self.config)  # torch is imported only for kind="torch"
        self.executor = executor
        self.kv_events = KVEventQueue()
        self.tiers = _build_tiers(self.config, executor, self.kv_events, inline_onboarding)
        self.block_manager = BlockManager(
            num_blocks=executor.num_blocks,
            block_size=executor.block_size,
            hash_seed=self.config.cache.hash_seed,
            enable_prefix_caching=self.config.cache.enable_prefix_caching,
            events=self.kv_events,
            tiers=self.tiers,
            # An optional capability (DeepSeek-V4's runner): per-sequence state outside the pool.
            on_free=getattr(executor, "blocks_freed", None),
        )
        self.scheduler = Scheduler(
            self.config.scheduler, self.block_manager, executor.max_model_len, executor.eos_token_ids,
            _speculator(self.config, executor),
        )
        self.stats = StatsQueue()
        # The last step scheduled nothing, reported nothing and started no pull: requests wait for
        # blocks only an input, a KV ack or a parked table's expiry can free. Until one of them
        # comes the next step would do the same, so the loop blocks in its poll instead of spinning.
        self.stalled = False
        self.grammars = _grammar_compiler(self.config, executor)

    @property
    def max_model_len(self) -> int:
        """The longest prompt + output: the model's limit, capped by the block pool."""
        return self.scheduler.max_model_len

    # ---- requests ----------------------------------------------------------

    def add_request(self, engine_request: EngineRequest, park_kv_seconds: float | None = None,
                    output_token_ids: Sequence[int] = ()) -> Request:
        """Queue a request; an invalid one is rejected by the next ``step()``.

        Returns the engine-side ``Request``, whose timestamps
        (``first_scheduled_time``, ``first_token_time``) feed perf records.
        Raises ValueError when the id is already in the engine.
        ``park_kv_seconds`` (disaggregated ctx side): park the request's blocks
        at finish for that long (see ``parked_block_ids`` / ``release_parked``).
        ``output_token_ids``: a migrated stream's tokens sampled elsewhere (``AddResumedRequest``):
        prefilled with the prompt, never reported, counted as this request's output.
        """
        request = self._make_request(engine_request)
        request.output_token_ids.extend(output_token_ids)
        if self._accepts_tokens(request) and self._attach_grammar(request):
            self.scheduler.add_request(request, park_kv_seconds)
        return request

    def add_remote_request(self, engine_request: EngineRequest, output_token_ids: Sequence[int] = (),
                           park_kv_seconds: float | None = None, num_remote_tokens: int | None = None) -> Request:
        """Queue a request whose KV comes from another engine (disaggregated gen side).

        ``output_token_ids``: tokens the remote engine already sampled (the first
        token); they are not reported again. The KV of every position but the
        last token's is pulled: see ``take_kv_pulls`` and ``finish_remote_kv``;
        with ``num_remote_tokens``, only that prefix (``Scheduler.add_remote_request``).
        """
        request = self._make_request(engine_request)
        request.output_token_ids.extend(output_token_ids)
        if self._accepts_tokens(request) and self._attach_grammar(request):
            self.scheduler.add_remote_request(request, park_kv_seconds, num_remote_tokens)
        return request

    def take_kv_pulls(self) -> list[KVPull]:
        """Remote requests whose blocks were allocated since the last call: blocks to fill."""
        return self.scheduler.take_kv_pulls()

    def has_kv_pulls(self) -> bool:
        """Whether ``take_kv_pulls`` has pulls to hand out."""
        return self.scheduler.has_kv_pulls()

    def finish_remote_kv(self, request_id: int) -> None:
        """The request's pulled blocks are filled (``import_blocks``): it decodes from the next step."""
        self.scheduler.finish_remote_kv(request_id)

    def recompute_remote(self, request_id: int) -> bool:
        """The request's KV pull failed: it is prefilled here instead (``Scheduler.recompute_remote``)."""
        return self.scheduler.recompute_remote(request_id)

    def parked_block_ids(self, request_id: int) -> list[int] | None:
        """Block table of a finished request parked with ``park_kv_seconds``; None when not parked."""
        return self.block_manager.parked_block_ids(request_id)

    def parked_deadline(self, request_id: int) -> float | None:
        """When the parked table expires: the scheduler set it at finish, the one owner of that fact."""
        return self.block_manager.parked_deadline(request_id)

    def next_parked_deadline(self) -> float | None:
        """When the earliest parked table expires (``time.time()`` seconds); None when none will."""
        return self.block_manager.next_deadline()

    def release_expired(self, now: float) -> list[int]:
        """Release parked tables past their deadline (also while no step runs); their request ids."""
        return self.block_manager.release_expired(now)

    def release_parked(self, request_id: int) -> bool:
        """Free a parked request's blocks (transfer acknowledged); False when none were parked."""
        return self.block_manager.release(request_id)

    def abort(self, request_id: int) -> None:
        """Finish a request in any state, freeing its blocks now; unknown ids are ignored."""
        self.scheduler.abort(request_id)

    @staticmethod
    def timing(request: Request, arrival: float) -> EngineTiming:
        """The finishing output's engine-side times of ``request`` (``add_request``'s return),
        stamped now; ``arrival`` is when the shell took it off ingress."""
        return EngineTiming(arrival, request.first_scheduled_time, request.first_token_time, time.time())

    def load(self) -> CoreLoad:
        """The queue and KV-pool figures a health reply carries."""
        scheduler = self.scheduler
        return CoreLoad(scheduler.num_running, scheduler.num_waiting,
                        self.block_manager.num_used_blocks, self.block_manager.num_blocks,
                        scheduler.num_draft_tokens, scheduler.num_accepted_tokens)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def has_work(self) -> bool:
        """Whether ``step()`` can make progress now; false while the only unfinished
        requests wait for pulled KV (a loop should then block on its inputs)."""
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """Run one batch; one output per request that produced a token or finished."""
        started = time.perf_counter()
        batch = self.scheduler.schedule()
        outputs = self.scheduler.take_finished_outputs()
        if batch.requests:
            result = self.executor.execute(batch)
            outputs += self.scheduler.update(batch, result)
            self._record_stats(batch, time.perf_counter() - started)
            if self.scheduler.is_idle:
                self.block_manager.check_idle()  # O(parked): catches a leak the moment it happens
            self.stalled = False
        else:
            self.stalled = not outputs and not self.scheduler.has_kv_pulls()
        return outputs

    # ---- drains, KV transfer, profiling ------------------------------------

    def drain_stats(self) -> list[IterationStats]:
        return self.stats.drain()

    def drain_kv_events(self) -> list[KVEvent]:
        return self.kv_events.drain()

    def kv_snapshot(self) -> KVCacheSnapshot:
        blocks = self.block_manager
        lower = self.tiers.block_hashes() if self.tiers is not None else []
        return KVCacheSnapshot(self.kv_events.next_event_id, blocks.cached_block_hashes(), blocks.num_blocks, lower)

    @property
    def onboarding(self) -> bool:
        """Whether a tier-to-pool copy is in flight (the loop then wakes soon to collect it)."""
        return self.scheduler.num_onboarding > 0

    def close(self) -> None:
        """Stop the tiers' threads and remove the disk tier's files."""
        if self.tiers is not None:
            self.tiers.close()

    def export_blocks(self, block_ids: list[int]) -> Sequence[bytes | memoryview]:
        return self.executor.export_blocks(block_ids)

    @property
    def kv_bytes_per_block(self) -> int:
        return self.executor.kv_bytes_per_block

    def export_heads(self, block_ids: list[int], heads: range) -> Sequence[Any]:
        """Some KV heads of blocks, for a gen engine of another tensor-parallel layout."""
        # An optional capability of the torch executors (``model_runner``, ``leader_executor``),
        # not of the ``Executor`` protocol: the synthetic engine has one layout.
        export_heads = getattr(self.executor, "export_heads", None)
        if export_heads is None:
            raise ValueError(f"{type(self.executor).__name__} cannot export KV heads")
        result: Sequence[Any] = export_heads(block_ids, heads)
        return result

    def import_blocks(self, block_ids: list[int], buffers: list[bytes]) -> None:
        self.executor.import_blocks(block_ids, buffers)

    def start_profile(self, trace_dir: str | None = None) -> None:
        """Start the executor's profiler; ``ProfilingUnsupported`` from the synthetic engine."""
        trace_dir = trace_dir or self.config.profile_dir
        if trace_dir is None:
            raise ValueError("no trace directory: pass one or set engine.profile_dir")
        self.executor.start_profile(trace_dir)

    def stop_profile(self) -> str:
        """Stop the profiler; the path of the trace it wrote."""
        return self.executor.stop_profile()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block (an ``AllBlocksCleared`` event); False while one is in use."""
        return self.block_manager.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Raise ``BlockIntegrityError`` when the block pool's books do not balance."""
        self.block_manager.check_integrity()

    # ---- internals ---------------------------------------------------------

    @staticmethod
    def _make_request(engine_request: EngineRequest) -> Request:
        return Request(
            engine_request.request_id,
            engine_request.prompt_token_ids,
            engine_request.sampling_params,
            engine_request.arrival_time,
        )

    def _accepts_tokens(self, request: Request) -> bool:
        """False (and the request rejected) when a token id would index outside the model's vocabulary."""
        vocab_size = self.executor.vocab_size
        prompt, output = request.prompt_token_ids, request.output_token_ids
        # min/max run in C: a scan in Python per prompt token was a tenth of the cost of admission
        # (and without ``default=``, whose keyword parsing cost as much as the scan of a short prompt).
        if (not prompt or (min(prompt) >= 0 and max(prompt) < vocab_size)) and (
                not output or (min(output) >= 0 and max(output) < vocab_size)):
            return True
        bad = next(t for t in request.all_token_ids if not 0 <= t < vocab_size)
        self._reject(request, RejectReason.TOKEN_OUT_OF_VOCABULARY,
                     f"token id {bad} is outside the vocabulary [0, {vocab_size})")
        return False

    def _attach_grammar(self, request: Request) -> bool:
        """Give a constrained request its matcher, past its output tokens; False (and the
        request rejected) when the grammar does not compile or refuses those tokens."""
        guided = request.sampling_params.guided
        if guided is None or self.config.kind == "synthetic":
            return True
        if self.grammars is None:
            self._reject(request, RejectReason.GUIDED_DECODING_OFF,
                         "guided decoding is off in this engine: no tokenizer.json matching the model "
                                  "(see the engine log)")
            return False
        try:
            request.grammar = self.grammars.matcher(guided)
        except GrammarError as exc:
            self._reject(request, RejectReason.GRAMMAR_DOES_NOT_COMPILE,
                         f"the {guided.kind} grammar does not compile: {exc}")
            return False
        for token_id in request.output_token_ids:
            if not request.grammar.consume_token(token_id):
                request.grammar = None
                self._reject(request, RejectReason.GRAMMAR_REJECTS_OUTPUT,
                             f"the {guided.kind} grammar rejects the output token {token_id}")
                return False
        return True

    def _reject(self, request: Request, reason: RejectReason, error: str) -> None:
        if request.request_id in self.scheduler.requests:
            raise ValueError(f"request id {request.request_id} is already in the engine")
        self.scheduler.reject(request, reason, error)

    def _record_stats(self, batch: SchedulerOutput, seconds: float) -> None:
        scheduler, blocks = self.scheduler, self.block_manager
        queries, hits = scheduler.num_prefix_queries, scheduler.num_prefix_hits
        self.stats.record(
            IterationStats(
                timestamp=time.time(),
                step_seconds=seconds,
                num_running=scheduler.num_running,
                num_waiting=scheduler.num_waiting,
                num_prefill_tokens=batch.num_prefill_tokens,
                num_decode_tokens=batch.num_decode_tokens,
                num_preemptions=scheduler.num_preemptions_last_step,
                num_finished=scheduler.num_finished_last_step,
                kv_blocks_used=blocks.num_used_blocks,
                kv_blocks_free=blocks.num_free_blocks,
                kv_blocks_cached=blocks.num_cached_blocks,
                kv_blocks_total=blocks.num_blocks,
                prefix_cache_queries=queries,
                prefix_cache_hits=hits,
                prefix_cache_hit_rate=hits / queries if queries else 0.0,
                num_waiting_for_remote_kv=scheduler.num_waiting_for_remote_kv,
                kv_blocks_parked=blocks.num_parked_blocks,
                tiers=self.tiers.stats() if self.tiers is not None else None,
                num_draft_tokens=batch.num_draft_tokens,
                num_accepted_tokens=scheduler.num_accepted_last_step,
            )
        )


def _speculator(config: EngineConfig, executor: Executor) -> Speculator | None:
    """The scheduler's draft source when ``engine.num_speculative_tokens`` asks for one and the executor
    verifies drafts (the one-rank torch runner: a tensor-parallel group's followers and the synthetic
    timing model do not)."""
    if not config.speculative.enabled:
        return None
    if not getattr(executor, "verifies_drafts", False):
        log.warning("speculative decoding is off: %s does not verify drafts (one-rank torch engines only)",
                    type(executor).__name__)
        return None
    return Speculator(config.speculative)


def _build_tiers(config: EngineConfig, executor: Executor, events: KVEventQueue, inline: bool) -> KVTiers | None:
    """The host (and disk) tiers of ``engine.cache``; None when ``host_tier_bytes`` is 0. Their host
    memory is the executor's (pinned beside a GPU pool) when it offers any."""
    cache = config.cache
    if not cache.has_tiers:
        return None
    return KVTiers(block_bytes=executor.kv_bytes_per_block, block_size=executor.block_size,
                   host_bytes=cache.host_tier_bytes, disk_path=cache.disk_tier_path, disk_bytes=cache.disk_tier_bytes,
                   export_blocks=executor.export_blocks, import_blocks=executor.import_blocks, events=events,
                   allocate_host=getattr(executor, "allocate_host_buffer", None), inline=inline)


def _grammar_compiler(config: EngineConfig, executor: Executor) -> GrammarCompiler | None:
    """The torch engine's grammar compiler over the model's tokenizer (None: no tokenizer,
    or the synthetic engine). Built at start: an LLTokenizer takes up to a second for
    a large vocabulary, which must not stall the loop at a first constrained request."""
    if config.kind != "torch" or not config.model:
        return None
    tokenizer = load_tokenizer(config.model)
    if tokenizer is None:
        return None
    if tokenizer.get_vocab_size(with_added_tokens=True) > executor.vocab_size:
        log.warning("guided decoding is off: the tokenizer has %d tokens, the model's logits only %d",
                    tokenizer.get_vocab_size(with_added_tokens=True), executor.vocab_size)
        return None
    return GrammarCompiler.for_tokenizer(tokenizer, executor.vocab_size, executor.eos_token_ids)
