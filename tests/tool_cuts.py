"""Forced tool calls that ``max_tokens`` cuts, asked streamed and not through the official SDKs on
chat, messages and Responses, shared by the worker and the orchestrator tests: the streamed
answer, as the SDK assembles it, must equal the non-streamed one (greedy sampling: same tokens),
and hold only calls (the one cut with the arguments written so far), never the call format's
markup as text."""

from __future__ import annotations

import anthropic
import openai
from openai.lib.streaming.chat import ChatCompletionStreamState

# A string argument a random-weight model never ends, and an enum it ends at once (so that with
# parallel calls allowed it repeats the call until the limit).
NOTE = {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"]}
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}
SCHEMAS = {"note": NOTE, "city": CITY}
USER = [{"role": "user", "content": "Take a note."}]
# Long enough for the first call's name on the tiny model's tokenizer, short enough to cut a call.
MAX_TOKENS = (24, 56)


def chat_answer(client: openai.OpenAI, schema: str, max_tokens: int, stream: bool) -> tuple:
    kwargs = dict(model="tiny", messages=USER, max_tokens=max_tokens, temperature=0, tool_choice="required",
                  tools=[{"type": "function", "function": {"name": schema, "parameters": SCHEMAS[schema]}}])
    if stream:
        state = ChatCompletionStreamState()
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            state.handle_chunk(chunk)
        completion = state.current_completion_snapshot
    else:
        completion = client.chat.completions.create(**kwargs)
    choice = completion.choices[0]
    calls = [(call.function.name, call.function.arguments) for call in choice.message.tool_calls or ()]
    return choice.finish_reason, choice.message.content or "", calls


def messages_answer(client: anthropic.Anthropic, schema: str, max_tokens: int, stream: bool) -> tuple:
    kwargs = dict(model="tiny", messages=USER, max_tokens=max_tokens, extra_body={"temperature": 0},
                  tool_choice={"type": "any"}, tools=[{"name": schema, "input_schema": SCHEMAS[schema]}])
    if stream:
        with client.messages.stream(**kwargs) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**kwargs)
    return message.stop_reason, [block.model_dump(include={"type", "text", "name", "input"})
                                 for block in message.content]


def responses_answer(client: openai.OpenAI, schema: str, max_tokens: int, stream: bool) -> tuple:
    kwargs = dict(model="tiny", input=USER[0]["content"], max_output_tokens=max_tokens, temperature=0,
                  tool_choice="required", store=False,
                  tools=[{"type": "function", "name": schema, "parameters": SCHEMAS[schema]}])
    if stream:
        events = list(client.responses.create(stream=True, **kwargs))
        assert [event.sequence_number for event in events] == list(range(len(events)))
        response = events[-1].response
    else:
        response = client.responses.create(**kwargs)
    items = [(item.type, item.name, item.arguments) if item.type == "function_call" else (item.type,)
             for item in response.output]
    return response.status, response.incomplete_details and response.incomplete_details.reason, items


def check_cut_calls(openai_client: openai.OpenAI, anthropic_client: anthropic.Anthropic) -> None:
    """Every API, streamed and not, for each schema and limit: the same calls. The note's string never
    ends, so the limit always cuts its call; the model may end the city's calls itself."""
    for schema in SCHEMAS:
        for max_tokens in MAX_TOKENS:
            where = f"{schema}, max_tokens={max_tokens}"
            plain = chat_answer(openai_client, schema, max_tokens, False)
            assert chat_answer(openai_client, schema, max_tokens, True) == plain, where
            finish_reason, content, calls = plain
            cut = finish_reason == "length"
            assert (cut or schema == "city") and content == "" and calls, (where, plain)
            assert all(name == schema for name, _ in calls), (where, plain)
            assert calls[-1][1] == "" or calls[-1][1].startswith("{"), (where, plain)

            plain = messages_answer(anthropic_client, schema, max_tokens, False)
            assert messages_answer(anthropic_client, schema, max_tokens, True) == plain, where
            stop_reason, blocks = plain
            assert stop_reason == ("max_tokens" if cut else "tool_use") and blocks, (where, plain)
            assert all(block["type"] == "tool_use" and block["name"] == schema for block in blocks), (where, plain)

            plain = responses_answer(openai_client, schema, max_tokens, False)
            assert responses_answer(openai_client, schema, max_tokens, True) == plain, where
            status, reason, items = plain
            assert (status, reason) == (("incomplete", "max_output_tokens") if cut else ("completed", None)), \
                (where, plain)
            assert items and all(item[:2] == ("function_call", schema) for item in items), (where, plain)
            # The same calls as chat: a Responses request runs as the chat request it means.
            assert [item[2] for item in items] == [arguments for _, arguments in calls], where
