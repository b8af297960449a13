"""gRPC adapted to trio: the node's server and the clients of other nodes.

grpc has no trio support; its asyncio API (grpc.aio) runs on a trio-asyncio
loop inside trio (docs/architecture.md, "the bridge").
"""
