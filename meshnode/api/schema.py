"""The OpenAI-compatible API's wire format: request bodies in, response documents out. Pure.

Requests are parsed field by field into a ``Job``; anything malformed is the
caller's ``InputError`` (HTTP 400) naming the field. Sampling defaults are
``Llama.create_completion``'s (``SamplingParams()``) for a completion and
``Llama.create_chat_completion``'s for a chat (the same, at temperature 0.2); ``max_tokens`` defaults to 16 for a
completion (OpenAI's and ``Llama``'s) and to what the context leaves for a chat.
Fields this mesh cannot honour with a value that would change the answer
(``n`` > 1, ``echo``, ``logprobs``, tools, a JSON ``response_format``,
``logit_bias``) are refused rather than ignored.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from meshnode import errors
from meshnode.executor.sampler import SamplingParams

if TYPE_CHECKING:  # the schema stays importable without the session machinery
    from meshnode.session.initiator import GenerationResult

#: sampling fields: (JSON name, SamplingParams field, type)
_SAMPLING = (("temperature", "temperature", float), ("top_p", "top_p", float), ("top_k", "top_k", int),
             ("min_p", "min_p", float), ("typical_p", "typical_p", float),
             ("repeat_penalty", "repeat_penalty", float), ("frequency_penalty", "frequency_penalty", float),
             ("presence_penalty", "presence_penalty", float), ("seed", "seed", int))
#: ``Llama.create_chat_completion``'s defaults: its completion's, but temperature 0.2
CHAT_DEFAULTS = SamplingParams(temperature=0.2)
#: stop strings a request may give (OpenAI's own bound)
MAX_STOP = 4


@dataclass(frozen=True)
class Job:
    """One request, checked: what to generate and how."""

    #: "completion" (raw text) or "chat" (messages through the model's chat template)
    kind: str
    #: the model as the client named it (name, file name or fingerprint prefix)
    model: str
    #: completion: the prompt text
    prompt: str = ""
    #: chat: (role, content) in order
    messages: tuple[tuple[str, str], ...] = ()
    #: None: as many as the context leaves (a chat's default)
    max_tokens: int | None = 16
    sampling: SamplingParams = field(default_factory=SamplingParams)
    #: whether the client gave a seed (else one is drawn and reported)
    seeded: bool = False
    stop: tuple[str, ...] = ()
    stream: bool = False
    #: stream_options.include_usage: a last chunk with the usage
    include_usage: bool = False
    #: meshnode's extension: speculative decoding for this request ("ngram" or "none"; None: the server's
    #: default, ``meshnode api --draft``), and the most tokens a step drafts (None: the server's)
    draft: str | None = None
    draft_max: int | None = None


def _get(body: Mapping[str, Any], name: str, kind: type, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise errors.InputError(f"'{name}' must be {_NAMES[kind]}, not {json_type(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise errors.InputError(f"'{name}' must be a finite number")
    return value


_NAMES = {float: "a number", int: "an integer", bool: "true or false", str: "a string", dict: "an object",
          list: "an array"}


def json_type(value: object) -> str:
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    if _get(body, "n", int, 1) != 1:
        raise errors.InputError("'n' must be 1: this server returns one choice")
    if _get(body, "best_of", int, 1) != 1:
        raise errors.InputError("'best_of' must be 1")
    if body.get("echo"):
        raise errors.InputError("'echo' is not supported")
    if body.get("logprobs") not in (None, False, 0):
        raise errors.InputError("'logprobs' is not supported")
    if body.get("suffix"):
        raise errors.InputError("'suffix' is not supported")
    if body.get("logit_bias"):
        raise errors.InputError("'logit_bias' is not supported")
    if body.get("tools") or body.get("functions"):
        raise errors.InputError("tools and functions are not supported")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, Mapping) or fmt.get("type", "text") != "text"):
        raise errors.InputError("'response_format' may only be {\"type\": \"text\"}")


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise errors.InputError("'stop' must be a string or an array of strings")
    if len(items) > MAX_STOP:
        raise errors.InputError(f"'stop' may hold at most {MAX_STOP} strings")
    return tuple(s for s in items if s)


def _common(body: object, kind: str, default_max: int | None) -> dict[str, Any]:
    if not isinstance(body, Mapping):
        raise errors.InputError("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise errors.InputError("'model' is required: a model name or fingerprint (GET /v1/models lists them)")
    _refuse_unsupported(body)
    defaults = CHAT_DEFAULTS if kind == "chat" else SamplingParams()
    values = {attr: _get(body, name, kind_, getattr(defaults, attr)) for name, attr, kind_ in _SAMPLING}
    max_tokens = _get(body, "max_tokens", int, None)
    if kind == "chat":
        max_tokens = _get(body, "max_completion_tokens", int, max_tokens)
    if max_tokens is None:
        max_tokens = default_max
    if max_tokens is not None and max_tokens < 1:
        raise errors.InputError("'max_tokens' must be at least 1")
    options = _get(body, "stream_options", dict, {})
    draft = _get(body, "draft", str, None)
    if draft is not None and draft not in ("none", "ngram"):
        raise errors.InputError(f"'draft' must be \"ngram\" or \"none\", not {draft!r}")
    draft_max = _get(body, "draft_max", int, None)
    if draft_max is not None and not 1 <= draft_max <= 64:
        raise errors.InputError("'draft_max' must be from 1 to 64")
    return {"draft": draft, "draft_max": draft_max,
            "kind": kind, "model": model.strip(), "max_tokens": max_tokens, "sampling": SamplingParams(**values),
            "seeded": body.get("seed") is not None, "stop": _stop(body), "stream": _get(body, "stream", bool, False),
            "include_usage": bool(options.get("include_usage"))}


def parse_completion(body: object) -> Job:
    """A ``POST /v1/completions`` body (InputError naming the bad field)."""
    fields = _common(body, "completion", 16)
    assert isinstance(body, Mapping)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise errors.InputError("'prompt' must be a non-empty string (one prompt per request)")
    return Job(prompt=prompt, **fields)


def parse_chat(body: object) -> Job:
    """A ``POST /v1/chat/completions`` body (InputError naming the bad field)."""
    fields = _common(body, "chat", None)
    assert isinstance(body, Mapping)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise errors.InputError("'messages' must be a non-empty array of {role, content}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise errors.InputError(f"messages[{i}] must be an object with a string 'role'")
        out.append((m["role"], _content(m.get("content"), i)))
    return Job(messages=tuple(out), **fields)


def _content(content: object, i: int) -> str:
    """A message's text: a string, or OpenAI's array of text parts joined."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise errors.InputError(f"messages[{i}].content must be a string or an array of text parts")


