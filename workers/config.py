"""Engine configuration: frozen, typed, validated with errors that name the key.

Torch-free (frontends read ``max_model_len`` and the model directory from it).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from common.config_errors import ConfigError
from workers.sampling_params import MAX_STREAM_INTERVAL


def check_tiers(host_bytes: int | None, disk_path: str | None, disk_bytes: int | None, prefix: str) -> None:
    """The KV tiers' keys together (the engine's ``cache`` and the deployment YAML's ``engine``)."""
    if disk_bytes and not disk_path:
        raise ConfigError(f"{prefix}.disk_tier_path", "a disk tier (disk_tier_bytes > 0) needs a directory")
    if disk_bytes and not host_bytes:
        raise ConfigError(f"{prefix}.disk_tier_bytes",
                          "blocks reach the disk tier through the host tier: set host_tier_bytes too")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV block. Prefix caching works on full blocks only."""
    num_blocks: int | None = None
    """Blocks in the pool. None: derived from ``memory_bytes``."""
    memory_bytes: int = 256 * 2**20
    """KV pool budget when ``num_blocks`` is None."""
    enable_prefix_caching: bool = True
    hash_seed: int = 0
    """Seed of the chained block hash. Every worker and the orchestrator must use
    the same seed to agree on block hashes. Collision policy: hashes are 64-bit
    digests of (parent hash, token ids); a hit also compares the block's token
    ids, so a collision costs a cache miss, never wrong KV."""
    host_tier_bytes: int = 0
    """Host-memory tier under the pool: blocks evicted from the pool are kept here (pinned memory
    when the pool is on a GPU) and brought back on a prefix hit. 0: no tiers."""
    disk_tier_path: str | None = None
    """Directory of the disk tier under the host tier (each engine makes its own subdirectory)."""
    disk_tier_bytes: int = 0
    """Disk tier budget: blocks evicted from the host tier are written here. 0: no disk tier."""

    def validate(self, prefix: str = "cache") -> None:
        if self.block_size < 1 or self.block_size > 1024:
            raise ConfigError(f"{prefix}.block_size", f"must be in [1, 1024], got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"{prefix}.num_blocks", f"must be >= 1, got {self.num_blocks}")
        if self.memory_bytes < 1:
            raise ConfigError(f"{prefix}.memory_bytes", f"must be >= 1, got {self.memory_bytes}")
        for name in ("host_tier_bytes", "disk_tier_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{prefix}.{name}", f"must be >= 0, got {getattr(self, name)}")
        check_tiers(self.host_tier_bytes, self.disk_tier_path, self.disk_tier_bytes, prefix)

    @property
    def has_tiers(self) -> bool:
        return self.host_tier_bytes > 0


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    """Most requests running at once."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step, prefill chunks and decodes together."""
    enable_chunked_prefill: bool = True
    stream_interval: int = 1
    """Tokens per output of a running request (its first token always goes out at once): 1 streams
    every token; N gathers N, fewer outputs, SSE events and messages for the same tokens (TensorRT-LLM's,
    vLLM's and SGLang's ``stream_interval``). A request's ``SamplingParams.stream_interval`` overrides it."""

    def validate(self, prefix: str = "scheduler") -> None:
        if not 1 <= self.stream_interval <= MAX_STREAM_INTERVAL:
            raise ConfigError(f"{prefix}.stream_interval",
                              f"must be in [1, {MAX_STREAM_INTERVAL}], got {self.stream_interval}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"{prefix}.max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"{prefix}.max_num_batched_tokens", f"must be >= 1, got {self.max_num_batched_tokens}"
            )


@dataclass(frozen=True)
class SyntheticConfig:
    """Timing model of the synthetic engine (no model, no torch).

    A step sleeps ``prefill_seconds_per_token * prefill_tokens +
    decode_step_base_seconds + decode_seconds_per_seq * decode_seqs +
    onboard_seconds_per_block * blocks_onboarded`` (the base only when the step
    decodes; the last term for the host- and disk-tier blocks brought back for
    the requests the step admits). All zero: as fast as it can go.
    """

    prefill_seconds_per_token: float = 0.0
    decode_step_base_seconds: float = 0.0
    decode_seconds_per_seq: float = 0.0
    onboard_seconds_per_block: float = 0.0
    vocab_size: int = 32000
    max_model_len: int = 8192
    seed: int = 0

    def validate(self, prefix: str = "synthetic") -> None:
        for f in fields(self):
            if getattr(self, f.name) < 0:
                raise ConfigError(f"{prefix}.{f.name}", f"must be >= 0, got {getattr(self, f.name)}")
        if self.vocab_size < 2:
            raise ConfigError(f"{prefix}.vocab_size", f"must be >= 2, got {self.vocab_size}")


DECODE_ATTENTION_MODES = ("auto", "native", "sdpa")  # EngineConfig.decode_attention
WEIGHT_MODES = ("dequantize", "quantized")  # EngineConfig.weights


