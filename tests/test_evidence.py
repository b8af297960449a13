"""Evidence that a hop lied: checked without the model, recomputed with it (real llama.cpp).

A three-hop session of the default model ([0, 10), [10, 20), [20, 30)) runs through the real
executor in its original chunking (a prompt in three chunks, then single-token steps); every hop
seals every chunk with a fresh key, as hops do. Honest evidence against any hop is refuted; a seal
over outputs with one element one ulp off is confirmed at exactly that chunk, for a head, a middle
and a tail; each way a piece of evidence can be forged or tampered is its own typed error.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from meshnode import errors
from meshnode.audit.evidence import (
    MAX_STEPS,
    check_evidence,
    open_evidence,
    parse_envelope,
    read_evidence,
    sign_evidence,
    write_evidence,
)
from meshnode.audit.recompute import recompute
from meshnode.audit.seals import logits_digest, rows_digest, sign_step, tokens_digest
from meshnode.executor.api import RangeExecutor
from meshnode.executor.config import ExecConfig
from meshnode.gguf import ensure_range, fingerprint
from meshnode.identity import NodeIdentity
from meshnode.proto import node_pb2 as pb
from meshnode.wire.tensors import encode_bundle
from tests.conftest import cli

CUTS = [(0, 10), (10, 20), (20, 30)]
#: the session's chunks: a 12-token prompt in chunks of 5, 4 and 3, then three decode steps
PROMPT = [1, 504, 3575, 282, 2295, 314, 253, 1345, 28, 39, 1219, 30]
CHUNKS = [(0, 5), (5, 4), (9, 3), (12, 1), (13, 1), (14, 1)]
DECODED = [216, 3202, 11]
SID = "session-1"


@dataclass
class Run:
    """One honest session: per hop, per chunk, its input (token ids or rows) and its output (rows or logits)."""

    fp: str
    idents: list[NodeIdentity]
    inputs: list[list[np.ndarray]]
    outputs: list[list[np.ndarray]]

    def cap(self, hop: int) -> pb.Capability:
        a, b = CUTS[hop]
        return pb.Capability(model_fingerprint=self.fp, range=pb.LayerRange(start=a, end=b),
                             numerics=pb.Numerics(n_ctx_per_session=256, n_batch=512, n_ubatch=512))

    def in_digest(self, hop: int, k: int) -> bytes:
        x = self.inputs[hop][k]
        return tokens_digest(x) if hop == 0 else rows_digest(x, pb.DTYPE_F32)

    def out_digest(self, hop: int, k: int, out: np.ndarray | None = None) -> bytes:
        y = self.outputs[hop][k] if out is None else out
        return logits_digest(y) if hop == len(CUTS) - 1 else rows_digest(y, pb.DTYPE_F32)

    def seal(self, hop: int, k: int, *, out: bytes | None = None, ident: NodeIdentity | None = None,
             **over: object) -> pb.SignedEnvelope:
        pos, n = CHUNKS[k]
        fields: dict = dict(session_id=SID, epoch=1, step_id=k, pos_start=pos, n_tokens=n, wire_dtype=pb.DTYPE_F32,
                            input_sha256=self.in_digest(hop, k), output_sha256=out or self.out_digest(hop, k))
        fields.update(over)
        return sign_step(ident or self.idents[hop], self.cap(hop), **fields)

    def evidence(self, hop: int, upto: int, lie: bool = False) -> pb.Evidence:
        """Evidence against ``hop`` through chunk ``upto``; ``lie``: its seal of that chunk is over outputs
        with one element one ulp up (the reporter's expected digest: the honest one)."""
        a, b = CUTS[hop]
        ev = pb.Evidence(accused_node_id=self.idents[hop].node_id, model_fingerprint=self.fp,
                         range=pb.LayerRange(start=a, end=b), wrong_pos_start=CHUNKS[upto][0],
                         replica_node_id="replica", reported_at_unix=1)
        for k in range(upto + 1):
            out = None
            if lie and k == upto:
                bad = self.outputs[hop][k].copy()
                bad.flat[7] = np.nextafter(bad.flat[7], np.float32(np.inf))
                out = self.out_digest(hop, k, bad)
            step = ev.steps.add(seal=self.seal(hop, k, out=out))
            if hop == 0:
                step.tokens.extend(int(t) for t in self.inputs[0][k])
            else:
                step.activation.CopyFrom(encode_bundle(self.inputs[hop][k], pos_start=CHUNKS[k][0]))
                step.sender_seal.CopyFrom(self.seal(hop - 1, k))
        honest = self.out_digest(hop, upto)
        ev.expected_output_sha256 = honest if lie else b"\x01" * 32  # honest evidence: the reporter is wrong
        return ev


async def _hop(model: Path, cut: tuple[int, int], inputs: list[np.ndarray]) -> list[np.ndarray]:
    """One hop's outputs, chunk by chunk, through the executor the node runs."""
    ex = RangeExecutor(ensure_range(model, *cut), ExecConfig(n_ctx_per_session=256, max_sessions=1))
    outs = []
    try:
        slot = ex.open_slot()
        for (pos, _), x in zip(CHUNKS, inputs, strict=True):
            t = await (ex.forward(slot, pos, tokens=x) if cut[0] == 0 else ex.forward(slot, pos, embd=x))
            y = t.output.residual if t.output.residual is not None else t.output.logits
            assert y is not None
            outs.append(np.array(y, copy=True))
        await ex.release(slot)
    finally:
        ex.close()
    return outs


@pytest.fixture(scope="module")
def run(model: Path) -> Run:
    tokens = [*PROMPT, *DECODED]
    first = [np.asarray(tokens[p:p + n], np.int32) for p, n in CHUNKS]
    inputs, outputs = [first], []
    for i, cut in enumerate(CUTS):
        outs = asyncio.run(_hop(model, cut, inputs[i]))
        outputs.append(outs)
        if i + 1 < len(CUTS):
            inputs.append(outs)
    return Run(fingerprint(model), [NodeIdentity.generate() for _ in CUTS], inputs, outputs)


# -- recomputation -------------------------------------------------------------------------------


@pytest.mark.parametrize("hop", [0, 1, 2])
def test_honest_evidence_is_refuted(run: Run, model: Path, hop: int) -> None:
    v = recompute(check_evidence(run.evidence(hop, len(CHUNKS) - 1)), model)
    assert not v.lied
    assert v.chunks_checked == len(CHUNKS)


@pytest.mark.parametrize(("hop", "k"), [(0, 2), (0, 4), (1, 1), (2, 0), (2, 5)])
def test_one_ulp_off_is_confirmed_at_exactly_that_chunk(run: Run, model: Path, hop: int, k: int) -> None:
    ev = run.evidence(hop, k, lie=True)
    v = recompute(check_evidence(ev), model)
    assert v.lied
    assert (v.pos_start, v.n_tokens, v.chunks_checked) == (CHUNKS[k][0], CHUNKS[k][1], k + 1)
    assert v.sealed_sha256 == pb.StepSeal.FromString(ev.steps[-1].seal.payload).output_sha256.hex()
    assert v.computed_sha256 == run.out_digest(hop, k).hex()
    assert v.matches_reporter


# -- structural checks ---------------------------------------------------------------------------


def test_a_signed_envelope_round_trips_through_a_file(run: Run, tmp_path: Path) -> None:
    reporter = NodeIdentity.generate()
    env = sign_evidence(reporter, run.evidence(1, 3, lie=True))
    write_evidence(tmp_path / "ev.pb", env)
    who, ev = open_evidence(read_evidence(tmp_path / "ev.pb"))
    assert who == reporter.node_id
    assert ev.accused_node_id == run.idents[1].node_id
    env.payload = env.payload[:-1] + bytes([env.payload[-1] ^ 1])
    with pytest.raises(errors.SignatureError):
        open_evidence(env)
    with pytest.raises(errors.InputError):
        parse_envelope(b"\xff" * 100)
    with pytest.raises(errors.InputError):
        read_evidence(tmp_path / "nothing.pb")


def _resign(run: Run, ev: pb.Evidence, k: int, hop: int, **over: object) -> None:
    ev.steps[k].seal.CopyFrom(run.seal(hop, k, **over))


def _tampered(run: Run, what: str) -> tuple[pb.Evidence, type[errors.MeshnodeError]]:
    """Evidence against the middle hop (or the head) with one piece forged, and the error it must get."""
    ev = run.evidence(1, 3, lie=True)
    if what == "signer":  # a seal signed by someone else than the accused
        _resign(run, ev, 1, 1, ident=NodeIdentity.generate())
        return ev, errors.SignatureError
    if what == "seal-bytes":
        ev.steps[0].seal.payload += b"\x00"
        return ev, errors.SignatureError
    if what == "gap":
        del ev.steps[1]
        return ev, errors.InputError
    if what == "wrong-last":
        ev.wrong_pos_start = 0
        return ev, errors.InputError
    if what == "no-accusation":
        ev.expected_output_sha256 = pb.StepSeal.FromString(ev.steps[-1].seal.payload).output_sha256
        return ev, errors.InputError
    if what == "input-rows":  # rows that are not what the accused sealed as received
        rows = run.inputs[1][2].copy()
        rows[0, 0] += 1
        ev.steps[2].activation.CopyFrom(encode_bundle(rows, pos_start=CHUNKS[2][0]))
        return ev, errors.ChecksumError
    if what == "input-tokens":
        ev = run.evidence(0, 2, lie=True)
        ev.steps[1].tokens[0] += 1
        return ev, errors.ChecksumError
    if what == "sender-output":  # the previous hop sealed another output than the accused's input
        ev.steps[2].sender_seal.CopyFrom(run.seal(0, 2, out=b"\x02" * 32))
        return ev, errors.ChecksumError
    if what == "sender-chunk":
        ev.steps[2].sender_seal.CopyFrom(run.seal(0, 1))
        return ev, errors.SessionError
    if what == "sender-session":
        ev.steps[2].sender_seal.CopyFrom(run.seal(0, 2, session_id="another"))
        return ev, errors.SessionError
    if what == "sender-range":  # a sender whose layers do not end where the accused's start
        ev.steps[2].sender_seal.CopyFrom(run.seal(2, 2, input_sha256=b"\x00" * 32,
                                                  out=run.in_digest(1, 2)))
        return ev, errors.RangeMismatchError
    if what == "sender-missing":
        ev.steps[2].ClearField("sender_seal")
        return ev, errors.InputError
    if what == "range":
        ev.range.end = 21
        return ev, errors.RangeMismatchError
    if what == "fingerprint":
        ev.model_fingerprint = "cd" * 32
        return ev, errors.FingerprintMismatchError
    if what == "session":
        _resign(run, ev, 2, 1, session_id="another")
        return ev, errors.SessionError
    if what == "numerics":
        seal = pb.StepSeal.FromString(ev.steps[2].seal.payload)
        cap = run.cap(1)
        cap.numerics.n_batch = 256
        ev.steps[2].seal.CopyFrom(sign_step(run.idents[1], cap, session_id=SID, epoch=1, step_id=2,
                                            pos_start=seal.pos_start, n_tokens=seal.n_tokens,
                                            wire_dtype=pb.DTYPE_F32, input_sha256=seal.input_sha256,
                                            output_sha256=seal.output_sha256))
        return ev, errors.SessionError
    if what == "no-steps":
        del ev.steps[:]
        return ev, errors.InputError
    if what == "too-many-steps":  # refused by its count, before any seal is opened
        for _ in range(MAX_STEPS + 1 - len(ev.steps)):
            ev.steps.add()
        return ev, errors.InputError
    if what == "dtype":  # the rows as float16: not the dtype sealed
        ev.steps[2].activation.CopyFrom(encode_bundle(run.inputs[1][2], dtype=pb.DTYPE_F16, pos_start=9))
        return ev, errors.ShapeError
    raise AssertionError(what)


TAMPERS = ["signer", "seal-bytes", "gap", "wrong-last", "no-accusation", "input-rows", "input-tokens",
           "sender-output", "sender-chunk", "sender-session", "sender-range", "sender-missing", "range",
           "fingerprint", "session", "numerics", "dtype", "no-steps", "too-many-steps"]


@pytest.mark.parametrize("what", TAMPERS)
def test_each_forged_piece_is_its_own_typed_error(run: Run, what: str) -> None:
    ev, want = _tampered(run, what)
    with pytest.raises(errors.MeshnodeError) as got:
        check_evidence(ev)
    assert type(got.value) is want, got.value


def test_the_untampered_evidence_passes_every_check(run: Run) -> None:
    c = check_evidence(run.evidence(1, 3, lie=True), n_layer=30, n_embd=576)
    assert (c.start, c.end, c.positions, c.n_embd, len(c.chunks)) == (10, 20, 13, 576, 4)


# -- the command ---------------------------------------------------------------------------------


def test_the_cli_exit_codes(run: Run, model: Path, tmp_path: Path) -> None:
    reporter = NodeIdentity.generate()
    lie, honest, bad = tmp_path / "lie.pb", tmp_path / "honest.pb", tmp_path / "bad.pb"
    write_evidence(lie, sign_evidence(reporter, run.evidence(2, 4, lie=True)))
    write_evidence(honest, sign_evidence(reporter, run.evidence(0, 5)))
    write_evidence(bad, sign_evidence(reporter, _tampered(run, "gap")[0]))
    got = cli("verify-evidence", str(lie), "--model", str(model), "--json")
    assert got.returncode == 0, got.stderr
    doc = json.loads(got.stdout)
    assert (doc["verdict"], doc["pos_start"], doc["accused"], doc["reporter"]) == (
        "confirmed", CHUNKS[4][0], run.idents[2].node_id, reporter.node_id)
    got = cli("verify-evidence", str(honest), "--model", str(model))
    assert got.returncode == 1, got.stderr
    assert "refuted" in got.stdout
    got = cli("verify-evidence", str(bad), "--model", str(model), "--json")
    assert got.returncode == 2, got.stderr
    assert json.loads(got.stdout)["error"] == "INVALID_ARGUMENT"
    (tmp_path / "garbage.pb").write_bytes(b"\xff\xfe not protobuf")
    got = cli("verify-evidence", str(tmp_path / "garbage.pb"), "--model", str(model))
    assert got.returncode == 2, got.stderr
    other = tmp_path / "other.gguf"  # the same weights, another file: another fingerprint
    shutil.copyfile(model, other)
    with other.open("ab") as fh:
        fh.write(b"\0")
    got = cli("verify-evidence", str(lie), "--model", str(other), "--json")
    assert got.returncode == 3, got.stderr
    assert json.loads(got.stdout)["error"] == "FINGERPRINT_MISMATCH"


def test_a_range_not_cut_yet_is_cut_aside_and_not_kept(run: Run, model: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHNODE_CACHE_DIR", str(tmp_path / "cache"))  # nothing cut in it
    v = recompute(check_evidence(run.evidence(1, 2, lie=True)), model)
    assert (v.lied, v.pos_start) == (True, CHUNKS[2][0])
    assert not (tmp_path / "cache" / "ranges").exists()
