"""examples/vllm/ settings are valid kvtier configuration (needs no vLLM: runs in default CI)."""

import json
from pathlib import Path

from kvtier import load_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "vllm"


def test_the_kvtier_yaml_parses_and_leaves_the_block_size_to_vllm():
    config = load_config(EXAMPLES / "tiers.yaml")
    assert [(t.name, t.kind) for t in config.tiers] == [("cpu", "cpu"), ("nvme", "lmdb")]
    assert config.block_size_tokens is None  # vLLM's block_size decides it


def test_the_kv_transfer_configs_name_kvtiers_classes():
    spec = json.loads((EXAMPLES / "kvtier-spec.json").read_text())["kv_connector_extra_config"]
    assert (spec["spec_name"], spec["spec_module_path"]) == (
        "TieredOffloadingSpec",
        "kvtier.integrations.vllm",
    )
    assert (EXAMPLES.parent.parent / spec["kvtier_config"]).is_file()
    tiering = json.loads((EXAMPLES / "tiering.json").read_text())["kv_connector_extra_config"]
    (entry,) = tiering["secondary_tiers"]
    assert (entry["type"], entry["module_path"]) == ("KvtierDiskTier", "kvtier.integrations.vllm")
