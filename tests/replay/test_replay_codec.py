"""``kvtier replay --codec``: at the same disk bytes a codec holds more blocks, and every block a
lossy codec brings back equals its own decode of what was stored (never another block's)."""

from __future__ import annotations

import json

import pytest
import yaml

from kvtier.errors import KvtierError
from kvtier.replay.run import default_config, replay

#: big enough that int4's blocks take fewer disk pages than raw ones (a page is the unit)
BLOCK = 16 * 1024


def run(tmp_path, codec):
    directory = tmp_path / (codec or "raw")
    directory.mkdir()
    config = default_config(str(directory), BLOCK)
    config["tiers"][0]["capacity"] = 400 * BLOCK  # a small CPU tier: blocks go down and come back
    config["tiers"][1]["capacity"] = 800 * (BLOCK + 4096)  # and a disk that fills up
    path = directory / "stack.yaml"
    path.write_text(yaml.safe_dump(config))
    return replay(
        config=str(path),
        limit=400,
        gpu_blocks=300,
        block_bytes=BLOCK,
        baseline=False,
        progress=False,
        deterministic=True,
        codec=codec,
    )


@pytest.mark.slow
def test_a_lossy_codec_holds_more_blocks_in_the_same_bytes_and_serves_its_own_decodes(tmp_path, capsys):
    raw, coded = run(tmp_path, None), run(tmp_path, "int4")
    assert raw["tier_blocks"]["disk"]["capacity_blocks"] == 800
    held = coded["tier_blocks"]["disk"]
    assert (
        held["codec"] == "int4" and held["capacity_blocks"] > 1.5 * 800 and held["raw_capacity_blocks"] == 800
    )
    assert held["codec_ratio"] == pytest.approx(3.2)
    assert coded["hits"]["disk"] > raw["hits"]["disk"] and coded["hit_ratio"] > raw["hit_ratio"]
    # every block the disk served came back through int4: each equal to its own decode
    assert coded["mismatched_blocks"] == 0 and coded["codec_verified_blocks"] >= coded["hits"]["disk"] > 0
    assert raw["mismatched_blocks"] == 0 and raw["codec_verified_blocks"] == 0
    assert "tier disk: codec int4" in capsys.readouterr().out


def test_a_codec_no_tier_takes_is_refused(tmp_path):
    config = {
        "block_size_tokens": 512,
        "tiers": [{"kind": "cpu", "capacity": 400 * BLOCK, "pin_memory": "off"}],
    }
    with pytest.raises(KvtierError, match="no tier below the CPU tier takes a codec"):
        replay(config=json.dumps(config), limit=5, block_bytes=BLOCK, progress=False, codec="int8")
