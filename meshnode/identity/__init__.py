"""Node identity: an Ed25519 key pair, the node id derived from it, signing and verifying."""

from meshnode.identity.keys import NodeIdentity, load_or_create, node_id_of, verify_signature

__all__ = ["NodeIdentity", "load_or_create", "node_id_of", "verify_signature"]
