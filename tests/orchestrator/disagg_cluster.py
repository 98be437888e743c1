"""A test deployment: a ctx worker, a gen worker (torch engine) and a 2-process orchestrator in
disaggregated mode (no conditional skip), with its state directory fixed so that a restarted
orchestrator finds its stores; workers restartable on their port."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import openai
from orchestrator_process import start_orchestrator, stop_orchestrator
from worker_process import disagg_worker_args, start_worker, stop_worker


class DisaggCluster:
    def __init__(self, tmp, model_dir, **orchestrator_overrides: Any) -> None:
        self.tmp, self.model_dir = tmp, model_dir
        self.overrides = orchestrator_overrides
        self.common = disagg_worker_args(tmp)
        self.ctx_url, self.ctx = self.start_worker("ctx")
        self.gen_url, self.gen = self.start_worker("gen")
        self.state_dir = tmp / "orchestrator-state"
        self.url, self.orch = self.start_orchestrator()

    def start_worker(self, role: str, port: int | None = None):
        return start_worker(self.model_dir, 1, engine="torch", port=port, extra_args=["--role", role, *self.common])

    def start_orchestrator(self, wait_healthy: bool = True):
        return start_orchestrator(self.tmp, self.model_dir, [("ctx", self.ctx_url), ("gen", self.gen_url)],
                                  processes=2, conditional={"enabled": False}, state_dir=str(self.state_dir),
                                  wait_healthy=wait_healthy, **self.overrides)

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key="unused", max_retries=0, timeout=60)

    def close(self) -> None:
        stop_orchestrator(self.orch)
        for worker in (self.ctx, self.gen):
            stop_worker(worker)


def prefill_tokens(url: str) -> int:
    """Prompt tokens the worker's engine computed since the last call (its drained step stats)."""
    return sum(step["num_prefill_tokens"] for step in httpx.get(url + "/metrics").json())
