"""gRPC, and only here: the node's server and service (servicer.py: handed the sessions it serves), the
clients of other nodes (client.py, stream.py), TLS pinned to node ids (security.py).

grpc.aio runs on an asyncio loop of the node's own thread (aiothread.py), which trio reaches through
one bridge (docs/architecture.md, "the bridge").
"""
