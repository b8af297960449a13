"""HTTP for the API and the tracker: the server (serve.py, hypercorn), the client (client.py, httpx),
certificates pinned by digest (tls.py), and token buckets per source (ratelimit.py)."""
