"""The synthetic executor: the engine's interface on a timing model, no model, no torch.

Its "KV cache" is real in one sense: every slot holds a 64-bit running hash
of the sequence up to that position, written when the position is computed
and read back to continue the sequence. A sampled token is a function of the
hash at the last position (and the request's seed), so

  - the same prompt gives the same output, whatever else shares the batch;
  - a prefix-cache hit, a preemption and recompute, or an exported and
    imported block gives the same output only if the block manager and the
    transfer path handed over the right blocks: the synthetic engine tests
    the engine's KV bookkeeping, not just its timing.

Tokens are never an EOS unless ``eos_token_ids`` is given; then they stop a
request whenever the stream happens to produce one.
"""

from __future__ import annotations

import struct
import time

from workers.config import EngineConfig, SyntheticConfig
from workers.engine.executor import (
    ExecutorOutput,
    ProfilingUnsupported,
    SampledToken,
    ScheduledRequest,
    SchedulerOutput,
)
from workers.protocol import TokenLogprobs

__all__ = ["SyntheticExecutor", "NOMINAL_KV_BYTES_PER_TOKEN", "step_seconds"]

NOMINAL_KV_BYTES_PER_TOKEN = 4096
"""Bytes one token's KV is taken to need when ``num_blocks`` is derived from ``memory_bytes``."""

_GREEDY_SALT = 0x5851F42D4C957F2D
# One of splitmix64's constants: the one (of the three) whose stream starts the chat prompt of
# benchmarks/hot_paths.py with a token that has text on the tiny model (its max_tokens=1 run counts a
# request without a text chunk as an error); any other value is as good a stream.
_SEED_SALT = 0x94D049BB133111EB
_MAX_SALTS = 4096


def _chain(value: int, salt: int) -> int:
    """A well-spread signed 64-bit function of two ints: CPython's tuple hash (xxHash's
    round, in C; a splitmix64 in Python cost four times as much, and at zero step cost
    this is most of the engine's work per token). Hashes of ints are not salted by
    PYTHONHASHSEED, so every engine process of one Python version agrees, as the KV
    export between a ctx and a gen engine needs. The loops inline it."""
    return hash((value, salt))


def step_seconds(timing: SyntheticConfig, batch: SchedulerOutput) -> float:
    """What the timing model says a step costs (decodes are one token each): the synthetic engine
    sleeps it, the cluster simulator (``disagg.sim``) advances its clock by it."""
    seconds = timing.prefill_seconds_per_token * batch.num_prefill_tokens
    seconds += timing.onboard_seconds_per_block * batch.num_onboarded_blocks
    if batch.num_decode_tokens:
        seconds += timing.decode_step_base_seconds + timing.decode_seconds_per_seq * batch.num_decode_tokens
    return seconds


