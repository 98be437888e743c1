"""Client ids: which frontend owns a request, readable from the id alone.

A client id is a uint64. Range table::

    bits 63..48  frontend id (0 .. 65535)      client_id >> FRONTEND_SHIFT
    bits 47..0   per-frontend sequence number  client_id & LOCAL_MASK

Frontend 0's ids are its bare sequence numbers (0, 1, 2, ...): exactly what a
single-frontend worker would use. The engine routes each output to the lane of
the frontend in the top bits; an id whose frontend has no lane goes to lane 0,
so an output is never silently lost to a lane that does not exist.
"""

from __future__ import annotations

import itertools

__all__ = [
    "FRONTEND_SHIFT",
    "MAX_FRONTENDS",
    "LOCAL_MASK",
    "make_client_id",
    "frontend_of",
    "lane_of",
    "ClientIdAllocator",
]

FRONTEND_SHIFT = 48
MAX_FRONTENDS = 1 << 16
LOCAL_MASK = (1 << FRONTEND_SHIFT) - 1


def make_client_id(frontend_id: int, local_id: int) -> int:
    if not 0 <= frontend_id < MAX_FRONTENDS:
        raise ValueError(f"frontend_id must be in [0, {MAX_FRONTENDS}), got {frontend_id}")
    if not 0 <= local_id <= LOCAL_MASK:
        raise ValueError(f"local_id must be in [0, 2**48), got {local_id}")
    return (frontend_id << FRONTEND_SHIFT) | local_id


def frontend_of(client_id: int) -> int:
    return client_id >> FRONTEND_SHIFT


def lane_of(client_id: int, num_lanes: int) -> int:
    """The lane an output goes to: its frontend's, or lane 0 when unroutable."""
    frontend_id = frontend_of(client_id)
    return frontend_id if 0 <= frontend_id < num_lanes else 0


class ClientIdAllocator:
    """Hands out one frontend's client ids in order. One per frontend process."""

    def __init__(self, frontend_id: int, first_local_id: int = 0) -> None:
        make_client_id(frontend_id, first_local_id)  # validates both
        self.frontend_id = frontend_id
        # A respawned frontend starts past its predecessor's ids (see AttachInfo.generation).
        self._sequence = itertools.count(first_local_id)

    def next_id(self) -> int:
        return make_client_id(self.frontend_id, next(self._sequence) & LOCAL_MASK)
