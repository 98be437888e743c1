"""The DeepSeek-V4 decoder: embeddings -> hc_mult streams -> layers (attention, MoE under mHC)
-> hyper head -> norm -> logits, over a flat batch of tokens from any number of sequences.

``forward`` takes each sequence's new tokens as a contiguous slice of the
batch and its ``SequenceState``; the state is advanced in place, so a full
forward is one call from an empty state and a cached decode is the same code.
With a ``TensorParallel`` the model is one rank's share (``shard.py``): its
attention heads and experts, an all-reduce after each, and the logits
gathered on rank 0 (the other ranks get an empty tensor).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from workers.engine.model.deepseek_v4.attention import AttentionWeights, SequenceSlice, attention
from workers.engine.model.deepseek_v4.compressor import CompressorWeights
from workers.engine.model.deepseek_v4.config import AttentionKind, DeepseekV4Config, MlpKind, load_dsv4_config
from workers.engine.model.deepseek_v4.hyper import HyperConnection, HyperHead, hyper_collapse, hyper_expand, hyper_head
from workers.engine.model.deepseek_v4.indexer import IndexerWeights
from workers.engine.model.deepseek_v4.moe import MoeWeights, moe
from workers.engine.model.deepseek_v4.ops import rms_norm
from workers.engine.model.deepseek_v4.rope import RopeTable
from workers.engine.model.deepseek_v4.shard import RankShare, rank_share, shard_tensors
from workers.engine.model.deepseek_v4.state import SequenceState
from workers.engine.model.deepseek_v4.weights import load_dsv4_tensors
from workers.engine.model.parallel import TensorParallel

__all__ = ["DeepseekV4Model", "SequenceBatch"]


@dataclass(frozen=True)
class SequenceBatch:
    """One sequence's part of a forward: its ``num_new`` tokens follow the state's ``num_tokens``."""

    state: SequenceState
    num_new: int


@dataclass(frozen=True)
class _Layer:
    attn_norm: torch.Tensor
    attention: AttentionWeights
    attn_hc: HyperConnection
    ffn_norm: torch.Tensor
    moe: MoeWeights
    ffn_hc: HyperConnection


class DeepseekV4Model:
    def __init__(
        self, config: DeepseekV4Config, tensors: dict[str, torch.Tensor], tp: TensorParallel | None = None
    ) -> None:
        self.config = config
        self.tp = tp
        self.share: RankShare = rank_share(config, 0 if tp is None else tp.rank, 1 if tp is None else tp.size)
        if tp is not None:
            shard_tensors(config, tensors, tp)
        self._tensors = tensors
        self.embed = tensors["embed_tokens.weight"]
        # Tied and sharded, the head is the embedding's vocabulary shard (``shard_tensors``).
        tied = config.tie_word_embeddings and "lm_head.weight" not in tensors
        self.lm_head = self.embed if tied else tensors["lm_head.weight"]
        self.norm = tensors["norm.weight"]
        self.head = HyperHead(
            tensors["hc_head.hc_fn"],
            tensors["hc_head.hc_base"],
            tensors["hc_head.hc_scale"],
            config.hc_eps,
            config.rms_norm_eps,
        )
        self.main_rope = RopeTable(config.main_rope)
        self.compress_rope = RopeTable(config.compress_rope)
        self.layers = [self._layer(i) for i in range(config.num_layers)]
        del self._tensors

    @classmethod
    def from_dir(cls, model_dir: str | Path, tp: TensorParallel | None = None) -> DeepseekV4Model:
        config = load_dsv4_config(model_dir)
        return cls(config, load_dsv4_tensors(Path(model_dir), config), tp)

    def new_state(self) -> SequenceState:
        return SequenceState.empty(self.config)

    def forward(self, token_ids: torch.Tensor, sequences: list[SequenceBatch]) -> torch.Tensor:
        """Logits (N, vocab) for the flat ``token_ids`` (N,), sequences' tokens in the order given."""
        return self.compute_logits(self.hidden(token_ids, sequences))

    @torch.inference_mode()
    def hidden(self, token_ids: torch.Tensor, sequences: list[SequenceBatch]) -> torch.Tensor:
        """The hyper head's output (N, hidden) for the flat ``token_ids`` (N,): ``compute_logits``
        of the rows wanted gives their logits."""
        positions = torch.cat([torch.arange(s.state.num_tokens, s.state.num_tokens + s.num_new) for s in sequences])
        bounds = torch.tensor([0] + [s.num_new for s in sequences]).cumsum(0).tolist()
        streams = self.embed[token_ids].unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        for index, layer in enumerate(self.layers):
            slices = [SequenceSlice(bounds[i], bounds[i + 1], s.state.layers[index]) for i, s in enumerate(sequences)]
            rope = self.main_rope if layer.attention.kind is AttentionKind.SLIDING else self.compress_rope
            post, comb, collapsed = hyper_collapse(layer.attn_hc, streams)
            attn_in = rms_norm(collapsed, layer.attn_norm, self.config.rms_norm_eps)
            attn_out = self._all_reduce(attention(layer.attention, attn_in, positions, slices, rope))
            streams = hyper_expand(post, comb, attn_out, streams)
            post, comb, collapsed = hyper_collapse(layer.ffn_hc, streams)
            ffn_in = rms_norm(collapsed, layer.ffn_norm, self.config.rms_norm_eps)
            streams = hyper_expand(post, comb, self._all_reduce(moe(layer.moe, ffn_in, token_ids)), streams)
        for sequence in sequences:
            sequence.state.num_tokens += sequence.num_new
        return hyper_head(self.head, streams)

    @torch.inference_mode()
    def compute_logits(self, streams: torch.Tensor) -> torch.Tensor:
        """(S, vocab) logits of rows ``hidden`` gave; on ranks > 0 an empty tensor (rank 0 gathers)."""
        hidden = rms_norm(streams, self.norm, self.config.rms_norm_eps)
        logits = hidden @ self.lm_head.T
        return logits if self.tp is None else self.tp.gather_logits(logits, self.config.vocab_size)

    def _all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.tp is None else self.tp.all_reduce(partial)

    def _layer(self, index: int) -> _Layer:
        config, p = self.config, f"layers.{index}."
        kind = config.layer_kinds[index]
        return _Layer(
            attn_norm=self._take(p + "input_layernorm.weight"),
            attention=self._attention(p + "self_attn.", kind),
            attn_hc=self._hyper(p + "attn_hc."),
            ffn_norm=self._take(p + "post_attention_layernorm.weight"),
            moe=self._moe(p + "mlp.", config.mlp_kinds[index]),
            ffn_hc=self._hyper(p + "ffn_hc."),
        )

    def _attention(self, p: str, kind: AttentionKind) -> AttentionWeights:
        config = self.config
        compressor = indexer = None
        if kind is not AttentionKind.SLIDING:
            compressor = self._compressor(p + "compressor.", config.compress_rate(kind), kind is AttentionKind.CSA)
        if kind is AttentionKind.CSA:
            indexer = IndexerWeights(
                compressor=self._compressor(p + "compressor.indexer.", config.csa_rate, overlap=True),
                q_b_proj=self._take(p + "compressor.indexer.q_b_proj.weight"),
                weights_proj=self._take(p + "compressor.indexer.scorer.weights_proj.weight"),
                num_heads=config.index_n_heads,
                head_dim=config.index_head_dim,
                top_k=config.index_topk,
            )
        return AttentionWeights(
            kind=kind,
            q_a_proj=self._take(p + "q_a_proj.weight"),
            q_a_norm=self._take(p + "q_a_norm.weight"),
            q_b_proj=self._take(p + "q_b_proj.weight"),
            kv_proj=self._take(p + "kv_proj.weight"),
            kv_norm=self._take(p + "kv_norm.weight"),
            o_a_proj=self._take(p + "o_a_proj.weight"),
            o_b_proj=self._take(p + "o_b_proj.weight"),
            sinks=self._take(p + "sinks"),
            compressor=compressor,
            indexer=indexer,
            num_heads=len(self.share.heads),
            head_dim=config.head_dim,
            o_groups=len(self.share.groups),
            sliding_window=config.sliding_window,
            eps=config.rms_norm_eps,
        )

    def _compressor(self, p: str, rate: int, overlap: bool) -> CompressorWeights:
        return CompressorWeights(
            kv_proj=self._take(p + "kv_proj.weight"),
            gate_proj=self._take(p + "gate_proj.weight"),
            position_bias=self._take(p + "position_bias"),
            norm=self._take(p + "kv_norm.weight"),
            rate=rate,
            overlap=overlap,
            eps=self.config.rms_norm_eps,
        )

    def _hyper(self, p: str) -> HyperConnection:
        config = self.config
        return HyperConnection(
            self._take(p + "fn"),
            self._take(p + "base"),
            self._take(p + "scale"),
            config.hc_mult,
            config.hc_sinkhorn_iters,
            config.hc_eps,
            config.rms_norm_eps,
        )

    def _moe(self, p: str, kind: MlpKind) -> MoeWeights:
        config, is_hash = self.config, kind is MlpKind.HASH_MOE
        return MoeWeights(
            router=self._take(p + "gate.weight"),
            correction_bias=None if is_hash else self._tensors.get(p + "gate.e_score_correction_bias"),
            tid2eid=self._take(p + "gate.tid2eid") if is_hash else None,
            gate=self._take(p + "experts.gate"),
            up=self._take(p + "experts.up"),
            down=self._take(p + "experts.down"),
            experts=self.share.experts,
            shared_gate=self._take(p + "shared_experts.gate_proj.weight"),
            shared_up=self._take(p + "shared_experts.up_proj.weight"),
            shared_down=self._take(p + "shared_experts.down_proj.weight"),
            top_k=config.num_experts_per_tok,
            scoring=config.scoring_func,
            norm_topk_prob=config.norm_topk_prob,
            routed_scaling_factor=config.routed_scaling_factor,
            swiglu_limit=config.swiglu_limit,
        )

    def _take(self, name: str) -> torch.Tensor:
        if name not in self._tensors:
            raise ValueError(f"deepseek_v4 checkpoint: tensor {name!r} is missing")
        return self._tensors[name]
