"""Chat messages -> prompt text, rendered exactly as llama-cpp-python's ``create_chat_completion``.

``Llama`` picks its chat format from the GGUF (``Llama.__init__``, 0.3.36): a
``tokenizer.chat_template`` that equals one of the templates it knows
(``guess_chat_format_from_gguf_metadata``) selects that built-in formatter
(chatml, mistral-instruct, llama-3); any other template is rendered by its
``Jinja2ChatFormatter`` (sandboxed Jinja, BOS/EOS texts of the vocabulary,
``add_generation_prompt``); a file with no template falls back to ``llama-2``.
The handler then tokenizes the text with BOS added unless the formatter says
the template put the special tokens in itself (``added_special``), parsing
special tokens. We call the same formatters, so the tokens are the same.

Messages are untrusted input: only ``{"role": str, "content": str}`` items
are accepted, sizes are bounded, and a template that refuses them (its own
``raise_exception``, a type error in Jinja) is the caller's InputError.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
from llama_cpp import llama_chat_format as cf

from meshnode import errors

#: messages per request, and characters in all of them, before rendering (the context caps tokens later)
MAX_MESSAGES = 1024
MAX_CHARS = 4 * 1024 * 1024

#: Llama's built-in formatters, by the names ``guess_chat_format_from_gguf_metadata`` returns
_BUILTIN: dict[str, Callable[..., cf.ChatFormatterResponse]] = {
    "chatml": cf.format_chatml,
    "mistral-instruct": cf.format_mistral_instruct,
    "llama-3": cf.format_llama3,
    "llama-2": cf.format_llama2,
}


@dataclass(frozen=True)
class ChatPrompt:
    #: the rendered prompt text
    text: str
    #: whether tokenizing it adds BOS (False when the template wrote its special tokens itself)
    add_bos: bool
    #: stop strings the format adds to the caller's (e.g. the EOS text, chatml's ``<|im_end|>``)
    stop: tuple[str, ...]


@dataclass(frozen=True)
class ChatFormat:
    """How one model file turns messages into a prompt."""

    #: ``tokenizer.chat_template`` of the GGUF (None: the file has none)
    template: str | None
    #: texts of the vocabulary's BOS and EOS tokens ("" when it has none)
    bos_token: str
    eos_token: str

    @property
    def name(self) -> str:
        """The format ``Llama`` would choose: a built-in name, or ``chat_template.default``."""
        if self.template is None:
            return "llama-2"
        guessed = cf.guess_chat_format_from_gguf_metadata({"tokenizer.chat_template": self.template})
        return guessed or "chat_template.default"

    @functools.cached_property
    def _formatter(self) -> Callable[..., cf.ChatFormatterResponse]:
        builtin = _BUILTIN.get(self.name)
        if builtin is not None:
            return builtin
        assert self.template is not None
        try:
            return cf.Jinja2ChatFormatter(self.template, self.eos_token, self.bos_token)
        except jinja2.TemplateError as e:
            raise errors.ModelFormatError(f"the model's tokenizer.chat_template is not valid Jinja: {e}") from e

    def render(self, messages: object) -> ChatPrompt:
        """The prompt for ``messages`` (InputError if they are malformed or the template refuses them;
        ModelFormatError if the model's template does not compile)."""
        msgs = check_messages(messages)
        formatter = self._formatter
        try:
            result = formatter(messages=msgs)
        except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError) as e:
            raise errors.InputError(f"the model's chat template refused these messages: {e}") from e
        stop = result.stop if isinstance(result.stop, list) else [result.stop] if result.stop else []
        return ChatPrompt(result.prompt, add_bos=not result.added_special, stop=tuple(stop))


def check_messages(messages: object) -> list[dict[str, Any]]:
    """A list of ``{"role": str, "content": str}`` within the size bounds, as new plain dicts."""
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes) or not messages:
        raise errors.InputError("messages must be a non-empty list of {role, content} objects")
    if len(messages) > MAX_MESSAGES:
        raise errors.InputError(f"{len(messages)} messages; at most {MAX_MESSAGES}")
    out: list[dict[str, Any]] = []
    total = 0
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise errors.InputError(f"messages[{i}] is not an object with role and content")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise errors.InputError(f"messages[{i}].role must be a non-empty string")
        if not isinstance(content, str):
            raise errors.InputError(f"messages[{i}].content must be a string")
        total += len(role) + len(content)
        if total > MAX_CHARS:
            raise errors.InputError(f"messages are longer than {MAX_CHARS} characters in all")
        out.append({"role": role, "content": content})
    return out
