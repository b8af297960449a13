"""Protobuf <-> domain types: tensor bundles, fragments, checksums, error codes."""
