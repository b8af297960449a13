"""A completion's text, cut as ``Llama.create_completion`` cuts it: pure, token by token.

Mirrors ``Llama._create_completion`` (llama-cpp-python 0.3.36, llama.py), its non-streamed loop
over the sampled tokens:

* an end-of-generation token ends it and is not part of the tokens or the text ("eog");
* the text is the pieces of the tokens so far (``detokenize``: specials render as nothing, a
  leading space is dropped when the first token is BOS), decoded with ``errors="ignore"``;
* while the text ends inside a UTF-8 character (its "multibyte fix": a count of tokens to let
  pass, from the lead bytes among the last three), nothing is checked — not even max_tokens;
* else, the first of the stop strings (in the order given) that occurs anywhere in the text ends
  it, and the text is cut where that string first occurs ("stop"); the token that completed it
  counts in ``tokens``, as in ``Llama``'s usage;
* else ``max_tokens`` tokens end it ("length").

While streaming, text that could be the start of a stop string is held back (``release``), as
``Llama`` does when streaming, so the streamed pieces concatenate to the final text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: (bytes a UTF-8 character with this lead needs, lead-byte mask), as Llama checks them
_LEADS = ((2, 192), (3, 224), (4, 240))


def _multibyte_fix(text: bytes, fix: int) -> int:
    """``Llama``'s check of the last three bytes for a character still missing bytes."""
    tail = text[-3:]
    for i, char in enumerate(tail):
        k = 3 - i  # Llama's k, as its loop over all_text[-3:] computes it (whatever the length)
        for num, pattern in _LEADS:
            if num > k and pattern & char == pattern:
                fix = num - k
    return fix


@dataclass
class Completion:
    """The tokens and text of one completion so far; ``add`` each sampled token until it says done."""

    #: stop after this many tokens (unless the text ends mid-character, as in Llama)
    max_tokens: int
    #: the stop strings, UTF-8
    stops: tuple[bytes, ...] = ()
    #: the vocabulary's BOS id (-1: none)
    bos: int = -1
    #: hard cap on tokens whatever the text (the session's context): then "length"
    limit: int = 1 << 31
    tokens: list[int] = field(default_factory=list)
    #: "eog" | "stop" | "length" once done
    finish: str | None = None
    _pieces: list[bytes] = field(default_factory=list)
    _cut: bytes = b""
    _fix: int = 0
    _released: int = 0

    @property
    def raw(self) -> bytes:
        """The text's bytes: cut at a stop string once done."""
        return self._cut if self.finish is not None else self._all()

    @property
    def text(self) -> str:
        return self.raw.decode("utf-8", errors="ignore")

    def _all(self) -> bytes:
        out = b"".join(self._pieces)
        if self.tokens and self.tokens[0] == self.bos and out[:1] == b" ":
            out = out[1:]
        return out

    def add(self, token: int, piece: bytes, *, eog: bool) -> bool:
        """Take one sampled token; True when the completion is over (``finish`` says why)."""
        if self.finish is not None:
            raise ValueError("the completion is already over")
        if eog:
            return self._end("eog", self._all())
        self.tokens.append(token)
        self._pieces.append(piece)
        text = self._all()
        self._fix = _multibyte_fix(text, self._fix)
        if self._fix > 0:
            self._fix -= 1
            return self._end("length", text) if len(self.tokens) >= self.limit else False
        found = [s for s in self.stops if s in text]
        if found:
            return self._end("stop", text[: text.index(found[0])])
        if len(self.tokens) >= min(self.max_tokens, self.limit):
            return self._end("length", text)
        return False

    def _end(self, why: str, text: bytes) -> bool:
        self.finish, self._cut = why, text
        return True

    def release(self) -> bytes:
        """Text bytes not yet released that can no longer become part of a stop string."""
        text = self.raw
        end = len(text)
        if self.finish is None:
            for s in self.stops:
                if (at := text.find(s)) >= 0:  # whole, but not checked yet (mid-character): the cut may come here
                    end = min(end, at)
                for i in range(min(len(s), len(text)), 0, -1):
                    if text.endswith(s[:i]):
                        end = min(end, len(text) - i)
                        break
        out = text[self._released : max(end, self._released)]
        self._released = max(end, self._released)
        return out
