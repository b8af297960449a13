"""Generated from proto/meshnode/proto/*.proto by `python -m meshnode.wire.codegen`. Do not edit."""
