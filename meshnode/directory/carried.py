"""The directory a node carries: records of its model's nodes (and what it learns), kept on disk and
exchanged with its peers over gRPC (peer exchange), so that the mesh is found with no tracker at all.

A node holds a ``RecordStore`` (directory/store.py): its own record, re-sealed every ``interval``;
the records its peers offer when they call ``Records`` and those they answer when it calls theirs;
and, while a tracker answers, the records the tracker lists for its model. Every record passes the
store's checks (signature, signer = node id, attestation, expiry, a newer seq) whoever sent it. The
store is saved to ``directory.pb`` in the node's state directory after each round, and loaded at
start: a node restarted while every tracker is down asks the peers it saved, and is found through
them (``generate --mesh NAME --bootstrap HOST:PORT``: session/mesh.py).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import trio

from meshnode import errors
from meshnode.directory.store import RecordStore
from meshnode.proto import node_pb2 as pb

log = logging.getLogger("meshnode.directory")

FILE = "directory.pb"
#: records one answer carries at most
MAX_ANSWER = 2000
#: peers asked each round
FANOUT = 3
#: records a caller may offer in one call (each costs two signature checks on the node's data-plane loop)
MAX_OFFER = 64


class CarriedDirectory:
    def __init__(self, state_dir: Path | None, model: str, node_id: str, own: Callable[[], pb.SignedEnvelope],
                 endpoint: Callable[[], str]) -> None:
        self.path = state_dir / FILE if state_dir is not None else None
        self.model, self.node_id, self.own, self.endpoint = model, node_id, own, endpoint
        self.store = RecordStore(max_records=20_000)
        #: the gRPC handler (asyncio thread) and the rounds (trio) share the store
        self.lock = threading.Lock()
        self.load()

    # -- disk -----------------------------------------------------------------------------------------

    def load(self) -> int:
        if self.path is None:
            return 0
        try:
            envs = pb.RecordBatch.FromString(self.path.read_bytes()).records
        except (OSError, Exception):  # missing, or not a RecordBatch: start empty
            return 0
        now = int(time.time())
        with self.lock:
            return sum(self.store.offer(env, now) for env in envs[:MAX_ANSWER * 10])

    def save(self) -> None:
        if self.path is None:
            return
        now = int(time.time())
        with self.lock:
            self.store.expire(now)
            body = pb.RecordBatch(records=[r.envelope for r in self.store.records.values()]).SerializeToString()
        tmp = self.path.with_suffix(".tmp")
        tmp.write_bytes(body)
        tmp.replace(self.path)

    # -- the RPC's side ---------------------------------------------------------------------------------

    def answer(self, req: pb.RecordsRequest) -> pb.RecordBatch:
        """Keep what the caller offers (each checked), answer what is held of ``req.model`` (all: empty)."""
        now = int(time.time())
        self.refresh(now)
        with self.lock:
            for env in req.offer.records[:MAX_OFFER]:
                self.store.offer(env, now)
            held = [r.envelope for r in self.store.live(now, req.model or None)]
        return pb.RecordBatch(records=held[:MAX_ANSWER])

    def offer(self, envs: Sequence[pb.SignedEnvelope]) -> int:
        now = int(time.time())
        with self.lock:
            return sum(self.store.offer(env, now) for env in envs[:MAX_ANSWER])

    def refresh(self, now: int) -> None:
        """This node's own record, re-sealed when the one held is past half its life."""
        with self.lock:
            own = self.store.records.get(self.node_id)
            stale = own is None or own.expires - now < (own.expires - own.issued) / 2
        if stale:
            env = self.own()
            with self.lock:
                self.store.offer(env, now)

    # -- the node's rounds ------------------------------------------------------------------------------

    def peers(self) -> list[str]:
        """Endpoints of the live records held, this node's own left out."""
        me, now = self.endpoint(), int(time.time())
        with self.lock:
            live = self.store.live(now)
        return sorted({r.advert.capability.endpoints[0] for r in live
                       if r.advert.capability.endpoints and r.advert.capability.endpoints[0] != me})

    async def run(self, ask: Callable[[str, pb.RecordsRequest], Awaitable[pb.RecordBatch]],
                  trackers: Callable[[], Awaitable[Sequence[pb.SignedEnvelope]]] | None = None,
                  seeds: Sequence[str] = (), interval: float = 10.0,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Every ``interval``: take what the trackers list (while one answers), exchange with up to
        ``FANOUT`` peers (``seeds`` first), save."""
        task_status.started()
        rng = random.Random()
        while True:
            now = int(time.time())
            self.refresh(now)
            if trackers is not None:
                try:
                    self.offer(await trackers())
                except errors.MeshnodeError as e:
                    log.debug("directory: the trackers did not answer: %s", e)
            known = self.peers()
            targets = [s for s in seeds if s != self.endpoint()] + rng.sample(known, min(FANOUT, len(known)))
            with self.lock:
                offer = pb.RecordBatch(records=[r.envelope for r in self.store.live(now, self.model)][:MAX_OFFER])
            for endpoint in dict.fromkeys(targets):
                try:
                    got = await ask(endpoint, pb.RecordsRequest(model=self.model, offer=offer))
                except errors.MeshnodeError as e:
                    log.debug("directory: %s did not answer: %s", endpoint, e)
                    continue
                self.offer(got.records)
            try:
                self.save()
            except OSError as e:
                log.warning("directory: could not save %s: %s", self.path, e)
            await trio.sleep(interval)
