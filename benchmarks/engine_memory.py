"""A ctx engine's memory under its own work alone: does its RSS grow, and is it in use or only kept?

In one process, without HTTP: an ``EngineCore`` on the torch engine serves
``--requests`` context-only requests one after another (random prompts of
40-``--max-prompt`` tokens, one output token, the KV parked as a ctx worker
parks it); each parked KV is exported as a KV transfer exports it (the
frames gathered on a thread of their own, sent zero-copy over a ZeroMQ
socket, freed by ZeroMQ's thread once sent) and released. Every
``--sample-every`` requests the RSS is read; at the end, glibc's
``malloc_trim(0)`` shows how much of it was freed memory the allocator kept.

``--trim-seconds S`` runs the engine loop's ``MemoryTrimmer`` every S seconds
(``workers.allocator``; 0: never, as before it existed). Prints the RSS slope
after the warm-up (the first ``--warmup-share`` of the requests) in MB per 100
requests, and writes JSON.

    python benchmarks/engine_memory.py [--model smollm2-135m-instruct] [--requests 300] [--trim-seconds 30]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak import slope_mb_per_min


def main(argv: list[str] | None = None) -> int:
    from disagg.model_names import resolve_model
    from workers.allocator import MemoryTrimmer, release_memory, rss_bytes
    from workers.config import CacheConfig, EngineConfig, SchedulerConfig
    from workers.engine_proc import build_core
    from workers.protocol import EngineRequest
    from workers.sampling_params import SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--max-prompt", type=int, default=500)
    parser.add_argument("--num-blocks", type=int, default=512)
    parser.add_argument("--trim-seconds", type=float, default=0.0)
    parser.add_argument("--sample-every", type=int, default=10)
    parser.add_argument("--warmup-share", type=float, default=0.3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/engine_memory.json"))
    args = parser.parse_args(argv)

    config = EngineConfig(model=str(resolve_model(args.model)), kind="torch", device="cpu", num_threads=args.threads,
                          cache=CacheConfig(block_size=16, num_blocks=args.num_blocks),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024))
    core, info = build_core(config.validate())
    release_memory()  # as the engine process does once its model is loaded
    ctx = zmq.Context()
    sink = ctx.socket(zmq.PULL)
    sink.bind("inproc://kv-sink")
    out = ctx.socket(zmq.PUSH)
    out.connect("inproc://kv-sink")
    drained = threading.Event()

    def drain() -> None:  # the gen side: receives the frames and drops them
        while not drained.is_set():
            if sink.poll(100):
                sink.recv_multipart(copy=False)

    threading.Thread(target=drain, daemon=True).start()
    def export(blocks: list[int]) -> None:  # the KV server's thread: 8 blocks a chunk, zero-copy
        for i in range(0, len(blocks), 8):
            out.send_multipart(list(core.export_blocks(blocks[i:i + 8])), copy=False)

    trimmer = MemoryTrimmer(args.trim_seconds) if args.trim_seconds > 0 else None
    rng = random.Random(0)
    samples: list[tuple[float, int, float]] = []
    start = time.time()
    for request_id in range(1, args.requests + 1):
        prompt = [rng.randrange(10, info.vocab_size) for _ in range(rng.randint(40, args.max_prompt))]
        core.add_request(EngineRequest(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0),
                                       time.time()), park_kv_seconds=60.0)
        while core.has_unfinished():
            core.step()
            if trimmer is not None:
                trimmer.tick()
        exporter = threading.Thread(target=export, args=(core.parked_block_ids(request_id) or [],))
        exporter.start()
        exporter.join()
        core.release_parked(request_id)
        if request_id % args.sample_every == 0:
            samples.append((time.time() - start, request_id, (rss_bytes() or 0) / 2**20))
            print(f"  {request_id:5d} requests  RSS {samples[-1][2]:8.1f} MB", flush=True)
    time.sleep(1.0)  # ZeroMQ has sent (and freed) the last frames
    drained.set()
    before = (rss_bytes() or 0) / 2**20
    release_memory()
    after = (rss_bytes() or 0) / 2**20
    warm = [(t, mb) for t, n, mb in samples if n >= args.warmup_share * args.requests]
    per_min = slope_mb_per_min(warm)
    per_request = None
    if len(warm) >= 3:
        ns = [n for _, n, _ in samples if n >= args.warmup_share * args.requests]
        per_request = slope_mb_per_min([(n, mb) for n, (_, mb) in zip(ns, warm)])
    per_100 = None if per_request is None else per_request / 60 * 100
    elapsed = time.time() - start
    print(f"{args.requests} requests in {elapsed:.0f} s, trim every {args.trim_seconds or 'never'} s: RSS "
          f"{samples[0][2]:.1f} -> {samples[-1][2]:.1f} MB; after the warm-up "
          f"{per_100 if per_100 is None else round(per_100, 2)} MB per 100 requests "
          f"({per_min if per_min is None else round(per_min, 2)} MB/min); malloc_trim(0) at the end: "
          f"{before:.1f} -> {after:.1f} MB (kept, not in use: {before - after:.1f} MB)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "elapsed_seconds": elapsed,
                                    "samples": samples, "mb_per_100_requests": per_100, "mb_per_min": per_min,
                                    "rss_before_trim_mb": before, "rss_after_trim_mb": after}, indent=1))
    out.close(linger=1000)
    sink.close(linger=0)
    ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
