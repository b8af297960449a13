"""The command line: ``meshnode`` and its commands (main.py), what ``generate`` and ``chat`` run
(generation.py, chatrepl.py), ``join``/``leave`` (membership.py), the local demo (demo.py), and
flags turned into typed settings below them all (flags.py)."""
