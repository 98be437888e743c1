"""The KV-transfer message codec: GMAC under per-sender subkeys, checked by the receiver."""

from __future__ import annotations

import os

import zmq

from workers import kv_codec
from workers.kv_codec import KVFrameCodec
from workers.kv_protocol import KVDone, KVReplyMessage

KEY = b"k" * 32


def frames_of(parts: list) -> list[zmq.Frame]:
    return [zmq.Frame(bytes(part)) for part in parts]


def test_messages_verify_from_many_senders_and_made_up_salts_do_not_grow_the_receiver(monkeypatch) -> None:
    monkeypatch.setattr(kv_codec, "_MAX_CACHED_SENDERS", 4)
    receiver = KVFrameCodec(KEY, KVReplyMessage, "receiver")
    senders = [KVFrameCodec(KEY, KVReplyMessage, f"sender-{i}") for i in range(6)]
    for round_ in range(3):
        for i, sender in enumerate(senders):
            decoded = receiver.decode(frames_of(sender.encode(KVDone(i, round_), [b"payload"])))
            assert decoded is not None and decoded[0] == KVDone(i, round_)
            assert bytes(decoded[1][0]) == b"payload"
    for _ in range(50):  # a forger's salts: rejected, and never more than the bound kept
        auth, header, payload = senders[0].encode(KVDone(1, 1), [b"payload"])
        forged = os.urandom(16) + auth[16:]
        assert receiver.decode(frames_of([forged, header, payload])) is None
        assert len(receiver._senders) <= 4
    tampered = senders[1].encode(KVDone(1, 1), [b"payload"])
    assert receiver.decode(frames_of([tampered[0], tampered[1], b"pay1oad"])) is None
    assert receiver.decode(frames_of(senders[1].encode(KVDone(2, 2)))) is not None  # still verifies
    assert receiver.num_rejected == 51
