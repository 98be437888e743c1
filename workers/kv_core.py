"""What the KV-transfer agent (``kv_transfer.KVTransferAgent``) uses of the engine core it serves.

Two classes stand behind it: ``engine.core.EngineCore`` (rank 0, or a single-rank engine) and
``kv_rank_pulls.FollowerKVStore`` (a tensor-parallel follower rank, which only serves pulls).
mypy checks both against this protocol, so a method the agent starts calling must exist on
both before the code type-checks, instead of failing every TP ctx worker at run time.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # the agent's module graph stays as it was: the engine is imported by the shell
    from workers.engine.request import Request
    from workers.engine.scheduler import KVPull
    from workers.protocol import EngineRequest


class KVCore(Protocol):
    @property
    def kv_bytes_per_block(self) -> int:
        """What ``export_blocks`` sends per block: sizes KV-transfer messages."""
        ...

    # ctx side: parked tables, served to pulls
    def parked_block_ids(self, request_id: int) -> list[int] | None: ...

    def parked_deadline(self, request_id: int) -> float | None: ...

    def release_parked(self, request_id: int) -> bool: ...

    def release_expired(self, now: float) -> list[int]: ...

    def export_blocks(self, block_ids: list[int]) -> Sequence[Any]: ...

    def export_heads(self, block_ids: list[int], heads: range) -> Sequence[Any]: ...

    # gen side: requests whose KV is pulled
    def add_request(self, engine_request: EngineRequest, park_kv_seconds: float | None = None) -> Request: ...

    def add_remote_request(self, engine_request: EngineRequest, output_token_ids: Sequence[int] = (),
                           park_kv_seconds: float | None = None, num_remote_tokens: int | None = None) -> Request: ...

    def take_kv_pulls(self) -> list[KVPull]: ...

    def has_kv_pulls(self) -> bool: ...

    def import_blocks(self, block_ids: list[int], buffers: list[Any]) -> None: ...

    def finish_remote_kv(self, request_id: int) -> None: ...

    def recompute_remote(self, request_id: int) -> bool: ...

    def abort(self, request_id: int) -> None: ...