@dataclass(frozen=True)
class SpeculativeConfig:
    """Prompt-lookup (n-gram) speculative decoding (``workers.engine.speculative``).

    Each decode step of an eligible request looks for the last n tokens of its prompt + output
    earlier in them (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) and proposes the
    up to ``num_speculative_tokens`` tokens that followed there; one forward verifies them all.
    Agentic turns and code edits quote earlier text back, which is where the drafts come from.
    """

    num_speculative_tokens: int = 0
    """Draft tokens proposed per step at most; 0: speculation off."""
    prompt_lookup_max: int = 4
    """The longest n-gram looked up (tried first: a longer match predicts better)."""
    prompt_lookup_min: int = 2
    """The shortest n-gram looked up (1 proposes after any repeated token: more drafts, fewer accepted)."""

    def validate(self, prefix: str = "speculative") -> None:
        if not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"{prefix}.num_speculative_tokens",
                              f"must be in [0, {MAX_SPECULATIVE_TOKENS}], got {self.num_speculative_tokens}")
        if self.prompt_lookup_min < 1:
            raise ConfigError(f"{prefix}.prompt_lookup_min", f"must be >= 1, got {self.prompt_lookup_min}")
        if not self.prompt_lookup_min <= self.prompt_lookup_max <= MAX_PROMPT_LOOKUP:
            raise ConfigError(f"{prefix}.prompt_lookup_max",
                              f"must be in [prompt_lookup_min ({self.prompt_lookup_min}), {MAX_PROMPT_LOOKUP}], "
                              f"got {self.prompt_lookup_max}")

    @property
    def enabled(self) -> bool:
        return self.num_speculative_tokens > 0


# Bounds of SpeculativeConfig: a verify forward of more tokens costs more than a decode, and an
# n-gram longer than this almost never matches where a shorter one would not.
MAX_SPECULATIVE_TOKENS = 32
MAX_PROMPT_LOOKUP = 16


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None
    """Hugging Face model directory (torch engine), or None for the synthetic engine
    (a directory still supplies the tokenizer when given)."""
    kind: str = "torch"
    """``torch`` (the real model) or ``synthetic`` (timing model)."""
    dtype: str = "float32"
    """float32, bfloat16 or float16."""
    device: str = "auto"
    """cpu, cuda, cuda:N or auto (cuda when available)."""
    max_model_len: int | None = None
    """Longest prompt + output. None: the model's ``max_position_embeddings``."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    """Prompt-lookup speculative decoding (torch engine, one rank; off by default)."""
    profile_dir: str | None = None
    """Where ``start_profile`` writes torch profiler traces."""
    decode_attention: str = "auto"
    """Decode attention of the torch engine: ``native`` (a C kernel reading the paged
    pool in place, built with the system C compiler on first use; float32 on the
    CPU only), ``sdpa`` (gather each group's KV, then torch's SDPA), or ``auto``
    (native where it applies and builds, else sdpa)."""
    weights: str = "dequantize"
    """A GGUF model's quantized weights: ``dequantize`` (to the engine's dtype at load) or
    ``quantized`` (Q4_0/Q4_1/Q4_K/Q8_0 linear layers keep their blocks and run on a C kernel
    built on first use; float32 on the CPU, one rank; docs/quantization.md)."""
    num_threads: int | None = None
    """torch intra-op threads of the engine process; None: torch's default, one per core the
    process may run on. Engines sharing a machine each take a share (``disagg up`` computes it
    from ``engine.threads``): two engines each spinning a thread per core on the same cores
    slow each other's every step."""

    def validate(self) -> EngineConfig:
        if self.kind not in ("torch", "synthetic"):
            raise ConfigError("engine.kind", f"must be 'torch' or 'synthetic', got {self.kind!r}")
        if self.kind == "torch" and not self.model:
            raise ConfigError("engine.model", "a model directory is required for the torch engine")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError("engine.dtype", f"must be float32, bfloat16 or float16, got {self.dtype!r}")
        if not (self.device in ("cpu", "cuda", "auto") or self.device.startswith("cuda:")):
            raise ConfigError("engine.device", f"must be cpu, cuda, cuda:N or auto, got {self.device!r}")
        if self.decode_attention not in DECODE_ATTENTION_MODES:
            raise ConfigError("engine.decode_attention",
                              f"must be auto, native or sdpa, got {self.decode_attention!r}")
        if self.weights not in WEIGHT_MODES:
            raise ConfigError("engine.weights", f"must be dequantize or quantized, got {self.weights!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError("engine.num_threads", f"must be >= 1, got {self.num_threads}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError("engine.max_model_len", f"must be >= 2, got {self.max_model_len}")
        self.cache.validate("engine.cache")
        self.scheduler.validate("engine.scheduler")
        self.synthetic.validate("engine.synthetic")
        self.speculative.validate("engine")  # flat in the deployment YAML: engine.num_speculative_tokens
        return self
