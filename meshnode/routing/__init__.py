"""Route choice and checking: pure functions over peers' capabilities."""
