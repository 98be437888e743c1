"""The paged KV cache's bookkeeping: one pool of fixed-size blocks.

Torch-free: it hands out block ids; the executor owns the memory behind them.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from common.block_hash import BlockHash, hash_block_tokens
from workers.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventQueue
from workers.engine.kv_tiers import KVTiers
from workers.engine.request import Request

__all__ = ["BlockManager", "NoFreeBlocksError", "BlockIntegrityError"]


class NoFreeBlocksError(RuntimeError):
    """``allocate`` was called when ``can_allocate`` would have said no."""


class BlockIntegrityError(RuntimeError):
    """The block manager's books do not balance (a bug, never a user error)."""


@dataclass(slots=True)
class _Block:
    block_id: int
    ref_count: int = 0
    # Set together when the block is registered in the prefix cache; the
    # parent hash and tokens are compared on a hit (see block_hash's collision policy).
    block_hash: BlockHash | None = None
    parent_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None


@dataclass(slots=True)
class _Table:
    """A live request's block table plus the hashes of its committed full blocks."""

    request: Request
    hashes: list[BlockHash] = field(default_factory=list)  # one per committed full block


@dataclass(slots=True)
class _Parked:
    block_ids: list[int]
    deadline: float | None


class BlockManager:
    """Reference-counted blocks with prefix caching and LRU eviction.

    Every block is in exactly one state:

        free    ref_count == 0, no hash       in ``_free`` (FIFO)
        cached  ref_count == 0, hash          in ``_evictable`` (LRU, oldest freed first)
        in use  ref_count > 0, hash or not    held by request tables and parked tables

    Invariants (``check_integrity`` verifies them):
      - free + cached + in use == num_blocks;
      - a block's ref_count is the number of tables (live requests' block
        tables and parked tables) that hold it; in-use blocks are never
        evicted, so parked blocks cannot be evicted either;
      - a hash maps to exactly one block and that block carries the hash;
        a second block computing the same content stays unregistered;
      - only full blocks whose KV is computed are registered
        (``cache_full_blocks`` after a step, never at allocation).

    Allocation takes free blocks first and then evicts the cached block freed
    longest ago (one ``BlockRemoved`` event per allocation). ``free`` releases a
    request's blocks tail first, so a prefix outlives its suffixes. A hit
    (``get_computed_blocks``) never covers the whole sequence: at least one
    token is computed so the step has logits to sample.

    Disaggregation: ``park`` moves a finished request's blocks into a parked
    table (still in use, hits still shared) until ``release`` or a deadline.
    A request whose KV will be imported (``WAITING_FOR_REMOTE_KV``) allocates
    like a prefill (``get_computed_blocks`` then ``allocate`` for the rest of
    the prompt); the importer writes the blocks past the hits, then the
    scheduler advances ``num_computed_tokens`` and calls ``cache_full_blocks``.
    Tiers (``tiers``, ``workers.engine.kv_tiers``): an evicted cached block is copied into the
    host tier before its id is reused. ``lower_tier_hits`` continues a prefix past the pool's hits
    into the tiers; the scheduler allocates pool blocks for those (``try_allocate`` of their
    tokens), the tiers copy the KV in, and ``keep_blocks`` drops the ones whose copy failed.
    ``on_free`` is told the blocks that become free (no table holds them, no hash keeps them), once
    per release: an executor that keeps state outside the pool per sequence drops it then.
    Single-threaded: the engine loop is the only caller.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        hash_seed: int = 0,
        enable_prefix_caching: bool = True,
        events: KVEventQueue | None = None,
        tiers: KVTiers | None = None,
        on_free: Callable[[list[int]], None] | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.enable_prefix_caching = enable_prefix_caching
        self.events = events if events is not None else KVEventQueue()
        self.tiers = tiers
        self.on_free = on_free
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[BlockHash, int] = {}
        self._tables: dict[int, _Table] = {}
        self._parked: dict[int, _Parked] = {}

    # ---- usage -------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def cached_block_hashes(self) -> list[int]:  # plain ints: they go on the wire (KVCacheSnapshot)
        """Every hash a prefix lookup can hit now (what the KV events have published, net)."""
        return list(self._cached)

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold a reusable hash (evictable)."""
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free) - len(self._evictable)

    @property
    def num_available_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_parked_blocks(self) -> int:
        # Distinct blocks: parked requests that shared a prefix share its blocks.
        return len({block_id for p in self._parked.values() for block_id in p.block_ids})

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._blocks[block_id].block_hash

    # ---- allocation --------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> list[int]:
        """The longest chain of cached full blocks that prefixes the request's tokens."""
        if not self.enable_prefix_caching:
            return []
        # (A fresh request's tokens are its prompt: no concatenation per admission.)
        tokens = request.all_token_ids if request.output_token_ids else request.prompt_token_ids
        bs = self.block_size
        hits: list[int] = []
        parent: BlockHash | None = None
        for i in range((len(tokens) - 1) // bs):  # never the last token
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            block_hash = hash_block_tokens(parent, chunk, self.hash_seed)
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            block = self._blocks[block_id]
            if block.token_ids != chunk or block.parent_hash != parent:
                break  # a hash collision: a miss, never wrong KV
            hits.append(block_id)
            parent = block_hash
        return hits

    def lower_tier_hits(self, request: Request, hits: Sequence[int]) -> list[BlockHash]:
        """The blocks after the pool's ``hits`` that the host and disk tiers hold, chained as
        ``get_computed_blocks`` chains them (never the last token's block)."""
        if self.tiers is None:
            return []
        tokens = request.all_token_ids if request.output_token_ids else request.prompt_token_ids
        bs = self.block_size
        parent = self._blocks[hits[-1]].block_hash if hits else None
        found: list[BlockHash] = []
        for i in range(len(hits), (len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            block_hash = hash_block_tokens(parent, chunk, self.hash_seed)
            if not self.tiers.find(block_hash, parent, chunk):
                if not found:
                    self.tiers.count_miss()
                break
            found.append(block_hash)
            parent = block_hash
        return found

    def keep_blocks(self, request: Request, num_blocks: int) -> None:
        """Release the request's blocks past its first ``num_blocks`` (onboarding copied no KV into them)."""
        dropped = request.block_ids[num_blocks:]
        if dropped:
            del request.block_ids[num_blocks:]
            self._release_blocks(dropped)

    def can_allocate(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Whether ``allocate`` can cover ``num_new_tokens`` more tokens (after the hits)."""
        return self._fits(self._num_new_blocks(request, num_new_tokens, computed_blocks), computed_blocks)

    def _fits(self, num_new_blocks: int, computed_blocks: Sequence[int]) -> bool:
        if not computed_blocks:
            return num_new_blocks <= len(self._free) + len(self._evictable)
        # A hit on a cached block takes it out of the evictable pool.
        num_revived = 0
        for block_id in computed_blocks:  # (a loop, not a generator: per admission)
            if self._blocks[block_id].ref_count == 0:
                num_revived += 1
        return num_new_blocks + num_revived <= self.num_available_blocks

    def allocate(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> None:
        """Take the hit blocks and enough new blocks for ``num_new_tokens`` more tokens.

        Slots cover positions up to ``num_computed_tokens + len(hits) * block_size
        + num_new_tokens``; the caller advances ``num_computed_tokens``.
        """
        if not self.try_allocate(request, num_new_tokens, computed_blocks):
            raise NoFreeBlocksError(
                f"request {request.request_id} needs more blocks than the {self.num_available_blocks} available"
            )

    def try_allocate(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """``allocate`` when ``can_allocate`` would say yes, in one count; False (nothing taken) otherwise."""
        num_new_blocks = self._num_new_blocks(request, num_new_tokens, computed_blocks)
        if not self._fits(num_new_blocks, computed_blocks):
            return False
        table = self._tables.get(request.request_id)
        if table is None:  # (not setdefault: that built a _Table at every allocation, a decode's new block too)
            table = self._tables[request.request_id] = _Table(request)
        for block_id in computed_blocks:
            self._touch(block_id)
            request.block_ids.append(block_id)
            table.hashes.append(self._blocks[block_id].block_hash)  # type: ignore[arg-type]  # a hit: hashed
        evicted: list[int] = []
        for _ in range(num_new_blocks):
            request.block_ids.append(self._take_block(evicted))
        if evicted:
            self.events.publish(BlockRemoved(block_hashes=evicted))
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that became full and computed since the last call."""
        table = self._tables.get(request.request_id)
        num_full = request.num_computed_tokens // self.block_size
        if not self.enable_prefix_caching or table is None or num_full <= len(table.hashes):
            return  # the common decode step: no block filled up
        bs, tokens = self.block_size, request.all_token_ids
        parent = table.hashes[-1] if table.hashes else None
        run: list[BlockHash] = []  # consecutive newly registered blocks, one event each run
        run_parent = parent
        for i in range(len(table.hashes), num_full):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            block_hash = hash_block_tokens(parent, chunk, self.hash_seed)
            table.hashes.append(block_hash)
            block = self._blocks[request.block_ids[i]]
            if block_hash in self._cached:  # another block holds the same content
                self._publish_stored(run, run_parent, tokens, i - len(run))
                run, run_parent = [], block_hash
            else:
                block.block_hash, block.parent_hash, block.token_ids = block_hash, parent, chunk
                self._cached[block_hash] = block.block_id
                run.append(block_hash)
            parent = block_hash
        self._publish_stored(run, run_parent, tokens, len(table.hashes) - len(run))

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (so a prefix is evicted last)."""
        self._tables.pop(request.request_id, None)
        self._release_blocks(request.block_ids)
        request.block_ids = []

    # ---- disaggregation ----------------------------------------------------

    def park(self, request: Request, deadline: float | None = None) -> None:
        """Keep a finished request's blocks (in use, not evictable) until ``release``."""
        if request.request_id in self._parked:
            raise ValueError(f"request {request.request_id} already has parked blocks")
        self._tables.pop(request.request_id, None)
        self._parked[request.request_id] = _Parked(request.block_ids, deadline)
        request.block_ids = []

    def parked_block_ids(self, request_id: int) -> list[int] | None:
        parked = self._parked.get(request_id)
        return None if parked is None else list(parked.block_ids)

    def parked_deadline(self, request_id: int) -> float | None:
        """When a parked table is released unless acknowledged first (``time.time()`` seconds);
        None when nothing is parked under that id or it never expires."""
        parked = self._parked.get(request_id)
        return None if parked is None else parked.deadline

    def release(self, request_id: int) -> bool:
        """Free a parked request's blocks; False when nothing was parked under that id."""
        parked = self._parked.pop(request_id, None)
        if parked is None:
            return False
        self._release_blocks(parked.block_ids)
        return True

    def next_deadline(self) -> float | None:
        """The earliest parked table's deadline (``time.time()`` seconds); None when none expires."""
        return min((p.deadline for p in self._parked.values() if p.deadline is not None), default=None)

    def release_expired(self, now: float) -> list[int]:
        """Release every parked table whose deadline has passed; their request ids."""
        expired = [rid for rid, p in self._parked.items() if p.deadline is not None and p.deadline <= now]
        for rid in expired:
            self.release(rid)
        return expired

    # ---- cache reset ---------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; False (and nothing done) while an in-use block carries one."""
        if any(self._blocks[b].ref_count > 0 for b in self._cached.values()):
            return False
        freed = list(self._evictable)
        for block_id in freed:
            block = self._blocks[block_id]
            block.block_hash = block.parent_hash = block.token_ids = None
            self._free.append(block_id)
        self._evictable.clear()
        if freed and self.on_free is not None:
            self.on_free(freed)
        self._cached.clear()
        if self.tiers is not None:
            self.tiers.clear()
        self.events.publish(AllBlocksCleared())
        return True

    # ---- integrity ---------------------------------------------------------

    def check_idle(self) -> None:
        """The cheap check for an engine with no live request: only parked blocks are in use."""
        num_parked = self.num_parked_blocks
        if self._tables or self.num_used_blocks != num_parked:
            raise BlockIntegrityError(
                f"idle, yet {len(self._tables)} request tables are live and "
                f"{self.num_used_blocks} blocks are in use ({num_parked} parked): blocks leaked"
            )

    def check_integrity(self) -> None:
        """Raise ``BlockIntegrityError`` listing every broken invariant."""
        holders: Counter[int] = Counter()
        for table in self._tables.values():
            holders.update(table.request.block_ids)
        for parked in self._parked.values():
            holders.update(parked.block_ids)
        free, evictable = set(self._free), set(self._evictable)
        errors: list[str] = []
        if len(free) != len(self._free):
            errors.append("a block is in the free queue twice")
        for block in self._blocks:
            errors += self._block_errors(block, holders[block.block_id], free, evictable)
        for block_hash, block_id in self._cached.items():
            if self._blocks[block_id].block_hash != block_hash:
                errors.append(f"hash {block_hash:#x} maps to block {block_id} which does not carry it")
        if self.tiers is not None:
            errors += self.tiers.integrity_errors()
        total = self.num_free_blocks + self.num_cached_blocks + self.num_used_blocks
        if total != self.num_blocks or len(free | evictable) != len(free) + len(evictable):
            errors.append(f"free + cached + used = {total}, pool has {self.num_blocks}")
        if errors:
            raise BlockIntegrityError("; ".join(errors[:20]))

    def _block_errors(self, block: _Block, num_holders: int, free: set[int], evictable: set[int]) -> list[str]:
        bid, errors = block.block_id, []
        if block.ref_count != num_holders:
            errors.append(f"block {bid} has ref_count {block.ref_count} but {num_holders} holders")
        if block.block_hash is not None and self._cached.get(block.block_hash) != bid:
            errors.append(f"block {bid} carries an unregistered hash")
        if block.ref_count > 0 and (bid in free or bid in evictable):
            errors.append(f"block {bid} is in use and in a free pool")
        if block.ref_count == 0 and (bid in free) == (bid in evictable):
            errors.append(f"block {bid} is unused but in {'both' if bid in free else 'neither'} free pools")
        if bid in free and block.block_hash is not None:
            errors.append(f"free block {bid} still carries a hash")
        if bid in evictable and block.block_hash is None:
            errors.append(f"evictable block {bid} carries no hash")
        return errors

    # ---- internals ---------------------------------------------------------

    def _num_new_blocks(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int]) -> int:
        if computed_blocks and (request.block_ids or request.num_computed_tokens):
            raise ValueError(f"request {request.request_id}: prefix hits only apply to a request with no blocks")
        num_tokens = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        num_blocks = -(-num_tokens // self.block_size)
        return max(0, num_blocks - len(request.block_ids) - len(computed_blocks))

    def _touch(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._evictable[block_id]
        block.ref_count += 1

    def _take_block(self, evicted: list[int]) -> int:
        if self._free:
            block = self._blocks[self._free.popleft()]
        else:
            block = self._blocks[self._evictable.popitem(last=False)[0]]
            evicted.append(block.block_hash)  # type: ignore[arg-type]  # evictable means cached: hashed
            if self.tiers is not None:  # its KV is still intact: the id is reused only after this
                self.tiers.offload(block.block_id, block.block_hash, block.parent_hash,  # type: ignore[arg-type]
                                   block.token_ids)  # type: ignore[arg-type]  # (hashed blocks carry both)
            del self._cached[block.block_hash]  # type: ignore[arg-type]  # (as above)
            block.block_hash = block.parent_hash = block.token_ids = None
        block.ref_count = 1
        return block.block_id

    def _release_blocks(self, block_ids: list[int]) -> None:
        freed = []
        for block_id in reversed(block_ids):
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    self._free.append(block_id)
                    freed.append(block_id)
                else:
                    self._evictable[block_id] = None
        if freed and self.on_free is not None:
            self.on_free(freed)

    def _publish_stored(self, run: list[BlockHash], parent: BlockHash | None, tokens: list[int], first: int) -> None:
        if run:
            bs = self.block_size
            self.events.publish(
                BlockStored(
                    block_hashes=list(run),
                    parent_block_hash=parent,
                    token_ids=tokens[first * bs : (first + len(run)) * bs],
                    block_size=bs,
                )
            )
