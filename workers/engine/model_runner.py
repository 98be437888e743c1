"""The torch executor: runs the model over a scheduled step and samples.

``ModelRunner(config)`` loads the checkpoint, allocates the paged KV pool and
implements ``workers.engine.executor.Executor``. A step's tokens (prefill
chunks and decodes, in the scheduler's order) are flattened into one batch;
the logits are computed only for the last token of each request whose
``sample`` is true, and for the prompt positions of a request that asked for
prompt logprobs.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from workers.config import ConfigError, EngineConfig
from workers.engine.attention import SequenceSlice, build_attention_metadata
from workers.engine.executor import ExecutorOutput, SchedulerOutput, logit_rows
from workers.engine.kv_cache import KVCache, KVCacheShape, num_blocks_for
from workers.engine.model.loader import DTYPES, load_model, resolve_device
from workers.engine.model.packed_linear import prepare_linears
from workers.engine.model.parallel import TensorParallel
from workers.engine.native_attention import NativeDecodeKernel, kernel_supports, load_kernel
from workers.engine.sampler import Sampler, sample_step

__all__ = ["ModelRunner"]

log = logging.getLogger(__name__)


class ModelRunner:
    """Executor over a Hugging Face Llama-family checkpoint (``config.model``)."""

    # Samples after every draft of an entry (``compute_logits``, ``sample_step``): speculative decoding.
    # Under tensor parallelism the leader wraps it, and the followers' forward knows no drafts.
    verifies_drafts = True

    def __init__(
        self, config: EngineConfig, sampler_seed: int | None = None, tp: TensorParallel | None = None
    ) -> None:
        """With ``tp`` this rank loads its shard and its KV cache holds only its KV heads;
        ``compute_logits`` then returns the logits on rank 0 only (the ranks must step together)."""
        config.validate()
        self.config = config
        if config.num_threads is not None:  # before any parallel region: the native kernel shares torch's OpenMP
            torch.set_num_threads(config.num_threads)
        self.tp = tp
        self.device = resolve_device(config.device)
        if config.model is None:  # validate() refuses a torch engine without one
            raise ConfigError("engine.model", "a model directory is required for the torch engine")
        self.model, self.model_config = load_model(config.model, config.dtype, self.device, _positions(config), tp,
                                                    config.weights)
        prepare_linears(self.model, self.device, DTYPES[config.dtype])  # from here on it only serves inference
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.vocab_size = self.model_config.vocab_size
        self.eos_token_ids = self.model_config.eos_token_ids
        self.block_size = config.cache.block_size
        shape = KVCacheShape(
            num_layers=self.model_config.num_layers,
            block_size=self.block_size,
            num_kv_heads=self.model.num_kv_heads,  # this rank's share under TP
            head_dim=self.model_config.head_dim,
            dtype=DTYPES[config.dtype],
        )
        self.num_blocks = num_blocks_for(config.cache, shape)
        self.kv_cache = KVCache(shape, self.num_blocks, self.device)
        self.kv_bytes_per_block = shape.bytes_per_block
        self.decode_kernel = _decode_kernel(config, self.device, shape)
        self.sampler = Sampler(self.eos_token_ids, self.device, sampler_seed)
        self._profiler: torch.profiler.profile | None = None
        self._trace_dir: Path | None = None

    # -- Executor -------------------------------------------------------

    def execute(self, batch: SchedulerOutput) -> ExecutorOutput:
        return sample_step(self.sampler, batch, self.compute_logits(batch))

    def compute_logits(self, batch: SchedulerOutput) -> torch.Tensor:
        """Run the step; (S, vocab) float32 logits of the requests with ``sample`` set, in order (an entry
        with k drafts has k + 1 rows: after its last token and after each draft), then the rows of prompt
        logprobs (``executor.logit_rows``)."""
        if not batch.requests:
            return torch.empty((0, self.vocab_size), device=self.device)
        token_ids: list[int] = []
        positions: list[int] = []
        for request in batch.requests:
            start, num_tokens = request.start_position, len(request.token_ids)
            if start + num_tokens > self.max_model_len:
                raise ValueError(f"request {request.request_id} reaches position {start + num_tokens} > max_model_len")
            token_ids.extend(request.token_ids)
            positions.extend(range(start, start + num_tokens))
        rows = logit_rows(batch.requests)
        sequences = [SequenceSlice(r.start_position, len(r.token_ids), r.block_ids) for r in batch.requests]
        with torch.inference_mode():
            metadata = build_attention_metadata(
                sequences, self.block_size, self.device, self.kv_cache.storage.dtype, self.decode_kernel
            )
            input_ids = torch.tensor(token_ids, dtype=torch.long).to(self.device)
            position_ids = torch.tensor(positions, dtype=torch.long).to(self.device)
            hidden = self.model(input_ids, position_ids, self.kv_cache, metadata)  # (N, hidden)
            if len(rows) < len(token_ids) or rows != list(range(len(rows))):  # (decodes alone: every row, in order)
                hidden = hidden[torch.tensor(rows, dtype=torch.long).to(self.device)]  # (S + prompt rows, hidden)
            return self.model.compute_logits(hidden)  # (S + prompt rows, vocab)

    def export_blocks(self, block_ids: list[int]) -> list[memoryview]:
        """The KV cache's wire frames of ``block_ids`` as raw bytes (views, not copies, where it can)."""
        return self.kv_cache.export_buffers(block_ids)

    def import_blocks(self, block_ids: list[int], buffers: list[Any]) -> None:
        self.kv_cache.import_buffers(block_ids, buffers)

    def allocate_host_buffer(self, num_bytes: int) -> memoryview:
        """Host memory for the KV tiers (``workers.engine.kv_tiers``): pinned beside a GPU pool, so
        copies between it and the pool are DMA; plain pages (committed as used) beside a CPU pool.
        (The numpy array keeps the tensor, and so the memory, alive.)"""
        pinned = self.kv_cache.storage.device.type == "cuda"
        host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pinned).numpy()
        return memoryview(host)  # type: ignore[arg-type]  # numpy's stub: ndarray is a buffer (see kv_cache)

    def export_heads(self, block_ids: list[int], heads: range) -> list[Any]:
        """Only KV heads ``heads`` of this rank's pool (a peer that splits them otherwise)."""
        return self.kv_cache.export_heads(block_ids, heads)

    def import_heads(self, block_ids: list[int], heads: range, buffers: list[Any]) -> None:
        self.kv_cache.import_heads(block_ids, heads, buffers)

    def start_profile(self, trace_dir: str) -> None:
        if self._profiler is not None:
            raise RuntimeError("profiler already running")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._trace_dir = Path(trace_dir)
        self._trace_dir.mkdir(parents=True, exist_ok=True)
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        self._profiler.start()

    def stop_profile(self) -> str:
        """Stop the profiler; return the path of the chrome trace it wrote."""
        if self._profiler is None or self._trace_dir is None:
            raise RuntimeError("profiler is not running")
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        path = self._trace_dir / f"engine-{os.getpid()}-{time.time_ns()}.trace.json"
        profiler.export_chrome_trace(str(path))
        return str(path)


def _decode_kernel(config: EngineConfig, device: torch.device, shape: KVCacheShape) -> NativeDecodeKernel | None:
    """The native paged-decode kernel where ``config.decode_attention`` allows it and it applies."""
    if config.decode_attention == "sdpa":
        log.info("decode attention: gather + SDPA (engine.decode_attention = sdpa)")
        return None
    why = None
    if device.type != "cpu" or config.dtype != "float32":
        why = "it is float32 on the CPU only"
    elif not kernel_supports(shape.head_dim, shape.block_size):
        why = f"it needs head_dim and block_size multiples of 16 (got {shape.head_dim}, {shape.block_size})"
    kernel = load_kernel() if why is None else None
    if kernel is None and config.decode_attention == "native":
        raise ConfigError("engine.decode_attention",
                          f"'native' requested but {why or 'it could not be built (see the log)'}")
    if kernel is None:
        log.info("decode attention: gather + SDPA (the native kernel does not apply: %s)", why or "see above")
    else:
        log.info("decode attention: native paged-decode kernel (%s)", kernel.path)
    return kernel


def _positions(config: EngineConfig) -> int | None:
    # RoPE tables must cover max_model_len even when it exceeds the model's own limit.
    return config.max_model_len
