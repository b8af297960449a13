"""Catching a hop that lies (docs/security.md, "A hop that lies").

``seals``: what each hop signs per step (digests of its input and output). ``auditor``: the
initiator's spot checks against a replica. ``evidence``: the proof a check produces, checked by
anyone with the model (``meshnode verify-evidence``, a tracker with ``--verify-model``).
"""
