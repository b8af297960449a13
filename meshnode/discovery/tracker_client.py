"""A node's side of the tracker: signed heartbeats, and lookups that trust nothing.

``run_heartbeat`` registers the node's signed advertisement, then re-sends a
fresh one (new ``seq``, new time) every ``interval`` seconds; on cancellation
it sends a last one marked ``leaving`` (bounded, shielded) so the tracker
drops the node at once. ``lookup`` verifies every advertisement the tracker
returns itself — signature, attestation, freshness — before using it, and
leaves out nodes the tracker found lying (``misbehaving``). ``report_evidence``
sends the tracker a signed report that a hop lied (meshnode/audit/evidence.py).
"""

from __future__ import annotations

import base64
import collections
import hashlib
import json
import logging
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import trio
from google.protobuf.message import DecodeError

from meshnode import errors
from meshnode.discovery.table import PeerEntry
from meshnode.http.client import request, tracker_url
from meshnode.identity import NodeIdentity
from meshnode.identity.advert import advertise, verify_advert
from meshnode.identity.attest import CLOCK_SKEW
from meshnode.proto import node_pb2 as pb

log = logging.getLogger("meshnode.tracker")
T = TypeVar("T")


async def register(url: str, env: pb.SignedEnvelope) -> None:
    status, body = await request(tracker_url(url, "/api/register"), "POST", env.SerializeToString(),
                                 content_type="application/x-protobuf")
    if status != 200:
        try:
            doc = json.loads(body)
        except ValueError:
            doc = {"error": "INTERNAL", "message": body[:200].decode(errors="replace")}
        raise errors.from_code(doc.get("error", "INTERNAL"), f"tracker refused: {doc.get('message')}", hop=url)


