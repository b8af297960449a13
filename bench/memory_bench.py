"""Memory that scales with the range: ``python -m bench.memory_bench``.

On a model whose weights dominate (default: the synthetic 1.34 GB llama model of ``bench.synth``, written
and cached on first use), measures the peak RSS (``VmHWM`` of /proc/PID/status) of:

* **whole** -- the whole model in ``llama_cpp.Llama`` (``n_ctx`` = ``--ctx-size``, the nodes' thread
  counts), in a child process of its own that imports only llama_cpp and numpy, after a greedy generation
  of ``--max-tokens`` tokens after ``--prompt`` (argmax of the logits, one ``eval`` per token);
* **halves** and **thirds** -- ``meshnode serve`` processes on 127.0.0.1 (port 0, a temporary
  ``--state-dir`` each; ``--ctx-size``, ``--max-sessions`` 1 = one KV sequence, as the whole process has),
  each read after the same greedy generation across the route through the real CLI
  (``meshnode generate --peer ... --json --temperature 0 --max-tokens N``, its identity in a temporary
  ``XDG_STATE_HOME``); the route's prompt ids and tokens are checked against the whole model's. Every range
  is cut before its node starts (``bench._setup.model_and_cuts``), so no node's peak includes a cut;
* **the runtime floor** -- a ``meshnode serve`` process with the same flags, run to the moment it would
  construct its ``RangeExecutor`` (the call that loads the range into llama.cpp and maps the weights):
  ``meshnode.node.RangeExecutor`` is replaced by a stub that reads /proc/self/status and exits. Everything
  before it is the real serve path: flags, config, the artifact lookup and its sha256 check, the state
  directory's lock, the node key, and every import a serving node has by then (node.py imports the gRPC
  server, servicer, sessions and executor modules at its top).

Each live process's current RSS is also split from /proc/PID/smaps into weights (pages of mapped ``.gguf``
files), anonymous memory (heap, KV cache, llama.cpp's compute buffers, Python objects) and other files
(shared libraries). ``--imports`` (default on) adds what each third-party package costs the floor: the
floor process's own module list is imported in a fresh interpreter without the package and then with it,
so each figure is the package's marginal cost given everything else a node loads (0 for a package that
another one needs anyway).

Targets: each half-range node <= 0.60 x the whole process, each third-range node <= 0.45 x.

Reproduce: ``.venv/bin/python -m bench.memory_bench`` from the repository root (``--json``: one JSON object
at the end). ``run(argv)`` returns the same figures as a dict, for other harnesses.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The capital of France is"
TARGETS = {"half": 0.60, "third": 0.45}
#: third-party packages reported in the import table (those of them a floor process has loaded)
WATCH = ("numpy", "llama_cpp", "grpc", "google.protobuf", "google_crc32c", "trio", "cryptography", "gguf",
         "jinja2", "prometheus_client", "httpx", "starlette", "hypercorn", "zeroconf", "tqdm", "yaml",
         "trio_asyncio", "anyio", "h11", "idna", "outcome", "sniffio")


# -- /proc readers (stdlib only: the children import this module) --------------------------------------------


def proc_status_mb(pid: int | str = "self") -> dict[str, float]:
    """VmHWM (peak), VmRSS, RssAnon, RssFile of a process, MB."""
    keys = ("VmHWM", "VmRSS", "RssAnon", "RssFile")
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in keys:
            out[k] = int(v.split()[0]) / 1024
    return out


_MAPPING = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")


def smaps_mb(pid: int | str = "self") -> dict[str, float]:
    """Current RSS of a process split by what is mapped: ``weights`` (.gguf files), ``anon`` (no file:
    heap, stacks, anonymous maps) and ``files`` (every other file: shared libraries, Python extensions)."""
    out = {"weights": 0.0, "anon": 0.0, "files": 0.0}
    kind = "anon"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if _MAPPING.match(line):
            parts = line.split(None, 5)
            path = parts[5].strip() if len(parts) > 5 else ""
            if path.endswith(".gguf") or path.endswith(".gguf (deleted)"):
                kind = "weights"
            elif not path or path.startswith("["):
                kind = "anon"
            else:
                kind = "files"
        elif line.startswith("Rss:"):
            out[kind] += int(line.split()[1]) / 1024
    return out


# -- the whole model, in a child of its own (imports llama_cpp and numpy only) -------------------------------


def whole_child(model: str, prompt: str, n_tokens: int, ctx: int, threads: int, threads_batch: int) -> dict[str, Any]:
    import llama_cpp
    import numpy as np

    before = proc_status_mb()
    llm = llama_cpp.Llama(model, n_ctx=ctx, n_threads=threads, n_threads_batch=threads_batch, verbose=False)
    n_vocab = llm.n_vocab()
    ids = llm.tokenize(prompt.encode(), add_bos=True, special=True)
    t0 = time.perf_counter()
    llm.eval(ids)
    toks: list[int] = []
    while True:
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
        toks.append(int(np.argmax(logits)))
        if len(toks) == n_tokens:
            break
        llm.eval([toks[-1]])
    return {"prompt_ids": ids, "tokens": toks, "seconds": time.perf_counter() - t0,
            "eog": [bool(llama_cpp.llama_vocab_is_eog(llm._model.vocab, t)) for t in toks],
            "status_before_load": before, "status": proc_status_mb(), "smaps": smaps_mb()}


def run_whole(model: Path, ns: argparse.Namespace, threads: int, threads_batch: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.memory_bench", "--whole-child", "--model", str(model), "--prompt", ns.prompt,
           "--max-tokens", str(ns.max_tokens), "--ctx-size", str(ns.ctx_size), "--threads", str(threads),
           "--threads-batch", str(threads_batch)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


# -- routes ---------------------------------------------------------------------------------------------------


def run_route(model: Path, cuts: list[str], ns: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    """Start one node per range, generate across them with the CLI, read every node, stop them."""
    from bench.paths import generate  # not at the top: the whole-model child imports this module
    from meshnode.runtime.launch import local_route
    with local_route(model, cuts, extra=extra) as nodes:
        peers = [n.endpoint for n in nodes]
        started = [proc_status_mb(n.proc.pid) for n in nodes]
        seconds, gen = generate(peers, ns.prompt, ns.max_tokens)
        hops = [{"layers": c, "endpoint": n.endpoint, "pid": n.proc.pid, "status_serving": s,
                 "status": proc_status_mb(n.proc.pid), "smaps": smaps_mb(n.proc.pid)}
                for c, n, s in zip(cuts, nodes, started, strict=True)]
    return {"cuts": cuts, "generate": gen, "generate_seconds": seconds, "hops": hops}


# -- the runtime floor: a real serve, stopped where it would load the range ----------------------------------

_FLOOR = r"""
import json, os, sys
sys.path.insert(0, {root!r})
from bench.memory_bench import proc_status_mb, smaps_mb

