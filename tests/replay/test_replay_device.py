"""``kvtier replay --device``: where the simulated GPU cache lives."""

from __future__ import annotations

import json

import pytest

from kvtier import KvtierError
from kvtier.replay.run import replay
from kvtier.replay.trace import bundled_trace_path

BLOCK = 4096
CPU_ONLY = json.dumps(
    {"block_size_tokens": 512, "tiers": [{"kind": "cpu", "capacity": 3000 * BLOCK, "pin_memory": "auto"}]}
)


def _cuda() -> bool:
    from kvtier.cuda import cuda_available

    return cuda_available()


@pytest.mark.skipif(_cuda(), reason="checks the refusal on a machine without CUDA")
def test_cuda_asked_for_without_cuda_is_an_error_that_says_so():
    with pytest.raises(KvtierError, match="CUDA is not available"):
        replay(str(bundled_trace_path()), CPU_ONLY, limit=5, progress=False, device="cuda")
    with pytest.raises(KvtierError, match="one of auto, cpu, cuda"):
        replay(str(bundled_trace_path()), CPU_ONLY, limit=5, progress=False, device="tpu")


def test_auto_without_cuda_runs_on_cpu_and_says_so():
    if _cuda():
        pytest.skip("auto picks cuda here")
    record = replay(
        str(bundled_trace_path()),
        CPU_ONLY,
        gpu_blocks=400,
        block_bytes=BLOCK,
        limit=50,
        progress=False,
        device="auto",
    )
    assert record["device"] == "cpu" and record["mismatched_blocks"] == 0


@pytest.mark.gpu
def test_replay_on_cuda_serves_every_load_byte_for_byte():
    if not _cuda():
        pytest.skip("needs CUDA")
    record = replay(
        str(bundled_trace_path()),
        CPU_ONLY,
        gpu_blocks=400,
        block_bytes=BLOCK,
        limit=300,
        progress=False,
        device="cuda",
    )
    assert record["device"] == "cuda" and record["failed_transfers"] == 0
    assert record["hits"]["cpu"] > 0 and record["verified_blocks"] == record["hits"]["cpu"]
    assert record["mismatched_blocks"] == 0
