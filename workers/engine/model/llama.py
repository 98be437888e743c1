"""The Llama-family decoder (Llama, Mistral, Qwen2 shapes) over the paged KV cache.

Every linear layer runs once on all tokens of a step, flattened to (N, ...);
only attention looks at sequence boundaries (``AttentionMetadata``).
q/k/v and gate/up projections are fused; ``loader`` concatenates the
Hugging Face tensors into them.

With ``tp`` (a ``TensorParallel``, ``parallel.py``) each module is built at
its shard's size and the row-parallel outputs are all-reduced; with None
(one rank) the model is exactly the unsharded one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.engine.attention import AttentionMetadata, paged_attention
from workers.engine.kv_cache import KVCache
from workers.engine.model.layers import RMSNorm, SwiGLUMLP
from workers.engine.model.model_config import ModelConfig
from workers.engine.model.parallel import TensorParallel
from workers.engine.model.rope import RotaryEmbedding, apply_rotary


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.tp = tp
        shard = tp.heads(config.num_heads, config.num_kv_heads) if tp else None
        self.num_heads = len(shard.q_heads) if shard else config.num_heads
        self.num_kv_heads = len(shard.kv_heads) if shard else config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)

    def forward(
        self,
        hidden: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # (N, q_size + 2 * kv_size)
        # q and k heads side by side rotate in one pass.
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(qk, *cos_sin).split([self.num_heads, self.num_kv_heads], dim=1)  # (N, H | KVH, D)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)  # (N, KVH, D)
        out = paged_attention(
            q, k, v, kv_cache.key_cache(self.layer_index), kv_cache.value_cache(self.layer_index), metadata
        )
        out = self.o_proj(out.reshape(num_tokens, self.q_size))  # (N, hidden), partial under TP
        return out if self.tp is None else self.tp.all_reduce(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_index, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        intermediate = config.intermediate_size // tp.size if tp else config.intermediate_size
        self.mlp = SwiGLUMLP(config.hidden_size, intermediate)

    def forward(
        self,
        hidden: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos_sin, kv_cache, metadata)
        mlp_out = self.mlp(self.post_attention_layernorm(hidden))  # partial sums under TP
        return hidden + (mlp_out if self.tp is None else self.tp.all_reduce(mlp_out))


class LlamaForCausalLM(nn.Module):
    def __init__(
        self, config: ModelConfig, max_positions: int, device: torch.device, tp: TensorParallel | None = None
    ) -> None:
        """Parameters are created on the current default device (the loader uses meta);
        the RoPE tables for ``max_positions`` positions on ``device``."""
        super().__init__()
        self.config = config
        self.tp = tp
        if tp is None:
            self.embed_tokens: nn.Embedding | VocabParallelEmbedding = nn.Embedding(config.vocab_size, config.hidden_size)
            vocab_rows = config.vocab_size
        else:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
            vocab_rows = self.embed_tokens.weight.shape[0]
        self.rotary = RotaryEmbedding(config, max_positions, device)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, vocab_rows, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def num_kv_heads(self) -> int:
        """This rank's KV heads (all of them without TP): the width of its KV cache."""
        layer = self.layers[0]
        assert isinstance(layer, LlamaDecoderLayer)  # nn.ModuleList types its items as bare Modules
        return layer.self_attn.num_kv_heads

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states (N, hidden) of the step's tokens; their K/V land in ``kv_cache``."""
        hidden = self.embed_tokens(input_ids)  # (N, hidden)
        cos_sin = self.rotary.cos_sin(positions, hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, cos_sin, kv_cache, metadata)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(S, hidden) -> (S, vocab) float32 logits (under TP: on rank 0; (S, 0) on the others)."""
        logits = self.lm_head(hidden).float()
        return logits if self.tp is None else self.tp.gather_logits(logits, self.config.vocab_size)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding (``TensorParallel.vocab_rows``, zero-padded);
    ids outside them contribute zeros, and the all-reduce assembles every id's row."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        rows, padded = tp.vocab_rows(vocab_size)
        self.start, self.stop = rows.start, rows.stop
        self.weight = nn.Parameter(torch.empty(padded, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        outside = (input_ids < self.start) | (input_ids >= self.stop)  # (N,)
        local = (input_ids - self.start).masked_fill_(outside, 0)
        hidden = F.embedding(local, self.weight).masked_fill_(outside.unsqueeze(1), 0.0)  # (N, hidden)
        return self.tp.all_reduce(hidden)