# -- responses ---------------------------------------------------------------------------------


def finish_reason(stop_reason: str) -> str:
    """OpenAI's finish_reason for a generation's stop reason ("eog" and a stop string are both "stop")."""
    return "length" if stop_reason == "length" else "stop"


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass(frozen=True)
class Answer:
    """What the document of a finished or streaming answer carries besides the text."""

    id: str
    kind: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    #: the sampler's seed (None: greedy), reported so a run can be repeated
    seed: int | None = None

    def _doc(self, choices: list[dict[str, Any]], *, chunk: bool) -> dict[str, Any]:
        obj = {"chat": "chat.completion", "completion": "text_completion"}[self.kind]
        doc: dict[str, Any] = {"id": self.id, "object": obj + (".chunk" if chunk and self.kind == "chat" else ""),
                               "created": self.created, "model": self.model, "choices": choices,
                               "system_fingerprint": None}
        if self.seed is not None:
            doc["seed"] = self.seed
        return doc

    def whole(self, text: str, stop_reason: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        reason = finish_reason(stop_reason)
        if self.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return self._doc([choice], chunk=False) | {"usage": usage(prompt_tokens, completion_tokens)}

    def chunk(self, text: str | None, reason: str | None = None, *, first: bool = False) -> dict[str, Any]:
        """One streamed piece (``reason``: the last one's finish_reason)."""
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        return self._doc([choice], chunk=True)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        return self._doc([], chunk=True) | {"usage": usage(prompt_tokens, completion_tokens)}


def served(result: GenerationResult) -> dict[str, Any]:
    """meshnode's extension of an answer (key ``meshnode``; OpenAI clients ignore it): the route
    that served it, head first, each hop's node id, endpoint and layers, and how fast it went."""
    rate = result.decode_tokens_per_second()
    return {"route": result.route_hops, "decode_tokens_per_second": round(rate, 2) if rate is not None else None,
            "prefill_seconds": round(result.prefill_seconds, 4), "decode_seconds": round(result.decode_seconds, 4),
            "tokens": len(result.tokens), "failovers": len(result.failovers)}


# -- errors -------------------------------------------------------------------------------------

#: (HTTP status, OpenAI error type) by meshnode error class, most specific first
_STATUS: tuple[tuple[type[errors.MeshnodeError], int, str], ...] = (
    (errors.ModelNotFoundError, 404, "not_found_error"),
    (errors.RouteError, 503, "service_unavailable"),
    (errors.InputError, 400, "invalid_request_error"),
    (errors.CapacityError, 429, "rate_limit_error"),
    (errors.DeadlineError, 504, "timeout_error"),
    (errors.PeerError, 502, "upstream_error"),
)


def error_status(e: errors.MeshnodeError) -> tuple[int, str]:
    """The HTTP status and OpenAI error type for a typed failure (500 for our own)."""
    for cls, status, kind in _STATUS:
        if isinstance(e, cls):
            return status, kind
    return 500, "server_error"


def error_doc(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