who = {{}}  # top-level package -> (its direct importer, the meshnode code that led to it), first import only

class _Who:
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in who or top in sys.modules:
            return None
        f, direct, ours = sys._getframe(1), None, None
        while f is not None:
            mod = f.f_globals.get("__name__") or ""
            if not mod.startswith(("importlib", "_frozen_importlib")) and direct is None:
                direct = mod
            if mod.startswith("meshnode"):
                ours = f"{{mod}}:{{f.f_code.co_name}}"
                break
            f = f.f_back
        who[top] = [direct, ours]
        return None

sys.meta_path.insert(0, _Who())
import meshnode.node

def _stop(*args, **kwargs):
    mods = list(sys.modules)
    print("FLOOR " + json.dumps({{"status": proc_status_mb(), "smaps": smaps_mb(), "modules": mods, "who": who}}),
          flush=True)
    os._exit(0)

meshnode.node.RangeExecutor = _stop
from meshnode.cli.main import main
sys.exit(main({argv!r}))
"""


def run_floor(model: Path, layers: str, extra: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="meshnode-state-") as st:
        argv = ["serve", "--model", str(model), "--layers", layers, "--listen", "127.0.0.1:0", "--state-dir", st,
                *extra]
        code = _FLOOR.format(root=str(ROOT), argv=argv)
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("FLOOR "):
            result: dict[str, Any] = json.loads(line[6:])
            return result
    raise RuntimeError(f"the floor child did not reach the executor ({proc.returncode}): {proc.stderr[-800:]}")


# -- what each package costs ----------------------------------------------------------------------------------

#: what a node's data path needs: llama.cpp and numpy (compute), gRPC and protobuf (the wire), CRC-32C (bundle
#: checks), Ed25519 (route-session signatures, checked when a session opens), trio (the node's lifecycle)
CORE = ("numpy", "llama_cpp", "grpc", "grpc.aio", "google.protobuf.message", "google_crc32c", "trio",
        "cryptography.hazmat.primitives.asymmetric.ed25519")

#: what "alone" imports for a package whose top module is an empty shell
ALONE = {"google.protobuf": "google.protobuf.message", "cryptography": CORE[-1]}


def _rss_after(*stmts: str) -> list[float]:
    """VmRSS (MB) of a fresh interpreter after each statement in turn."""
    code = "\n".join([f"import sys; sys.path.insert(0, {str(ROOT)!r})", "from bench.memory_bench import proc_status_mb",
                      "out = []", *(f"{s}\nout.append(proc_status_mb()['VmRSS'])" for s in stmts),
                      "print(out)"])
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    result: list[float] = json.loads(out.strip().splitlines()[-1])
    return result


def import_costs(floor: dict[str, Any]) -> dict[str, Any]:
    """Per watched package: what importing it alone adds to a bare interpreter, and what it adds on top of
    the data-path core (CORE) -- what a node would save if nothing imported it; MB, VmRSS. Best of 2."""
    mods = set(floor["modules"])
    core = "; ".join(f"import {m}" for m in CORE)

    def best(*stmts: str) -> list[float]:
        a, b = _rss_after(*stmts), _rss_after(*stmts)
        return [min(x, y) for x, y in zip(a, b, strict=True)]

    bare, with_core, with_node = best("pass", core, "import meshnode.node")
    rows = []
    for pkg in WATCH:
        if pkg not in mods:
            continue
        base, alone = best("pass", f"import {ALONE.get(pkg, pkg)}")
        in_core = any(c == pkg or c.startswith(pkg + ".") for c in CORE)
        c0, c1 = best(core, f"import {pkg}") if not in_core else (0.0, 0.0)
        rows.append({"package": pkg, "alone_mb": alone - base, "over_core_mb": None if in_core else c1 - c0,
                     "imported_by": floor["who"].get(pkg.partition(".")[0])})
    rows.sort(key=lambda r: (r["over_core_mb"] is not None, -(r["over_core_mb"] or r["alone_mb"])))
    return {"bare_python_mb": bare, "core_mb": with_core - bare, "core": list(CORE),
            "import_meshnode_node_mb": with_node - bare,
            "not_loaded": [p for p in WATCH if p not in mods], "packages": rows}


# -- driver ---------------------------------------------------------------------------------------------------


def _ranges(n_layer: int, k: int) -> list[str]:
    edges = [round(i * n_layer / k) for i in range(k + 1)]
    return [f"{a}:{b}" for a, b in itertools.pairwise(edges)]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="python -m bench.memory_bench",
                                 description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", help="GGUF file (default: bench.synth's model, written if missing)")
    ap.add_argument("--size-gb", type=float, default=1.0, help="without --model: bench.synth --size-gb")
    ap.add_argument("--ctx-size", type=int, default=512, help="context of the whole model and of each node session")
    ap.add_argument("--max-tokens", type=int, default=16, help="greedy tokens generated before RSS is read")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--max-sessions", type=int, default=1, help="node KV sessions (default 1: the whole has one)")
    ap.add_argument("--threads", type=int, default=0, help="decode threads, both sides (default: cores/2)")
    ap.add_argument("--threads-batch", type=int, default=0, help="prefill threads, both sides (default: cores)")
    ap.add_argument("--no-imports", action="store_true", help="skip the per-package import costs")
    ap.add_argument("--json", action="store_true", help="print one JSON object at the end")
    ap.add_argument("--whole-child", action="store_true", help=argparse.SUPPRESS)
    return ap


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure, print the table, return the figures."""
    from bench._setup import model_and_cuts, thread_counts

    ns = _parser().parse_args(argv)
    threads, threads_batch = thread_counts(ns)
    if ns.model:
        model = Path(ns.model)
    else:
        from bench.synth import ensure_model

        model = ensure_model(ns.size_gb)
    from meshnode.gguf import inspect_model

    n_layer = inspect_model(model).n_layer
    halves, thirds = _ranges(n_layer, 2), _ranges(n_layer, 3)
    t0 = time.monotonic()
    model_and_cuts(argparse.Namespace(model=str(model), cuts=",".join(halves + thirds)))
    print(f"model: {model} ({model.stat().st_size / 1e6:.0f} MB, {n_layer} layers); ranges cut here "
          f"({time.monotonic() - t0:.1f} s): {','.join(halves)} and {','.join(thirds)}", flush=True)
    extra = ["--threads", str(threads), "--threads-batch", str(threads_batch), "--ctx-size", str(ns.ctx_size),
             "--max-sessions", str(ns.max_sessions)]
    print(f"node flags: {' '.join(extra)}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
          flush=True)

    whole = run_whole(model, ns, threads, threads_batch)
    w_peak = whole["status"]["VmHWM"]
    print(f"whole: peak {w_peak:.1f} MB, {len(whole['tokens'])} tokens in {whole['seconds']:.1f} s", flush=True)
    routes = {}
    for name, cuts in (("half", halves), ("third", thirds)):
        routes[name] = r = run_route(model, cuts, ns, extra)
        gen = r["generate"]
        n = len(gen["tokens"])
        r["prompt_ids_equal"] = gen["prompt_tokens"] == whole["prompt_ids"]
        ended = n == ns.max_tokens or (gen["stop_reason"] == "eog" and n > 0 and whole["eog"][n - 1])
        r["tokens_equal"] = bool(r["prompt_ids_equal"] and gen["tokens"] == whole["tokens"][:n] and ended)
        peaks = ", ".join(f"{h['status']['VmHWM']:.1f}" for h in r["hops"])
        print(f"{'halves' if name == 'half' else 'thirds'} {','.join(cuts)}: peaks {peaks} MB; "
              f"tokens equal to the whole model's: {r['tokens_equal']} ({r['generate_seconds']:.1f} s)", flush=True)
    floor = run_floor(model, halves[1], extra)
    imports = import_costs(floor) if not ns.no_imports else None

    rows: list[dict[str, Any]] = [{"process": "whole (llama_cpp.Llama)", "layers": f"0:{n_layer}", "kind": "whole",
                                   "peak_mb": w_peak, "now_mb": whole["status"]["VmRSS"], "smaps": whole["smaps"]}]
    for name, r in routes.items():
        labels = ["head", "tail"] if len(r["hops"]) == 2 else ["head", "middle", "tail"]
        for label, h in zip(labels, r["hops"], strict=True):
            rows.append({"process": f"{name} {label} (meshnode serve)", "layers": h["layers"], "kind": name,
                         "peak_mb": h["status"]["VmHWM"], "now_mb": h["status"]["VmRSS"], "smaps": h["smaps"],
                         "serving_mb": h["status_serving"]["VmRSS"]})
    rows.append({"process": "runtime floor (serve, before load)", "layers": halves[1], "kind": "floor",
                 "peak_mb": floor["status"]["VmHWM"], "now_mb": floor["status"]["VmRSS"], "smaps": floor["smaps"]})
    for row in rows:
        row["ratio"] = row["peak_mb"] / w_peak
        target = TARGETS.get(row["kind"])
        row["target"] = target
        row["met"] = None if target is None else row["ratio"] <= target

    print(f"\n{'process':<36}{'layers':>8}{'peak MB':>10}{'ratio':>8}{'target':>9}  {'met':<8}"
          f"{'now MB':>8}{'weights':>9}{'anon':>8}{'files':>8}")
    for row in rows:
        tgt = f"<= {row['target']:.2f}" if row["target"] else ""
        met = "" if row["met"] is None else "met" if row["met"] else "NOT MET"
        s = row["smaps"]
        print(f"{row['process']:<36}{row['layers']:>8}{row['peak_mb']:>10.1f}{row['ratio']:>8.3f}{tgt:>9}  {met:<8}"
              f"{row['now_mb']:>8.1f}{s['weights']:>9.1f}{s['anon']:>8.1f}{s['files']:>8.1f}")
    print("(peak = VmHWM; now = VmRSS when read; weights/anon/files = that RSS split by /proc/PID/smaps: pages of "
          ".gguf maps, anonymous memory, other files such as shared libraries)")
    print(f"greedy tokens equal to the whole model's: halves {routes['half']['tokens_equal']}, "
          f"thirds {routes['third']['tokens_equal']} ({ns.max_tokens} tokens after {ns.prompt!r})")
    print(f"whole process before Llama(): {whole['status_before_load']['VmRSS']:.1f} MB (python + llama_cpp + numpy)")
    if imports is not None:
        print(f"\nimport costs, MB of VmRSS: bare python {imports['bare_python_mb']:.1f}; + the data-path core "
              f"({', '.join(CORE)}) {imports['core_mb']:.1f}; + `import meshnode.node` "
              f"{imports['import_meshnode_node_mb']:.1f}; the floor process {floor['status']['VmRSS']:.1f} "
              f"({len(floor['modules'])} modules)")
        print(f"{'package':<20}{'alone':>8}{'over core':>11}  first imported by (direct importer / meshnode code)")
        for p in imports["packages"]:
            by = p["imported_by"] or ["?", "?"]
            over = "core" if p["over_core_mb"] is None else f"{p['over_core_mb']:.1f}"
            print(f"{p['package']:<20}{p['alone_mb']:>8.1f}{over:>11}  {by[0]} / {by[1]}")
        print(f"not imported by a node up to that point: {', '.join(imports['not_loaded'])}")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    result = {"model": str(model), "model_bytes": model.stat().st_size, "n_layer": n_layer, "ctx_size": ns.ctx_size,
              "max_tokens": ns.max_tokens, "prompt": ns.prompt, "node_flags": extra, "targets": TARGETS,
              "rows": rows, "whole": {k: v for k, v in whole.items() if k not in ("prompt_ids",)},
              "routes": routes, "floor": {k: v for k, v in floor.items() if k != "modules"},
              "floor_modules": len(floor["modules"]), "imports": imports,
              "all_met": all(r["met"] for r in rows if r["met"] is not None),
              "tokens_equal": all(r["tokens_equal"] for r in routes.values())}
    if ns.json:
        print(json.dumps(result))
    return result


def main(argv: list[str] | None = None) -> int:
    ns, _ = _parser().parse_known_args(argv)
    if ns.whole_child:
        from bench._setup import thread_counts

        threads, threads_batch = thread_counts(ns)
        print(json.dumps(whole_child(ns.model, ns.prompt, ns.max_tokens, ns.ctx_size, threads, threads_batch)))
        return 0
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
