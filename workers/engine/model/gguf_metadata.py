"""A GGUF file's metadata: the model's shape as a ``ModelConfig``, without torch.

llama.cpp's GGUF carries no ``config.json``: the key/value metadata is the
config (``<arch>.block_count``, ``<arch>.attention.head_count``, ...) and the
tokenizer (``tokenizer.ggml.*``). Read with the ``gguf`` package (numpy
memory maps), so the synthetic engine, the frontends and the orchestrator can
use it without importing torch.

Supported architectures: ``llama`` (Llama, Mistral and SmolLM files all say
``llama``). Another architecture is a ``ConfigError`` naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workers.config import ConfigError
from workers.engine.model.model_config import ModelConfig, RopeScaling

__all__ = ["SUPPORTED_GGUF_ARCHITECTURES", "is_gguf_file", "open_gguf", "gguf_field", "gguf_model_config",
           "gguf_vocab_size", "gguf_context_length"]

SUPPORTED_GGUF_ARCHITECTURES = ("llama",)
# Metadata arrays this large are read only where needed (the tokenizer); a scalar read skips them.
_TOKEN_LIST = "tokenizer.ggml.tokens"


def is_gguf_file(path: str | Path) -> bool:
    path = Path(path)
    return path.suffix == ".gguf" and path.is_file()


def open_gguf(path: str | Path) -> Any:
    """A ``gguf.GGUFReader`` over ``path`` (memory-mapped: opening reads no tensor data)."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise ConfigError(str(path), f"not a readable GGUF file: {exc}") from None


def gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    """The value of metadata ``key`` (str, number, bool or list), or ``default`` when absent."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_vocab_size(reader: Any) -> int:
    architecture = gguf_field(reader, "general.architecture", "")
    size = gguf_field(reader, f"{architecture}.vocab_size")
    if size is None:  # older files: the length of the token list
        field = reader.fields.get(_TOKEN_LIST)
        size = len(field.data) if field is not None else None
    if size is None:
        raise ConfigError(f"{reader.data.filename}: {architecture}.vocab_size",
                          "missing (and no tokenizer.ggml.tokens)")
    return int(size)


def gguf_context_length(reader: Any) -> int:
    architecture = gguf_field(reader, "general.architecture", "")
    return int(gguf_field(reader, f"{architecture}.context_length", 2048))


def gguf_model_config(reader: Any) -> ModelConfig:
    """The model's shape from the file's metadata; ConfigError naming the key when it cannot run."""
    source = str(reader.data.filename)
    architecture = gguf_field(reader, "general.architecture")
    if architecture not in SUPPORTED_GGUF_ARCHITECTURES:
        supported = list(SUPPORTED_GGUF_ARCHITECTURES)
        raise ConfigError(f"{source}: general.architecture",
                          f"unsupported GGUF architecture {architecture!r}; supported: {supported}")

    def require(name: str) -> Any:
        value = gguf_field(reader, f"{architecture}.{name}")
        if value is None:
            raise ConfigError(f"{source}: {architecture}.{name}", "missing")
        return value

    hidden_size = int(require("embedding_length"))
    num_heads = int(require("attention.head_count"))
    num_kv_heads = int(gguf_field(reader, f"{architecture}.attention.head_count_kv", num_heads))
    head_dim = int(gguf_field(reader, f"{architecture}.attention.key_length", hidden_size // num_heads))
    rotary_dim = int(gguf_field(reader, f"{architecture}.rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise ConfigError(f"{source}: {architecture}.rope.dimension_count",
                          f"partial rotary ({rotary_dim} of {head_dim} dims) is not supported")
    if num_heads % num_kv_heads != 0:
        raise ConfigError(f"{source}: {architecture}.attention.head_count_kv",
                          f"{num_kv_heads} does not divide attention.head_count {num_heads}")
    tensor_names = {tensor.name for tensor in reader.tensors}
    if "rope_freqs.weight" in tensor_names:  # llama3-style frequency factors, stored as a tensor
        raise ConfigError(f"{source}: rope_freqs.weight", "per-frequency RoPE factors are not supported")
    return ModelConfig(
        model_type=architecture,
        vocab_size=gguf_vocab_size(reader),
        hidden_size=hidden_size,
        intermediate_size=int(require("feed_forward_length")),
        num_layers=int(require("block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(require("attention.layer_norm_rms_epsilon")),
        rope_theta=float(gguf_field(reader, f"{architecture}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(reader, architecture, source),
        max_position_embeddings=gguf_context_length(reader),
        tie_word_embeddings="output.weight" not in tensor_names,  # llama.cpp writes no output when tied
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        o_bias="blk.0.attn_output.bias" in tensor_names,
        eos_token_ids=_stop_token_ids(reader),
    )


def _rope_scaling(reader: Any, architecture: str, source: str) -> RopeScaling | None:
    kind = gguf_field(reader, f"{architecture}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "linear":
        raise ConfigError(f"{source}: {architecture}.rope.scaling.type",
                          f"unsupported RoPE scaling {kind!r}; supported: none, linear")
    return RopeScaling(rope_type="linear", factor=float(gguf_field(reader, f"{architecture}.rope.scaling.factor", 1.0)))


def _stop_token_ids(reader: Any) -> frozenset[int]:
    # EOS and the chat template's end of turn (EOT/EOM where the file names them): generation
    # stops on any of them, as llama.cpp's end-of-generation set does.
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    return frozenset(int(value) for key in keys if (value := gguf_field(reader, key)) is not None)
