"""A node's TLS certificate, bound to its Ed25519 identity (libp2p's identity-bound TLS, in spirit).

The certificate's key is an ECDSA P-256 key of its own (what every TLS stack
speaks); the certificate carries, in a non-critical extension, the node's
Ed25519 public key and that key's signature over the certificate's
SubjectPublicKeyInfo. So a certificate names exactly one node id, and only the
holder of that node's Ed25519 key can make one: a client that pins the
certificate it checked here (as the one root it trusts for the connection)
talks to that node and nobody else, with no certificate authority and no
trust on first use (``transport/security.py``).

The pair is kept in the state directory beside ``node.key`` (``tls.key`` mode
0600, ``tls.crt``), made on first use and remade if it no longer matches the
identity, so a restarted node presents the same certificate.
"""

from __future__ import annotations

import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from meshnode import atomicfile, errors
from meshnode.identity.keys import PUBLIC_KEY_BYTES, NodeIdentity, node_id_of, verify_signature

#: the extension's OID (a UUID arc, 2.25: nobody else's number)
BINDING_OID = x509.ObjectIdentifier("2.25.215467830958395376127461538542213580241")
#: what the identity key signs, before the certificate key's SubjectPublicKeyInfo (DER)
BINDING_CONTEXT = b"meshnode-tls-binding-v1\x00"
#: the name every node certificate carries; clients verify it (grpc.ssl_target_name_override)
TLS_NAME = "meshnode"
KEY_FILE, CERT_FILE = "tls.key", "tls.crt"
_SIG_BYTES = 64
# DER of SEQUENCE { OCTET STRING (32: public key), OCTET STRING (64: signature) }
_PREFIX = bytes([0x30, 4 + PUBLIC_KEY_BYTES + _SIG_BYTES, 0x04, PUBLIC_KEY_BYTES])


def _encode(public_key: bytes, signature: bytes) -> bytes:
    return _PREFIX + public_key + bytes([0x04, _SIG_BYTES]) + signature


def _decode(value: bytes) -> tuple[bytes, bytes]:
    n = len(_PREFIX) + PUBLIC_KEY_BYTES
    if len(value) != n + 2 + _SIG_BYTES or not value.startswith(_PREFIX) or value[n:n + 2] != bytes([4, _SIG_BYTES]):
        raise errors.TransportSecurityError("the certificate's identity binding is malformed")
    return value[len(_PREFIX):n], value[n + 2:]


def _spki(cert: x509.Certificate) -> bytes:
    return cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def make(ident: NodeIdentity) -> tuple[bytes, bytes]:
    """A fresh (key PEM, certificate PEM) bound to ``ident``."""
    key = ec.generate_private_key(ec.SECP256R1())
    spki = key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    binding = _encode(ident.public_key, ident.sign(BINDING_CONTEXT + spki))
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{TLS_NAME} {ident.node_id}")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=3650))  # the pin, not the date, is what is trusted
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(TLS_NAME)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.UnrecognizedExtension(BINDING_OID, binding), critical=False)
            .sign(key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)


def bound_node_id(cert_der_or_pem: bytes) -> str:
    """The node id a certificate is bound to; TransportSecurityError if it is bound to none."""
    try:
        if cert_der_or_pem.lstrip().startswith(b"-----BEGIN"):
            cert = x509.load_pem_x509_certificate(cert_der_or_pem)
        else:
            cert = x509.load_der_x509_certificate(cert_der_or_pem)
    except ValueError as e:
        raise errors.TransportSecurityError(f"the peer's certificate does not parse: {e}") from e
    try:
        ext = cert.extensions.get_extension_for_oid(BINDING_OID)
    except x509.ExtensionNotFound:
        raise errors.TransportSecurityError("the peer's certificate is not bound to a meshnode identity") from None
    except ValueError as e:  # a malformed extension list
        raise errors.TransportSecurityError(f"the peer's certificate does not parse: {e}") from e
    value = ext.value.value if isinstance(ext.value, x509.UnrecognizedExtension) else b""
    public_key, signature = _decode(value)
    if not verify_signature(public_key, BINDING_CONTEXT + _spki(cert), signature):
        raise errors.TransportSecurityError("the peer's certificate binding is not signed by the identity it names")
    return node_id_of(public_key)


def load_or_create(state_dir: Path, ident: NodeIdentity) -> tuple[bytes, bytes]:
    """The node's (key PEM, certificate PEM) from ``state_dir``, made (again) if missing or not ``ident``'s."""
    kpath, cpath = state_dir / KEY_FILE, state_dir / CERT_FILE
    if kpath.exists() and cpath.exists():
        mode = kpath.stat().st_mode & 0o777
        if mode & 0o077:
            raise errors.InputError(f"{kpath} is readable by others (mode {mode:o}); it must be 0600")
        key_pem, cert_pem = kpath.read_bytes(), cpath.read_bytes()
        try:
            cert = x509.load_pem_x509_certificate(cert_pem)
            key = serialization.load_pem_private_key(key_pem, password=None)
            same = bound_node_id(cert_pem) == ident.node_id and _spki(cert) == key.public_key().public_bytes(
                serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        except (errors.TransportSecurityError, ValueError, TypeError):
            same = False  # half-written, foreign or another identity's: made again
        if same:
            return key_pem, cert_pem
    key_pem, cert_pem = make(ident)
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    atomicfile.write(kpath, key_pem, 0o600)
    atomicfile.write(cpath, cert_pem, 0o644)
    return key_pem, cert_pem
