"""A pinned run of the synthetic engine: every output, stat and KV slot, digested.

The engine's hot loops (``Scheduler.schedule``/``update``, ``SyntheticExecutor.execute``) are
hand-inlined for speed; this run pins what they produce, byte for byte, so that a rewrite
of any of them that changes a token, a finish, a report boundary, a stat or a KV slot fails
here. The mix covers the paths the inlined fast paths skip: prefix hits, chunked prefill,
preemption under block pressure, aborts, seeds, logprobs, stream intervals, stop tokens
and EOS, and a parked ctx request's exported KV.

The run was recorded before the fast paths were inlined (commit ae42629). The synthetic
stream is CPython's tuple hash of ints, stable across processes and versions since 3.8.
The digest is over the record with the trailing unset (None) fields of its array-like
structs dropped: a new optional field (``RequestOutput.reject_reason``, ``prompt_logprobs``,
``TokenLogprobs.rank``) changes the encoding, not what the engine did; the digest below is
that of the run recorded at ae42629, so read that way.
"""

from __future__ import annotations

import hashlib
import random

import msgspec

from workers.config import CacheConfig, EngineConfig, SchedulerConfig, SyntheticConfig
from workers.engine.core import EngineCore
from workers.protocol import EngineRequest
from workers.sampling_params import SamplingParams

GOLDEN_DIGEST = "cfc7522010a87138"


def _pinned_run() -> bytes:
    rng = random.Random(20261202)
    config = EngineConfig(kind="synthetic", cache=CacheConfig(block_size=4, num_blocks=18),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=24, stream_interval=2),
                          synthetic=SyntheticConfig(vocab_size=97))
    core = EngineCore(config)
    core.scheduler.eos_token_ids = frozenset({3, 4, 6})
    shared = [rng.randrange(0, 97) for _ in range(10)]
    record: list = []
    next_id = 0
    for step in range(300):
        if next_id < 60 and rng.random() < 0.35:
            prompt = shared[: rng.randrange(0, 11)] + [rng.randrange(0, 97) for _ in range(rng.randrange(1, 14))]
            kind = next_id % 6
            params = SamplingParams(
                max_tokens=rng.randrange(1, 20),
                temperature=0.0 if kind in (0, 3) else 1.0,
                seed=None if kind in (0, 3) else next_id,
                logprobs=2 if kind == 1 else None,
                stream_interval=None if kind != 2 else 3,
                stop_token_ids=[5, 7, 11, 13, 17, 19] if kind == 4 else [],
                ignore_eos=kind != 5,
            )
            request = EngineRequest(next_id, prompt, params, 0.0)
            if kind == 3 and next_id % 4 == 3:
                core.add_request(request, park_kv_seconds=1e9)
            else:
                core.add_request(request)
            next_id += 1
        if next_id and rng.random() < 0.08:
            core.abort(rng.randrange(next_id))
        for output in core.step():
            output.timing = None
            record.append(output)
        stats = core.drain_stats()
        record.append([(s.num_running, s.num_waiting, s.num_prefill_tokens, s.num_decode_tokens, s.num_preemptions,
                        s.num_finished, s.kv_blocks_used, s.kv_blocks_free, s.kv_blocks_cached,
                        s.prefix_cache_queries, s.prefix_cache_hits, s.kv_blocks_parked) for s in stats])
        if step % 50 == 49:
            for request_id in range(next_id):
                parked = core.parked_block_ids(request_id)
                if parked:
                    record.append([bytes(frame) for frame in core.export_blocks(parked)])
                    core.release_parked(request_id)
    record.append([(e.event_id, e.event) for e in core.drain_kv_events()])  # (not their clock readings)
    return msgspec.msgpack.encode(record)


def _without_trailing_unset(value):
    """Lists (array-like structs among them) with their trailing None entries dropped, all the way down."""
    if isinstance(value, list):
        value = [_without_trailing_unset(item) for item in value]
        while value and value[-1] is None:
            value.pop()
    return value


def test_the_pinned_run_is_unchanged_and_covers_the_slow_paths():
    record = _without_trailing_unset(msgspec.msgpack.decode(_pinned_run()))
    encoded = msgspec.msgpack.encode(record)
    finishes = {o[2] for o in record if isinstance(o, list) and len(o) > 2 and isinstance(o[2], str)}
    stats = [s for o in record if isinstance(o, list) and o and isinstance(o[0], list) and len(o[0]) == 12 for s in o]
    assert {"length", "stop", "abort"} <= finishes
    assert sum(s[4] for s in stats) > 0 and max(s[10] for s in stats) > 0 and max(s[11] for s in stats) > 0
    assert hashlib.blake2b(encoded, digest_size=8).hexdigest() == GOLDEN_DIGEST
