"""Flags turned into typed settings, for every command that takes them: below the CLI and the runners.

``cli.py`` (argument parsing, commands) and ``generation.py`` (what ``generate``
and ``chat`` run) both need these; they live here so that neither imports the
other.
"""

from __future__ import annotations

import argparse

from meshnode import errors
from meshnode.executor.config import ExecConfig
from meshnode.executor.linger import check_cap


def exec_config(ns: argparse.Namespace) -> ExecConfig:
    base = ExecConfig()
    ctx = ns.ctx_size or 0
    sessions = ns.max_sessions or base.max_sessions
    if sessions < 1:
        raise errors.InputError(f"--max-sessions must be at least 1, not {sessions}")
    if not 0 <= ctx < (1 << 31) // sessions:  # llama.cpp's n_ctx (all sessions' cells) is 32-bit
        raise errors.InputError(f"--ctx-size must be a number of tokens from 1 to {(1 << 31) // sessions - 1} "
                                f"(0 = the default), not {ctx}")
    return ExecConfig(
        n_ctx_per_session=ctx,
        max_sessions=sessions,
        n_threads=ns.threads or base.n_threads,
        n_threads_solo=ns.threads or base.n_threads_solo,
        n_threads_batch=ns.threads_batch or base.n_threads_batch,
        inline_decode=not getattr(ns, "decode_on_worker", False),
        use_mmap=getattr(ns, "mmap", None),
        linger=base.linger if getattr(ns, "linger", None) is None else check_cap(ns.linger, "--linger"),
    )


def check_endpoints(ns: argparse.Namespace) -> None:
    """Every HOST:PORT and URL flag of ``generate``, before anything connects."""
    from meshnode.transport.server import split_hostport

    given = (("--peer", ns.peer), ("--spare", ns.spare), ("--bootstrap", getattr(ns, "bootstrap", ()) or ()))
    for flag, values in given:
        for v in values:
            split_hostport(v, flag)
    for url in ns.tracker or ():
        check_url(url)


def check_url(url: str, flag: str = "--tracker") -> None:
    """An http(s)://HOST[:PORT] URL, or InputError naming ``flag``."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port or 0) >= 0
    except ValueError:  # a port that is not a number, or out of range
        ok = False
    if not ok:
        raise errors.InputError(f"{flag} {url!r} is not a URL like http://HOST:PORT")
    from meshnode.http.tls import pin_of

    pin_of(url)  # a #sha256= pin, if any, is well formed and goes with https://
