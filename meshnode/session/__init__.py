"""Route sessions: a hop's side of one (hop.py), the sessions a node hosts and their streams (host.py,
replies.py; what to admit, evict, claim and cut: admission.py), and the initiator's side (initiator.py)."""
