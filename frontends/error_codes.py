"""Error codes another process acts on: the frontend that sends one and the orchestrator that
reads it compare the same constant, not two spellings of it."""

from __future__ import annotations

__all__ = ["KV_TRANSFER_FAILED"]

# A gen leg whose KV pull failed (frontends.disaggregation.KVTransferError): the ctx engine died
# or dropped the parked KV, the gen worker itself is fine (the orchestrator may replay it there).
KV_TRANSFER_FAILED = "kv_transfer_failed"
