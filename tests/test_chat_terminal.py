"""``meshnode chat`` in a real terminal (tmux): streamed answers over a route, Ctrl-C stops one answer
(the session is released on every hop) without leaving, the history carries on, Ctrl-D leaves."""

from __future__ import annotations

import shlex
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator

import pytest
import trio

from meshnode.runtime.launch import NodeProcess
from meshnode.transport.client import health
from tests.conftest import aio


class Tmux:
    def __init__(self, command: list[str]) -> None:
        self.name = f"meshnode-test-{uuid.uuid4().hex[:8]}"
        subprocess.run(["tmux", "new-session", "-d", "-s", self.name, "-x", "160", "-y", "50",
                        shlex.join(command) + "; echo EXITED-$?; sleep 30"], check=True)

    def keys(self, *keys: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.name, *keys], check=True)

    def screen(self) -> str:
        return subprocess.run(["tmux", "capture-pane", "-p", "-J", "-S", "-200", "-t", self.name],
                              capture_output=True, text=True, check=True).stdout

    async def wait_for(self, ok: Callable[[str], bool], timeout: float = 120) -> str:
        with trio.fail_after(timeout):
            while not ok(screen := self.screen()):  # noqa: ASYNC110 (another process's screen)
                await trio.sleep(0.1)
        return screen

    def kill(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True, check=False)


async def _held(endpoint: str) -> int:
    """Sessions a hop holds for a live stream: the shared route may also keep other tests' broken
    sessions detached for their grace period (test_initiator_death leaves one), which are not ours."""
    h = await aio(health, endpoint)
    return int(h.live_sessions - h.detached_sessions)


@pytest.fixture
def terminal(route2: list[NodeProcess]) -> Iterator[Tmux]:
    cmd = [sys.executable, "-m", "meshnode", "chat", *[a for n in route2 for a in ("--peer", n.endpoint)],
           "--temperature", "0", "--max-tokens", "3000"]
    t = Tmux(cmd)
    yield t
    t.kill()


async def test_chat_streams_stops_on_ctrl_c_and_keeps_the_history(terminal: Tmux, route2: list[NodeProcess]) -> None:
    await terminal.wait_for(lambda s: "Ctrl-C stops an answer" in s and s.rstrip().endswith(">"))
    terminal.keys("Write a very long story about a dragon who learns to cook, in many chapters.", "Enter")
    # the answer streams: text appears after the question while the hops hold the session
    screen = await terminal.wait_for(lambda s: len(s.split("chapters.", 1)[-1].strip()) > 80)
    assert [await _held(n.endpoint) for n in route2] == [1, 1]
    terminal.keys("C-c")
    screen = await terminal.wait_for(lambda s: "[stopped]" in s and s.rstrip().endswith(">"))
    assert "EXITED" not in screen  # still chatting
    with trio.fail_after(10):
        while [await _held(n.endpoint) for n in route2] != [0, 0]:  # noqa: ASYNC110
            await trio.sleep(0.05)
    # the next question gets a whole answer, then the prompt again
    terminal.keys("What is 2 + 2? Answer with one number.", "Enter")
    screen = await terminal.wait_for(lambda s: "one number." in s and s.split("one number.")[-1].rstrip().endswith(">"))
    answer = screen.split("one number.")[-1].rstrip().removesuffix(">")
    assert answer.strip(), screen
    terminal.keys("C-d")
    screen = await terminal.wait_for(lambda s: "EXITED-" in s)
    assert "EXITED-0" in screen
    assert "Traceback" not in screen
