"""Chat prompts: the tokens meshnode renders for messages equal the ones ``Llama.create_chat_completion``
feeds to its model, for the default model (SmolLM2, its own Jinja template) and for tiny models of a
second architecture whose templates take Llama's other paths (a built-in format chosen by guessing,
a template that raises, a file with no template)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_cpp
import pytest
from llama_cpp import llama_chat_format as cf

from meshnode import errors
from meshnode.chat import ChatFormat
from meshnode.executor._llama import Vocab
from tests.tinymodels import make_tiny_model

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Sky colour?"}],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello. How can I help?"},
        {"role": "user", "content": "Écris « bonjour » en 日本語, s'il te plaît. <|im_end|> is text here"},
    ],
]

#: a Qwen2-style template (not one Llama knows by heart: rendered by its Jinja formatter)
QWEN_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are Qwen, a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] | trim + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
#: a template that refuses a system message, as some models' templates do
STRICT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
)


class _Captured(Exception):
    pass


def llama_chat_tokens(llm: llama_cpp.Llama, messages: list[dict[str, Any]]) -> list[int]:
    """The prompt tokens ``create_chat_completion`` hands to ``create_completion`` (captured, not re-derived)."""
    seen: list[list[int]] = []

    def record(prompt: list[int], **_: Any) -> None:
        seen.append(list(prompt))
        raise _Captured

    llm.create_completion = record  # type: ignore[method-assign]
    with contextlib.suppress(_Captured):
        llm.create_chat_completion(messages=messages, max_tokens=1)  # type: ignore[arg-type]
    return seen[0]


def ours(path: Path, messages: list[dict[str, Any]]) -> tuple[list[int], ChatFormat]:
    with contextlib.ExitStack() as stack:
        vocab = Vocab(path, stack)
        fmt = vocab.chat_format()
        prompt = fmt.render(messages)
        return vocab.tokenize(prompt.text, add_special=prompt.add_bos, parse_special=True), fmt


@contextlib.contextmanager
def llama(path: Path) -> Iterator[llama_cpp.Llama]:
    llm = llama_cpp.Llama(str(path), verbose=False, n_ctx=256, vocab_only=True)
    try:
        yield llm
    finally:
        llm.close()


@pytest.fixture(scope="module")
def tiny_models(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat-models")
    kinds = {"qwen": QWEN_TEMPLATE, "mistral": cf.MISTRAL_INSTRUCT_CHAT_TEMPLATE, "strict": STRICT_TEMPLATE}
    return {name: make_tiny_model(root / f"{name}.gguf", "qwen2", n_layer=2, tokenizer_from=model, n_vocab=1024,
                                  extra_kv={"tokenizer.chat_template": tpl})
            for name, tpl in kinds.items()}


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_default_model_chat_tokens_equal_llamas(model: Path, conv: int) -> None:
    messages = CONVERSATIONS[conv]
    with llama(model) as llm:
        expected = llama_chat_tokens(llm, messages)
    got, fmt = ours(model, messages)
    assert fmt.name == "chat_template.default"  # SmolLM2's own template, through Jinja
    assert got == expected
    assert len(got) > 10  # the default system prompt and the generation prompt are in it


@pytest.mark.parametrize(("kind", "name"), [("qwen", "chat_template.default"), ("mistral", "mistral-instruct")])
@pytest.mark.parametrize("conv", [0, 2])
def test_second_arch_chat_tokens_equal_llamas(tiny_models: dict[str, Path], kind: str, name: str, conv: int) -> None:
    path = tiny_models[kind]
    messages = CONVERSATIONS[conv]
    with llama(path) as llm:
        assert llm.chat_format == name
        expected = llama_chat_tokens(llm, messages)
    got, fmt = ours(path, messages)
    assert fmt.name == name
    assert got == expected


def test_a_template_that_refuses_is_the_callers_input_error(tiny_models: dict[str, Path]) -> None:
    path = tiny_models["strict"]
    with llama(path) as llm, pytest.raises(ValueError, match="System role not supported"):
        llama_chat_tokens(llm, CONVERSATIONS[1])
    with pytest.raises(errors.InputError, match="System role not supported"):
        ours(path, CONVERSATIONS[1])
    # and without the system message, both render the same tokens (the template writes BOS itself)
    with llama(path) as llm:
        expected = llama_chat_tokens(llm, CONVERSATIONS[2])
    got, fmt = ours(path, CONVERSATIONS[2])
    assert got == expected
    assert not fmt.render(CONVERSATIONS[2]).add_bos


def test_no_template_falls_back_to_llama2_as_llama_does() -> None:
    fmt = ChatFormat(None, bos_token="<s>", eos_token="</s>")
    assert fmt.name == "llama-2"
    prompt = fmt.render(CONVERSATIONS[1])
    assert prompt.text == cf.format_llama2(messages=CONVERSATIONS[1]).prompt
    assert prompt.add_bos


@pytest.mark.parametrize("bad", [
    [], "hello", None, [{"role": "user"}], [{"content": "x"}], [{"role": "", "content": "x"}],
    [{"role": "user", "content": 3}], [{"role": "user", "content": ["a", "b"]}], ["just a string"],
    [{"role": "user", "content": "x" * (4 * 1024 * 1024 + 1)}],
])
def test_malformed_messages_are_refused_with_a_typed_error(bad: object) -> None:
    fmt = ChatFormat("{{ messages }}", bos_token="", eos_token="")
    with pytest.raises(errors.InputError):
        fmt.render(bad)


def test_an_invalid_template_is_the_models_fault() -> None:
    with pytest.raises(errors.ModelFormatError, match="not valid Jinja"):
        ChatFormat("{% for %}", bos_token="", eos_token="").render([{"role": "user", "content": "x"}])


def test_the_template_runs_sandboxed() -> None:
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(errors.InputError):
        ChatFormat(evil, bos_token="", eos_token="").render([{"role": "user", "content": "x"}])


async def test_a_tail_node_renders_chat_like_llama_over_grpc(model: Path, route2: list[Any]) -> None:
    """The tail process renders and tokenizes chat (its GGUF range keeps the template); the head has no
    vocabulary and says so; messages the template refuses come back as the caller's typed InputError."""
    from meshnode.transport.client import tokenize_chat
    from tests.conftest import aio

    head, tail = route2
    for messages in CONVERSATIONS:
        with llama(model) as llm:
            expected = llama_chat_tokens(llm, messages)
        tokens, stop = await aio(tokenize_chat, tail.endpoint, [(m["role"], m["content"]) for m in messages])
        assert tokens == expected
        assert stop == ["<|im_end|>"]  # Jinja2ChatFormatter's stop: the EOS text
    with pytest.raises(errors.PeerError, match="no vocabulary"):
        await aio(tokenize_chat, head.endpoint, [("user", "hi")])
    with pytest.raises(errors.InputError, match=r"messages\[0\].role"):
        await aio(tokenize_chat, tail.endpoint, [("", "hi")])
