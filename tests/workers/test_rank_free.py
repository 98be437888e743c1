"""Rank 0 tells its followers the blocks its block manager frees (``RankFree``), for a runner that
keeps state by block (DeepSeek-V4's), over the real signed link; Llama's runner gets no hook."""

from __future__ import annotations

import secrets

import zmq

from tests.worker_process import free_port
from workers.engine.leader_executor import LeaderExecutor
from workers.rank_link import FollowerLink, LeaderLink
from workers.rank_protocol import RankFree, RankHello

SHAPE = {"eos_token_ids": frozenset(), "vocab_size": 8, "num_blocks": 4, "block_size": 16, "max_model_len": 64,
         "kv_bytes_per_block": 1}


class _PagedRunner:  # the block manager owns its pool: nothing to drop when blocks are freed
    def __init__(self) -> None:
        self.__dict__.update(SHAPE)


class _StatefulRunner(_PagedRunner):
    def __init__(self) -> None:
        super().__init__()
        self.freed: list[list[int]] = []

    def blocks_freed(self, block_ids: list[int]) -> None:
        self.freed.append(block_ids)


def test_freed_blocks_reach_every_follower_in_order() -> None:
    ctx, key, port = zmq.Context(), secrets.token_bytes(32), free_port()
    leader = LeaderLink(ctx, key, 3, "127.0.0.1", port)
    followers = [FollowerLink(ctx, key, rank, "127.0.0.1", port) for rank in (1, 2)]
    try:
        for follower in followers:
            follower.send(RankHello(follower.rank, 0))
        leader.wait_hellos(10)
        inner = _StatefulRunner()
        executor = LeaderExecutor(inner, leader, wait_for_acks=False)  # type: ignore[arg-type]
        executor.blocks_freed([3, 1])
        executor.blocks_freed([2])
        assert inner.freed == [[3, 1], [2]]  # rank 0's own runner, at once
        for follower in followers:
            assert [follower.recv(5000), follower.recv(5000)] == [RankFree([3, 1]), RankFree([2])]
        # A paged runner: the core finds no hook (getattr None) and no frame is sent.
        assert getattr(LeaderExecutor(_PagedRunner(), leader, wait_for_acks=False), "blocks_freed", None) is None
    finally:
        for follower in followers:
            follower.close()
        leader.stop()
        ctx.term()
