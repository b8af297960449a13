"""Trackers that sync (``meshnode-tracker --peer URL``, repeatable): no single one whose loss stops the mesh.

Every record a tracker accepts (a node's registration, or one a peer sent) is pushed to its peers
within ``PUSH_EVERY`` seconds, and every ``sync_every`` seconds it reconciles with each peer by
digests (meshnode/directory/sync.py): it sends its bucket digests, gets the peer's (node id, seq)
pairs of the buckets that differ, fetches the records the peer has newer and sends those it has
newer. Whatever comes from a peer goes through the same checks as a node's registration (signature,
signer = node id, attestation, freshness, a newer seq) and is counted when refused: a peer is trusted
no more than a node. What peers may send is bounded (``MAX_SYNC_BODY``, ``MAX_IDS``).

HTTP (tracker/app.py routes them here):

    POST /api/sync/digest    {"digests": [hex, ...]}  ->  {"buckets": [differing], "entries": {node_id: seq}}
    POST /api/sync/fetch     {"ids": [node_id, ...]}  ->  RecordBatch (application/x-protobuf)
    POST /api/sync/records   RecordBatch              ->  {"kept": n, "refused": {reason: n}}
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from meshnode import errors
from meshnode.directory.records import RecordRefused, check
from meshnode.directory.store import BUCKETS, RecordStore
from meshnode.directory.sync import batch, differing, plan
from meshnode.http.client import request, tracker_url
from meshnode.proto import node_pb2 as pb

log = logging.getLogger("meshnode.tracker")

#: a sync body at most (a RecordBatch of MAX_IDS records of a few kB)
MAX_SYNC_BODY = 8 << 20
#: node ids one fetch may name
MAX_IDS = 2000
#: seconds between pushes of newly accepted records to the peers
PUSH_EVERY = 0.5
#: records one push carries at most
PUSH_BATCH = 500


@dataclass
class PeerState:
    url: str
    last_sync: float | None = None
    last_error: str = ""
    records_in: int = 0
    records_out: int = 0
    bytes: int = 0
    their_records: int = 0

    def view(self, now: float) -> dict[str, object]:
        ago = None if self.last_sync is None else round(now - self.last_sync, 1)
        return {"url": self.url, "last_sync_seconds_ago": ago,
                "ok": not self.last_error, "error": self.last_error, "records_in": self.records_in,
                "records_out": self.records_out, "bytes": self.bytes, "their_records": self.their_records}


@dataclass
class Peering:
    """The tracker's mirror of its records (a RecordStore) and its peers; ``accept`` is the tracker's
    own registration path (verify, then keep), used for records from peers too."""

    peers: list[str]
    accept: Callable[[pb.SignedEnvelope, str], bool]
    sync_every: float = 10.0
    mirror: RecordStore = field(default_factory=lambda: RecordStore(attest=False))
    state: dict[str, PeerState] = field(default_factory=dict)
    refused: Counter[str] = field(default_factory=Counter)
    _outbox: list[pb.SignedEnvelope] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.state = {u: PeerState(u) for u in self.peers}

    # -- records kept here --------------------------------------------------------------------------

    def learned(self, env: pb.SignedEnvelope, now: float, *, from_peer: bool = False) -> None:
        """A record the tracker accepted: mirrored, and pushed to the peers (not back where it came from:
        the peer that sent it has it; the others get it from this push or their next reconcile)."""
        try:
            rec = check(env, now=int(now), attest=False)  # verified by the registration path already
        except RecordRefused:
            return
        if self.mirror.keep(rec, int(now)) and self.peers and not from_peer:
            self._outbox.append(env)

    # -- the HTTP side --------------------------------------------------------------------------------

    def digest_answer(self, body: bytes) -> dict[str, object]:
        doc = _json(body)
        theirs = doc.get("digests")
        if not isinstance(theirs, list) or len(theirs) != BUCKETS or not all(isinstance(d, str) for d in theirs):
            raise errors.InputError(f"digests must be a list of {BUCKETS} hex strings")
        try:
            raw = [bytes.fromhex(d) for d in theirs]
        except ValueError:
            raise errors.InputError("digests must be hex") from None
        self.mirror.expire(int(time.time()))
        buckets = differing(self.mirror.digests(), raw)
        return {"buckets": buckets, "entries": self.mirror.entries(buckets), "records": len(self.mirror.records)}

    def fetch_answer(self, body: bytes) -> bytes:
        ids = _json(body).get("ids")
        if not isinstance(ids, list) or len(ids) > MAX_IDS or not all(isinstance(i, str) for i in ids):
            raise errors.InputError(f"ids must be a list of at most {MAX_IDS} node ids")
        return batch(self.mirror.envelopes(ids))

    def records_answer(self, body: bytes, source: str) -> dict[str, object]:
        try:
            envs = pb.RecordBatch.FromString(body).records
        except Exception:  # protobuf DecodeError
            raise errors.WireError("not a RecordBatch") from None
        if len(envs) > MAX_IDS:
            raise errors.InputError(f"a batch of {len(envs)} records is over {MAX_IDS}")
        kept, refused = 0, Counter[str]()
        for env in envs:
            if self.accept(env, source):
                kept += 1
            else:
                refused["refused"] += 1
        self.refused.update(refused)
        return {"kept": kept, "refused": dict(refused)}

    # -- the loops ------------------------------------------------------------------------------------

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        if not self.peers:
            await trio.sleep_forever()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._push_loop)
            while True:
                async with trio.open_nursery() as rounds:
                    for url in self.peers:
                        rounds.start_soon(self._reconcile_logged, url)
                await trio.sleep(self.sync_every)

    async def _push_loop(self) -> None:
        while True:
            await trio.sleep(PUSH_EVERY)
            if not self._outbox:
                continue
            out, self._outbox = self._outbox[:PUSH_BATCH], self._outbox[PUSH_BATCH:]
            body = batch(out)
            for url in self.peers:
                st = self.state[url]
                try:
                    await self._post(url, "/api/sync/records", body, "application/x-protobuf")
                    st.records_out += len(out)
                    st.bytes += len(body)
                except errors.MeshnodeError as e:
                    st.last_error = str(e)  # the next reconcile brings it what it missed

    async def _reconcile_logged(self, url: str) -> None:
        st = self.state[url]
        try:
            await self.reconcile(url)
            st.last_sync, st.last_error = time.time(), ""
        except errors.MeshnodeError as e:
            if not st.last_error:
                log.warning("sync with peer %s failed: %s", url, e)
            st.last_error = str(e)

    async def reconcile(self, url: str) -> None:
        st = self.state[url]
        now = int(time.time())
        self.mirror.expire(now)
        digests = self.mirror.digests()
        body = json.dumps({"digests": [d.hex() for d in digests]}).encode()
        answer = await self._post(url, "/api/sync/digest", body)
        st.bytes += len(body) + len(answer)
        doc = _json(answer)
        theirs = doc.get("entries")
        if not isinstance(theirs, dict):
            raise errors.PeerError("its digest answer is not meshnode's JSON", hop=url)
        count = doc.get("records")
        st.their_records = count if isinstance(count, int) else 0
        theirs = {str(k): int(v) for k, v in theirs.items() if isinstance(v, int)}
        buckets = doc.get("buckets")
        if not isinstance(buckets, list) or not all(isinstance(b, int) for b in buckets):
            raise errors.PeerError("its digest answer names no buckets", hop=url)
        want, give = plan(self.mirror.entries(buckets), theirs)
        for i in range(0, len(want), MAX_IDS):
            got = await self._post(url, "/api/sync/fetch", json.dumps({"ids": want[i:i + MAX_IDS]}).encode())
            st.bytes += len(got)
            try:
                envs = pb.RecordBatch.FromString(got).records
            except Exception:
                raise errors.PeerError("its records are not a RecordBatch", hop=url) from None
            for env in envs:
                if self.accept(env, f"peer {url}"):
                    st.records_in += 1
        for i in range(0, len(give), PUSH_BATCH):
            body = batch(self.mirror.envelopes(give[i:i + PUSH_BATCH]))
            await self._post(url, "/api/sync/records", body, "application/x-protobuf")
            st.records_out += min(PUSH_BATCH, len(give) - i)
            st.bytes += len(body)

    async def _post(self, url: str, path: str, body: bytes, content_type: str = "application/json") -> bytes:
        status, answer = await request(tracker_url(url, path), "POST", body, content_type=content_type, timeout=10.0,
                                       max_answer=MAX_SYNC_BODY)
        if status != 200:
            raise errors.PeerError(f"{path} answered HTTP {status}", hop=url)
        return answer

    def view(self) -> list[dict[str, object]]:
        now = time.time()
        return [self.state[u].view(now) for u in self.peers]


def _json(body: bytes) -> dict[str, object]:
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise errors.InputError("the body is not JSON") from None
    if not isinstance(doc, dict):
        raise errors.InputError("the body is not a JSON object")
    return doc
