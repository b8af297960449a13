"""systemd's notify protocol (sd_notify(3)), without a dependency.

``notify("READY=1")`` once the node really serves, ``WATCHDOG=1`` keep-alives
at half of ``$WATCHDOG_USEC``, ``STOPPING=1`` when it starts to drain. Does
nothing outside systemd (no ``$NOTIFY_SOCKET``).
"""

from __future__ import annotations

import os
import socket

import trio


def notify(state: str) -> bool:
    """Send one notification; False if not running under systemd."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    addr = "\0" + path[1:] if path.startswith("@") else path
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        s.connect(addr)
        s.sendall(state.encode())
    return True


def watchdog_interval() -> float | None:
    """Seconds between keep-alives systemd expects (half its WatchdogSec), or None."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and int(pid) != os.getpid()):
        return None
    return int(usec) / 1e6 / 2


async def run_watchdog(interval: float) -> None:
    """Keep-alives until cancelled; sent from the trio loop, so a stuck loop stops them."""
    while True:
        notify("WATCHDOG=1")
        await trio.sleep(interval)
