"""Running requests through an EngineCore to completion, for engine-level tests."""

from __future__ import annotations

from workers.engine.core import EngineCore
from workers.protocol import EngineRequest, RequestOutput


def run(core: EngineCore, *requests: EngineRequest) -> dict[int, list[RequestOutput]]:
    """Add ``requests``, step until none is unfinished (checking block integrity after each
    step); every request's outputs in order."""
    for request in requests:
        core.add_request(request)
    outputs: dict[int, list[RequestOutput]] = {}
    while core.has_unfinished():
        for output in core.step():
            outputs.setdefault(output.request_id, []).append(output)
        core.check_integrity()
    return outputs


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]
