"""Agent frameworks against a running deployment (issue 31): what a user of openai-agents, pydantic-ai and
LangChain (OpenAI and Anthropic) gets from disagg's URL, each library used the way its documentation shows.

Each check runs one agentic step a framework is used for and says whether the library got what it
needed: a tool called with arguments its schema accepts, a structured answer its model validates,
the tool result fed back and answered. With a random-weight model the text is noise but the shapes
must hold (forced calls and schemas are grammar-constrained); with SmolLM2 (``make up``) the answers
read as answers. The frameworks are not dependencies of disagg: install them where you run this

    pip install openai-agents==0.24.0 "pydantic-ai-slim[openai,anthropic]==2.68.0" \\
        langchain-openai==1.7.4 langchain-anthropic==1.7.10
    python benchmarks/agent_frameworks.py --url http://127.0.0.1:8000 [--api-key KEY] [--model NAME]
        [--out benchmarks/results/agent_frameworks.json]

Prints one line per check (pass or the error) and writes JSON; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

CITY_QUESTION = "What is the weather in Paris? Use the tool."


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"It is 21 degrees and sunny in {city}."


def served_model(url: str, headers: dict[str, str]) -> str:
    models = httpx.get(f"{url}/v1/models", headers=headers, timeout=30).json()["data"]
    return models[0]["id"]


async def openai_agents_tool_loop(url: str, key: str, model: str) -> str:
    """openai-agents: an Agent with a function tool on the Chat Completions model; the first turn
    must call the tool (``tool_choice: required``), the runner feeds the result back for the answer."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return get_weather(city)

    agent = Agent(name="assistant", instructions="Answer with the tools you have.", tools=[weather],
                  model=OpenAIChatCompletionsModel(model, AsyncOpenAI(base_url=f"{url}/v1", api_key=key)),
                  model_settings=ModelSettings(tool_choice="required", max_tokens=64))
    result = await Runner.run(agent, CITY_QUESTION, max_turns=4)
    assert calls, "the tool was never called"
    return f"tool called with city={calls[0]!r}; final output {str(result.final_output)[:60]!r}"


def pydantic_ai_structured(url: str, key: str, model: str) -> str:
    """pydantic-ai: an Agent whose output is a pydantic model (its output tool, arguments validated)."""
    from pydantic import BaseModel
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class Weather(BaseModel):
        city: str
        degrees: int

    agent = Agent(OpenAIChatModel(model, provider=OpenAIProvider(base_url=f"{url}/v1", api_key=key)),
                  output_type=Weather, retries=2)
    result = agent.run_sync("Paris is at 21 degrees. Report it.", model_settings={"max_tokens": 96})
    assert isinstance(result.output, Weather)
    return f"output {result.output!r}"


def pydantic_ai_tool(url: str, key: str, model: str) -> str:
    """pydantic-ai: a tool the agent calls, then a text answer."""
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    calls: list[str] = []
    agent = Agent(OpenAIChatModel(model, provider=OpenAIProvider(base_url=f"{url}/v1", api_key=key)))

    @agent.tool_plain
    def weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return get_weather(city)

    result = agent.run_sync(CITY_QUESTION, model_settings={"max_tokens": 64})
    return f"tool calls {calls!r}; output {str(result.output)[:60]!r}"


def langchain_openai_tools(url: str, key: str, model: str) -> str:
    """LangChain ChatOpenAI: bind_tools with a forced tool, and with_structured_output (json_schema)."""
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class Weather(BaseModel):
        city: str
        degrees: int

    chat = ChatOpenAI(model=model, base_url=f"{url}/v1", api_key=key, max_tokens=64, temperature=0)
    message = chat.bind_tools([get_weather], tool_choice="get_weather").invoke(CITY_QUESTION)
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather", message
    assert isinstance(message.tool_calls[0]["args"].get("city"), str), message.tool_calls
    structured = chat.with_structured_output(Weather, method="json_schema").invoke("Paris is at 21 degrees.")
    assert isinstance(structured, Weather)
    return f"tool call {message.tool_calls[0]['args']!r}; structured {structured!r}"


def langchain_anthropic_tools(url: str, key: str, model: str) -> str:
    """LangChain ChatAnthropic against /v1/messages: a forced tool_use block, then the tool result
    sent back and answered."""
    from langchain_anthropic import ChatAnthropic
    from langchain_core.messages import HumanMessage, ToolMessage

    chat = ChatAnthropic(model=model, base_url=url, api_key=key, max_tokens=64, temperature=0)
    forced = chat.bind_tools([get_weather], tool_choice="get_weather")
    message = forced.invoke(CITY_QUESTION)
    assert message.tool_calls and isinstance(message.tool_calls[0]["args"].get("city"), str), message
    call = message.tool_calls[0]
    answer = chat.bind_tools([get_weather]).invoke([
        HumanMessage(CITY_QUESTION), message,
        ToolMessage(get_weather(call["args"]["city"]), tool_call_id=call["id"])])
    return f"tool_use {call['args']!r}; answer {str(answer.content)[:60]!r}"


CHECKS: dict[str, Callable[[str, str, str], Any]] = {
    "openai-agents tool loop": lambda u, k, m: asyncio.run(openai_agents_tool_loop(u, k, m)),
    "pydantic-ai structured output": pydantic_ai_structured,
    "pydantic-ai tool": pydantic_ai_tool,
    "langchain-openai tools + structured": langchain_openai_tools,
    "langchain-anthropic tool_use loop": langchain_anthropic_tools,
}


def run_check(name: str, check: Callable[[str, str, str], Any], url: str, key: str, model: str) -> dict:
    start = time.perf_counter()
    try:
        detail = check(url, key, model)
        return {"check": name, "ok": True, "seconds": time.perf_counter() - start, "detail": detail}
    except ImportError as exc:
        return {"check": name, "ok": False, "seconds": 0.0, "detail": f"not installed: {exc.name}"}
    except Exception as exc:  # noqa: BLE001 (a failing check is the finding: report it, run the others)
        return {"check": name, "ok": False, "seconds": time.perf_counter() - start,
                "detail": f"{type(exc).__name__}: {exc}"[:400], "traceback": traceback.format_exc()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--model", default=None, help="default: the first of the server's /v1/models")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/agent_frameworks.json"))
    args = parser.parse_args()
    headers = {"authorization": f"Bearer {args.api_key}"}
    model = args.model or served_model(args.url, headers)
    rows = []
    for name, check in CHECKS.items():
        rows.append(run_check(name, check, args.url, args.api_key, model))
        row = rows[-1]
        print(f"{'PASS' if row['ok'] else 'FAIL'}  {name:38s} {row['seconds']:6.1f} s  {row['detail']}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"url": args.url, "model": model, "checks": rows}, indent=1) + "\n")
    print(f"{sum(r['ok'] for r in rows)}/{len(rows)} passed; wrote {args.out}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
