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

from workers.config import EngineConfig
from workers.engine.executor import (
    ExecutorOutput,
    ProfilingUnsupported,
    SampledToken,
    ScheduledRequest,
    SchedulerOutput,
)
from workers.protocol import TokenLogprobs

__all__ = ["SyntheticExecutor", "NOMINAL_KV_BYTES_PER_TOKEN"]

NOMINAL_KV_BYTES_PER_TOKEN = 4096
"""Bytes one token's KV is taken to need when ``num_blocks`` is derived from ``memory_bytes``."""

_MASK = 2**64 - 1
_GREEDY_SALT = 0x5851F42D4C957F2D
_MAX_SALTS = 4096


def _mix(x: int) -> int:
    """splitmix64's finaliser: a cheap, well-spread 64-bit bijection."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


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
        self.kv_bytes_per_block = 8 * self.block_size  # export_blocks: one uint64 per slot
        self._initial_hash = _mix(synthetic.seed)
        self._kv: dict[int, list[int]] = {}  # block id -> running hash per slot, written lazily
        self._salts: dict[int, int] = {}  # seed -> _mix(seed): the same per request and step

    # ---- Executor ----------------------------------------------------------

    def execute(self, batch: SchedulerOutput) -> ExecutorOutput:
        started = time.perf_counter()
        sampled: dict[int, SampledToken] = {}
        for scheduled in batch.requests:
            last_hash = self._fill(scheduled)
            if scheduled.sample:
                sampled[scheduled.request_id] = self._sample(scheduled, last_hash)
        remaining = self.step_seconds(batch) - (time.perf_counter() - started)
        if remaining > 0:
            time.sleep(remaining)
        return ExecutorOutput(sampled=sampled)

    def step_seconds(self, batch: SchedulerOutput) -> float:
        """What the timing model says this step costs (decodes are one token each)."""
        seconds = self.timing.prefill_seconds_per_token * batch.num_prefill_tokens
        if batch.num_decode_tokens:
            seconds += self.timing.decode_step_base_seconds
            seconds += self.timing.decode_seconds_per_seq * batch.num_decode_tokens
        return seconds

    def export_blocks(self, block_ids: list[int]) -> list[bytes]:
        """One frame: the blocks' token ids, ``block_size`` little-endian uint64 each."""
        tokens = [token for block_id in block_ids for token in self._block(block_id)]
        return [struct.pack(f"<{len(tokens)}Q", *tokens)]

    def import_blocks(self, block_ids: list[int], buffers: list[bytes]) -> None:
        size = 8 * self.block_size * len(block_ids)
        if len(buffers) != 1 or memoryview(buffers[0]).nbytes != size:
            got = [memoryview(b).nbytes for b in buffers]
            raise ValueError(f"expected one frame of {size} bytes for {len(block_ids)} blocks, got frames of {got}")
        tokens = struct.unpack(f"<{self.block_size * len(block_ids)}Q", buffers[0])
        for number, block_id in enumerate(block_ids):
            self._kv[block_id] = list(tokens[number * self.block_size:(number + 1) * self.block_size])

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
        for token_id in scheduled.token_ids:
            running = _mix(running ^ (token_id * 0x100000001B3 & _MASK))
            block = kv.get(blocks[position // bs]) or self._block(blocks[position // bs])
            block[position % bs] = running
            position += 1
        return running

    def _salt(self, seed: int) -> int:
        salt = self._salts.get(seed)
        if salt is None:
            if len(self._salts) >= _MAX_SALTS:
                self._salts.clear()
            salt = self._salts[seed] = _mix(seed)
        return salt

    def _sample(self, scheduled: ScheduledRequest, last_hash: int) -> SampledToken:
        params = scheduled.sampling_params
        salt = _GREEDY_SALT if params.temperature == 0.0 else self._salt(params.seed or 0)
        draw = _mix(last_hash ^ salt)
        token_id = draw % self.vocab_size
        logprobs = None
        if params.logprobs is not None:
            logprob = -((draw >> 32) % 1000) / 1000.0
            top_ids = [(token_id + k) % self.vocab_size for k in range(params.logprobs)]
            top_logprobs = [logprob - k for k in range(params.logprobs)]
            logprobs = TokenLogprobs(token_id, logprob, top_ids, top_logprobs)
        return SampledToken(token_id, logprobs)
