"""The chat templates' environment renders as jinja2's own sandbox does, and refuses what it refuses
(api.chat_template_env: a macro's and a dict method's call skip the sandbox's per-call checks)."""

from __future__ import annotations

import pytest
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from api.chat_template_env import compile_template, template_environment
from workers.engine.model.tiny_tokenizer import CHAT_TEMPLATE

_MACROS = """\
{%- macro tag(name, value='-') -%}[{{ name }}={{ value }}{{ varargs | join(',') }}{{ kwargs.get('x', '') }}]{%- endmacro -%}
{%- macro wrap() -%}({{ caller() }}){%- endmacro -%}
{%- for message in messages -%}
{{ tag(message['role']) }}{{ tag(message.get('name', 'anon'), 'v', 1, 2, x='k') }}
{%- call wrap() %}{{ message.get('content') }}{% endcall -%}
{%- for key, value in message.items() | sort %}{{ key }}:{{ value }};{% endfor -%}
{{ message.get('missing') is none }}{{ message.keys() | list | length }}
{%- endfor -%}
"""

_CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi", "name": "bob"},
     {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
     {"role": "tool", "content": [{"type": "text", "text": "21"}, {"type": "image"}]}],
    [{"role": "assistant", "content": "x", "tool_calls": [{"name": "g", "arguments": "{}"}]}],
]


def _stock(source: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = template_environment().filters["tojson"]
    return env.from_string(source)


@pytest.mark.parametrize("source", [CHAT_TEMPLATE, _MACROS])
@pytest.mark.parametrize("messages", _CONVERSATIONS)
def test_renders_as_the_stock_sandbox(source, messages):
    tools = [{"type": "function", "function": {"name": "f"}}]
    for kwargs in ({"messages": messages}, {"messages": messages, "tools": tools, "add_generation_prompt": True}):
        assert compile_template(source).render(bos_token="<s>", **kwargs) == _stock(source).render(
            bos_token="<s>", **kwargs)


def _outcome(template, messages) -> str:
    try:
        return template.render(messages=messages)
    except Exception as exc:  # noqa: BLE001  # what it raised is the outcome compared
        return f"raised {type(exc).__name__}"


@pytest.mark.parametrize("source", [
    "{{ messages.append(1) }}",
    "{{ messages[0].update({'role': 'x'}) }}",
    "{% set m = messages[0] %}{{ m.pop('role') }}",
    "{{ messages[0].setdefault('a', 1) }}",
    "{{ messages[0].clear() }}",
    "{{ messages.__class__.__mro__[1].__subclasses__() }}",
    "{{ '{0.__class__}'.format(messages) }}{{ '{}!'.format(messages[0].get('role')) }}",
    "{{ messages[0]['get']('role') }}{{ messages[0].copy() }}{{ messages[0].get.__self__ }}",
])
def test_refuses_what_the_stock_sandbox_refuses(source):
    messages = [{"role": "user", "content": "x"}]
    outcome = _outcome(compile_template(source), messages)
    assert outcome == _outcome(_stock(source), messages)
    if "format" not in source and "copy" not in source:
        assert outcome == f"raised {SecurityError.__name__}"
    assert messages == [{"role": "user", "content": "x"}]


def test_other_callables_still_pass_the_sandbox_and_get_their_context():
    from jinja2 import pass_context
    from jinja2.sandbox import unsafe

    @pass_context
    def role_of(context, index):
        return context["messages"][index]["role"]

    @unsafe
    def forbidden():
        return "called"

    env = template_environment()
    env.globals.update(role_of=role_of, forbidden=forbidden)
    messages = [{"role": "user", "content": "x"}]
    assert env.from_string("{{ role_of(0) }}").render(messages=messages) == "user"
    with pytest.raises(SecurityError):
        env.from_string("{{ forbidden() }}").render()
