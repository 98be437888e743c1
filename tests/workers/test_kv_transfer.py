"""Engine level: two EngineCores and their real KV-transfer agents over TCP on 127.0.0.1.

Invariant: greedy tokens of a disaggregated request (ctx prefill + first token,
gen pulls the KV and decodes) equal those of the same request on one
aggregated engine; after every test both engines hold zero blocks in use.
"""

from __future__ import annotations

import contextlib
import random
import socket
import time
from collections import defaultdict
from collections.abc import Iterator

import pytest
import zmq

from workers.config import CacheConfig, EngineConfig, SchedulerConfig
from workers.engine.core import EngineCore
from workers.engine.request import Request
from workers.kv_codec import KVFrameCodec
from workers.kv_protocol import KVPullRequest, KVReplyMessage, KVRequestMessage
from workers.kv_server import CHUNK_BYTES, MIN_VIEW_RUN, _next_chunk, blocks_within
from workers.kv_transfer import EXPIRY_MARGIN_SECONDS, KVTransferAgent
from workers.protocol import AddContextRequest, AddRemoteRequest, EngineRequest, KVTransferStats, RequestOutput
from workers.sampling_params import SamplingParams

KEY = b"k" * 32
BLOCK_SIZE = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
FIRST_ONLY = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def _config(kind: str, model_dir: str | None, num_blocks: int = 256) -> EngineConfig:
    return EngineConfig(kind=kind, model=model_dir, device="cpu",
                        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks),
                        scheduler=SchedulerConfig(max_num_batched_tokens=256))


class Node:
    """One engine and its agent, stepped like the engine process loop does."""

    def __init__(self, config: EngineConfig, zctx: zmq.Context, key: bytes = KEY, pull_timeout: float = 30.0):
        self.core = EngineCore(config)
        self.agent = KVTransferAgent(self.core, key, zctx, "127.0.0.1", 0, pull_timeout=pull_timeout)
        self.outputs: dict[int, list[RequestOutput]] = defaultdict(list)

    def turn(self) -> bool:
        self.agent.tick()
        if not self.core.has_work():
            return False
        outputs = self.core.step()
        self.agent.on_outputs(outputs)
        for output in outputs:
            self.outputs[output.request_id].append(output)
        return True

    def finished(self, request_id: int) -> bool:
        outs = self.outputs.get(request_id)
        return bool(outs) and outs[-1].finish_reason is not None

    def tokens(self, request_id: int) -> list[int]:
        return [t for o in self.outputs[request_id] for t in o.new_token_ids]

    def assert_no_blocks_in_use(self) -> None:
        blocks = self.core.block_manager
        assert (blocks.num_used_blocks, blocks.num_parked_blocks) == (0, 0)
        self.core.check_integrity()


