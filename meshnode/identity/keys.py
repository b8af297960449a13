"""Ed25519 keys of a node, kept in its state directory with mode 0600.

The node id is derived from the public key alone: ``mn`` followed by the
lower-case base32 of the first 20 bytes of sha256(raw public key), so anyone
holding the public key can check an id, and an id cannot be claimed without
the private key that signs for it.
"""

from __future__ import annotations

import base64
import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from meshnode import atomicfile
from meshnode.errors import InputError

KEY_FILE = "node.key"
PUBLIC_KEY_BYTES = 32


@functools.lru_cache(maxsize=4096)  # seals name their signer on every step: the same few keys again and again
def node_id_of(public_key: bytes) -> str:
    """The node id of a raw 32-byte Ed25519 public key."""
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise InputError(f"an Ed25519 public key has {PUBLIC_KEY_BYTES} bytes, not {len(public_key)}")
    digest = hashlib.sha256(public_key).digest()[:20]
    return "mn" + base64.b32encode(digest).decode().lower().rstrip("=")


def verify_signature(public_key: bytes, payload: bytes, signature: bytes) -> bool:
    """True iff ``signature`` is ``public_key``'s Ed25519 signature of ``payload``."""
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, payload)
    except (InvalidSignature, ValueError):
        return False
    return True


@dataclass(frozen=True)
class NodeIdentity:
    private_key: Ed25519PrivateKey

    # computed once: a hop seals every step with them (their cost showed in a decode's profile)
    @functools.cached_property
    def public_key(self) -> bytes:
        return self.private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    @functools.cached_property
    def node_id(self) -> str:
        return node_id_of(self.public_key)

    def sign(self, payload: bytes) -> bytes:
        return self.private_key.sign(payload)

    @classmethod
    def generate(cls) -> NodeIdentity:
        return cls(Ed25519PrivateKey.generate())


def load_or_create(state_dir: Path) -> NodeIdentity:
    """The node's identity from ``state_dir/node.key``, made on first use (mode 0600)."""
    path = state_dir / KEY_FILE
    if path.exists():
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            raise InputError(f"{path} is readable by others (mode {mode:o}); it must be 0600")
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise InputError(f"{path} does not hold an Ed25519 private key")
        return NodeIdentity(key)
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    ident = NodeIdentity.generate()
    pem = ident.private_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    atomicfile.write(path, pem, 0o600, exclusive=True)
    return ident
