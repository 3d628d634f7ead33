"""A fleet's TTFT: one prefill queue per engine over the requests it was sent."""

import pytest

from kvtier_testing.costs import TINY
from kvtier.costs.gpus import parse_gpu
from kvtier.costs.models import model_from_config
from kvtier.costs.timing import CostModel, tier_speeds
from kvtier.replay.trace import Request
from kvtier.replay.ttft import fleet_time


def test_each_engine_queues_only_its_own_requests():
    gpu = parse_gpu("tflops=1,hbm=1,pcie=1,prefill=1000")  # 1000 prefill tokens/s
    speeds = tier_speeds([("cpu", "cpu")], gpu, {"cpu": (128e-6, "test")})  # 2000 tokens/s loaded
    cost = CostModel(model_from_config(TINY), gpu, {s.name: s for s in speeds})
    first = [Request(0, 1024, 1, (1, 2)), Request(500, 1024, 1, (1, 2))]
    second = [Request(250, 1024, 1, (3, 4))]
    served = [[{"computed": 2}, {"cpu": 2}], [{"computed": 2}]]
    figures = fleet_time(cost, [first, second], served)
    # engine 0: 1.024 s, then its second request waits for the first: 1.024 + 0.513 - 0.5;
    # engine 1 alone: 1.024 s, whatever engine 0 does
    assert figures["ttft_p50_s"] == pytest.approx(1.024)
    assert figures["ttft_p99_s"] == pytest.approx(1.537 - 0.5)
    assert figures["ttft_mean_s"] == pytest.approx((1.024 + 1.037 + 1.024) / 3)
    assert figures["gpu_seconds"] == pytest.approx(1.024 + 0.001 + 1.024)
    assert figures["offered_load"] == pytest.approx((1.024 + 0.001 + 0.512) / 0.5)  # engine 0's
