"""``n`` choices in one request against ``n`` requests for the same prompt: prompt tokens computed and time.

One worker (the tiny ``bench`` Llama on the torch engine, one frontend). For
each prompt length, a chat request with ``n`` choices (``max_tokens`` 16,
``ignore_eos``, seeded), against the same prompt sent as ``n`` separate
requests at once (seeds ``seed + i``: the same choices). Each prompt is new
(a serial number first), so nothing is in the prefix cache before it runs.
Reported per row: the prompt tokens the engine computed (its step stats,
``GET /metrics``, drained before and after) and the wall time of the
request(s), median over ``--rounds``.

Sent together, ``n`` requests each prefill the whole prompt (a block is in
the prefix cache only once its KV is computed); ``n`` choices compute it
once and then only its last partial block per other choice
(``api/choices.py``). Target: ``n`` choices compute at most the prompt
plus ``n - 1`` blocks.

    PYTHONPATH=. python benchmarks/n_choices.py [--n 4] [--lengths 256,1024] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from frontend_scaling import Server
from orchestrator_overhead import HOST, free_port

WORKER_READY = "disagg serve: ready on"
MODEL = "tiny-bench"
MAX_TOKENS = 16


def start_worker(model_dir: Path, work: Path, max_len: int) -> Server:
    argv = [sys.executable, "-m", "disagg.cli", "serve", str(model_dir), "--engine", "torch", "--num-frontends", "1",
            "--host", HOST, "--port", str(free_port()), "--log-level", "warning", "--max-model-len", str(max_len),
            "--max-num-batched-tokens", str(max_len), "--served-model-name", MODEL]
    return Server(argv, WORKER_READY, work, "n-choices-worker", timeout=300)


def chat(words: int, serial: int, n: int, seed: int) -> dict:
    content = f"{serial} " + " ".join(f"w{i}" for i in range(words))
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
            "temperature": 1.0, "seed": seed, "n": n, "ignore_eos": True}


async def computed(client: httpx.AsyncClient) -> int:
    """Prompt tokens the engine computed since the last call."""
    return sum(step["num_prefill_tokens"] for step in (await client.get("/metrics")).json())


async def one_row(client: httpx.AsyncClient, words: int, serial: int, n: int, together: bool) -> dict:
    await computed(client)
    start = time.perf_counter()
    if together:
        answers = [(await client.post("/v1/chat/completions", json=chat(words, serial, n, 1))).json()]
    else:
        answers = [r.json() for r in await asyncio.gather(*(
            client.post("/v1/chat/completions", json=chat(words, serial, 1, 1 + i)) for i in range(n)))]
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "prefill": await computed(client), "prompt": answers[0]["usage"]["prompt_tokens"]}


async def measure(url: str, args: argparse.Namespace) -> list[dict]:
    rows, serial = [], 0
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        block_size = (await client.get("/worker_info")).json()["block_size"]
        for words in args.lengths:
            for together in (True, False):
                runs = []
                for _ in range(args.rounds):
                    serial += 1
                    runs.append(await one_row(client, words, serial, args.n, together))
                rows.append({"words": words, "mode": f"n={args.n}" if together else f"{args.n} requests",
                             "prompt": runs[0]["prompt"], "prefill": runs[0]["prefill"],
                             "seconds": statistics.median(r["seconds"] for r in runs), "block_size": block_size})
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--lengths", type=lambda text: [int(v) for v in text.split(",")], default=[256, 1024],
                        help="prompt lengths in words (a word is about two tokens)")
    parser.add_argument("--rounds", type=int, default=3)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from workers.engine.model.tiny import make_tiny_model  # torch-free

    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = make_tiny_model(work / MODEL, size="bench")
        server = start_worker(model_dir, work, max(args.lengths) * 4 + 256)
        try:
            rows = asyncio.run(measure(server_url(server), args))
        finally:
            server.stop()
    failed = False
    print(f"{'words':>6} {'mode':>12} {'prompt':>7} {'computed':>9} {'seconds':>8}")
    for row in rows:
        print(f"{row['words']:>6} {row['mode']:>12} {row['prompt']:>7} {row['prefill']:>9} {row['seconds']:>8.3f}")
        if row["mode"].startswith("n="):
            bound = row["prompt"] + (args.n - 1) * row["block_size"]
            failed |= row["prefill"] > bound
    print("target: n choices compute <= prompt + (n - 1) blocks:", "FAIL" if failed else "ok")
    return 1 if failed else 0


def server_url(server: Server) -> str:
    argv = server.popen.args
    return f"http://{HOST}:{argv[argv.index('--port') + 1]}"


if __name__ == "__main__":
    sys.exit(main())
