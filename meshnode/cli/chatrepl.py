"""``meshnode chat``: an interactive chat in the terminal, over a route or the whole model here.

Each turn renders the whole conversation with the model's own chat template (the tail does it, as
``Llama.create_chat_completion`` would) and streams the answer as it is generated. Ctrl-C during
an answer stops that answer -- its route session is released on every hop at once -- and keeps
what came so far in the history; Ctrl-C or Ctrl-D at the prompt leaves. ``/reset`` starts over,
``/exit`` leaves.
"""

from __future__ import annotations

import codecs
import sys
from typing import TextIO

from meshnode import errors
from meshnode.cli.generation import Runner

HELP = "Ctrl-C stops an answer; /reset starts over; Ctrl-D or /exit leaves."


def run_chat(runner: Runner, *, system: str | None = None, stdin: TextIO | None = None,
             out: TextIO | None = None) -> int:
    """The chat loop until the user leaves (exit code 0)."""
    stdin, out = stdin or sys.stdin, out or sys.stdout
    where = "the whole model here" if runner.local else (runner.mesh or " -> ".join(runner.peers))
    print(f"meshnode chat over {where}. {HELP}", file=out, flush=True)
    history: list[tuple[str, str]] = [("system", system)] if system else []
    while True:
        line = _read(stdin, out)
        if line is None:
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            history = history[:1] if system else []
            print("(the conversation starts over)", file=out, flush=True)
            continue
        history.append(("user", line.rstrip("\n")))
        answer = _answer(runner, history, out)
        if answer is None:
            history.pop()  # it failed: the question is not part of the conversation
        else:
            history.append(("assistant", answer))


def _read(stdin: TextIO, out: TextIO) -> str | None:
    """One line typed at the prompt; None when the user leaves (Ctrl-D, or Ctrl-C here)."""
    print("> ", end="", file=out, flush=True)
    try:
        line = stdin.readline()
    except KeyboardInterrupt:
        print(file=out, flush=True)
        return None
    if not line:
        print(file=out, flush=True)
        return None
    return line


def _answer(runner: Runner, history: list[tuple[str, str]], out: TextIO) -> str | None:
    """Stream one answer; its text (what came, if stopped), or None if it failed."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")
    shown: list[str] = []

    def show(token: int | None, piece: bytes) -> None:
        text = decoder.decode(piece, final=token is None)
        shown.append(text)
        out.write(text)
        out.flush()

    try:
        result = runner.run(runner.config(prompt="", messages=tuple(history)), show)
    except KeyboardInterrupt:
        print(" [stopped]", file=out, flush=True)
        return "".join(shown)
    except errors.MeshnodeError as e:
        print(f"\nmeshnode: error: {e}", file=out, flush=True)
        return None
    print(file=out, flush=True)
    return result.text
