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


def run_disaggregated(ctx: EngineCore, gen: EngineCore, first_leg: EngineRequest,
                      request: EngineRequest) -> tuple[RequestOutput, list[RequestOutput]]:
    """The disaggregated flow between two engines: ``ctx`` prefills ``first_leg`` (``max_tokens`` 1)
    and parks its KV, ``gen`` pulls it (the whole prompt) and decodes ``request`` to the end; the
    ctx leg's one output and the gen leg's outputs. Both engines hold no blocks of it afterwards."""
    request_id = request.request_id
    ctx.add_request(first_leg, park_kv_seconds=60.0)
    (first,) = run(ctx)[request_id]
    gen.add_remote_request(request, output_token_ids=first.new_token_ids)
    gen.step()
    (pull,) = gen.take_kv_pulls()
    gen.import_blocks(pull.block_ids, ctx.export_blocks(ctx.parked_block_ids(request_id)[pull.first_block:]))
    assert ctx.release_parked(request_id)
    gen.finish_remote_kv(request_id)
    return first, run(gen)[request_id]


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]
