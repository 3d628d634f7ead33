"""The time model with a codec: fewer bytes read, then a decode; and when that loses."""

from __future__ import annotations

import json

import pytest

from kvtier.costs import CostModel, load_model, parse_gpu
from kvtier.costs.bandwidth import DEFAULT_CODEC_COSTS, codec_cost, read_bandwidth_file
from kvtier.costs.timing import tier_speeds
from kvtier.errors import ConfigError


def disk_figures(tier_gbps: float, codec: str, measured=None) -> dict:
    gpu = parse_gpu("H100")
    speeds = tier_speeds(
        [("cpu", "cpu"), ("disk", "lmdb")],
        gpu,
        {"lmdb": (tier_gbps, "test"), **(measured or {})},
        {"disk": codec},
    )
    return CostModel(load_model("Llama-3.1-8B"), gpu, {s.name: s for s in speeds}).break_even(4096)["tiers"]


def test_a_codec_reads_fewer_bytes_then_decodes_them():
    cost = DEFAULT_CODEC_COSTS["int8"]
    disk = disk_figures(1.0, "int8")["disk"]
    read = 1 / (1.0 * cost.ratio) + 1 / cost.decode_gbps  # seconds per raw GB up to the CPU tier
    assert disk["effective_gbps"] == pytest.approx(1 / (read + 1 / 64))
    assert disk["codec"] == "int8" and disk["codec_ratio"] == cost.ratio


def test_a_codec_loses_on_a_tier_that_reads_faster_than_it_pays_off():
    cost = DEFAULT_CODEC_COSTS["lossless"]
    edge = cost.decode_gbps * (1 - 1 / cost.ratio)
    slow, fast = disk_figures(edge / 2, "lossless")["disk"], disk_figures(edge * 2, "lossless")["disk"]
    assert slow["codec_loses_above_gbps"] == pytest.approx(edge)
    assert not slow["codec_slows_loads"] and fast["codec_slows_loads"]
    plain_slow, plain_fast = disk_figures(edge / 2, "none")["disk"], disk_figures(edge * 2, "none")["disk"]
    assert "codec" not in plain_slow
    assert slow["effective_gbps"] > plain_slow["effective_gbps"]  # below the edge the codec speeds loads
    assert fast["effective_gbps"] < plain_fast["effective_gbps"]  # above it, it slows them


def test_a_bench_codec_record_gives_the_decode_speed_and_ratio(tmp_path):
    record = {
        "bench": "codec",
        "codecs": {"none": {"ratio": 1.0, "decode_gbps": 9.0}, "int8": {"ratio": 1.9, "decode_gbps": 4.0}},
    }
    path = tmp_path / "codec.jsonl"
    path.write_text("a table line\n" + json.dumps(record) + "\n")
    measured = read_bandwidth_file(path)
    assert "codec:none" not in measured
    found = codec_cost("int8", measured)
    assert (found.ratio, found.decode_gbps) == (1.9, 4.0) and str(path) in found.source
    assert codec_cost("int4", measured) == DEFAULT_CODEC_COSTS["int4"]
    with pytest.raises(ConfigError, match="kvtier bench codec"):
        codec_cost("mine", measured)
