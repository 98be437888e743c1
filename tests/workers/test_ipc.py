from __future__ import annotations

import hmac
import stat

import msgspec
import pytest
import zmq

from workers.ipc import FrameCodec, make_ipc_dir, new_key, send_nowait, write_private_file
from workers.protocol import AbortRequests, AddRequest, EngineRequest, IngressMessage, OutputBatch, RequestOutput
from workers.sampling_params import SamplingParams

KEY = b"k" * 32


def test_round_trip_of_a_tagged_union():
    codec = FrameCodec(KEY, IngressMessage, "test")
    add = AddRequest(EngineRequest(7, [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0), 12.5))
    assert codec.decode(codec.encode(add)) == add
    assert codec.decode(codec.encode(AbortRequests([1, 2]))) == AbortRequests([1, 2])
    assert codec.num_rejected == 0


def test_frames_received_without_copy_decode_and_are_checked_alike():
    codec = FrameCodec(KEY, IngressMessage, "test")
    mac, payload = codec.encode(AbortRequests([4]))
    assert codec.decode([zmq.Frame(mac), zmq.Frame(payload)]) == AbortRequests([4])
    assert codec.decode([zmq.Frame(mac), zmq.Frame(payload + b"\x00")]) is None
    assert codec.decode([zmq.Frame(mac), zmq.Frame(payload), zmq.Frame(b"")]) is None
    assert codec.num_rejected == 2


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


@pytest.mark.parametrize("key_bytes", [16, 32, 63, 64, 65, 200])
def test_the_mac_is_hmac_sha256_byte_for_byte(key_bytes):
    """The padded-state MAC is RFC 2104 HMAC-SHA256 for every key length (longer than a block: hashed)."""
    key = bytes(range(256))[:key_bytes]
    codec = FrameCodec(key, IngressMessage, "test")
    for payload in (b"", b"x", bytes(range(256)) * 9, memoryview(b"abc" * 50)):
        assert codec.mac(payload) == hmac.new(key, payload, "sha256").digest()
    mac, payload = codec.encode(AbortRequests([1, 2]))
    assert mac == hmac.new(key, payload, "sha256").digest()
    # The states are copied per frame, never consumed: the same payload signs the same twice.
    assert codec.mac(payload) == codec.mac(payload) == mac
    tampered = bytes([payload[0] ^ 1]) + payload[1:]
    assert codec.decode([mac, tampered]) is None and codec.num_rejected == 1


def test_send_nowait_delivers_signed_frames_and_reports_a_full_queue(tmp_path):
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        pull.bind(f"ipc://{tmp_path}/s.sock")
        push.setsockopt(zmq.SNDHWM, 1)
        push.connect(f"ipc://{tmp_path}/s.sock")
        codec = FrameCodec(KEY, IngressMessage, "test")
        big = AddRequest(EngineRequest(7, list(range(40_000)), SamplingParams(max_tokens=4), 1.0))  # zero-copy size
        assert send_nowait(push, codec, big)
        assert pull.poll(5000)
        frames = pull.recv_multipart()
        assert frames[0] == hmac.new(KEY, frames[1], "sha256").digest()
        assert codec.decode(frames) == big
        pull.setsockopt(zmq.RCVHWM, 1)
        pull.close()  # no reader: the queue fills and stays full, and a send reports it instead of blocking
        results = [send_nowait(push, codec, AbortRequests([i])) for i in range(5000)]
        assert results[0] and not results[-1]
    finally:
        push.close(0)
        ctx.term()


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
