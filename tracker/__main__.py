"""``meshnode-tracker``: run the tracker (one documented command).

    meshnode-tracker --listen 127.0.0.1:8700 --db ~/.local/state/meshnode/tracker.sqlite --ttl 30
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import trio

from meshnode import errors
from meshnode.http.serve import serve_asgi
from meshnode.http.tls import add_tls_flags, base_url, pin_note, tls_of
from meshnode.runtime.paths import state_dir
from meshnode.transport.server import split_hostport
from tracker.app import Tracker
from tracker.evidence import Verifier
from tracker.limits import Bounds
from tracker.peering import Peering
from tracker.probe import run_prober
from tracker.registry import Registry

log = logging.getLogger("meshnode.tracker")


def verify_models(paths: Sequence[str]) -> dict[str, Path]:
    """fingerprint -> GGUF of each --verify-model, each fingerprinted now and logged (ModelError if unusable)."""
    from meshnode.gguf.model import check_file, fingerprint, inspect_model

    models = {}
    for p in map(Path, paths):
        check_file(p)
        info, fp = inspect_model(p), fingerprint(p)
        models[fp] = p.resolve()
        log.info("verifies evidence about %s (%s, %d layers) with %s", fp, info.name, info.n_layer, p)
    return models


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, prog="meshnode-tracker", description="registry and status page of a meshnode mesh")
    ap.add_argument("--listen", default="127.0.0.1:8700", help="HOST:PORT (port 0 = any free port)")
    ap.add_argument("--db", help="SQLite file (default: <state dir>/tracker.sqlite)")
    ap.add_argument("--ttl", type=float, default=30.0, help="seconds an entry lives without a heartbeat")
    d = Bounds()
    ap.add_argument("--register-rate", type=float, default=d.per_source_per_minute, metavar="N",
                    help=f"registrations one source address may make per minute, after a burst of "
                         f"{d.per_source_burst:g} (default {d.per_source_per_minute:g}; a node heartbeats 6 times "
                         "a minute)")
    ap.add_argument("--max-per-source", type=int, default=d.entries_per_source, metavar="N",
                    help=f"nodes listed from one source address (default {d.entries_per_source})")
    ap.add_argument("--max-entries", type=int, default=d.max_entries, metavar="N",
                    help=f"nodes listed in all (default {d.max_entries}); a newcomer to a full table takes the place "
                         "of a node the probes never reached")
    ap.add_argument("--evidence-rate", type=float, default=d.evidence_per_minute, metavar="N",
                    help=f"reports that a hop lied one source address may post per minute, after a burst of "
                         f"{d.evidence_burst:g} (default {d.evidence_per_minute:g})")
    ap.add_argument("--verify-model", action="append", default=[], metavar="GGUF",
                    help="a model to verify reports that a hop lied with, by recomputing its range in a child "
                         "process (repeat for several; without one, no report is verified and nobody is marked)")
    ap.add_argument("--verify-timeout", type=float, default=600.0, metavar="SECONDS",
                    help="seconds one verification may take (default 600); past them it is killed, nothing marked")
    ap.add_argument("--peer", action="append", default=[], metavar="URL",
                    help="another tracker to sync records with (repeat): each record accepted here is pushed to "
                         "it, and the two reconcile by digests every --sync-every seconds (docs/directory.md)")
    ap.add_argument("--sync-every", type=float, default=10.0, metavar="SECONDS",
                    help="seconds between two reconciles with each peer (default 10)")
    add_tls_flags(ap, "the tracker")
    ns = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # its line per request: every sync with every peer
    try:
        host, port = split_hostport(ns.listen)
        db = Path(ns.db) if ns.db else state_dir() / "tracker.sqlite"
        db.parent.mkdir(parents=True, exist_ok=True)
        tls = tls_of(ns, host, "the tracker", db.parent, "tracker-tls")
        if ns.register_rate <= 0 or ns.max_per_source < 1 or ns.max_entries < 1:
            raise errors.InputError("--register-rate, --max-per-source and --max-entries must be positive")
        bounds = Bounds(per_source_per_minute=ns.register_rate, per_source_burst=min(d.per_source_burst,
                        max(1.0, ns.register_rate)), entries_per_source=ns.max_per_source, max_entries=ns.max_entries)
        if ns.verify_timeout <= 0 or ns.evidence_rate <= 0:
            raise errors.InputError("--verify-timeout and --evidence-rate must be positive")
        bounds = dataclasses.replace(bounds, evidence_per_minute=ns.evidence_rate,
                                     evidence_burst=min(d.evidence_burst, max(1.0, ns.evidence_rate)))
        models = verify_models(ns.verify_model)
        if ns.sync_every <= 0:
            raise errors.InputError("--sync-every must be positive")
        from meshnode.cli.flags import check_url

        for url in ns.peer:
            check_url(url, "--peer")
    except (errors.InputError, errors.ModelError) as e:
        print(f"meshnode-tracker: error: {e}", file=sys.stderr)
        return 2
    registry = Registry(db, ns.ttl, bounds=bounds)
    verifier = Verifier(registry, models, db.parent / "evidence", timeout=ns.verify_timeout)
    tracker = Tracker(registry, verifier)
    peering = tracker.peering = Peering(list(ns.peer), tracker.accept_from_peer, sync_every=ns.sync_every)

    async def run() -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                await nursery.start(run_prober, registry)  # tracker/probe.py: liveness and live counters
                await nursery.start(verifier.serve)  # tracker/evidence.py: reports that a hop lied
                await nursery.start(peering.run)  # tracker/peering.py: the peers' records
                bound = await nursery.start(functools.partial(serve_asgi, tracker.asgi(), host, port, tls=tls))
                print(f"meshnode-tracker: status page {base_url(host, bound, tls)}/ listening on {host}:{bound}"
                      f"{pin_note(tls, 'nodes use --tracker', host, bound)}", flush=True)
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    break

    try:
        trio.run(run)
    except BaseExceptionGroup as group:  # trio nurseries wrap errors in groups: report the typed one
        typed = errors.typed_leaf(group)
        if typed is None:
            raise
        print(f"meshnode-tracker: error: {typed}", file=sys.stderr)
        return 2 if isinstance(typed, errors.InputError) else 1
    finally:
        registry.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