async def run_heartbeat(url: str, ident: NodeIdentity, capability: Callable[[], pb.Capability],
                        health: Callable[[], pb.HealthReply], *, interval: float = 10.0, required: bool = True,
                        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Register, then heartbeat every ``interval``; leaving, deregister. ``required``: the first
    registration must succeed (one tracker); else (one of several) a failure is logged and retried."""
    def sealed(leaving: bool = False) -> pb.SignedEnvelope:
        # time in ns as seq: strictly increasing, across restarts too
        return advertise(ident, capability(), health(), seq=time.time_ns(), now=int(time.time()), leaving=leaving,
                         ttl=max(int(3 * interval), 30))  # three heartbeats missed: gone from every directory

    try:
        await register(url, sealed())
    except errors.MeshnodeError as e:
        if required:
            raise
        log.warning("tracker %s: %s (trying again every heartbeat)", url, e)
    task_status.started()
    try:
        while True:
            await trio.sleep(interval)
            try:
                await register(url, sealed())
            except errors.MeshnodeError as e:
                log.warning("heartbeat to %s failed: %s", url, e)
    finally:
        with trio.move_on_after(3, shield=True):
            try:
                await register(url, sealed(leaving=True))
            except errors.MeshnodeError as e:
                log.warning("could not deregister from %s: %s", url, e)


#: seconds between polls of a verdict the tracker is still working on
POLL_EVERY = 1.0


async def report_evidence(url: str, env: pb.SignedEnvelope, timeout: float = 600.0) -> dict[str, Any]:
    """Send the tracker a signed Evidence (``meshnode.audit.evidence.sign_evidence``) and wait up to ``timeout``
    seconds for its verdict: the tracker's JSON, ``verdict`` "confirmed" (the node is marked misbehaving) or
    "refuted" (the hop computed what it sealed). Typed errors otherwise: the tracker's code for malformed
    evidence (400), ``MODEL_NOT_FOUND`` when it has no model to verify with (422: nothing is marked),
    ``RATE_LIMITED``/``RESOURCE_EXHAUSTED`` (429), ``DeadlineError`` when no verdict came in time."""
    with trio.move_on_after(timeout) as scope:
        status, body = await request(tracker_url(url, "/api/evidence"), "POST", env.SerializeToString(),
                                     content_type="application/x-protobuf", timeout=min(timeout, 120.0))
        doc = _doc(url, body)
        poll = tracker_url(url, str(doc.get("poll", "")))
        while status == 202:
            await trio.sleep(POLL_EVERY)
            status, body = await request(poll)
            doc = _doc(url, body)
        if status in (200, 409):
            return doc
        raise errors.from_code(str(doc.get("error", "INTERNAL")), f"tracker: {doc.get('message')}", hop=url)
    assert scope.cancelled_caught
    raise errors.DeadlineError(f"the tracker gave no verdict on the evidence within {timeout:g}s", hop=url)


def _doc(url: str, body: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(body)
        if not isinstance(doc, dict):
            raise ValueError("not an object")
    except ValueError as e:
        raise errors.PeerError(f"the tracker's answer is not meshnode's JSON: {e!r}", hop=url) from None
    return doc


async def tracker_models(url: str) -> list[tuple[str, str]]:
    """(fingerprint, name) of each model the tracker's status lists (for a "models seen" message)."""
    status, body = await request(tracker_url(url, "/api/status"))
    if status != 200:
        raise errors.PeerError(f"tracker status failed with HTTP {status}", hop=url)
    try:
        return [(str(m["fingerprint"]), str(m["name"])) for m in json.loads(body)["models"]]
    except (ValueError, KeyError, TypeError) as e:
        raise errors.PeerError(f"the tracker's status is not meshnode's JSON: {e!r}", hop=url) from None


#: once one tracker has answered, the seconds the others get before they are given up on (a tracker that
#: is down or cut off would otherwise hold a lookup for its whole timeout)
GRACE = 0.3


async def _cut_after(scope: trio.CancelScope, seconds: float) -> None:
    await trio.sleep(seconds)
    scope.cancel()


def urls_of(tracker: str | Sequence[str] | None) -> list[str]:
    """A ``--tracker`` setting (one URL, several, or none) as a list."""
    if not tracker:
        return []
    return [tracker] if isinstance(tracker, str) else list(tracker)


async def ask_all(tracker: str | Sequence[str] | None, ask: Callable[[str], Awaitable[list[T]]]) -> list[T]:
    """``ask(url)`` of every tracker at once; the answers of those that answered, in order. PeerError
    only if none did (naming each one's failure): any one tracker is enough (docs/directory.md)."""
    urls = urls_of(tracker)
    got: dict[str, list[T]] = {}
    failed: dict[str, str] = {}

    async with trio.open_nursery() as nursery:

        async def one(url: str) -> None:
            try:
                answer = await ask(url)
            except errors.MeshnodeError as e:
                failed[url] = str(e)
            else:
                if not got:  # the first answer: the others get a moment more, not their whole timeout
                    nursery.start_soon(_cut_after, nursery.cancel_scope, GRACE)
                got[url] = answer
            if len(got) + len(failed) == len(urls):
                nursery.cancel_scope.cancel()  # all in: no reason to wait out the grace

        for url in urls:
            nursery.start_soon(one, url)
    for url in urls:
        if url not in got and url not in failed:
            failed[url] = f"no answer within {GRACE}s of another tracker's"
    if urls and not got:
        raise errors.PeerError("no tracker answered: " + "; ".join(f"{u}: {m}" for u, m in failed.items()),
                               hop=urls[0])
    return [x for url in urls if url in got for x in got[url]]


def _one_per_node(entries: list[PeerEntry]) -> list[PeerEntry]:
    seen: dict[str, PeerEntry] = {}
    for e in entries:
        seen.setdefault(e.node_id, e)
    return list(seen.values())


async def lookup_any(tracker: str | Sequence[str] | None, query: str) -> list[PeerEntry]:
    """``lookup`` on every tracker at once: the nodes any of them lists, once each."""
    return _one_per_node(await ask_all(tracker, lambda url: lookup(url, query)))


async def lookup_all_any(tracker: str | Sequence[str] | None) -> list[PeerEntry]:
    return _one_per_node(await ask_all(tracker, lookup_all))


async def lookup_records(url: str, query: str) -> list[pb.SignedEnvelope]:
    """The signed records the tracker lists for model ``query``, as they are (for a directory's store,
    which checks each itself)."""
    target = tracker_url(url, "/api/lookup?" + urllib.parse.urlencode({"model": query}))
    out = []
    for node in await _nodes(url, target):
        try:
            out.append(pb.SignedEnvelope.FromString(base64.b64decode(node["envelope"], validate=True)))  # type: ignore[index]
        except (ValueError, KeyError, TypeError, DecodeError):
            continue
    return out


async def lookup(url: str, query: str) -> list[PeerEntry]:
    """The tracker's live nodes of model ``query``, each advertisement verified here."""
    target = tracker_url(url, "/api/lookup?" + urllib.parse.urlencode({"model": query}))
    return _verified(url, await _nodes(url, target))


async def lookup_all(url: str) -> list[PeerEntry]:
    """Every node the tracker lists (``/api/status``), each advertisement verified here."""
    return _verified(url, await _nodes(url, tracker_url(url, "/api/status")))


async def _nodes(url: str, target: str) -> list[object]:
    status, body = await request(target)
    if status != 200:
        raise errors.PeerError(f"tracker lookup failed with HTTP {status}", hop=url)
    try:
        nodes = json.loads(body)["nodes"]
        if not isinstance(nodes, list):
            raise TypeError("'nodes' is not a list")
    except (ValueError, KeyError, TypeError) as e:
        raise errors.PeerError(f"the tracker's lookup answer is not meshnode's JSON: {e!r}", hop=url) from None
    return nodes


class _VerifiedCache:
    """Envelopes already verified (their exact bytes -> the advertisement), so a client that looks the
    same records up again does not check the same signatures again: a warm lookup costs its HTTP round
    trip. Bounded; an entry is used only while the advertisement is within the clock skew of now."""

    def __init__(self, most: int = 20_000) -> None:
        self.most = most
        self.table: collections.OrderedDict[bytes, pb.Advertisement] = collections.OrderedDict()

    def get(self, raw: bytes, now: int) -> pb.Advertisement | None:
        key = hashlib.sha256(raw).digest()
        ad = self.table.get(key)
        if ad is None or abs(now - ad.issued_at_unix) > CLOCK_SKEW:
            return None
        self.table.move_to_end(key)
        return ad

    def put(self, raw: bytes, ad: pb.Advertisement, now: int) -> None:
        self.table[hashlib.sha256(raw).digest()] = ad
        while len(self.table) > self.most:
            self.table.popitem(last=False)


_VERIFIED = _VerifiedCache()


def _verified(url: str, nodes: list[object]) -> list[PeerEntry]:
    out = []
    now = int(time.time())
    for node in nodes:
        if isinstance(node, dict) and node.get("alive") is False:
            continue  # the tracker saw it die (its probe), whatever its last advertisement says
        if isinstance(node, dict) and node.get("misbehaving") is True:
            # the tracker verified a report that it lied: never routed through (a tracker could hide a node
            # this way, as it can by leaving it out; it cannot make anyone route through one)
            log.warning("leaving out node %s: the tracker %s marked it misbehaving (%s)", node.get("node_id"), url,
                        node.get("misbehaving_report"))
            continue
        try:
            raw = base64.b64decode(node["envelope"], validate=True)  # type: ignore[index]
            ad = _VERIFIED.get(raw, now)
            if ad is None:
                ad = verify_advert(pb.SignedEnvelope.FromString(raw), now=now, last_seq=None)
                _VERIFIED.put(raw, ad, now)
        except errors.MeshnodeError as e:
            log.warning("ignoring a tracker entry: %s", e)
            continue
        except (ValueError, KeyError, TypeError, DecodeError) as e:  # binascii.Error is a ValueError
            log.warning("ignoring a malformed tracker entry: %r", e)
            continue
        cap = ad.capability
        if not cap.endpoints:
            continue
        out.append(PeerEntry(cap.node_id, cap.endpoints[0], cap, "tracker", time.time()))
    return out
