"""The sandboxed jinja2 environment that chat templates run in (``api.tokenizer``).

Set up as Hugging Face does (``trim_blocks``, ``lstrip_blocks``, ``raise_exception``,
``tojson``, ``strftime_now``), so a model's own template gives the same prompt text as
``apply_chat_template``. Templates come from model files: the sandbox stays. What is cut
is its per-call toll on the two callables a chat template calls for every message, a
macro it defined itself (``render_content(message['content'])``) and a dict's
``get`` (``message.get('tool_calls')``): ``SandboxedEnvironment.call`` would ask
``is_safe_callable`` (a macro and a builtin method never carry ``unsafe_callable`` or
``alters_data``) and ``Context.call`` would look for ``pass_context`` markers (neither
has one); both then make the plain call. About 2 us a call (jinja2 3.1).
"""

from __future__ import annotations

import json
from datetime import datetime
from types import BuiltinMethodType
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.runtime import Context, Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplateError", "compile_template", "template_environment"]


class ChatTemplateError(ValueError):
    """The chat template refused the conversation (its ``raise_exception``) or failed."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _plain_callable(obj: Any) -> bool:
    # A dict's own methods only: the immutable sandbox already refused the mutating ones when the
    # template looked them up (they arrive here as Undefined), and older jinja2 intercepted
    # ``str.format`` in ``call``, so no other builtin method takes this way.
    return type(obj) is Macro or (type(obj) is BuiltinMethodType and type(obj.__self__) is dict)


class _ChatTemplateEnvironment(ImmutableSandboxedEnvironment):
    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # __: kwargs may hold "obj"
        if not _plain_callable(__obj):
            return super().call(__context, __obj, *args, **kwargs)
        # What Context.call does for a callable without pass_* markers.
        kwargs.pop("_block_vars", None)
        kwargs.pop("_loop_vars", None)
        try:
            return __obj(*args, **kwargs)
        except StopIteration:
            return __self.undefined("value was undefined because a callable raised a StopIteration exception")


def template_environment() -> jinja2.Environment:
    env = _ChatTemplateEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def compile_template(source: str) -> jinja2.Template:
    template = template_environment().from_string(source)
    # jinja keeps the globals as a ChainMap over the environment's, and every render copies it
    # into the context by iterating it: a plain dict of the same names renders a third faster.
    template.globals = dict(template.globals)
    return template
