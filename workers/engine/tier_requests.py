"""The scheduler's requests in ``ONBOARDING``: whose prefix is being copied back from the host and
disk tiers (``kv_tiers``) into pool blocks they already hold, and what each holds meanwhile.

The scheduler owns every status change; this table owns the blocks' side: it takes the hits out
of their tiers and allocates pool blocks for them (``start``), and when a copy is done keeps the
blocks it filled, drops the rest and caches the filled ones (``collect``). A request aborted while
its copy runs keeps its blocks until the copy is done (the copy still writes them), then they are
freed here. Single-threaded, like the scheduler: the copy itself runs on the tiers' thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.block_hash import BlockHash
from workers.engine.block_manager import BlockManager
from workers.engine.kv_tiers import KVTiers
from workers.engine.request import Request

__all__ = ["TierRequests", "TierCopy"]


@dataclass(slots=True)
class TierCopy:
    request: Request
    num_hits: int  # the pool's own hits, before the copied blocks
    remote: bool  # its KV is pulled from a remote engine once the copy is done (gen side)


class TierRequests:
    def __init__(self, block_manager: BlockManager, tiers: KVTiers) -> None:
        self.block_manager, self.tiers = block_manager, tiers
        self._copies: dict[int, TierCopy] = {}
        self._abandoned: dict[int, Request] = {}
        self._charges: dict[int, int] = {}  # request id -> blocks copied in, charged when it is scheduled

    def start(self, request: Request, hits: list[int], lower: list[BlockHash], remote: bool) -> bool:
        """Allocate pool blocks for the ``lower`` tier hits after the pool's ``hits`` and start
        copying them in; False (nothing taken) when the pool has no room now."""
        taken = self.tiers.take(lower)  # first: the allocation's evictions must not push them out
        if not self.block_manager.try_allocate(request, len(lower) * self.block_manager.block_size, hits):
            self.tiers.put_back(taken)
            return False
        self._copies[request.request_id] = TierCopy(request, len(hits), remote)
        self.tiers.onboard(request.request_id, request.block_ids[len(hits):], taken)
        return True

    def collect(self) -> list[TierCopy]:
        """Copies done: their requests hold the copied blocks, cached, with ``num_computed_tokens``
        covering them (a copy that failed part way keeps the blocks before the failure)."""
        done = []
        block_manager = self.block_manager
        for request_id, num_loaded in self.tiers.collect():
            abandoned = self._abandoned.pop(request_id, None)
            if abandoned is not None:
                block_manager.free(abandoned)
                continue
            copy = self._copies.pop(request_id)
            block_manager.keep_blocks(copy.request, copy.num_hits + num_loaded)
            copy.request.num_computed_tokens = (copy.num_hits + num_loaded) * block_manager.block_size
            block_manager.cache_full_blocks(copy.request)
            if not copy.remote:
                self._charges[request_id] = num_loaded
            done.append(copy)
        return done

    def abandon(self, request: Request) -> TierCopy:
        """The request was aborted mid-copy: its blocks are freed when the copy is done."""
        self._abandoned[request.request_id] = request
        return self._copies.pop(request.request_id)

    def is_abandoned(self, request_id: int) -> bool:
        return request_id in self._abandoned

    def take_charge(self, request_id: int) -> int:
        """Blocks copied in for this request, once (what the timing model charges the step it joins)."""
        return self._charges.pop(request_id, 0) if self._charges else 0

    def has_done(self) -> bool:
        return self.tiers.has_done()

    @property
    def num_in_flight(self) -> int:
        return len(self._copies) + len(self._abandoned)

    @property
    def num_abandoned(self) -> int:
        return len(self._abandoned)
