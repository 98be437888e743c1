"""A deployment in simulated time: the orchestrator's routing over simulated engines, one trace request
at a time through the two-phase flow.

What is real here is what decides the cache: the routers (``orchestrator.routing``: the policies and
conditional disaggregation, gen worker first as ``Flow.plan`` does), the KV index
(``orchestrator.kv_index``, fed with each engine's KV events every ``health.interval_seconds``, as
process 0 drains them), the load counts the policies read, and every engine's scheduler, block
manager and prefix cache (``disagg.sim.engine``). What is modelled: time. A step takes the synthetic
timing model's seconds; a leg's HTTP hop takes ``hop_seconds``; a KV pull takes ``pull_latency_seconds``
plus its bytes (``kv_bytes_per_token`` per token, the pulled blocks only) over
``transfer_bytes_per_second``. No HTTP, no processes, no sleeping: an hour of a trace on tens of
workers runs in minutes on one core.

A request's record is ``disagg.bench``'s: TTFT is when the gen engine is handed the ctx leg's first
token (the first event a client sees, ``DisaggLeg.early_tokens``), or the first token of a request
served whole on a gen worker; cached tokens are the ctx leg's prefix-cache hits, as the usage
reports them.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from common.block_hash import compute_block_hashes
from disagg.bench.metrics import RequestRecord
from disagg.deploy_config import DeployConfig
from disagg.sim.engine import SimEngine
from orchestrator.kv_index import KVIndex
from orchestrator.kv_pool import choose_prefix
from orchestrator.routing import Candidate, Router, RouteRequest, should_skip_ctx
from workers.config import EngineConfig
from workers.engine.scheduler import KVPull
from workers.http_protocol import decode_kv_events
from workers.protocol import EngineRequest, RequestOutput
from workers.sampling_params import SamplingParams

__all__ = ["SimTiming", "SimCluster"]


@dataclass(frozen=True)
class SimTiming:
    """The simulated costs outside an engine step."""

    hop_seconds: float = 0.002
    """One leg's trip through the orchestrator and a worker's frontend to its engine."""
    pull_latency_seconds: float = 0.002
    """Fixed cost of one KV pull (request, first bytes, import, ack)."""
    transfer_bytes_per_second: float = 1e9
    kv_bytes_per_token: int = 4096
    park_seconds: float = 60.0


@dataclass
class _Flight:
    """One request in the cluster."""

    index: int
    prompt: list[int]
    max_tokens: int
    record: RequestRecord
    gen: SimEngine
    ctx: SimEngine | None = None
    ctx_request_id: int | None = None
    hashes: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    """The prompt's block hashes by (block size, seed), computed once for all routing decisions."""
    holder: SimEngine | None = None
    """The KV pool's holder of the prompt's prefix, parked there by the export leg ``export_id``."""
    export_id: int | None = None
    prefix_tokens: int = 0


