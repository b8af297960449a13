"""The daemon's runtime: state directories and running nodes (nodes.py), where state and cache live
(paths.py), starting node processes (launch.py), logs (logs.py), and systemd's notify protocol
(sdnotify.py)."""
