"""``kvtier bench codec`` and ``kvtier plan --codec``: what each codec buys, and what it costs."""

from __future__ import annotations

import json

import pytest

from kvtier.cli.main import main
from kvtier.codecs import CODEC_NAMES
from kvtier.plan.run import plan


def test_bench_codec_measures_every_codec_against_memcpy(capsys):
    argv = ["bench", "codec", "--mib", "1", "--rounds", "1", "--block-bytes", "65536", "131072"]
    assert main([*argv, "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1  # --json: the JSON line alone
    record = json.loads(lines[0])
    assert record["bench"] == "codec" and record["data"] == "synthetic KV"
    assert set(record["codecs"]) == set(CODEC_NAMES)
    for name, figures in record["codecs"].items():
        assert figures["encode_gbps"] > 0 and figures["decode_gbps"] > 0
        # the model's error needs a model: null, never a made-up figure
        assert figures["kl_mean"] is None and figures["ppl_delta"] is None
        assert set(figures["by_block_bytes"]) == {"65536", "131072"}
        assert figures["lossy"] == (name in ("int8", "fp8", "int4"))
    codecs = record["codecs"]
    assert codecs["none"]["ratio"] == 1 and codecs["none"]["rel_rms_error"] == 0
    assert codecs["lossless"]["ratio"] > 1.3 and codecs["lossless"]["rel_rms_error"] == 0
    assert codecs["int8"]["ratio"] == pytest.approx(128 / 66) and 0 < codecs["int8"]["rel_rms_error"] < 0.02
    assert codecs["int4"]["ratio"] == pytest.approx(64 / 20) and codecs["fp8"]["ratio"] == pytest.approx(
        128 / 66
    )
    assert main(argv) == 0
    shown = capsys.readouterr().out
    assert "memcpy" in shown and "needs a real model" in shown
    assert not any(line.startswith("{") for line in shown.splitlines())  # no JSON without --json


def test_bench_codec_refuses_bad_arguments(capsys):
    assert main(["bench", "codec", "--rounds", "0", "--json"]) == 2
    assert "--rounds" in capsys.readouterr().err


def test_bench_codec_with_a_model_refuses_what_does_not_apply(tmp_path, capsys):
    assert main(["bench", "codec", "--model", "smollm2", "--block-bytes", "65536"]) == 2
    assert "--block-bytes" in capsys.readouterr().err
    pytest.importorskip("transformers")
    assert main(["bench", "codec", "--model", str(tmp_path / "nowhere")]) == 2
    assert "MODEL" in capsys.readouterr().err


def test_plan_shows_the_blocks_a_codec_holds_in_the_same_bytes(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"timestamp": i, "input_length": 2048, "output_length": 1, "hash_ids": ids}) + "\n"
            for i, ids in enumerate([[1, 2, 3], [1, 2, 4], [5, 6], [1, 2, 3], [5, 6, 7], [1, 2, 4]] * 4)
        )
    )
    capacities = [2, 4, 6]
    record = plan(str(trace), capacities, ["lru"], block_bytes=1 << 20, codec="int4")
    codec = record["codec"]
    assert codec["blocks_per_byte_ratio"] > 3
    assert all(held > capacity for held, capacity in zip(codec["blocks"], capacities))
    # LRU's hit ratio only grows with its size: more blocks in the same bytes, no fewer hits
    assert all(c >= r for c, r in zip(codec["hit_ratio"], record["hit_ratio"]["lru"]))
    assert codec["hit_ratio"][0] > record["hit_ratio"]["lru"][0]
    lossless = plan(str(trace), capacities, ["lru"], block_bytes=1 << 20, codec="lossless")["codec"]
    # a files tier counts its pages: at the ratio measured on real KV (1.45x), 1 MiB blocks
    # take 178 pages and their header, not 257
    assert lossless["blocks_per_byte_ratio"] == pytest.approx(257 / 178)
    assert lossless["blocks"] == [c * 257 // 178 for c in capacities]
