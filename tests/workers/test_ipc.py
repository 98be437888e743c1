from __future__ import annotations

import stat

import msgspec
import pytest

from workers.ipc import FrameCodec, make_ipc_dir, new_key, write_private_file
from workers.protocol import AbortRequests, AddRequest, EngineRequest, IngressMessage, OutputBatch, RequestOutput
from workers.sampling_params import SamplingParams

KEY = b"k" * 32


def test_round_trip_of_a_tagged_union():
    codec = FrameCodec(KEY, IngressMessage, "test")
    add = AddRequest(EngineRequest(7, [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0), 12.5))
    assert codec.decode(codec.encode(add)) == add
    assert codec.decode(codec.encode(AbortRequests([1, 2]))) == AbortRequests([1, 2])
    assert codec.num_rejected == 0


def test_a_frame_signed_with_another_key_is_dropped_and_counted():
    codec = FrameCodec(KEY, IngressMessage, "test")
    forged = FrameCodec(b"x" * 32, IngressMessage, "forger").encode(AbortRequests([1]))
    assert codec.decode(forged) is None
    mac, payload = codec.encode(AbortRequests([1]))
    assert codec.decode([mac, payload + b"\x00"]) is None  # payload changed after signing
    assert codec.decode([payload]) is None  # wrong frame count
    assert codec.num_rejected == 3
    assert codec.num_undecodable == 0


def test_an_authenticated_payload_of_the_wrong_type_is_not_returned():
    codec = FrameCodec(KEY, OutputBatch, "test")
    frames = FrameCodec(KEY, IngressMessage, "other").encode(AbortRequests([1]))
    assert codec.decode(frames) is None
    assert (codec.num_rejected, codec.num_undecodable) == (0, 1)
    batch = OutputBatch([RequestOutput(1, [5], "stop")], 1.0)
    assert codec.decode(codec.encode(batch)) == batch


def test_short_keys_are_refused():
    with pytest.raises(ValueError):
        FrameCodec(b"short", OutputBatch, "test")
    assert len(new_key()) == 32


def test_ipc_dir_is_private_and_private_files_are_0600(tmp_path):
    paths = make_ipc_dir()
    try:
        assert stat.S_IMODE(paths.dir.stat().st_mode) == 0o700
        assert paths.lane(3) == f"ipc://{paths.dir}/lane-3.sock"
        assert len(paths.lane(65535)) - len("ipc://") < 104
        write_private_file(paths.attach_file(1), b"secret")
        assert stat.S_IMODE(paths.attach_file(1).stat().st_mode) == 0o600
        with pytest.raises(FileExistsError):
            write_private_file(paths.attach_file(1), b"again")
    finally:
        import shutil

        shutil.rmtree(paths.dir)


def test_protocol_structs_are_msgpack_without_pickle():
    payload = msgspec.msgpack.encode(OutputBatch([], 2.0))
    assert msgspec.msgpack.decode(payload) == [[], 2.0]  # array_like: a plain list on the wire