def run_until(nodes: list[Node], done, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        busy = [node.turn() for node in nodes]
        if not any(busy):
            time.sleep(0.0005)  # transfers in flight on ZeroMQ's I/O thread
        assert time.monotonic() < deadline, "timed out"


def settle(nodes: list[Node]) -> None:
    """Let acks reach the ctx side."""
    run_until(nodes, lambda: all(n.core.block_manager.num_used_blocks == 0 for n in nodes), timeout=10)


def park_and_pull(ctx: Node, gen: Node, request_id: int, prompt: list[int]) -> None:
    """Prefill ``prompt`` on ``ctx`` (its KV parked), then hand the gen leg to ``gen``."""
    ctx.agent.add_context(AddContextRequest(EngineRequest(request_id, prompt, FIRST_ONLY), 60.0))
    run_until([ctx], lambda: ctx.finished(request_id))
    gen.agent.add_remote(AddRemoteRequest(EngineRequest(request_id, prompt, GREEDY), ctx.tokens(request_id)[0],
                                          request_id, ctx.agent.endpoint))


def assert_prefilled_after_failed_pull(gen: Node, request_id: int, caplog, why: str) -> None:
    """The pull failed for ``why`` (logged) and the request was prefilled on ``gen`` instead:
    it ended normally (``Scheduler.recompute_remote``)."""
    last = gen.outputs[request_id][-1]
    assert (last.finish_reason, last.error, gen.agent.num_pulls_failed) == ("length", None, 1)
    assert last.kv_transfer == KVTransferStats(0, 0, 0.0, recomputed=True)  # what the recompute metric counts
    assert len(gen.tokens(request_id)) == GREEDY.max_tokens - 1  # the first token is the ctx engine's
    assert any(why in r.getMessage() and "prefilled here" in r.getMessage() for r in caplog.records), caplog.text


@contextlib.contextmanager
def engine_pair(config: EngineConfig, zctx: zmq.Context) -> Iterator[tuple[Node, Node]]:
    """A ctx and a gen node; on a clean exit both must end with no blocks in use."""
    ctx, gen = Node(config, zctx), Node(config, zctx)
    try:
        yield ctx, gen
        settle([ctx, gen])
        ctx.assert_no_blocks_in_use()
        gen.assert_no_blocks_in_use()
    finally:
        ctx.agent.close()
        gen.agent.close()


@pytest.fixture
def zctx():
    ctx = zmq.Context()
    yield ctx
    ctx.term()


def aggregated(config: EngineConfig, prompts: list[list[int]]) -> list[list[int]]:
    core = EngineCore(config)
    for i, prompt in enumerate(prompts):
        core.add_request(EngineRequest(i, prompt, GREEDY))
    tokens: dict[int, list[int]] = defaultdict(list)
    while core.has_unfinished():
        for output in core.step():
            tokens[output.request_id].extend(output.new_token_ids)
    return [tokens[i] for i in range(len(prompts))]


def disaggregated(ctx: Node, gen: Node, prompts: list[list[int]], base_id: int) -> list[list[int]]:
    """All prompts concurrently through ctx, then all concurrently through gen."""
    ids = [base_id + i for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        ctx.agent.add_context(AddContextRequest(EngineRequest(rid, prompt, FIRST_ONLY), 60.0))
    run_until([ctx, gen], lambda: all(ctx.finished(r) for r in ids))
    for rid, prompt in zip(ids, prompts):
        last = ctx.outputs[rid][-1]
        assert last.finish_reason == "length" and last.kv_parked is not None
        assert last.kv_parked.num_tokens == len(prompt)
        first = ctx.tokens(rid)
        gen.agent.add_remote(AddRemoteRequest(EngineRequest(rid, prompt, GREEDY), first[0], rid, ctx.agent.endpoint))
    run_until([ctx, gen], lambda: all(gen.finished(r) for r in ids))
    settle([ctx, gen])
    return [ctx.tokens(r) + gen.tokens(r) for r in ids]


def _prompts(vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """50 prompts: partial blocks, exact block multiples, and a second wave that hits both caches."""
    rng = random.Random(7)
    lengths = [1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 15, 16, 17, 20, 23, 24, 31, 32, 33, 40]
    first = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    first += [first[i][:8] + [rng.randrange(vocab) for _ in range(n)] for i, n in ((16, 3), (17, 8), (18, 5))]
    second = [p + [rng.randrange(vocab) for _ in range(n)] for p, n in zip(first, [1, 4, 6] * 9)][:27]
    return first, second  # 23 + 27 = 50


@pytest.mark.parametrize("kind", ["synthetic", "torch"])
def test_disaggregated_tokens_equal_aggregated(kind, tiny_model_dir, zctx):
    model_dir = str(tiny_model_dir) if kind == "torch" else None
    vocab = 512 if kind == "torch" else 32000
    config = _config(kind, model_dir)
    first, second = _prompts(vocab)
    ctx, gen = Node(config, zctx), Node(config, zctx)
    try:
        got_first = disaggregated(ctx, gen, first, base_id=1000)
        # The second wave extends the first: prefix hits on the ctx side and on the gen side.
        got_second = disaggregated(ctx, gen, second, base_id=2000)
        assert got_first + got_second == aggregated(config, first + second)
        ctx_cached = [ctx.outputs[2000 + i][0].num_cached_tokens for i in range(len(second))]
        gen_pulled = [gen.outputs[2000 + i][-1].kv_transfer.num_blocks for i in range(len(second))]
        assert sum(ctx_cached) > 0 and all(c % BLOCK_SIZE == 0 for c in ctx_cached)
        # gen pulled only what it did not hold: fewer blocks than the prompts span
        assert sum(gen_pulled) < sum(-(-len(p) // BLOCK_SIZE) for p in second)
        assert gen.agent.num_bytes_received == ctx.agent.server.num_bytes_sent > 0
        ctx.assert_no_blocks_in_use()
        gen.assert_no_blocks_in_use()
    finally:
        ctx.agent.close()
        gen.agent.close()


def test_chunks_are_runs_of_the_pool_where_they_can_be():
    up, down = list(range(20, 40)), list(range(50, 30, -1))
    assert _next_chunk(up, 0, 32) == (up, False)  # one view of the pool
    assert _next_chunk(up, 5, 8) == (up[5:13], False)  # the tick's budget cuts it
    assert _next_chunk(down, 0, 32) == (down, True)  # sent in memory order, written back to front
    assert _next_chunk(up[:10] + down, 0, 32) == (up[:10], False)  # cut where the run ends
    scattered = [7, 3, 9, 1, 12, 4, 8, 2, 30, 31]
    assert _next_chunk(scattered, 0, 32) == (scattered, False)  # short runs: gathered
    assert _next_chunk(scattered + up, 0, 32) == ((scattered + up)[:32], False)
    assert _next_chunk([5, 6, 7], 0, 32) == ([5, 6, 7], False)  # all that is left
    assert _next_chunk(up[:MIN_VIEW_RUN] + [0], 0, 32) == (up[:MIN_VIEW_RUN], False)
    # Messages are sized in bytes: 32 of the bench model's 64 KiB blocks, one 8 MiB block at least.
    assert blocks_within(CHUNK_BYTES, 64 * 2**10) == 32 and blocks_within(CHUNK_BYTES, 8 * 2**20) == 1


def test_blocks_of_a_descending_ctx_table_land_in_order(tiny_model_dir, zctx):
    # A table freed tail first hands out its ids in descending order: the next
    # prompt's blocks are a descending run, sent as views and written back to front.
    config = _config("torch", str(tiny_model_dir), num_blocks=24)
    with engine_pair(config, zctx) as (ctx, gen):
        blocks = ctx.core.block_manager
        filler = Request(1, [3] * (24 * BLOCK_SIZE), FIRST_ONLY)
        blocks.allocate(filler, 24 * BLOCK_SIZE)
        blocks.free(filler)
        prompt = [random.Random(5).randrange(512) for _ in range(15 * BLOCK_SIZE)]
        ctx.agent.add_context(AddContextRequest(EngineRequest(7, prompt, FIRST_ONLY), 60.0))
        run_until([ctx], lambda: ctx.finished(7))
        parked = ctx.core.parked_block_ids(7)
        assert parked == list(range(23, 8, -1))
        ctx_kv = [bytes(b) for b in ctx.core.export_blocks(parked)]
        gen.agent.add_remote(AddRemoteRequest(EngineRequest(9, prompt, GREEDY), ctx.tokens(7)[0], 7,
                                              ctx.agent.endpoint))
        run_until([ctx, gen], lambda: gen.finished(9))
        assert ctx.tokens(7) + gen.tokens(9) == aggregated(config, [prompt])[0]
        assert gen.outputs[9][-1].kv_transfer.num_blocks == 15
        # A fresh gen engine took blocks 0..14 for the prompt; decoding wrote past them.
        assert [bytes(b) for b in gen.core.export_blocks(list(range(15)))] == ctx_kv


def test_decode_of_other_requests_continues_while_a_pull_is_in_flight(zctx):
    config = _config("synthetic", None)
    gen = Node(config, zctx)
    silent = zctx.socket(zmq.ROUTER)  # a ctx agent that has not answered the pull yet
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        gen.core.add_request(EngineRequest(1, [5, 6, 7], SamplingParams(max_tokens=50, temperature=0.0,
                                                                        ignore_eos=True)))
        gen.turn()
        gen.agent.add_remote(AddRemoteRequest(EngineRequest(9, list(range(10, 50)), GREEDY), 1, 7,
                                              f"tcp://127.0.0.1:{port}"))
        for _ in range(5):
            gen.turn()
        assert len(gen.tokens(1)) == 6 and not gen.outputs.get(9)
        assert gen.core.scheduler.num_waiting_for_remote_kv == 1
        gen.agent.abort(9)
        gen.core.abort(9)
        run_until([gen], lambda: gen.finished(9) and gen.finished(1))
        gen.assert_no_blocks_in_use()
    finally:
        silent.close()
        gen.agent.close()


def test_the_ctx_side_serves_a_pull_while_its_engine_is_inside_a_step(zctx):
    """The ctx engine's loop never turns after parking (as if one long prefill step ran): its
    server thread answers the pull all the same; the ack frees the blocks at its next tick."""
    config = _config("synthetic", None)
    with engine_pair(config, zctx) as (ctx, gen):
        park_and_pull(ctx, gen, 7, list(range(10, 50)))
        run_until([gen], lambda: gen.finished(7), timeout=10)
        assert gen.outputs[7][-1].error is None and gen.outputs[7][-1].kv_transfer.num_blocks == 10
        assert ctx.agent.server.num_pulls_served == 1
        assert ctx.core.block_manager.num_parked_blocks == 10  # freed by the engine loop, not the thread
        run_until([ctx], lambda: ctx.core.block_manager.num_parked_blocks == 0, timeout=5)


def test_abort_of_gen_request_frees_both_sides(zctx):
    config = _config("synthetic", None)
    with engine_pair(config, zctx) as (ctx, gen):
        ctx.agent.add_context(AddContextRequest(EngineRequest(7, list(range(10, 30)), FIRST_ONLY), 60.0))
        run_until([ctx], lambda: ctx.finished(7))
        assert ctx.core.block_manager.num_parked_blocks == 5
        gen.agent.add_remote(AddRemoteRequest(EngineRequest(9, list(range(10, 30)), GREEDY), 1, 7,
                                              ctx.agent.endpoint))
        gen.turn()  # allocates and sends the pull
        gen.agent.abort(9)
        gen.core.abort(9)
        run_until([ctx, gen], lambda: gen.finished(9))
        assert gen.outputs[9][-1].finish_reason == "abort"


def test_a_failed_pull_is_prefilled_on_the_gen_engine_instead(zctx):
    """The parked KV expired before the pull: the gen request is not aborted (its client may hold
    its first token already) but prefilled here, prompt and first token, and ends with exactly the
    tokens a pull would have given it."""
    config = _config("synthetic", None)
    ctx, gen = Node(config, zctx), Node(config, zctx)
    prompt = list(range(10, 30))
    try:
        ctx.agent.add_context(AddContextRequest(EngineRequest(7, prompt, FIRST_ONLY), 0.05))
        run_until([ctx], lambda: ctx.finished(7))
        first = ctx.tokens(7)[0]
        time.sleep(0.1)
        ctx.turn()  # the deadline frees the parked blocks even though no step runs
        ctx.assert_no_blocks_in_use()
        gen.agent.add_remote(AddRemoteRequest(EngineRequest(9, prompt, GREEDY), first, 7, ctx.agent.endpoint))
        run_until([ctx, gen], lambda: gen.finished(9))
        last = gen.outputs[9][-1]
        assert (last.finish_reason, last.error, gen.agent.num_pulls_failed) == ("length", None, 1)
        assert [first, *gen.tokens(9)] == aggregated(config, [prompt])[0]
        assert gen.core.scheduler.num_waiting_for_remote_kv == 0
        gen.assert_no_blocks_in_use()
    finally:
        ctx.agent.close()
        gen.agent.close()


def test_the_advertised_park_expiry_is_the_schedulers_deadline(zctx):
    """One owner per fact: the agent advertises the deadline the scheduler set when it parked
    the blocks (less the margin), not one of its own."""
    config = _config("synthetic", None)
    ctx = Node(config, zctx)
    try:
        before = time.time()
        ctx.agent.add_context(AddContextRequest(EngineRequest(7, list(range(10, 30)), FIRST_ONLY), 30.0))
        run_until([ctx], lambda: ctx.finished(7))
        deadline = ctx.core.parked_deadline(7)
        assert deadline is not None and before + 30.0 <= deadline <= time.time() + 30.0
        parked = ctx.outputs[7][-1].kv_parked
        assert parked is not None and parked.expires_at == deadline - EXPIRY_MARGIN_SECONDS
        assert ctx.core.release_expired(deadline - 1.0) == [] and ctx.core.release_expired(deadline) == [7]
        assert ctx.core.parked_deadline(7) is None
        ctx.assert_no_blocks_in_use()
    finally:
        ctx.agent.close()


def test_stop_on_first_token_parks_nothing(zctx):
    config = _config("synthetic", None)
    ctx = Node(config, zctx)
    try:
        probe = EngineCore(config)
        probe.add_request(EngineRequest(1, [3, 4, 5], FIRST_ONLY))
        first = probe.step()[0].new_token_ids[0]
        stop_at_first = SamplingParams(max_tokens=1, temperature=0.0, stop_token_ids=(first,))
        ctx.agent.add_context(AddContextRequest(EngineRequest(7, [3, 4, 5], stop_at_first), 60.0))
        run_until([ctx], lambda: ctx.finished(7))
        last = ctx.outputs[7][-1]
        assert (last.finish_reason, last.kv_parked) == ("stop", None)
        ctx.assert_no_blocks_in_use()
    finally:
        ctx.agent.close()


def test_messages_under_another_key_are_dropped(zctx):
    config = _config("synthetic", None)
    ctx = Node(config, zctx)
    try:
        ctx.agent.add_context(AddContextRequest(EngineRequest(7, list(range(10, 30)), FIRST_ONLY), 60.0))
        run_until([ctx], lambda: ctx.finished(7))
        forger = zctx.socket(zmq.DEALER)
        forger.setsockopt(zmq.LINGER, 0)
        forger.connect(ctx.agent.endpoint)
        forged = KVFrameCodec(b"x" * 32, KVRequestMessage, "forger")
        forger.send_multipart(forged.encode(KVPullRequest(1, 7, 0, 5)))
        run_until([ctx], lambda: ctx.agent.server.num_rejected == 1, timeout=5)
        assert ctx.agent.server.num_pulls_served == 0 and ctx.core.block_manager.num_parked_blocks == 5
        assert forger.poll(100) == 0  # no answer at all
        # the same pull under the cluster key is served
        forger.send_multipart(KVFrameCodec(KEY, KVRequestMessage, "gen").encode(KVPullRequest(1, 7, 0, 5)))
        replies = KVFrameCodec(KEY, KVReplyMessage, "gen")
        run_until([ctx], lambda: ctx.agent.server.num_pulls_served == 1, timeout=5)
        ctx.turn()
        kinds = []
        while forger.poll(1000):
            message, _ = replies.decode(forger.recv_multipart(copy=False))
            kinds.append(type(message).__name__)
            if kinds[-1] == "KVDone":
                break
        assert kinds == ["KVBlocks", "KVDone"]
        forger.close()
    finally:
        ctx.agent.close()


def test_a_silent_ctx_engine_fails_the_pull_after_the_timeout(zctx, caplog):
    config = _config("synthetic", None)
    gen = Node(config, zctx, pull_timeout=0.3)
    silent = zctx.socket(zmq.ROUTER)  # accepts the connection, never answers
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        gen.agent.add_remote(AddRemoteRequest(EngineRequest(9, list(range(10, 30)), GREEDY), 1, 7,
                                              f"tcp://127.0.0.1:{port}"))
        started = time.monotonic()
        run_until([gen], lambda: gen.finished(9), timeout=10)
        assert 0.3 <= time.monotonic() - started < 5
        assert_prefilled_after_failed_pull(gen, 9, caplog, "no KV arrived")
        gen.assert_no_blocks_in_use()
    finally:
        silent.close()
        gen.agent.close()


def test_a_pull_from_a_ctx_agent_that_goes_away_fails_at_once_not_after_the_timeout(zctx, caplog):
    config = _config("synthetic", None)
    gen = Node(config, zctx, pull_timeout=30.0)
    silent = zctx.socket(zmq.ROUTER)  # a ctx agent that accepts the pull and then dies mid-transfer
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        gen.agent.add_remote(AddRemoteRequest(EngineRequest(9, list(range(10, 30)), GREEDY), 1, 7,
                                              f"tcp://127.0.0.1:{port}"))
        run_until([gen], lambda: silent.poll(0), timeout=5)  # the pull request arrived: the connection is up
        silent.recv_multipart()
        started = time.monotonic()
        silent.close()
        run_until([gen], lambda: gen.finished(9), timeout=10)
        assert time.monotonic() - started < 5  # not the 30 s pull timeout
        assert_prefilled_after_failed_pull(gen, 9, caplog, "disconnected")
        gen.assert_no_blocks_in_use()
    finally:
        silent.close()
        gen.agent.close()


def test_a_pull_from_a_ctx_agent_already_gone_fails_at_once(zctx, caplog):
    config = _config("synthetic", None)
    gen = Node(config, zctx, pull_timeout=30.0)
    with socket.socket() as s:  # a port nothing listens on: the ctx engine died before the pull
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        gen.agent.add_remote(AddRemoteRequest(EngineRequest(9, list(range(10, 30)), GREEDY), 1, 7,
                                              f"tcp://127.0.0.1:{port}"))
        started = time.monotonic()
        run_until([gen], lambda: gen.finished(9), timeout=10)
        assert time.monotonic() - started < 5
        assert_prefilled_after_failed_pull(gen, 9, caplog, "refused the connection")
        gen.assert_no_blocks_in_use()
    finally:
        gen.agent.close()


def test_a_pull_completes_on_its_last_block_without_waiting_for_the_final_message(zctx):
    """The gen side counts contiguous blocks: once the last one is imported the pull is done (and
    acknowledged) in the same tick; the KVDone sent after the blocks is not waited for."""
    from workers.kv_protocol import KVAck, KVBlocks

    config = _config("synthetic", None)
    gen = Node(config, zctx, pull_timeout=0.5)
    ctx = zctx.socket(zmq.ROUTER)  # a ctx agent that sends the blocks and never the KVDone
    ctx.setsockopt(zmq.LINGER, 0)
    port = ctx.bind_to_random_port("tcp://127.0.0.1")
    requests, replies = KVFrameCodec(KEY, KVRequestMessage, "ctx"), KVFrameCodec(KEY, KVReplyMessage, "ctx")
    prompt = list(range(10, 30))  # 5 blocks of 4 tokens
    try:
        gen.agent.add_remote(AddRemoteRequest(EngineRequest(9, prompt, GREEDY), 1, 7, f"tcp://127.0.0.1:{port}"))
        run_until([gen], lambda: ctx.poll(0), timeout=5)
        identity, *frames = ctx.recv_multipart(copy=False)
        pull, _ = requests.decode(frames)
        assert isinstance(pull, KVPullRequest) and (pull.first_block, pull.num_blocks) == (0, 5)
        body = b"".join(t.to_bytes(8, "little") for t in prompt)  # the synthetic wire form: uint64 token ids
        ctx.send_multipart([identity.bytes, *replies.encode(KVBlocks(pull.pull_id, 0, 5, False), [body])])
        run_until([gen], lambda: ctx.poll(0), timeout=5)  # the ack comes back, no KVDone was sent
        ack, _ = requests.decode(ctx.recv_multipart(copy=False)[1:])
        assert isinstance(ack, KVAck) and ack.completed and ack.ctx_request_id == 7
        run_until([gen], lambda: gen.finished(9), timeout=5)  # decodes: long before the 0.5 s pull timeout
        last = gen.outputs[9][-1]
        assert last.finish_reason == "length" and last.error is None and gen.agent.num_pulls_failed == 0
        assert last.kv_transfer is not None and last.kv_transfer.num_blocks == 5
        gen.assert_no_blocks_in_use()
    finally:
        ctx.close()
        gen.agent.close()


def test_the_agent_has_work_while_allocated_pulls_wait_to_be_requested(zctx):
    """The engine loop blocks in poll (250 ms) when nothing has work: a step that allocated a gen
    request's blocks must keep it awake until the next tick has sent the pull request."""
    config = _config("synthetic", None)
    with engine_pair(config, zctx) as (ctx, gen):
        park_and_pull(ctx, gen, 3, list(range(10, 30)))
        gen.agent.tick()
        assert not gen.agent.has_work()
        gen.core.step()  # allocates the blocks: a pull waits to be requested
        assert not gen.core.has_work() and gen.agent.has_work()
        gen.agent.tick()  # requests it
        assert not gen.agent.has_work()
        run_until([ctx, gen], lambda: gen.finished(3))
