"""The model's tokenizer and chat template, without transformers or torch.

``Tokenizer.from_model_path(path)`` takes a Hugging Face model directory or a
GGUF file. From a directory (``from_model_dir``) it reads ``tokenizer.json``
with the ``tokenizers`` library and ``tokenizer_config.json`` for the special
tokens, ``model_max_length`` and the chat template; from a GGUF file
(``from_gguf``) it rebuilds them from the file's ``tokenizer.*`` metadata
(``workers.engine.model.gguf_tokenizer``, torch-free). Templates render in a sandboxed
jinja2 environment set up as Hugging Face does (``api.chat_template_env``), so a
model's own template gives the same prompt text as ``apply_chat_template``.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jinja2
import tokenizers

from api.chat_template_env import ChatTemplateError, compile_template, template_environment
from api.errors import PromptTooLongError
from api.piece_cache import PieceCache
from api.prompt_segments import PromptSegments, template_literals

__all__ = ["Tokenizer", "ChatTemplateError"]


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens as strings or AddedToken dicts.
    if isinstance(value, dict):
        value = value.get("content")
    return None if value is None else str(value)


# Normalizers that never shrink a text (the Llama/SentencePiece ones): a token's vocabulary string
# then bounds the input characters it can stand for.
_NON_SHRINKING_NORMALIZERS = frozenset({"Prepend", "Replace"})


def _max_token_chars(backend: tokenizers.Tokenizer) -> int | None:
    """The most input characters one token can stand for; None when the tokenizer's normalizer may
    remove characters (e.g. strip accents, NFC composition), so no bound holds.

    A vocabulary entry is at least as long as the text it matches: byte-level BPE writes one
    character per byte (a character is at least one byte), SentencePiece one per character
    (``▁`` for a space), byte-fallback tokens (``<0xE3>``) six for one byte, added tokens as they are.
    """
    normalizer = json.loads(backend.to_str()).get("normalizer")
    parts = [] if normalizer is None else normalizer.get("normalizers", [normalizer])
    for part in parts:
        if part.get("type") not in _NON_SHRINKING_NORMALIZERS:
            return None
        if part.get("type") == "Replace" and len(part.get("content", "")) < len(part.get("pattern", {}).get("String") or "x"):
            return None
    return max(len(token) for token in backend.get_vocab(with_added_tokens=True))


def _cut_after_final_message(rendered: str, final: dict[str, Any]) -> str:
    content = final.get("content")
    if not isinstance(content, str) or not content.strip():
        raise ChatTemplateError("the final message to continue has no text")
    for text in (content, content.strip()):  # templates may strip the content
        end = rendered.rfind(text)
        if end >= 0:
            return rendered[: end + len(text)]
    raise ChatTemplateError("the chat template does not write the final message's text; it cannot be continued")


class Tokenizer:
    """Encode, decode, count and render chat for one model."""

    def __init__(self, backend: tokenizers.Tokenizer, config: dict[str, Any]) -> None:
        self.backend = backend
        self._encode_fast = getattr(backend, "encode_batch_fast", None)  # tokenizers >= 0.20
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.model_max_length: int | None = config.get("model_max_length")
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._template_sources = self._template_table(config.get("chat_template"))
        self._templates: dict[str, jinja2.Template] = {}
        eos_id = backend.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_token_id: int | None = eos_id
        self.max_token_chars = _max_token_chars(backend)

    @functools.cached_property
    def token_byte_table(self) -> tuple[bytes, ...] | None:
        """Each token id's bytes for byte-level BPE tokenizers (``api.byte_detokenizer``),
        built on first use; None for other tokenizers."""
        from api.byte_detokenizer import token_byte_table

        return token_byte_table(self.backend)

    @functools.cached_property
    def prompt_segments(self) -> PromptSegments | None:
        """The chat prompt's tokenizer (``api.prompt_segments``), built on first use; None
        where this tokenizer's pieces do not tokenize alone."""
        env, literals = template_environment(), []
        for source in self._template_sources.values():
            try:
                literals += template_literals(env, source)
            except jinja2.TemplateError:  # rendering it reports that; the others' pieces still count
                pass
        return PromptSegments.of(self.backend, literals, PieceCache())

    @property
    def piece_cache(self) -> PieceCache | None:
        """Where chat prompts' long pieces are kept (``api.piece_cache``); None when this
        tokenizer's prompts are encoded whole."""
        segments = self.prompt_segments
        return None if segments is None else segments.cache

    @classmethod
    def from_model_path(cls, path: str | Path) -> Tokenizer:
        """A Hugging Face model directory or a ``.gguf`` file."""
        path = Path(path)
        if path.suffix == ".gguf" and path.is_file():
            return cls.from_gguf(path)
        return cls.from_model_dir(path)

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        from workers.engine.model.gguf_tokenizer import tokenizer_from_gguf

        backend, config = tokenizer_from_gguf(path)
        return cls(backend, config)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        backend = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
        template_path = model_dir / "chat_template.jinja"
        if "chat_template" not in config and template_path.exists():
            config["chat_template"] = template_path.read_text(encoding="utf-8")
        return cls(backend, config)

    @staticmethod
    def _template_table(value: Any) -> dict[str, str]:
        # A string, or HF's list of {"name", "template"} (e.g. "default", "tool_use").
        if value is None:
            return {}
        if isinstance(value, str):
            return {"default": value}
        return {entry["name"]: entry["template"] for entry in value}

    @property
    def has_chat_template(self) -> bool:
        return bool(self._template_sources)

    @property
    def chat_template_source(self) -> str | None:
        """The template that renders tools (``tool_use`` when the model has one), as text."""
        sources = self._template_sources
        return sources.get("tool_use") or sources.get("default") or next(iter(sources.values()), None)

    def proves_too_long(self, text: str, max_tokens: int) -> bool:
        """Whether ``text`` has more than ``max_tokens`` tokens, decided from its length alone: a
        token stands for at most ``max_token_chars`` characters. False: tokenize to know."""
        return self.max_token_chars is not None and len(text) > max_tokens * self.max_token_chars

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._encode_fast is not None:  # no character offsets: a third less time, every request
            ids: list[int] = self._encode_fast([text], add_special_tokens=add_special_tokens)[0].ids
            return ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token on its own, as API logprobs show it."""
        return self.backend.decode([token_id], skip_special_tokens=False)

    def count_tokens(self, text: str, add_special_tokens: bool = True) -> int:
        return len(self.encode(text, add_special_tokens))

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The prompt text of a conversation under the model's chat template.

        ``continue_final_message``: the last message (an assistant's) is left
        open, so the model continues it (Anthropic prefill; as HF's option:
        the text is cut right after that message's content).

        Raises ChatTemplateError when the model has no template or the
        template rejects the conversation.
        """
        template = self._template(with_tools=bool(tools))
        context = dict(template_kwargs or {})
        context.update(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )
        try:
            rendered = template.render(**context)
        except ChatTemplateError:
            raise
        except Exception as exc:  # e.g. ``'...' + None`` on a null content: the conversation's fault
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
        return _cut_after_final_message(rendered, messages[-1]) if continue_final_message else rendered

    def encode_chat(self, messages: list[dict[str, Any]], *, max_tokens: int | None = None,
                    **kwargs: Any) -> list[int]:
        """The conversation's prompt ids; ``PromptTooLongError`` without tokenizing when its rendered
        text alone proves it has more than ``max_tokens``."""
        text = self.render_chat(messages, **kwargs)
        if max_tokens is not None and self.proves_too_long(text, max_tokens):
            raise too_long_error(len(text), max_tokens, self.max_token_chars, "messages")
        # The template writes BOS itself: encode without adding special tokens, as HF does.
        segments = self.prompt_segments
        return self.encode(text, add_special_tokens=False) if segments is None else segments.encode(text)

    def _template(self, with_tools: bool) -> jinja2.Template:
        if not self._template_sources:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        name = "tool_use" if with_tools and "tool_use" in self._template_sources else "default"
        if name not in self._template_sources:
            name = next(iter(self._template_sources))
        if name not in self._templates:
            self._templates[name] = compile_template(self._template_sources[name])
        return self._templates[name]


def too_long_error(num_chars: int, max_tokens: int, max_token_chars: int | None, param: str) -> PromptTooLongError:
    return PromptTooLongError(
        f"the prompt has {num_chars} characters: more than {max_tokens} tokens, the model's context length, "
        f"can hold (a token here is at most {max_token_chars} characters)", param=param)