class SyntheticExecutor:
    """Sleeps like a model, samples from a deterministic stream, keeps a tiny KV per slot."""

    def __init__(self, config: EngineConfig, eos_token_ids: frozenset[int] = frozenset()) -> None:
        synthetic, cache = config.synthetic, config.cache
        self.timing = synthetic
        self.eos_token_ids = eos_token_ids
        self.vocab_size = synthetic.vocab_size
        self.block_size = cache.block_size
        self.num_blocks = cache.num_blocks or max(
            1, cache.memory_bytes // (NOMINAL_KV_BYTES_PER_TOKEN * cache.block_size)
        )
        self.max_model_len = config.max_model_len or synthetic.max_model_len
        self.kv_bytes_per_block = 8 * self.block_size  # export_blocks: one int64 per slot
        self._initial_hash = _chain(synthetic.seed, _SEED_SALT)
        self._kv: dict[int, list[int]] = {}  # block id -> running hash per slot, written lazily
        self._salts: dict[int, int] = {}  # seed -> its salt: the same per request and step

    # ---- Executor ----------------------------------------------------------

    def execute(self, batch: SchedulerOutput) -> ExecutorOutput:
        started = time.perf_counter()
        token_ids_out: list[int | None] = []
        logprobs: list[TokenLogprobs | None] | None = None
        prompt_logprobs: list[list[TokenLogprobs] | None] | None = None
        vocab_size, bs, kv, salts = self.vocab_size, self.block_size, self._kv, self._salts
        for scheduled in batch.requests:
            token_ids = scheduled.token_ids
            position = scheduled.start_position
            slot = position % bs
            if slot and len(token_ids) == 1:  # a decode whose previous slot is in the same block: _fill, inlined
                block_id = scheduled.block_ids[position // bs]
                block = kv.get(block_id) or self._block(block_id)
                last_hash = block[slot] = hash((block[slot - 1], token_ids[0]))  # _chain
            else:
                last_hash = self._fill(scheduled)
            if scheduled.prompt_logprob_rows:
                if prompt_logprobs is None:
                    prompt_logprobs = [None] * len(batch.requests)
                prompt_logprobs[len(token_ids_out)] = self._prompt_logprobs(scheduled)
            if not scheduled.sample:
                token_ids_out.append(None)
                continue
            params = scheduled.sampling_params
            if params.logprobs is None:  # the common case, inlined: one draw per request per step
                if params.temperature == 0.0:
                    salt = _GREEDY_SALT
                else:
                    salt = salts.get(params.seed or 0) or self._salt(params.seed or 0)
                token_ids_out.append(hash((last_hash, salt)) % vocab_size)  # _chain
            else:
                sampled = self._sample(scheduled, last_hash)
                if logprobs is None:
                    logprobs = [None] * len(batch.requests)
                logprobs[len(token_ids_out)] = sampled.logprobs
                token_ids_out.append(sampled.token_id)
        remaining = self.step_seconds(batch) - (time.perf_counter() - started)
        if remaining > 0:
            time.sleep(remaining)
        return ExecutorOutput(token_ids_out, logprobs, prompt_logprobs)

    def step_seconds(self, batch: SchedulerOutput) -> float:
        return step_seconds(self.timing, batch)

    def export_blocks(self, block_ids: list[int]) -> list[bytes]:
        """One frame: the blocks' slots, ``block_size`` little-endian int64 running hashes each."""
        slots = [value for block_id in block_ids for value in self._block(block_id)]
        return [struct.pack(f"<{len(slots)}q", *slots)]

    def import_blocks(self, block_ids: list[int], buffers: list[bytes]) -> None:
        size = 8 * self.block_size * len(block_ids)
        if len(buffers) != 1 or memoryview(buffers[0]).nbytes != size:
            got = [memoryview(b).nbytes for b in buffers]
            raise ValueError(f"expected one frame of {size} bytes for {len(block_ids)} blocks, got frames of {got}")
        slots = struct.unpack(f"<{self.block_size * len(block_ids)}q", buffers[0])
        for number, block_id in enumerate(block_ids):
            self._kv[block_id] = list(slots[number * self.block_size:(number + 1) * self.block_size])

    def start_profile(self, trace_dir: str) -> None:
        raise ProfilingUnsupported("the synthetic engine runs no model: there is nothing to profile")

    def stop_profile(self) -> str:
        raise ProfilingUnsupported("the synthetic engine runs no model: there is nothing to profile")

    # ---- internals ---------------------------------------------------------

    def _block(self, block_id: int) -> list[int]:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} is outside the pool of {self.num_blocks}")
        return self._kv.setdefault(block_id, [0] * self.block_size)

    def _fill(self, scheduled: ScheduledRequest) -> int:
        """Write the running hash of each scheduled position; the hash at the last one."""
        bs, blocks, kv = self.block_size, scheduled.block_ids, self._kv
        position = scheduled.start_position
        if position == 0:
            running = self._initial_hash
        else:
            previous = kv.get(blocks[(position - 1) // bs]) or self._block(blocks[(position - 1) // bs])
            running = previous[(position - 1) % bs]
        token_ids = scheduled.token_ids
        if len(token_ids) == 1:  # a decode (the hot path): one slot
            running = hash((running, token_ids[0]))  # _chain, inlined
            (kv.get(blocks[position // bs]) or self._block(blocks[position // bs]))[position % bs] = running
            return running
        # A prefill chunk: block by block, slot by slot.
        done, end = 0, len(token_ids)
        while done < end:
            block = kv.get(blocks[position // bs]) or self._block(blocks[position // bs])
            first = position % bs
            last = min(bs, first + end - done)
            for slot in range(first, last):
                running = hash((running, token_ids[done]))  # _chain, inlined
                block[slot] = running
                done += 1
            position += last - first
        return running

    def _salt(self, seed: int) -> int:
        salt = self._salts.get(seed)
        if salt is None:
            if len(self._salts) >= _MAX_SALTS:
                self._salts.clear()
            salt = self._salts[seed] = _chain(seed, _SEED_SALT ^ _GREEDY_SALT)
        return salt

    def _prompt_logprobs(self, scheduled: ScheduledRequest) -> list[TokenLogprobs]:
        """Stand-in prompt logprobs of the chunk's rows: a function of the position and token alone
        (the real values need a model; these only carry the shape through the engine and the APIs)."""
        start, top_n = scheduled.start_position, scheduled.sampling_params.prompt_logprobs or 0
        entries = []
        for position in range(start + 1, start + 1 + scheduled.prompt_logprob_rows):
            token_id = scheduled.prompt_token_ids[position]
            logprob = -(_chain(position, token_id) % 1000) / 1000.0
            top_ids = [(token_id + k) % self.vocab_size for k in range(top_n)]
            entries.append(TokenLogprobs(token_id, logprob, top_ids, [logprob - k for k in range(top_n)], 1))
        return entries

    def _sample(self, scheduled: ScheduledRequest, last_hash: int) -> SampledToken:
        """The token after ``last_hash`` and its logprobs (``execute`` inlines the draw without them)."""
        params = scheduled.sampling_params
        salt = _GREEDY_SALT if params.temperature == 0.0 else self._salt(params.seed or 0)
        draw = _chain(last_hash, salt)
        token_id = draw % self.vocab_size
        if params.logprobs is None:
            return SampledToken(token_id)
        logprob = -((draw >> 32) % 1000) / 1000.0
        top_ids = [(token_id + k) % self.vocab_size for k in range(params.logprobs)]
        top_logprobs = [logprob - k for k in range(params.logprobs)]
        return SampledToken(token_id, TokenLogprobs(token_id, logprob, top_ids, top_logprobs))
