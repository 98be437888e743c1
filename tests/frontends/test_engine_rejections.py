"""An engine's error output as the client's error: the request's own fault a 400, the engine's a 500
(which the orchestrator retries on another worker, ``orchestrator.flow``)."""

from __future__ import annotations

import pytest

from api.errors import EngineFailedError, InvalidRequestError, http_error
from api.generation import rejection
from workers.protocol import CLIENT_REJECTIONS, FinishReason, RejectReason, RequestOutput


def aborted(reason: RejectReason | None, error: str = "why") -> RequestOutput:
    return RequestOutput(7, [], FinishReason.ABORT, error=error, reject_reason=reason)


@pytest.mark.parametrize("reason", sorted(CLIENT_REJECTIONS))
def test_a_known_rejection_is_the_clients_400(reason):
    error = rejection(aborted(reason, "prompt is empty"), "prompt is empty")
    assert type(error) is InvalidRequestError and http_error(error).status == 400
    assert error.message == "prompt is empty"


@pytest.mark.parametrize("reason", [r for r in RejectReason if r not in CLIENT_REJECTIONS] + [None])
def test_any_other_engine_error_is_a_500_and_logged(reason, caplog):
    error = rejection(aborted(reason, "ValueError: request id 7 is already in the engine"),
                      "ValueError: request id 7 is already in the engine")
    assert isinstance(error, EngineFailedError)
    api = http_error(error)
    assert api.status == 500 and api.code == "engine_error" and "already in the engine" in api.message
    assert "request 7: the engine failed it" in caplog.text


def test_the_reason_travels_with_the_output_on_the_engine_wire():
    import msgspec

    output = aborted(RejectReason.INTERNAL)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(output), type=RequestOutput)
    assert decoded.reject_reason is RejectReason.INTERNAL and decoded.finish_reason is FinishReason.ABORT
