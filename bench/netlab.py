"""A small network of separate hosts on one machine: Linux network namespaces on a bridge.

Each host is a namespace of its own with one interface (``eth0``, a veth pair
whose other end is on a bridge in a switch namespace of its own) and one
address from 198.18.0.0/15, the benchmarking block (RFC 2544): nothing is
routed anywhere else, and the machine's own namespace is not touched. Links
go down and up (a partition), and take a ``tc tbf`` rate limit both ways.
Everything is torn down on exit, processes first. Needs root (``ip netns``).

Used by tests/test_netns.py and ``python -m bench --only netns``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field

#: the lab's subnet: inside 198.18.0.0/15
SUBNET = "198.18.0"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def tc(*args: str) -> None:
    subprocess.run(["tc", *args], check=True, capture_output=True, timeout=30)


def available() -> str | None:
    """Why a lab cannot be built here (None: it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"mnprobe{os.getpid()}"
    try:
        ip("netns", "add", probe)
    except (OSError, subprocess.CalledProcessError) as e:
        return f"ip netns add failed: {e}"
    ip("netns", "del", probe)
    return None


@dataclass
class Host:
    name: str
    ns: str
    addr: str
    #: the switch side of its link
    port: str

    def exec(self) -> list[str]:
        """The command prefix that runs a program on this host."""
        return ["ip", "netns", "exec", self.ns]


@dataclass
class Lab:
    tag: str = field(default_factory=lambda: f"mn{os.getpid() % 100000}")
    hosts: dict[str, Host] = field(default_factory=dict)

    @property
    def switch(self) -> str:
        return f"{self.tag}-sw"

    def _up(self) -> None:
        ip("netns", "add", self.switch)
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")

    def add(self, name: str) -> Host:
        """A host on the bridge, with the next address."""
        n = len(self.hosts) + 1
        host = Host(name, f"{self.tag}-{name}", f"{SUBNET}.{n}", f"p{n}")
        ip("netns", "add", host.ns)
        ip("-n", host.ns, "link", "set", "lo", "up")
        ip("-n", self.switch, "link", "add", host.port, "type", "veth", "peer", "name", "eth0", "netns", host.ns)
        ip("-n", self.switch, "link", "set", host.port, "master", "br0")
        ip("-n", self.switch, "link", "set", host.port, "up")
        ip("-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
        ip("-n", host.ns, "link", "set", "eth0", "up")
        self.hosts[name] = host
        return host

    def link(self, name: str, up: bool) -> None:
        """Take a host's link down (a partition: its packets go nowhere, nobody is told) or up again."""
        ip("-n", self.switch, "link", "set", self.hosts[name].port, "up" if up else "down")

    def shape(self, name: str, mbit: float) -> None:
        """A ``tbf`` rate limit on a host's link, both ways (its eth0 out, its switch port out).

        A token bucket, as a shaper at a provider's edge: after an idle spell, a message that fits its
        bucket (``burst``: one MTU here, the least it takes) goes out at once; beyond, bytes go at the rate.
        (This kernel has no ``netem``, which would serialize every byte.) Its queue holds 8 packets' worth of
        time at the rate: a slow link with a buffer, not one that drops the second packet of a residual."""
        burst = max(1600, int(mbit * 1e6 / 8 / 250))  # >= one MTU; the kernel wants rate/HZ at least
        latency_ms = max(50.0, 8 * 1600 / (mbit * 1e6 / 8) * 1e3)
        for ns, dev in ((self.hosts[name].ns, "eth0"), (self.switch, self.hosts[name].port)):
            tc("-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
               "burst", str(burst), "latency", f"{latency_ms}ms")

    def unshape(self, name: str) -> None:
        for ns, dev in ((self.hosts[name].ns, "eth0"), (self.switch, self.hosts[name].port)):
            with contextlib.suppress(subprocess.CalledProcessError):
                tc("-n", ns, "qdisc", "del", "dev", dev, "root")

    def close(self) -> None:
        for host in self.hosts.values():
            _kill_all(host.ns)
            with contextlib.suppress(subprocess.CalledProcessError):
                ip("netns", "del", host.ns)
        with contextlib.suppress(subprocess.CalledProcessError):
            ip("netns", "del", self.switch)
        self.hosts.clear()


def _kill_all(ns: str) -> None:
    """Every process still in ``ns`` (a test that failed half-way leaves some)."""
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30).stdout
    for pid in out.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), 9)


@contextlib.contextmanager
def lab(*names: str) -> Iterator[Lab]:
    """A lab with these hosts (in order: 198.18.0.1, .2, ...), torn down on exit."""
    net = Lab()
    try:
        net._up()
        for name in names:
            net.add(name)
        yield net
    finally:
        net.close()
