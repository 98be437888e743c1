"""Ids of a frontend's answers (``chatcmpl-…``, ``cmpl-…``, ``msg_…``).

Each is 32 hex digits, as ``uuid4().hex`` was, drawn as a random 64-bit
prefix per process and a 64-bit counter: unique across a worker's
frontends, its restarts and the cluster (a prefix collision between two
processes is a 1-in-2**64 event per pair), for a tenth of a uuid4's cost,
which reads the system's random source on every call. These ids name an
answer; nothing is looked up or authorized by them (stored responses keep
their random ids, ``api.responses``).
"""

from __future__ import annotations

import itertools
import os

__all__ = ["ResponseIds"]


class ResponseIds:
    """A process's source of answer ids (one per ``ServingContext``)."""

    def __init__(self) -> None:
        self._prefix = os.urandom(8).hex()
        self._counter = itertools.count()

    def next_hex(self) -> str:
        """32 hex digits, never the same twice from this object."""
        return f"{self._prefix}{next(self._counter):016x}"
