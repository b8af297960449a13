"""Node identities, signed attestations, and the load-time integrity check."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from meshnode import errors
from meshnode.identity import NodeIdentity, load_or_create, node_id_of
from meshnode.identity.attest import attest, check_attested, seal, verify_attestation
from meshnode.proto import node_pb2 as pb

NOW = 1_800_000_000
FP = "ab" * 32


def test_key_is_made_once_with_mode_0600(tmp_path):
    a = load_or_create(tmp_path / "st")
    assert (tmp_path / "st" / "node.key").stat().st_mode & 0o777 == 0o600
    b = load_or_create(tmp_path / "st")
    assert a.node_id == b.node_id
    assert a.node_id == node_id_of(a.public_key)
    assert a.node_id.startswith("mn")
    assert NodeIdentity.generate().node_id != a.node_id


def test_a_world_readable_key_is_refused(tmp_path):
    load_or_create(tmp_path)
    os.chmod(tmp_path / "node.key", 0o644)
    with pytest.raises(errors.InputError, match="0600"):
        load_or_create(tmp_path)


def test_meshnode_id_prints_the_node_id(tmp_path):
    out = subprocess.run([sys.executable, "-m", "meshnode", "id", "--state-dir", str(tmp_path), "--json"],
                         capture_output=True, text=True, check=True).stdout
    doc = json.loads(out)
    assert doc["node_id"] == node_id_of(bytes.fromhex(doc["public_key"]))
    assert doc["node_id"] == load_or_create(tmp_path).node_id


@pytest.fixture
def ident() -> NodeIdentity:
    return NodeIdentity.generate()


def _env(ident, **kw):
    args = {"fingerprint": FP, "start": 0, "end": 15, "range_digest": "cd" * 32, "llama_build": "x", "now": NOW}
    args.update(kw)
    return attest(ident, **args)


def test_a_genuine_attestation_verifies(ident):
    a = verify_attestation(_env(ident), now=NOW + 10, fingerprint=FP, start=0, end=15, range_digest="cd" * 32,
                           node_id=ident.node_id)
    assert a.node_id == ident.node_id


def test_forged_tampered_expired_and_mismatched_attestations(ident):
    env = _env(ident)
    tampered = pb.SignedEnvelope()
    tampered.CopyFrom(env)
    att = pb.Attestation.FromString(env.payload)
    att.range.end = 30
    tampered.payload = att.SerializeToString()
    with pytest.raises(errors.SignatureError):
        verify_attestation(tampered, now=NOW)
    # signed by another key but naming this node
    other = NodeIdentity.generate()
    forged = seal(other, "meshnode.v1.Attestation", env.payload)
    with pytest.raises(errors.SignatureError, match="another key"):
        verify_attestation(forged, now=NOW)
    # a valid signature moved onto another key's envelope
    swapped = pb.SignedEnvelope()
    swapped.CopyFrom(env)
    swapped.signer_public_key = other.public_key
    with pytest.raises(errors.SignatureError):
        verify_attestation(swapped, now=NOW)
    with pytest.raises(errors.AttestationExpiredError):
        verify_attestation(env, now=NOW + 25 * 3600)
    with pytest.raises(errors.AttestationExpiredError):
        verify_attestation(env, now=NOW - 3600)
    with pytest.raises(errors.AttestationMismatchError, match="range end"):
        verify_attestation(env, now=NOW, end=30)
    with pytest.raises(errors.AttestationMismatchError, match="model"):
        verify_attestation(env, now=NOW, fingerprint="ef" * 32)


def test_the_initiator_refuses_a_capability_its_attestation_does_not_vouch_for(ident):
    cap = pb.Capability(model_fingerprint=FP, range=pb.LayerRange(start=0, end=15), range_digest="cd" * 32,
                        node_id=ident.node_id, attestation=_env(ident, now=NOW))
    check_attested("h:1", cap, NOW)
    cap.range.end = 20  # claims more than it attests
    with pytest.raises(errors.AttestationMismatchError) as info:
        check_attested("h:1", cap, NOW)
    assert info.value.hop == "h:1"


async def test_live_nodes_publish_verifiable_attestations(route2):
    from meshnode.session.initiator import check_route
    from tests.conftest import aio

    caps = await aio(check_route, [n.endpoint for n in route2])
    assert len({c.node_id for c in caps}) == 2  # one identity per node
    for c in caps:
        assert c.attestation.signer_public_key
        assert node_id_of(c.attestation.signer_public_key) == c.node_id


def test_one_flipped_byte_in_a_range_file_is_caught(model, tmp_path, monkeypatch):
    from meshnode.gguf import ensure_range

    monkeypatch.setenv("MESHNODE_CACHE_DIR", str(tmp_path / "cache"))
    art = ensure_range(model, 20, 30)
    info = art.manifest["tensors"]["blk.4.ffn_up.weight"]
    data = bytearray(art.range_path.read_bytes())
    data[int(info["offset"]) + 1000] ^= 0x10
    art.range_path.write_bytes(bytes(data))
    env = {**os.environ, "MESHNODE_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "meshnode", "serve", "--model", str(model), "--layers", "20:30",
                           "--state-dir", str(tmp_path / "st")], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1
    assert "INTEGRITY_FAILED" in proc.stderr
    assert "blk.4.ffn_up.weight" in proc.stderr
    assert "listening on" not in proc.stdout
    shutil.rmtree(tmp_path / "cache")
