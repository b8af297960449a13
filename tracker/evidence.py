"""The tracker's side of "a hop that lies is caught": evidence verified out of process, liars marked.

``POST /api/evidence`` takes a SignedEnvelope of an Evidence (meshnode/audit/evidence.py). The
tracker opens the envelope itself (a signature and a protobuf parse, bounded by the body's size) to
learn the model; whether the hop lied is decided by ``python -m meshnode verify-evidence --json`` in a
child process, with one of the tracker's ``--verify-model`` files: whatever a hostile evidence file
makes llama.cpp do happens in that child, under a timeout, one at a time (``MAX_WAITING`` more may
queue; past them 429). The tracker never imports llama.cpp.

Only a confirmed lie marks a node id misbehaving (tracker/registry.py, kept in its SQLite for good):
an accusation the child refutes, cannot verify (no model, another model, a timeout, a crash) or finds
malformed marks nothing.

A request waits up to ``ANSWER_WITHIN`` seconds for its verdict: the HTTP server closes a connection
silent for 10 s (meshnode/http/serve.py), and a long session's evidence may take minutes to recompute.
Past that it gets 202 and polls ``GET /api/evidence/ID`` (ID: the sha256 of the body), which answers
the verdict once there is one. Verdicts are kept in memory, the last ``MAX_VERDICTS``.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from meshnode import errors
from meshnode.audit.evidence import open_evidence, parse_envelope
from tracker.registry import Mark, Registry

log = logging.getLogger("meshnode.tracker")

#: seconds a POST waits for its verdict before answering 202 (below the server's 10 s read timeout)
ANSWER_WITHIN = 8.0
#: verifications that may wait for the one running; past them, 429
MAX_WAITING = 4
#: verdicts kept for GET /api/evidence/ID (and to answer the same evidence posted again)
MAX_VERDICTS = 256
#: the child's exit codes (meshnode/audit/verify.py) -> HTTP status
STATUS = {0: 200, 1: 409, 2: 400, 3: 422}


@dataclass
class _Job:
    done: trio.Event = field(default_factory=trio.Event)
    status: int = 202
    doc: dict[str, Any] = field(default_factory=dict)


@dataclass
class Verifier:
    """Verifies posted evidence in child processes, one at a time, and marks confirmed liars."""

    registry: Registry
    #: model fingerprint -> the GGUF to recompute with (--verify-model)
    models: dict[str, Path]
    #: where bodies wait for their child (private, emptied as each is done)
    scratch: Path
    #: seconds a child may take (--verify-timeout)
    timeout: float = 600.0
    _jobs: collections.OrderedDict[str, _Job] = field(default_factory=collections.OrderedDict)
    _limit: trio.CapacityLimiter = field(default_factory=lambda: trio.CapacityLimiter(1))
    _waiting: int = 0
    _nursery: trio.Nursery | None = None

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the verifications' tasks until cancelled (a child running then is killed)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    def result(self, evidence_id: str) -> tuple[int, dict[str, Any]]:
        """The verdict of evidence ``evidence_id`` (202 while it runs, 404 if unknown)."""
        job = self._jobs.get(evidence_id)
        if job is None:
            return 404, {"error": "NOT_FOUND", "message": f"no evidence {evidence_id[:16]}… is known here"}
        return job.status, job.doc

    async def submit(self, body: bytes) -> tuple[int, dict[str, Any]]:
        """Start verifying ``body`` (a serialized SignedEnvelope of an Evidence) unless it is known; wait
        up to ANSWER_WITHIN seconds for its verdict."""
        evidence_id = hashlib.sha256(body).hexdigest()
        job = self._jobs.get(evidence_id)
        if job is not None and job.done.is_set() and job.status >= 500:
            # a verification that failed (over its time, a crash) is no verdict: the same evidence posted
            # again is verified again, not answered from memory
            del self._jobs[evidence_id]
            job = None
        if job is None:
            try:
                reporter, ev = open_evidence(parse_envelope(body))
            except errors.MeshnodeError as e:
                return 400, {"error": e.code, "message": e.message}
            model = self.models.get(ev.model_fingerprint)
            if model is None:
                return 422, {"error": "MODEL_NOT_FOUND", "message": f"this tracker has no --verify-model for model "
                             f"{ev.model_fingerprint[:16]}…: the accusation is not verified, nothing is marked"}
            if self._waiting >= MAX_WAITING + 1 or self._nursery is None:
                return 429, {"error": "RESOURCE_EXHAUSTED", "message": f"{self._waiting} verifications are under "
                             "way or waiting; retry later"}
            job = await self._start(evidence_id, body, model, reporter, ev.accused_node_id)
        with trio.move_on_after(ANSWER_WITHIN):
            await job.done.wait()
        return job.status, job.doc  # 202 and the poll URL while it runs

    async def _start(self, evidence_id: str, body: bytes, model: Path, reporter: str, accused: str) -> _Job:
        job = self._jobs[evidence_id] = _Job(doc={"verdict": "pending", "id": evidence_id,
                                                  "poll": f"/api/evidence/{evidence_id}"})
        while len(self._jobs) > MAX_VERDICTS:
            self._jobs.popitem(last=False)
        self._waiting += 1
        try:
            path = await trio.to_thread.run_sync(_spill, self.scratch, body)  # up to 64 MiB: off the loop
        except OSError as e:
            self._waiting -= 1
            job.status, job.doc = 500, {"verdict": "unverified", "error": "INTERNAL", "message": f"spill: {e}"}
            job.done.set()
            return job
        assert self._nursery is not None
        self._nursery.start_soon(self._run, job, evidence_id, path, model, reporter, accused)
        return job

    async def _run(self, job: _Job, evidence_id: str, path: Path, model: Path, reporter: str, accused: str) -> None:
        try:
            async with self._limit:
                status, doc = await self._child(path, model)
            doc["id"] = evidence_id
            if status == 200:
                doc["marked"] = self._mark(doc, evidence_id, reporter, accused)
            job.status, job.doc = status, doc
            log.warning("evidence %s against %s from %s: %s", evidence_id[:12], accused, reporter,
                        doc.get("verdict"))
        finally:
            self._waiting -= 1
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            job.done.set()

    async def _child(self, path: Path, model: Path) -> tuple[int, dict[str, Any]]:
        """Run the verification in a child process: (HTTP status, its JSON); never raises for what it did."""
        cmd = [sys.executable, "-m", "meshnode", "verify-evidence", str(path), "--model", str(model), "--json"]
        with trio.move_on_after(self.timeout) as scope:
            proc = await trio.run_process(cmd, capture_stdout=True, capture_stderr=True, check=False)
        if scope.cancelled_caught:
            return 503, {"verdict": "unverified", "error": "DEADLINE_EXCEEDED",
                         "message": f"the verification took over {self.timeout:g}s (--verify-timeout); "
                                    "nothing is marked"}
        try:
            doc = json.loads(proc.stdout)
            if not isinstance(doc, dict):
                raise ValueError("not an object")
        except ValueError:
            tail = proc.stderr[-300:].decode(errors="replace")
            return 500, {"verdict": "unverified", "error": "INTERNAL",
                         "message": f"the verifier exited {proc.returncode} without a verdict: {tail}"}
        return STATUS.get(proc.returncode, 500), doc

    def _mark(self, doc: dict[str, Any], evidence_id: str, reporter: str, accused: str) -> bool:
        if doc.get("accused") != accused:  # the child read another file than the tracker: never mark on it
            log.error("the verifier's verdict names %s, the evidence %s: not marked", doc.get("accused"), accused)
            return False
        rng = doc.get("range") or [0, 0]
        m = Mark(accused, str(doc.get("model", "")), (int(rng[0]), int(rng[1])), int(doc.get("pos_start") or 0),
                 reporter, time.time(), evidence_id)
        if not self.registry.mark(m):
            log.error("node %s lied (evidence %s) but the table of marks is full", accused, evidence_id[:12])
            return False
        log.warning("node %s marked misbehaving: lied at position %d (layers %d:%d), reported by %s", accused,
                    m.pos_start, *m.range, reporter)
        return True


def _spill(scratch: Path, body: bytes) -> Path:
    """``body`` in a private file of its own under ``scratch`` (the child reads it from there)."""
    scratch.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix="evidence-", suffix=".pb", dir=scratch)
    with os.fdopen(fd, "wb") as fh:
        fh.write(body)
    return Path(name)
