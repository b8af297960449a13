"""A memory cgroup of the caller's own: run node processes under a memory limit (issue 24, item 5).

``memory_cgroup(limit)`` makes a cgroup (v1 ``memory.limit_in_bytes``, or v2 ``memory.max``) under
the machine's memory controller, yields what a process is started under to run in it (``prefix``:
``sh -c 'echo $$ > cgroup.procs && exec "$@"'``), and removes it afterwards (its processes must have
ended). ``peak`` and ``events`` read what the cgroup saw: its peak usage, how often it hit the limit,
and OOM kills. Skips (``Unavailable``) on a machine with no writable memory controller.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

V1 = Path("/sys/fs/cgroup/memory")
V2_ROOTS = (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))


class Unavailable(Exception):
    """This machine gives no writable memory cgroup."""


@dataclass(frozen=True)
class MemCap:
    dir: Path
    version: int
    limit: int

    @property
    def prefix(self) -> list[str]:
        """A command line's start that runs the rest of it inside this cgroup."""
        return ["sh", "-c", f'echo $$ > {self.dir / "cgroup.procs"} && exec "$@"', "sh"]

    def peak(self) -> int:
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            return int((self.dir / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return 0

    def events(self) -> dict[str, int]:
        """v1: {"failcnt": times the limit was hit, "oom_kill": ...}; v2: memory.events."""
        out: dict[str, int] = {}
        with contextlib.suppress(OSError, ValueError):
            if self.version == 1:
                out["failcnt"] = int((self.dir / "memory.failcnt").read_text())
                for line in (self.dir / "memory.oom_control").read_text().splitlines():
                    k, _, v = line.partition(" ")
                    if k == "oom_kill":
                        out["oom_kill"] = int(v)
            else:
                for line in (self.dir / "memory.events").read_text().splitlines():
                    k, _, v = line.partition(" ")
                    out[k] = int(v)
        return out


def drop_cached(paths: list[Path]) -> None:
    """Ask the kernel to drop these files' pages from the page cache (``POSIX_FADV_DONTNEED``), so the
    next process that maps them faults them in and its cgroup is charged for them: a page already
    cached is charged to whoever read it first, and a limit would not bind on it."""
    for p in paths:
        with contextlib.suppress(OSError):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def model_files(model: Path) -> list[Path]:
    """The model file and every range file cut from it in the cache."""
    from meshnode.gguf.model import fingerprint
    from meshnode.runtime.paths import cache_dir

    cut = cache_dir() / "ranges" / fingerprint(model)[:32]
    return [model, *cut.glob("*/*.gguf")]


def _effective(f: Path, asked: int) -> int:
    """The limit the kernel set: it rounds the one asked for to a whole page (v1 rounds up), and the
    peak it reports is measured against that, so a peak a few KB above ``asked`` is within it."""
    try:
        return int(f.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return asked


def _make(limit: int) -> MemCap:
    name = f"meshnode-cap-{uuid.uuid4().hex[:8]}"
    if (V1 / "memory.limit_in_bytes").exists() and os.access(V1, os.W_OK):
        d = V1 / name
        d.mkdir()
        (d / "memory.limit_in_bytes").write_text(str(limit))
        return MemCap(d, 1, _effective(d / "memory.limit_in_bytes", limit))
    for root in V2_ROOTS:
        ctl = root / "cgroup.subtree_control"
        if ctl.exists() and "memory" in ctl.read_text().split() and os.access(root, os.W_OK):
            d = root / name
            d.mkdir()
            (d / "memory.max").write_text(str(limit))
            return MemCap(d, 2, _effective(d / "memory.max", limit))
    raise Unavailable("no writable memory cgroup on this machine (cgroup v1 memory or v2 memory.max)")


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[MemCap]:
    cap = _make(limit)
    try:
        yield cap
    finally:
        deadline = time.monotonic() + 10
        while True:  # the processes' exit is seen by the cgroup a moment later
            try:
                cap.dir.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


# -- the benchmark: python -m bench.memcap ------------------------------------------------------------


def _whole_under(cap: MemCap, model: Path, tokens: int) -> dict[str, object]:
    """The whole model in ``Llama`` (2 threads) under ``cap``: its decode
    tok/s, or how it failed."""
    import json
    import subprocess
    import sys

    drop_cached(model_files(model))
    cmd = [*cap.prefix, sys.executable, "-m", "bench.route_bench", "--whole-child", "--model", str(model),
           "--tokens", str(tokens), "--threads", "2", "--threads-batch", "2"]
    t0 = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    out: dict[str, object] = {"seconds": round(time.monotonic() - t0, 1), "returncode": done.returncode}
    if done.returncode == 0:
        r = json.loads(done.stdout.strip().splitlines()[-1])
        out.update(decode_tps=r["decode_tps"], tokens=r["short_tokens"])
    else:
        out["error"] = done.stderr.strip()[-300:]
    return out


def main(argv: list[str] | None = None) -> int:
    """Three nodes of the 1.34 GB model each under a memory limit of ``--cap`` of it (one joined with no
    copy), against the whole model without a limit and under the same limit, side by side."""
    import argparse
    import json
    import sys
    import tempfile

    from bench import paths, synth
    from meshnode.gguf.model import fingerprint
    from meshnode.runtime.launch import start_node
    from tests.test_tracker import _start_tracker, _stop

    ap = argparse.ArgumentParser(prog="python -m bench.memcap", description=main.__doc__)
    ap.add_argument("--cap", type=float, default=0.55, help="each node's memory limit, as a share of the model")
    ap.add_argument("--tokens", type=int, default=64)
    ns = ap.parse_args(argv)
    model = synth.ensure_model(1.0)
    size = model.stat().st_size
    limit = int(ns.cap * size)
    print(f"command: python -m bench.memcap {' '.join(sys.argv[1:] if argv is None else argv)}\n"
          f"model {model.name}: {size / 1e9:.2f} GB; limit per node {limit / 1e9:.2f} GB ({ns.cap} of it)", flush=True)
    flags = ("--max-sessions", "1", "--ctx-size", "512", "--heartbeat", "1")
    rows: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp, memory_cgroup(limit) as a, memory_cgroup(limit) as b, \
            memory_cgroup(limit) as c:
        proc, url = _start_tracker(Path(tmp) / "t.sqlite", ttl=10)
        nodes = []
        try:
            for cap, layers in ((a, "0:8"), (b, "8:16")):
                drop_cached(model_files(model))  # each node's cgroup is charged for the weights it maps
                nodes.append(start_node(model, layers, command="join", prefix=cap.prefix, timeout=300,
                                        extra=("--tracker", url, *flags)))
            time.sleep(3)
            t0 = time.monotonic()
            nodes.append(start_node(None, "16:24", command="join", prefix=c.prefix, timeout=900,
                                    extra=("--mesh", fingerprint(model)[:16], "--tracker", url, *flags),
                                    env={"MESHNODE_CACHE_DIR": str(Path(tmp) / "cache")}))
            joined = time.monotonic() - t0
            fetched = next((ln for ln in nodes[2].stderr().splitlines() if "fetched" in ln), "")
            print(f"  the third node joined with no copy in {joined:.1f} s: {fetched}", flush=True)
            peers = [n.endpoint for n in nodes]
            paths.generate(peers, paths.PROMPT, 4)
            ts, s = paths.generate(peers, paths.PROMPT, 8)
            tl, lg = paths.generate(peers, paths.PROMPT, 8 + ns.tokens)
            route = (len(lg["tokens"]) - len(s["tokens"])) / (tl - ts)
            rows["route"] = {"decode_tps": route, "peak_mb": [x.peak() >> 20 for x in (a, b, c)],
                             "events": [x.events() for x in (a, b, c)], "join_seconds": joined}
        finally:
            for n in nodes:
                n.stop()
            _stop(proc)
    free = paths.whole_decode(model, 2, ns.tokens)
    rows["whole"] = {"decode_tps": free["decode_tps"]}
    with memory_cgroup(limit) as w:
        capped = _whole_under(w, model, ns.tokens)
        capped.update(peak_mb=w.peak() >> 20, events=w.events())
    rows["whole_capped"] = capped
    same = capped.get("tokens") == free["short_tokens"] if "tokens" in capped else None
    print("\n| what | memory limit | decode tok/s | peak MB per process | limit hits / OOM kills |")
    print("|---|---|---|---|---|")
    r = rows["route"]
    assert isinstance(r, dict)
    hits = ", ".join(f"{e.get('failcnt', e.get('max', 0))}/{e.get('oom_kill', 0)}" for e in r["events"])
    print(f"| route of 3 (one fetched its range) | {limit >> 20} MB each | {r['decode_tps']:.2f} | "
          f"{', '.join(map(str, r['peak_mb']))} | {hits} |")
    print(f"| whole model (`Llama`, 2 threads) | none | {free['decode_tps']:.2f} | - | - |")
    ev = capped.get("events", {})
    assert isinstance(ev, dict)
    tps = capped.get("decode_tps")
    print(f"| whole model (`Llama`, 2 threads) | {limit >> 20} MB | "
          f"{f'{tps:.2f}' if isinstance(tps, float) else 'failed: ' + str(capped.get('error', ''))[:60]} | "
          f"{capped.get('peak_mb')} | {ev.get('failcnt', ev.get('max', 0))}/{ev.get('oom_kill', 0)} |")
    print(f"greedy tokens of the route equal the whole model's: "
          f"{lg['tokens'][: len(free['short_tokens'])] == free['short_tokens'][: len(lg['tokens'])]}; the capped whole "
          f"model's equal the free one's: {same}")
    print(json.dumps(rows, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
