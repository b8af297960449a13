"""The node's config file (TOML): the same settings as ``serve``/``join`` flags.

    # /etc/meshnode/node.toml
    model = "/var/lib/meshnode/models/SmolLM2-135M-Instruct.Q4_1.gguf"   # default: the default model
    layers = "0:15"             # or: auto = true (take the weakest-covered range), span = 15
    listen = "0.0.0.0:7001"
    tracker = "http://tracker.example:8700"
    mdns = "192.168.1.20"       # interface address to advertise/browse on
    state_dir = "/var/lib/meshnode"
    heartbeat = 10.0
    drain_timeout = 30.0
    max_sessions = 4
    ctx_size = 8192             # tokens per session, prompt + output (default: the model's training context)
    threads = 1
    threads_batch = 2
    mmap = false                # read the range's weights (false) or map its file (true); default: by memory
    huge_pages = true           # weights read into memory and the KV cache in transparent huge pages
    linger = 1.0                # seconds a node keeps its CPU awake between steps, at most (0: never)
    metrics = "127.0.0.1:9464"  # Prometheus /metrics (default: off)
    api = "127.0.0.1:8080"      # an OpenAI-compatible API over the mesh (default: off)
    api_key = "..."             # Bearer key the API requires (needed when api is not on loopback)
    api_tls = true              # the API over HTTPS, self-signed, kept in the state dir (needed off loopback)
    max_opens_per_minute = 600  # sessions one initiator may open per minute (after a burst of 60)
    max_detached = 4            # broken sessions kept for a resume at once (default: max_sessions)

A flag given on the command line wins over the file; the file wins over the
built-in default. Unknown keys are an error (a typo must not pass silently).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from meshnode.errors import InputError

#: key -> (type, built-in default)
KEYS: dict[str, tuple[type, Any]] = {
    "model": (str, None),
    "mesh": (str, None),
    "share_rate": (float, None),
    "cache_limit": (float, None),
    "memory": (float, None),
    "bootstrap": (list, None),
    "layers": (str, None),
    "auto": (bool, False),
    "span": (int, 0),
    "listen": (str, "127.0.0.1:0"),
    "tracker": (str, None),
    "mdns": (str, None),
    "state_dir": (str, None),
    "heartbeat": (float, 10.0),
    "drain_timeout": (float, 30.0),
    "max_sessions": (int, 0),
    "ctx_size": (int, 0),
    "threads": (int, 0),
    "threads_batch": (int, 0),
    "mmap": (bool, None),
    "huge_pages": (bool, None),
    "linger": (float, None),
    "metrics": (str, None),
    "api": (str, None),
    "api_key": (str, None),
    "insecure": (bool, False),
    "api_tls": (bool, False),
    "max_opens_per_minute": (float, None),
    "max_detached": (int, 0),
}


def load(path: Path) -> dict[str, Any]:
    try:
        doc = tomllib.loads(path.read_text())
    except OSError as e:
        raise InputError(f"cannot read config {path}: {e.strerror}") from e
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"config {path} is not valid TOML: {e}") from e
    unknown = sorted(set(doc) - set(KEYS))
    if unknown:
        raise InputError(f"config {path} has unknown keys: {', '.join(unknown)} (known: {', '.join(KEYS)})")
    for key, value in doc.items():
        want = KEYS[key][0]
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            doc[key] = float(value)
        elif key == "tracker" and isinstance(value, list) and all(isinstance(v, str) for v in value):
            continue  # several trackers
        elif not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise InputError(f"config {path}: {key} must be {want.__name__}, not {type(value).__name__}")
    return doc


def resolve(flags: dict[str, Any], file: dict[str, Any]) -> dict[str, Any]:
    """Flag (if given) > file > built-in default, for every key. Pure."""
    out = {}
    for key, (_, default) in KEYS.items():
        flag = flags.get(key)
        out[key] = flag if flag is not None else file.get(key, default)
    if isinstance(out.get("tracker"), str):  # one tracker or several: a list either way
        out["tracker"] = [out["tracker"]]
    return out
