"""Schema version of the wire contract (proto/meshnode/proto/node.proto)."""

#: bumped on any change of meaning; a peer with another version is refused
SCHEMA_VERSION = 1
#: the Capability.service value that tells a meshnode from other gRPC servers
SERVICE_NAME = "meshnode"
