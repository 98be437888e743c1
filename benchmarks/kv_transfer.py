"""KV-transfer rate between two engines against raw ZeroMQ over TCP loopback, same run.

Two ``EngineCore``s with the torch executor on the CPU (the tiny ``bench``
Llama: 4 layers, 4 KV heads of 32 dims, fp32: 4 KiB of KV per token, 64 KiB
blocks of 16 tokens) and their real ``KVTransferAgent``s over
``tcp://127.0.0.1``, each in its own process (as two engines are) and
ticked as the engine loop does, waking on its sockets. The ctx side holds a parked prompt of N tokens (its blocks are allocated and parked
directly: prefilling 32k tokens on a CPU would only measure the model), the
gen side takes the request (``AddRemoteRequest``), allocates its blocks and
pulls them: export, HMAC, send, receive, verify, import. The rate is the
agent's own ``KVTransferStats`` (bytes / seconds from the pull request to
the last block imported).

Baseline, same process, same ZeroMQ context settings: a DEALER asks a ROUTER,
which sends the same number of messages with the same frames (a 32-byte MAC
frame, a header frame, one block frame of the same size, zero-copy from
memory prepared beforehand) and a final message; the DEALER receives them
all. No export, HMAC or import: the wire alone.

Target: agent rate >= 0.8x raw, for 1k to 32k-token prompts (medians over
``--repeats``).

    python benchmarks/kv_transfer.py [--tokens 1024,4096,16384,32768] [--repeats 5]
        [--out benchmarks/results/kv_transfer.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq

from workers.config import CacheConfig, EngineConfig, SchedulerConfig
from workers.engine.core import EngineCore
from workers.engine.model.tiny import make_tiny_model
from workers.engine.request import Request
from workers.kv_transfer import KVTransferAgent
from workers.protocol import AddRemoteRequest, EngineRequest
from workers.sampling_params import SamplingParams

KEY = b"bench-cluster-key-0123456789abcdef"
BLOCK_SIZE = 16
TARGET = 0.8


def make_node(model_dir: Path, num_blocks: int, max_len: int, zctx: zmq.Context) -> tuple[EngineCore, KVTransferAgent]:
    config = EngineConfig(kind="torch", model=str(model_dir), device="cpu", max_model_len=max_len,
                          cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks),
                          scheduler=SchedulerConfig(max_num_batched_tokens=max_len))
    core = EngineCore(config)
    return core, KVTransferAgent(core, KEY, zctx, "127.0.0.1", 0)


def prompt_of(num_tokens: int, request_id: int) -> list[int]:
    return [(7 * i + request_id) % 2000 + 2 for i in range(num_tokens)]  # no prefix hit on the gen side


def ctx_engine(model_dir: Path, num_blocks: int, max_len: int, conn) -> None:
    """The ctx engine process: parks prompts on command, serves pulls until told to stop."""
    zctx = zmq.Context()
    core, agent = make_node(model_dir, num_blocks, max_len, zctx)
    poller = zmq.Poller()
    agent.register(poller)
    poller.register(conn.fileno(), zmq.POLLIN)
    conn.send(agent.endpoint)
    while True:
        poller.poll(0 if agent.has_work() else 100)
        if conn.poll():
            command = conn.recv()
            if command is None:
                break
            request_id, num_tokens = command
            parked = Request(request_id, prompt_of(num_tokens, request_id), SamplingParams(max_tokens=1))
            core.block_manager.allocate(parked, num_tokens)
            core.block_manager.park(parked, deadline=time.time() + 600)
            conn.send(request_id)
        agent.tick()
    agent.close()
    zctx.term()


def agent_transfer(ctx_conn, ctx_endpoint: str, gen: tuple[EngineCore, KVTransferAgent], poller: zmq.Poller,
                   num_tokens: int, request_id: int) -> tuple[float, int, int]:
    """(seconds, bytes, blocks) of one pull of a ``num_tokens`` prompt parked on the ctx engine."""
    gen_core, gen_agent = gen
    ctx_conn.send((request_id, num_tokens))
    assert ctx_conn.recv() == request_id
    prompt = prompt_of(num_tokens, request_id)
    gen_agent.add_remote(AddRemoteRequest(
        EngineRequest(request_id, prompt, SamplingParams(max_tokens=2, ignore_eos=True)), 5, request_id,
        ctx_endpoint))
    ended = gen_agent.num_pulls_completed + gen_agent.num_pulls_failed
    gen_core.step()  # the scheduler allocates the gen blocks: the pull is queued (no model step runs)
    gen_agent.tick()  # sends the pull request (and registers the new DEALER with the poller)
    while gen_agent.num_pulls_completed + gen_agent.num_pulls_failed == ended:
        poller.poll(100)
        gen_agent.tick()
    stats = gen_agent._stats.pop(request_id, None)  # noqa: SLF001 - what the finishing output would carry
    if stats is None:
        raise RuntimeError(f"the pull of {num_tokens} tokens failed")
    gen_core.abort(request_id)
    gen_core.step()  # report the abort: frees the blocks (the ack already released the ctx side)
    return stats.seconds, stats.num_bytes, stats.num_blocks


def raw_transfer(zctx: zmq.Context, blocks: list[memoryview], header_size: int) -> float:
    """Seconds to move ``blocks`` as [mac, header, block] messages ROUTER -> DEALER over TCP loopback."""
    router, dealer = zctx.socket(zmq.ROUTER), zctx.socket(zmq.DEALER)
    for sock in (router, dealer):
        sock.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.SNDHWM, 0)
    dealer.setsockopt(zmq.RCVHWM, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    mac, header = b"m" * 32, b"h" * header_size
    try:
        dealer.send(b"pull")  # connection set up and warmed, as the agents' are after the first pull
        identity, _ = router.recv_multipart()
        router.send_multipart([identity, b"ready"])
        dealer.recv()
        started = time.perf_counter()
        dealer.send(b"pull")
        identity, _ = router.recv_multipart()
        for block in blocks:
            router.send_multipart([identity, mac, header, block], copy=False)
        router.send_multipart([identity, mac, header])
        for _ in range(len(blocks) + 1):
            dealer.recv_multipart(copy=False)
        return time.perf_counter() - started
    finally:
        router.close()
        dealer.close()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=lambda t: [int(x) for x in t.split(",")], default=[1024, 4096, 16384, 32768])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/kv_transfer.json"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    max_tokens = max(args.tokens)
    model_dir = make_tiny_model(Path(tempfile.mkdtemp(prefix="kv-bench-")) / "bench", size="bench",
                                max_position_embeddings=max_tokens + 64)
    num_blocks = max_tokens // BLOCK_SIZE + 8
    conn, child_conn = multiprocessing.Pipe()
    ctx = multiprocessing.get_context("spawn").Process(target=ctx_engine, daemon=True,
                                                        args=(model_dir, num_blocks, max_tokens + 64, child_conn))
    ctx.start()
    ctx_endpoint = conn.recv()
    zctx = zmq.Context()
    gen = make_node(model_dir, num_blocks, max_tokens + 64, zctx)
    poller = zmq.Poller()
    gen[1].register(poller)
    agent_transfer(conn, ctx_endpoint, gen, poller, 256, request_id=1)  # connect the DEALER, warm the paths
    bytes_per_block = gen[0].executor.kv_cache.shape.bytes_per_block
    pool = np.random.default_rng(0).integers(0, 255, size=(num_blocks, bytes_per_block), dtype=np.uint8)
    rows, request_id = [], 10
    for num_tokens in args.tokens:
        num_blocks_sent = -(-num_tokens // BLOCK_SIZE)
        blocks = [memoryview(pool[i]) for i in range(num_blocks_sent)]
        agent_rates, raw_rates = [], []
        for _ in range(args.repeats):
            request_id += 1
            seconds, num_bytes, sent = agent_transfer(conn, ctx_endpoint, gen, poller, num_tokens, request_id)
            assert sent == num_blocks_sent and num_bytes == sent * bytes_per_block
            agent_rates.append(num_bytes / seconds)
            raw_rates.append(num_bytes / raw_transfer(zctx, blocks, header_size=8))
        agent, raw = statistics.median(agent_rates), statistics.median(raw_rates)
        row = {"tokens": num_tokens, "blocks": num_blocks_sent, "bytes": num_blocks_sent * bytes_per_block,
               "agent_gb_per_s": round(agent / 1e9, 3), "raw_zmq_gb_per_s": round(raw / 1e9, 3),
               "ratio": round(agent / raw, 3), "agent_runs_gb_per_s": [round(r / 1e9, 3) for r in agent_rates],
               "raw_runs_gb_per_s": [round(r / 1e9, 3) for r in raw_rates]}
        rows.append(row)
        print(f"{num_tokens:>6} tokens ({row['bytes'] / 2**20:7.1f} MiB): agent {row['agent_gb_per_s']:.3f} GB/s, "
              f"raw ZeroMQ {row['raw_zmq_gb_per_s']:.3f} GB/s, ratio {row['ratio']:.2f}", flush=True)
    conn.send(None)
    ctx.join(30)
    gen[1].close()
    zctx.term()
    targets = [{"target": f"agent rate >= {TARGET}x raw ZeroMQ ({r['tokens']} tokens)", "value": r["ratio"],
                "pass": r["ratio"] >= TARGET} for r in rows]
    for target in targets:
        print(f"{'PASS' if target['pass'] else 'FAIL'}: {target['target']}: {target['value']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": {"tokens": args.tokens, "repeats": args.repeats,
                                               "bytes_per_block": bytes_per_block, "block_size": BLOCK_SIZE},
                                    "results": rows, "targets": targets}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
