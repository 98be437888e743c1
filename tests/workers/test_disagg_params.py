"""Signing and checking disaggregated_params; loading the cluster key."""

from __future__ import annotations

import time

import msgspec
import pytest

from workers.disagg_params import (
    ClusterKeyError,
    DisaggParams,
    DisaggParamsError,
    RequestType,
    load_cluster_key,
    signed_params,
    verify_params,
)

KEY = bytes(range(32))
PROMPT = [5, 6, 7, 8, 9]


def _gen_params(**changes) -> DisaggParams:
    ctx = signed_params(KEY, "281474976710657", "tcp://127.0.0.1:5555", len(PROMPT), 42, time.time() + 60, PROMPT)
    params = msgspec.structs.replace(ctx, request_type=RequestType.GENERATION_ONLY)
    return msgspec.structs.replace(params, **changes)


def test_signed_params_verify_and_return_the_prompt():
    assert verify_params(KEY, _gen_params()) == PROMPT


def test_the_signature_is_the_documented_hmac():
    import hashlib
    import hmac
    import struct

    params = _gen_params()
    prompt_hash = hashlib.sha256(struct.pack("<5q", *PROMPT)).hexdigest()
    message = msgspec.msgpack.encode([params.ctx_request_id, params.kv_endpoint, params.num_tokens,
                                      params.first_token_id, params.expires_at, prompt_hash])
    assert params.signature == hmac.new(KEY, message, hashlib.sha256).hexdigest()


@pytest.mark.parametrize("change", [
    {"kv_endpoint": "tcp://10.0.0.1:5555"}, {"ctx_request_id": "2"}, {"num_tokens": 4}, {"first_token_id": 43},
    {"expires_at": time.time() + 600}, {"prompt_token_ids": [5, 6, 7, 8, 10]}, {"signature": "00" * 32},
])
def test_any_changed_field_fails(change):
    with pytest.raises(DisaggParamsError, match="signature"):
        verify_params(KEY, _gen_params(**change))


def test_another_key_missing_fields_and_expiry_fail():
    with pytest.raises(DisaggParamsError, match="signature"):
        verify_params(b"x" * 32, _gen_params())
    with pytest.raises(DisaggParamsError, match="lack signature"):
        verify_params(KEY, _gen_params(signature=None))
    with pytest.raises(DisaggParamsError, match="expired"):
        verify_params(KEY, _gen_params(), now=time.time() + 61)


def test_cluster_key_file_must_be_private(tmp_path):
    path = tmp_path / "key"
    path.write_text(KEY.hex() + "\n")
    path.chmod(0o644)
    with pytest.raises(ClusterKeyError, match="mode 644"):
        load_cluster_key(path)
    path.chmod(0o600)
    assert load_cluster_key(path) == KEY
    raw = tmp_path / "raw"
    raw.write_bytes(b"\xff" * 20)
    raw.chmod(0o600)
    assert load_cluster_key(raw) == b"\xff" * 20
    short = tmp_path / "short"
    short.write_text("abcd")
    short.chmod(0o600)
    with pytest.raises(ClusterKeyError, match="2 bytes"):
        load_cluster_key(short)