class SimCluster:
    """ctx and gen engines as a ``DeployConfig`` describes them (a ``both`` pool serves as gen); the
    records of finished requests accumulate in ``records``."""

    def __init__(self, config: DeployConfig, engine_configs: dict[str, EngineConfig],
                 timing: SimTiming = SimTiming()) -> None:
        self.config, self.timing = config, timing
        orchestrator = config.orchestrator
        self.ctx_router, self.gen_router = Router(orchestrator.ctx_router), Router(orchestrator.gen_router)
        self.events_interval = orchestrator.health.interval_seconds
        self.kv = KVIndex()
        self.engines: dict[str, list[SimEngine]] = {"ctx": [], "gen": []}
        self.load: dict[str, list[int]] = {}
        for pool_name, pool in vars(config.pools).items():
            if pool is None:
                continue
            phase = "ctx" if (pool.role or pool_name) == "ctx" else "gen"
            for index in range(pool.instances):
                worker_id = f"{pool_name}-{index}"
                engine = SimEngine(worker_id, engine_configs[pool_name], self.at, self._outputs, self._pulls)
                self.engines[phase].append(engine)
                self.load[worker_id] = [0, 0]
                self.kv.set_capacity(worker_id, engine.executor.num_blocks)
        self._queue: list[tuple[float, int, Callable[[float], None]]] = []
        self._order = itertools.count()
        self._flights: dict[tuple[str, int], _Flight] = {}  # (worker id, engine request id) -> flight
        self._ids = itertools.count(1)
        self.records: list[RequestRecord] = []
        self.now = 0.0

    # ---- the event queue -------------------------------------------------------------------

    def at(self, when: float, callback: Callable[[float], None]) -> None:
        heapq.heappush(self._queue, (when, next(self._order), callback))

    def run(self) -> float:
        """Run until every event is done (the periodic KV-event drain stops with the work); the end time."""
        self.at(self.events_interval, self._drain_events)
        while self._queue:
            self.now, _, callback = heapq.heappop(self._queue)
            callback(self.now)
        for engine in self.engines["ctx"] + self.engines["gen"]:
            engine.core.close()  # the tiers' disk files
        return self.now

    def _drain_events(self, now: float) -> None:
        for engine in self.engines["ctx"] + self.engines["gen"]:
            events = engine.core.drain_kv_events()
            if events:
                # Through the page's own decoder: the index reads what a worker's /kv_cache_events says.
                self.kv.apply(engine.worker_id, decode_kv_events(msgspec.json.encode(events)))
        if self._queue or self._flights:
            self.at(now + self.events_interval, self._drain_events)

    # ---- routing ---------------------------------------------------------------------------

    def _choose(self, phase: str, flight: _Flight) -> tuple[SimEngine, Candidate]:
        """The engine the phase's router picks, and the candidate row it picked (``Flow.choose``)."""
        engines = sorted(self.engines[phase], key=lambda e: e.worker_id)
        rows = []
        for engine in engines:
            cache = engine.core.config.cache
            key = (cache.block_size, cache.hash_seed)
            if key not in flight.hashes:
                flight.hashes[key] = list(compute_block_hashes(flight.prompt, *key))
            requests, tokens = self.load[engine.worker_id]
            matched, lower = self.kv.match(engine.worker_id, flight.hashes[key])
            rows.append(Candidate(engine.worker_id, requests, tokens, matched, key[0], lower))
        router = self.ctx_router if phase == "ctx" else self.gen_router
        chosen = router.choose(rows, RouteRequest(len(flight.prompt)))
        return next(e for e in engines if e.worker_id == chosen.worker_id), chosen

    def _acquire(self, engine: SimEngine, tokens: int, sign: int = 1) -> None:
        load = self.load[engine.worker_id]
        load[0] += sign
        load[1] += sign * tokens

    # ---- the flow --------------------------------------------------------------------------

    def submit(self, when: float, index: int, prompt: list[int], max_tokens: int) -> None:
        """A request arriving at ``when`` (seconds of simulated time)."""
        self.at(when, lambda now: self._arrive(now, index, prompt, max_tokens))

    def _arrive(self, now: float, index: int, prompt: list[int], max_tokens: int) -> None:
        record = RequestRecord(index, 0, now)
        flight = _Flight(index, prompt, max_tokens, record, gen=self.engines["gen"][0])
        flight.gen, chosen = self._choose("gen", flight)
        conditional = self.config.orchestrator.conditional
        if max_tokens == 1 or not self.engines["ctx"] or should_skip_ctx(
                conditional, len(prompt), chosen.matched_blocks, chosen.block_size):
            self._start(now, flight, flight.gen, max_tokens)
        else:
            flight.ctx, _ = self._choose("ctx", flight)
            if not self._export(now, flight, flight.ctx):
                self._start(now, flight, flight.ctx, 1)

    def _export(self, now: float, flight: _Flight, ctx: SimEngine) -> bool:
        """The KV pool (``orchestrator.kv_pool``): park the prompt's prefix on the worker holding it, for
        the ctx leg to pull; False when the pool decides against it. Its speeds are the model's own:
        prefill from the timing model, transfer from ``SimTiming``."""
        config = self.config.orchestrator.kv_pool
        if not config.enabled:
            return False
        cache = ctx.core.config.cache
        key = (cache.block_size, cache.hash_seed)
        holders = {e.worker_id: e for phase in ("ctx", "gen") for e in self.engines[phase]
                   if e is not ctx and (e.core.config.cache.block_size, e.core.config.cache.hash_seed) == key}
        per_token = ctx.core.config.synthetic.prefill_seconds_per_token
        prefill = config.prefill_tokens_per_second or (1.0 / per_token if per_token > 0 else 0.0)
        transfer = config.transfer_tokens_per_second or (
            self.timing.transfer_bytes_per_second / self.timing.kv_bytes_per_token)
        found = choose_prefix(config, self.kv, flight.hashes[key], len(flight.prompt), key[0], ctx.worker_id,
                              sorted(holders), prefill, transfer)
        if found is None:
            return False
        holder_id, num_tokens, _ = found
        flight.holder, flight.prefix_tokens = holders[holder_id], num_tokens
        flight.export_id = self._leg(now, flight, flight.holder, flight.prompt[:num_tokens], 1,
                                     lambda engine, request: engine.core.add_request(
                                         request, park_kv_seconds=self.timing.park_seconds))
        return True

    def _start(self, now: float, flight: _Flight, engine: SimEngine, max_tokens: int,
               first_token: int | None = None) -> None:
        """A leg reaches ``engine`` one hop from now; ``first_token``: a gen leg after its ctx leg."""

        def add(engine: SimEngine, request: EngineRequest) -> None:
            if first_token is not None:
                engine.core.add_remote_request(request, [first_token])
                # The ctx leg's token is written to the client as the gen leg is handed to its engine.
                flight.record.ttft, flight.record.output_tokens = self.now - flight.record.start, 1
            elif engine is flight.ctx and flight.export_id is not None:  # its prefix is parked on the holder
                engine.core.add_remote_request(request, (), self.timing.park_seconds, flight.prefix_tokens)
            elif engine is flight.ctx:
                engine.core.add_request(request, park_kv_seconds=self.timing.park_seconds)
            else:
                engine.core.add_request(request)

        self._leg(now, flight, engine, flight.prompt, max_tokens, add)

    def _leg(self, now: float, flight: _Flight, engine: SimEngine, prompt: list[int], max_tokens: int,
             add: Callable[[SimEngine, EngineRequest], object]) -> int:
        """A request of ``prompt`` reaches ``engine`` one hop from now (``add`` hands it over); its id."""
        request_id = next(self._ids)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        request = EngineRequest(request_id, prompt, params)
        self._flights[(engine.worker_id, request_id)] = flight
        self._acquire(engine, len(prompt))

        def arrive(at: float) -> None:
            add(engine, request)
            engine.kick(at)

        self.at(now + self.timing.hop_seconds, arrive)
        return request_id

    def _outputs(self, now: float, engine: SimEngine, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            key = (engine.worker_id, output.request_id)
            flight = self._flights.get(key)
            if flight is None:
                continue
            record = flight.record
            if output.error:
                record.error_kind, record.error = "engine", output.error
            if engine is flight.holder and output.request_id == flight.export_id:
                if output.finish_reason is not None:  # parked: the ctx leg goes, and pulls the prefix
                    del self._flights[key]
                    self._acquire(engine, flight.prefix_tokens, -1)
                    assert flight.ctx is not None
                    if output.error:
                        flight.export_id = None  # the ctx leg computes it all
                    self._start(now, flight, flight.ctx, 1)
                continue
            if engine is flight.ctx:
                if output.finish_reason is None:
                    continue
                del self._flights[key]
                self._acquire(engine, len(flight.prompt), -1)
                record.prompt_tokens, record.cached_tokens = output.num_prompt_tokens, output.num_cached_tokens
                if output.error or not output.new_token_ids:
                    self._finish(now, flight)
                    continue
                flight.ctx_request_id = output.request_id
                self._start(now, flight, flight.gen, flight.max_tokens, first_token=output.new_token_ids[-1])
                continue
            self._tokens(now, flight, output)
            if output.finish_reason is not None:
                del self._flights[key]
                self._acquire(engine, len(flight.prompt), -1)
                self._finish(now, flight)

    def _tokens(self, now: float, flight: _Flight, output: RequestOutput) -> None:
        record = flight.record
        if not output.new_token_ids:
            return
        if record.ttft is None:  # a request served whole on its gen worker
            record.prompt_tokens, record.cached_tokens = output.num_prompt_tokens, output.num_cached_tokens
            record.ttft = now - record.start
        record.output_tokens += len(output.new_token_ids)

    def _finish(self, now: float, flight: _Flight) -> None:
        flight.record.e2e = now - flight.record.start
        self.records.append(flight.record)

    # ---- KV transfer -----------------------------------------------------------------------

    def _pulls(self, now: float, engine: SimEngine, pulls: list[KVPull]) -> None:
        for pull in pulls:
            flight = self._flights[(engine.worker_id, pull.request_id)]
            if engine is flight.ctx:  # a ctx leg pulls its prefix from the KV pool's holder
                ctx, ctx_id = flight.holder, flight.export_id
            else:
                ctx, ctx_id = flight.ctx, flight.ctx_request_id
            assert ctx is not None and ctx_id is not None, "a pull follows a leg that parked its KV"
            num_tokens = len(pull.block_ids) * ctx.core.config.cache.block_size
            seconds = 0.0 if not pull.block_ids else (
                self.timing.pull_latency_seconds
                + num_tokens * self.timing.kv_bytes_per_token / self.timing.transfer_bytes_per_second)

            def filled(at: float, pull: KVPull = pull, ctx: SimEngine = ctx, ctx_id: int = ctx_id) -> None:
                if pull.block_ids:
                    parked = ctx.core.parked_block_ids(ctx_id) or []
                    source = parked[pull.first_block:pull.first_block + len(pull.block_ids)]
                    engine.core.import_blocks(pull.block_ids, [bytes(b) for b in ctx.core.export_blocks(source)])
                engine.core.finish_remote_kv(pull.request_id)
                ctx.core.release_parked(ctx_id)
                engine.kick(at)
                ctx.kick(at)

            self.at(now + seconds, filled)
