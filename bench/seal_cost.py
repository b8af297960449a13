"""What sealing a step costs (docs/security.md, "A hop that lies"): ``python -m bench.seal_cost``.

A middle hop digests the residual it received and the one it sends on and signs the seal; the tail
digests its logits instead; the initiator parses each seal as it arrives and verifies those a check
uses. SmolLM2-135M's sizes (n_embd 576, 49,152-token vocabulary), one decode position; best of 5.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from meshnode.audit.seals import logits_digest, open_seal, rows_digest, sign_step
from meshnode.identity.keys import NodeIdentity
from meshnode.proto import node_pb2 as pb


def best_us(fn: Callable[[], object], n: int) -> float:
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t) / n * 1e6)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-embd", type=int, default=576)
    ap.add_argument("--n-vocab", type=int, default=49152)
    ap.add_argument("--n", type=int, default=1000, help="repeats per measurement")
    ns = ap.parse_args()
    ident = NodeIdentity.generate()
    cap = pb.Capability(model_fingerprint="0" * 64, range=pb.LayerRange(start=10, end=20),
                        numerics=pb.Numerics(n_ctx_per_session=2048, n_batch=512, n_ubatch=512))
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((1, ns.n_embd), dtype=np.float32)
    logits = rng.standard_normal(ns.n_vocab, dtype=np.float32)

    def seal(out: bytes) -> pb.SignedEnvelope:
        return sign_step(ident, cap, session_id="0" * 36, epoch=1, step_id=7, pos_start=7, n_tokens=1,
                         wire_dtype=pb.DTYPE_F32, input_sha256=rows_digest(rows, pb.DTYPE_F32), output_sha256=out)

    env = seal(b"\0" * 32)
    print(f"middle hop, per step (2 digests + sign): {best_us(lambda: seal(rows_digest(rows, 1)), ns.n):8.1f} us")
    print(f"tail, per step (digests + sign):         {best_us(lambda: seal(logits_digest(logits)), ns.n):8.1f} us")
    parse = best_us(lambda: pb.StepSeal.FromString(env.payload), ns.n)
    print(f"initiator, parse a seal as it arrives:   {parse:8.1f} us")
    print(f"initiator, verify a seal at a check:     {best_us(lambda: open_seal(env), ns.n):8.1f} us")
    print(f"seal size: {env.ByteSize()} bytes a hop a step")


if __name__ == "__main__":
    main()
