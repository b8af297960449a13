"""Route sessions: the hop side (hop.py) and the initiator side (initiator.py)."""
