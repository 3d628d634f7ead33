"""KVTIER_CONFIG: the configuration path wherever one is taken and none was given.

A path or inline keys given in place win; the variable comes next; then the place's own
default or its error, which names the variable. ``kvtier replay`` never reads it.
"""

import json
from pathlib import Path

import pytest

from kvtier.cli.main import main
from kvtier.config import CONFIG_ENV
from kvtier.errors import ConfigError
from kvtier.integrations.sglang.settings import resolve_settings
from kvtier.integrations.vllm.settings import kvtier_settings

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
VLLM_SPEC = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "kvtier.integrations.vllm"}
SGLANG_CLASS = {
    "backend_name": "kvtier",
    "module_path": "kvtier.integrations.sglang",
    "class_name": "KvtierHiCacheStorage",
}


@pytest.fixture
def env_stack(tmp_path, monkeypatch):
    """KVTIER_CONFIG naming a stack whose lower tier is called 'from-env'."""
    path = tmp_path / "env.yaml"
    path.write_text(
        "tiers:\n  - {name: cpu, kind: cpu, capacity: 16MiB}\n"
        f"  - {{name: from-env, kind: lmdb, path: {tmp_path / 'store'}, capacity: 64MiB}}\n"
    )
    monkeypatch.setenv(CONFIG_ENV, str(path))
    return path


def test_config_check_takes_the_variable_when_no_file_is_given(env_stack, capsys):
    assert main(["config", "check"]) == 0
    out = capsys.readouterr().out
    assert f"{env_stack}: valid" in out and "from-env" in out
    assert main(["config", "check", str(EXAMPLES / "cpu-only.yaml")]) == 0  # a FILE wins
    out = capsys.readouterr().out
    assert "cpu-only.yaml: valid" in out and "from-env" not in out


def test_config_check_without_file_or_variable_says_both(monkeypatch, capsys):
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    assert main(["config", "check"]) == 2
    assert CONFIG_ENV in capsys.readouterr().err


def test_model_judges_the_variables_tiers(env_stack, capsys):
    assert main(["model", "Llama-3.1-8B", "--json"]) == 0
    tiers = json.loads(capsys.readouterr().out)["break_even"]["tiers"]
    assert sorted(tiers) == ["cpu", "from-env"]
    assert main(["model", "Llama-3.1-8B", "--config", str(EXAMPLES / "cpu-only.yaml"), "--json"]) == 0
    assert sorted(json.loads(capsys.readouterr().out)["break_even"]["tiers"]) == ["cpu"]


def test_check_without_a_target_checks_the_variables_shared_tier(env_stack, capsys):
    # env.yaml has no valkey tier: the check says so, as for --config env.yaml (bad input)
    assert main(["check"]) == 2
    assert "valkey tier" in capsys.readouterr().err


def test_vllm_takes_the_variable_when_the_extra_config_names_no_stack(env_stack):
    kvtier, _ = kvtier_settings({**VLLM_SPEC, "block_size": 256})
    assert kvtier["kvtier_config"] == str(env_stack)
    given = str(EXAMPLES / "vllm" / "tiers.yaml")
    assert kvtier_settings({**VLLM_SPEC, "kvtier_config": given})[0]["kvtier_config"] == given
    inline = {**VLLM_SPEC, "tiers": [{"name": "cpu", "kind": "cpu", "capacity": "1GiB"}]}
    assert "kvtier_config" not in kvtier_settings(inline)[0]


def test_vllm_without_a_stack_or_the_variable_names_all_three(monkeypatch):
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    with pytest.raises(ConfigError) as caught:
        kvtier_settings(VLLM_SPEC)
    error = caught.value
    assert error.field == "kv_connector_extra_config.kvtier_config"
    assert "inline tiers" in error.expected and CONFIG_ENV in error.fix and "kvtier_config" in error.fix


def test_sglang_takes_the_variable_when_the_extra_config_names_no_tiers(env_stack):
    settings = resolve_settings({**SGLANG_CLASS, "interface_v1": 1})
    assert [tier.name for tier in settings.lower_tiers] == ["from-env"]
    inline = {
        **SGLANG_CLASS,
        "tiers": [{"name": "inline", "kind": "files", "path": "/tmp/x", "capacity": "1GiB"}],
    }
    assert [tier.name for tier in resolve_settings(inline).lower_tiers] == ["inline"]


def test_sglang_without_tiers_or_the_variable_names_it(monkeypatch):
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    with pytest.raises(ConfigError) as caught:
        resolve_settings(SGLANG_CLASS)
    assert CONFIG_ENV in caught.value.fix
