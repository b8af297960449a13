"""A node measures and advertises what it has."""

from __future__ import annotations

from meshnode.capabilities import cpu_features
from meshnode.transport.client import get_capability
from tests.conftest import aio


def test_cpu_features_parse_llama_system_info():
    info = "CPU : SSE3 = 1 | AVX = 1 | AVX512 = 0 | AVX512_VNNI = 1 | LLAMAFILE = 1 | "
    assert cpu_features(info) == ["SSE3", "AVX", "AVX512_VNNI", "LLAMAFILE"]


async def test_a_live_node_advertises_hardware_throughput_and_endpoints(route2):
    for node in route2:
        cap = await aio(get_capability, node.endpoint)
        hw = cap.hardware
        assert hw.cores >= 1
        assert hw.memory_total_bytes > 0
        assert hw.cpu_features
        assert hw.cpu_model
        assert any(d.type == "cpu" for d in hw.devices)
        assert cap.throughput.decode_tokens_per_second > 0
        assert cap.throughput.prefill_tokens_per_second > 0
        assert list(cap.endpoints) == [node.endpoint]
        assert cap.max_sessions == 4


class _Recorder:
    """Stands in for a LlamaRange under measure_throughput: records the calls, runs nothing."""

    takes_tokens, n_embd, n_ctx_seq = True, 8, 512

    def __init__(self) -> None:
        self.config = type("C", (), {"max_sessions": 4, "n_batch": 512})()
        self.calls: list[tuple[str, int, int]] = []

    def forward(self, seq, pos, *, tokens=None, embd=None):
        self.calls.append(("forward", pos, len(tokens)))

    def release(self, seq):
        assert seq == 3  # the last slot, which no session holds at start
        self.calls.append(("release", 0, 0))


def test_throughput_is_measured_warm_then_over_several_runs_and_the_slot_freed():
    from meshnode.capabilities import measure_throughput

    rng = _Recorder()
    tput = measure_throughput(rng, prefill_tokens=32, decode_steps=2, runs=3, budget=60.0)
    run = [("release", 0, 0), ("forward", 0, 32), ("forward", 32, 1), ("forward", 33, 1)]
    warm_up = [("forward", 0, 16), ("forward", 16, 1), ("forward", 17, 1)]  # untimed
    assert rng.calls == [*warm_up, *run * 3, ("release", 0, 0)]
    assert tput.prefill_tokens_per_second > 0
    assert tput.decode_tokens_per_second > 0
    rng = _Recorder()
    measure_throughput(rng, prefill_tokens=32, decode_steps=2, runs=3, budget=0.0)
    assert rng.calls == [*warm_up, *run, ("release", 0, 0)]  # no time left: one timed run
