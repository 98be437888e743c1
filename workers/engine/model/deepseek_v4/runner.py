"""The engine's executor for DeepSeek-V4 checkpoints (``config.json`` model_type ``deepseek_v4``).

What it does today: continuous batching of any number of sequences, chunked
prefill cut anywhere, greedy and sampled decoding (the engine's ``Sampler``),
float32 on the CPU, one rank. Each sequence's cache (every state kind of
``state.py``) lives in a ``SequenceState`` keyed by the sequence's first
block id: without prefix caching a block belongs to one sequence, and a
sequence that starts over (a new request, a recompute after preemption) comes
with ``start_position`` 0 and gets a fresh state. The block manager tells
``blocks_freed`` when a sequence's blocks are free (finished, aborted,
preempted, a parked table released): its state goes with its first block.

KV transfer (disaggregated ctx -> gen): ``export_blocks`` cuts a parked
sequence's state into one payload per block (``block_payload.py``);
``import_blocks`` keeps the payloads by block id, and the request's first step
on this engine assembles them into its state.

Across a worker's ranks (``tp``): every rank runs this runner on its share
of the model (``shard.py``), the same steps in the same order (rank 0's
``LeaderExecutor`` sends them, and the blocks it frees: ``RankFree``). Every
rank's state is the whole cache (one shared KV head, replicated
compressors), so a gen rank pulls every block's payload as the one KV head
(``export_heads`` / ``import_heads``) from whichever ctx rank the layout
names, whatever the two workers' numbers of ranks.

Not yet: the paged pool per state kind indexed by the block table, hence no
prefix caching (refused: a cached block would not bring its compressor state),
no GPU. docs/deepseek_v4.md says how the paged pool is to be laid out.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from workers.config import ConfigError, EngineConfig
from workers.engine.executor import ExecutorOutput, ProfilingUnsupported, SchedulerOutput, logit_rows
from workers.engine.model.deepseek_v4.block_payload import (
    BlockPayload,
    assemble_state,
    check_payload,
    decode_payload,
    encode_block,
)
from workers.engine.model.deepseek_v4.cache_bytes import state_bytes_per_token
from workers.engine.model.deepseek_v4.model import DeepseekV4Model, SequenceBatch
from workers.engine.model.deepseek_v4.state import SequenceState
from workers.engine.model.loader import resolve_device
from workers.engine.model.parallel import TensorParallel
from workers.engine.sampler import Sampler, sample_step

__all__ = ["DeepseekV4Runner"]

log = logging.getLogger(__name__)


class DeepseekV4Runner:
    def __init__(
        self, config: EngineConfig, sampler_seed: int | None = None, tp: TensorParallel | None = None
    ) -> None:
        config.validate()
        _refuse_unsupported(config)
        if config.model is None:  # validate() refuses a torch engine without one
            raise ConfigError("engine.model", "a model directory is required for the torch engine")
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.tp = tp
        self.model = DeepseekV4Model.from_dir(config.model, tp)
        model_config = self.model_config = self.model.config
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        self.vocab_size = model_config.vocab_size
        self.eos_token_ids = model_config.eos_token_ids
        self.block_size = config.cache.block_size
        # What a block's tokens keep at the longest context (the window is bounded, so this is an upper bound).
        self.kv_bytes_per_block = max(1, int(state_bytes_per_token(model_config, self.max_model_len) * self.block_size))
        self.num_blocks = config.cache.num_blocks or max(1, config.cache.memory_bytes // self.kv_bytes_per_block)
        self.sampler = Sampler(self.eos_token_ids, torch.device("cpu"), sampler_seed)
        self._states: dict[int, SequenceState] = {}  # first block id -> its sequence's state
        # block id -> (its sequence's first block, its index in the table): what export_blocks cuts.
        self._owners: dict[int, tuple[int, int]] = {}
        self._num_owned: dict[int, int] = {}  # first block id -> blocks of its table in _owners
        self._imported: dict[int, BlockPayload] = {}  # pulled blocks, until their request's first step

    @property
    def num_live_states(self) -> int:
        """Sequences whose state this runner keeps."""
        return len(self._states)

    @property
    def num_tracked_blocks(self) -> int:
        """Blocks this runner knows an owner or a pulled payload of (0 when every block is free)."""
        return len(self._owners) + len(self._imported)

    def execute(self, batch: SchedulerOutput) -> ExecutorOutput:
        return sample_step(self.sampler, batch, self.compute_logits(batch))

    def compute_logits(self, batch: SchedulerOutput) -> torch.Tensor:
        """(S, vocab) float32 logits of the requests with ``sample`` set, in order, then the rows of
        prompt logprobs (``executor.logit_rows``); on ranks > 0 an empty tensor (rank 0 gathers)."""
        if not batch.requests:
            return torch.empty((0, self.vocab_size))
        token_ids: list[int] = []
        sequences: list[SequenceBatch] = []
        for request in batch.requests:
            end = request.start_position + len(request.token_ids)
            if end > self.max_model_len:
                raise ValueError(f"request {request.request_id} reaches position {end} > max_model_len")
            sequences.append(SequenceBatch(self._state_of(request.block_ids, request.start_position),
                                           len(request.token_ids)))
            token_ids.extend(request.token_ids)
        hidden = self.model.hidden(torch.tensor(token_ids, dtype=torch.long), sequences)
        return self.model.compute_logits(hidden[torch.tensor(logit_rows(batch.requests), dtype=torch.long)])

    def _state_of(self, block_ids: list[int], start_position: int) -> SequenceState:
        first_block = block_ids[0]
        if start_position == 0:
            self._states[first_block] = self.model.new_state()
            self._num_owned[first_block] = 0
        elif first_block not in self._states and first_block in self._imported:
            self._states[first_block] = self._assemble(block_ids, start_position)
        owned = self._num_owned.get(first_block, 0)
        for index in range(owned, len(block_ids)):
            self._owners[block_ids[index]] = (first_block, index)
        self._num_owned[first_block] = len(block_ids)
        state = self._states.get(first_block)
        if state is None or state.num_tokens != start_position:
            have = None if state is None else state.num_tokens
            raise RuntimeError(
                f"deepseek_v4: no cache for block {first_block} at position {start_position} (has {have})"
            )
        return state

    def _assemble(self, block_ids: list[int], num_tokens: int) -> SequenceState:
        """A pulled sequence's state from its blocks' payloads (every block up to position ``num_tokens - 1``)."""
        covering = block_ids[: -(-num_tokens // self.block_size)]
        payloads = [self._imported.pop(b) for b in covering if b in self._imported]
        try:
            if len(payloads) != len(covering):
                raise ValueError(f"{len(payloads)} of its {len(covering)} blocks were imported")
            state = assemble_state(payloads, self.model.config, self.block_size)
        except ValueError as exc:
            raise RuntimeError(f"deepseek_v4: the pulled KV of block {block_ids[0]} is unusable: {exc}") from exc
        return state

    def export_blocks(self, block_ids: list[int]) -> list[bytes]:
        """One payload frame per block: its share of its sequence's state (``block_payload``)."""
        frames = []
        for block_id in block_ids:
            owner = self._owners.get(block_id)
            state = None if owner is None else self._states.get(owner[0])
            if owner is None or state is None:
                raise ValueError(f"deepseek_v4: block {block_id} holds no sequence's state")
            frames.append(encode_block(state, owner[1], self.block_size, self.model.config))
        return frames

    def import_blocks(self, block_ids: list[int], buffers: list[Any]) -> None:
        """Keep the payloads until the request's first step assembles them (ValueError: not this model's
        payloads: the pull fails and the request is prefilled here)."""
        if len(buffers) != len(block_ids):
            raise ValueError(f"deepseek_v4: {len(buffers)} KV frames for {len(block_ids)} blocks")
        payloads = [decode_payload(frame) for frame in buffers]
        for payload in payloads:
            check_payload(payload, self.model.config, self.block_size)
        self._imported.update(zip(block_ids, payloads))

    def export_heads(self, block_ids: list[int], heads: range) -> list[bytes]:
        """The blocks' payloads as KV head 0, the one head of the model (``kv_rank_pulls``)."""
        _check_one_head(heads)
        return self.export_blocks(block_ids)

    def import_heads(self, block_ids: list[int], heads: range, buffers: list[Any]) -> None:
        _check_one_head(heads)
        self.import_blocks(block_ids, buffers)

    def blocks_freed(self, block_ids: list[int]) -> None:
        """Drop what the freed blocks held: a sequence's state goes with its first block."""
        for block_id in block_ids:
            self._owners.pop(block_id, None)
            self._imported.pop(block_id, None)
            self._num_owned.pop(block_id, None)
            self._states.pop(block_id, None)

    def start_profile(self, trace_dir: str) -> None:
        raise ProfilingUnsupported("the DeepSeek-V4 engine has no profiler hook yet")

    def stop_profile(self) -> str:
        raise ProfilingUnsupported("the DeepSeek-V4 engine has no profiler hook yet")


def _check_one_head(heads: range) -> None:
    # One shared KV head (MQA), whole on every rank: a layout asking for a part of it is not this model's.
    if heads != range(1):
        raise ValueError(f"deepseek_v4 has one shared KV head; asked for heads [{heads.start}, {heads.stop})")


def _refuse_unsupported(config: EngineConfig) -> None:
    if config.cache.enable_prefix_caching:
        raise ConfigError(
            "engine.cache.enable_prefix_caching",
            "must be false for a DeepSeek-V4 model: a cached block does not bring its compressor state yet",
        )
    if config.dtype != "float32":
        raise ConfigError("engine.dtype", f"the DeepSeek-V4 engine computes in float32 for now, got {config.dtype!r}")
    if resolve_device(config.device).type != "cpu":
        raise ConfigError("engine.device", f"the DeepSeek-V4 engine runs on the CPU for now, got {config.device!r}")
