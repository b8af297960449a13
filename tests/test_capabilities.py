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
