"""A node's side of ``Fetch``: the bytes of the model it holds, to peers that join without a copy.

Only the model this node holds is served (by its model id), and of it only what a fetcher can check:
the manifest (whose bytes hash to the id), the header, or single manifest pieces, each of which this
node holds (a node that fetched its own range holds only that range's pieces). Requests are checked
whole before a byte is sent (``check_request``: pure); fetches are bounded per requester and in all
and paced (fetch/limits.py); file reads run on a thread, never on the loop that carries sessions.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable, Collection
from pathlib import Path

from meshnode import errors
from meshnode.fetch.limits import Admission, Pacer, ShareLimits
from meshnode.fetch.plan import Piece, all_pieces
from meshnode.modelid.manifest import Manifest, is_id_prefix
from meshnode.proto import node_pb2 as pb

#: bytes of one FetchChunk
CHUNK = 1 << 20
#: spans one request may ask for (64 pieces of 4 MiB: 256 MiB)
MAX_SPANS = 64
#: tests only: a node that sends every chunk with its first byte changed (a peer that lies)
LIE = os.environ.get("MESHNODE_TEST_FETCH_LIE") == "1"


def check_request(manifest: Manifest, model_id: str, req: pb.FetchRequest, held: dict[int, Piece]) -> list[Piece]:
    """The pieces ``req`` asks for, or a typed error: another model (ModelNotFoundError), a malformed
    request or a span that is not exactly one piece of the manifest (InputError), a piece this node
    does not hold (ModelNotFoundError)."""
    if len(req.model_id) != 64 or not is_id_prefix(req.model_id):
        raise errors.InputError("a fetch names its model by its id: 64 lower-case hex digits")
    if req.model_id != model_id:
        raise errors.ModelNotFoundError(f"this node holds model {model_id[:16]}…, not {req.model_id[:16]}…")
    if req.manifest:
        if req.spans:
            raise errors.InputError("a fetch asks for the manifest or for spans, not both")
        return []
    if not req.spans or len(req.spans) > MAX_SPANS:
        raise errors.InputError(f"a fetch asks for 1 to {MAX_SPANS} spans, not {len(req.spans)}")
    out = []
    for s in req.spans:
        p = held.get(s.offset)
        if p is None or p.length != s.length:
            known = any(x.offset == s.offset and x.length == s.length for x in all_pieces(manifest))
            if known:
                raise errors.ModelNotFoundError(f"this node does not hold the piece at {s.offset}")
            raise errors.InputError(f"the span ({s.offset}, {s.length}) is not one piece of the model's manifest")
        out.append(p)
    return out


class Share:
    """What a node serves of its model: all of the file, or the pieces ``have`` lists (a fetched range)."""

    def __init__(self, path: Path, manifest: Manifest, have: Collection[int] | None = None,
                 limits: ShareLimits | None = None, on_bytes: Callable[[int], None] | None = None,
                 on_refused: Callable[[str], None] | None = None) -> None:
        self.path, self.manifest = path, manifest
        self.model_id = manifest.model_id
        self._canonical = manifest.canonical()
        every = all_pieces(manifest)
        self.held = {p.offset: p for p in every if have is None or p.offset in have}
        self.limits = limits or ShareLimits()
        self.admission = Admission(self.limits)
        self.pacer = Pacer(self.limits.rate, self.limits.burst)
        self._on_bytes = on_bytes or (lambda n: None)
        self._on_refused = on_refused or (lambda code: None)

    async def serve(self, req: pb.FetchRequest, requester: str) -> AsyncIterator[pb.FetchChunk]:
        """The chunks ``req`` asks for; typed errors before the first chunk (nothing is half-refused)."""
        try:
            pieces = check_request(self.manifest, self.model_id, req, self.held)
            self.admission.enter(requester)
        except errors.MeshnodeError as e:
            self._on_refused(e.code)
            raise
        try:
            if req.manifest:
                raw = self._canonical
                for off in range(0, len(raw), CHUNK):
                    yield pb.FetchChunk(offset=off, data=raw[off : off + CHUNK], total=len(raw))
                return
            loop = asyncio.get_running_loop()
            fd = await loop.run_in_executor(None, os.open, self.path, os.O_RDONLY)
            try:
                for p in pieces:
                    for off in range(p.offset, p.offset + p.length, CHUNK):
                        n = min(CHUNK, p.offset + p.length - off)
                        wait = self.pacer.delay(n, time.monotonic())
                        if wait > 0:
                            await asyncio.sleep(wait)
                        data = await loop.run_in_executor(None, os.pread, fd, n, off)
                        if len(data) != n:
                            raise errors.IntegrityError(f"this node's copy of the model ends at byte {off + len(data)}")
                        if LIE:
                            data = bytes([data[0] ^ 1]) + data[1:]
                        self._on_bytes(n)
                        yield pb.FetchChunk(offset=off, data=data)
            finally:
                os.close(fd)
        finally:
            self.admission.leave(requester)
