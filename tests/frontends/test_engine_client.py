"""EngineClient against a real engine process (synthetic engine, real sockets)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from contextlib import aclosing

import msgspec
import pytest

from api.errors import EngineDeadError, EngineUnresponsiveError
from frontends.engine_client import EngineClient
from workers.config import EngineConfig, SyntheticConfig
from workers.launcher import WorkerGroup
from workers.protocol import EngineHealth, HealthPing
from workers.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=5, temperature=0.0)
LONG = SamplingParams(max_tokens=10_000, temperature=0.0)


@pytest.fixture
def group():
    # 20 ms per decode step: a LONG request runs for minutes, a GREEDY one for 0.1 s.
    config = EngineConfig(kind="synthetic", synthetic=SyntheticConfig(decode_step_base_seconds=0.02))
    with WorkerGroup(config, 2, "127.0.0.1", 1, grace_seconds=1.0) as group:
        group.start_engine(timeout=30.0)
        yield group


def num_unfinished(group: WorkerGroup) -> int:
    reply = group.control(HealthPing())
    assert isinstance(reply, EngineHealth)
    return reply.num_unfinished


def test_generate_streams_until_the_finishing_output_on_every_frontend(group):
    async def main():
        clients = [EngineClient(group.attach_info(i)) for i in range(2)]
        for client in clients:
            await client.start()
        assert clients[1].max_model_len == group.engine_info.max_model_len
        assert clients[1].vocab_size == 32000
        assert clients[0].is_healthy

        async def run(client):
            return [out async for out in client.generate([1, 2, 3], GREEDY)]

        results = await asyncio.gather(run(clients[0]), run(clients[1]), run(clients[1]))
        for client in clients:
            await client.close()
        return results

    results = asyncio.run(main())
    assert [{o.request_id for o in r} for r in results] == [{0}, {1 << 48}, {(1 << 48) + 1}]
    for outputs in results:
        assert sum(len(o.new_token_ids) for o in outputs) == 5
        assert [o.finish_reason for o in outputs][-1] == "length"
        assert all(o.finish_reason is None for o in outputs[:-1])
    # Greedy synthetic tokens are a function of the prompt: every frontend got its own copy.
    assert [o.new_token_ids for o in results[0]] == [o.new_token_ids for o in results[1]]


def test_leaving_generate_early_aborts_the_request_in_the_engine(group):
    async def main():
        client = EngineClient(group.attach_info(0))
        await client.start()
        async with aclosing(client.generate([1, 2, 3], LONG)) as outputs:
            async for _ in outputs:
                break
        assert client.num_in_flight == 0
        async def consume():
            async for _ in client.generate([4, 5], LONG):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.1)
        task.cancel()  # a client that went away
        await asyncio.gather(task, return_exceptions=True)
        deadline = time.monotonic() + 5.0
        while await asyncio.to_thread(num_unfinished, group) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        remaining = await asyncio.to_thread(num_unfinished, group)
        await client.close()
        return remaining

    assert asyncio.run(main()) == 0


def test_abort_ends_the_stream_with_finish_reason_abort(group):
    async def main():
        client = EngineClient(group.attach_info(0))
        await client.start()
        reasons = []
        async for out in client.generate([1, 2, 3], LONG):
            if out.finish_reason is None and not reasons:
                await client.abort(out.request_id)
            reasons.append(out.finish_reason)
        await client.close()
        return reasons[-1]

    assert asyncio.run(main()) == "abort"


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_dead_engine_ends_in_flight_requests_with_engine_dead_error(group, how):
    """SIGKILL: the process is gone. SIGSTOP: alive but silent; its requests end past the heartbeat
    limit (5 s, ``EngineUnresponsiveError``), the engine is dead past the wedged limit (7 s here)."""
    engine_pid = group.engine.popen.pid

    async def main():
        client = EngineClient(msgspec.structs.replace(group.attach_info(0), engine_wedged_seconds=7.0))
        await client.start()
        outputs = []

        async def consume():
            async for out in client.generate([1, 2, 3], LONG):
                outputs.append(out)

        task = asyncio.create_task(consume())
        while not outputs:
            await asyncio.sleep(0.01)
        os.kill(engine_pid, getattr(signal, how))
        killed_at = time.monotonic()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(task, timeout=10.0)
        noticed_after = time.monotonic() - killed_at
        healthy = client.is_healthy
        with pytest.raises(EngineDeadError):
            await anext(aiter(client.generate([1], GREEDY)))
        while client.dead_reason is None:  # a stopped engine is dead at the wedged limit
            assert time.monotonic() - killed_at < 12.0, "never called dead"
            await asyncio.sleep(0.05)
        await client.close()
        return noticed_after, healthy, client.dead_reason

    try:
        noticed_after, healthy, reason = asyncio.run(main())
    finally:
        if how == "SIGSTOP":
            os.kill(engine_pid, signal.SIGCONT)
    assert not healthy
    if how == "SIGKILL":
        assert noticed_after < 2.0
        assert reason == f"the engine process (pid {engine_pid}) exited"
    else:
        # In-flight requests end at the heartbeat limit (unresponsive, a retryable 503), not the wedged one.
        assert 4.5 <= noticed_after < 8.0
        assert reason.startswith("no heartbeat from the engine for ") and "wedged" in reason


def test_a_stopped_engine_is_unresponsive_not_dead_and_recovers(group):
    """Slow is not dead, but nothing waits for it: silence past the heartbeat limit refuses new
    requests (503) and ends the in-flight ones with the same retryable 503 (never held for the
    stall's length); the engine answering again makes the client healthy, with no restart."""
    engine_pid = group.engine.popen.pid
    params = SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True)  # ~3 s of 20 ms steps

    async def main():
        client = EngineClient(group.attach_info(0))
        await client.start()
        outputs = []

        async def consume():
            async for out in client.generate([1, 2, 3], params):
                outputs.append(out)

        task = asyncio.create_task(consume())
        while not outputs:
            await asyncio.sleep(0.01)
        os.kill(engine_pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            while client.is_healthy:
                assert time.monotonic() - stopped_at < 10.0, "never noticed the silence"
                await asyncio.sleep(0.05)
            noticed_after = time.monotonic() - stopped_at
            refused = client.unavailable_error()
            with pytest.raises(EngineUnresponsiveError):
                await anext(aiter(client.generate([1], GREEDY)))
            with pytest.raises(EngineUnresponsiveError):  # the in-flight request ended with it at once
                await asyncio.wait_for(task, timeout=1.0)
            assert client.dead_reason is None
        finally:
            os.kill(engine_pid, signal.SIGCONT)
        continued_at = time.monotonic()
        while not client.is_healthy:
            assert time.monotonic() - continued_at < 5.0, "never healthy again"
            await asyncio.sleep(0.05)
        again = [out async for out in client.generate([1], GREEDY)]
        await client.close()
        return noticed_after, refused, outputs, again

    noticed_after, refused, outputs, again = asyncio.run(main())
    assert 4.5 <= noticed_after < 8.0  # 5 heartbeats of silence, counted from the last output
    assert isinstance(refused, EngineUnresponsiveError) and refused.status == 503
    assert refused.code == "engine_unresponsive" and "no heartbeat" in str(refused)
    assert 0 < sum(len(o.new_token_ids) for o in outputs) < 150
    assert again[-1].finish_reason == "length"


def test_start_fails_cleanly_when_the_engine_does_not_answer(group):
    engine_pid = group.engine.popen.pid

    async def main():
        client = EngineClient(group.attach_info(1))
        with pytest.raises(EngineDeadError, match="did not answer frontend 1 within 0.3 s"):
            await client.start(timeout=0.3)
        assert not client.is_healthy

    os.kill(engine_pid, signal.SIGSTOP)  # alive but hung
    try:
        asyncio.run(main())
    finally:
        os.kill(engine_pid, signal.SIGCONT)
