"""The directory: signed, versioned, expiring records of nodes (``records``), a store that converges
whatever order they arrive in (``store``), and reconciliation by digests (``sync``). Trackers and
nodes keep it; docs/directory.md."""
