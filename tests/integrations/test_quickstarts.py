"""The quickstarts (docs/quickstart/) and the deployment page say what the code does: their
settings parse through the code the engine runs, and the log lines and metrics they tell a
user to look for are the ones kvtier writes.

No GPU serves here, so the serve commands themselves do not run. What runs without an engine:
the JSON of each command, parsed as the integration parses it and opened as a real stack (its
sizes and paths scaled into a temporary folder); the request the quickstart sends; the KV
arithmetic behind the block size. With vLLM (``scripts/test-vllm.sh``) or SGLang
(``scripts/test-sglang.sh``), the log line each quickstart quotes is captured from the
integration itself.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from kvtier import build_manager, load_config
from kvtier.integrations.sglang.settings import resolve_settings
from kvtier.integrations.vllm.settings import kvtier_settings
from kvtier.metrics.names import METRICS

ROOT = Path(__file__).resolve().parents[2]
VLLM_PAGE = ROOT / "docs" / "quickstart" / "vllm.md"
SGLANG_PAGE = ROOT / "docs" / "quickstart" / "sglang.md"
DEPLOYMENT_PAGE = ROOT / "docs" / "deployment.md"
#: Qwen2.5-0.5B-Instruct's config.json, the fields kvtier reads (the quickstarts' model)
QWEN_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}


def _bash_blocks(page: Path) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", page.read_text(), re.S)


def _command(page: Path, starts: str) -> str:
    """The bash block whose command starts with ``starts``."""
    (block,) = [b for b in _bash_blocks(page) if starts in b]
    return block


def _quoted_json(command: str, option: str) -> dict:
    found = re.search(re.escape(option) + r" '(.*?)'", command, re.S)
    assert found, f"{option} '...' not in the command"
    return json.loads(found.group(1))


def _vllm_extra() -> dict:
    transfer = _quoted_json(_command(VLLM_PAGE, "vllm serve"), "--kv-transfer-config")
    assert (transfer["kv_connector"], transfer["kv_role"]) == ("OffloadingConnector", "kv_both")
    return transfer["kv_connector_extra_config"]


def _scaled(tiers: list[dict], tmp_path: Path) -> list[dict]:
    """The tiers with sizes a test can allocate and paths under ``tmp_path``."""
    return [
        {**tier, "capacity": "8MiB" if tier["kind"] == "cpu" else "32MiB"}
        | ({"path": str(tmp_path / tier["name"])} if "path" in tier else {})
        for tier in tiers
    ]


def _logged_names(line: str, prefix: str) -> list[str]:
    """The ``name=`` figures a quoted log line shows after ``prefix`` (its ``...`` skipped)."""
    assert prefix in line, line
    return re.findall(r"([\w.]+)=", line.split(prefix, 1)[1])


def _quoted_line(page: Path, prefix: str) -> str:
    (line,) = [
        text
        for block in re.findall(r"```text\n(.*?)```", page.read_text(), re.S)
        for text in block.splitlines()
        if prefix in text
    ]
    return line


def test_the_vllm_command_parses_as_the_spec_parses_it(tmp_path):
    extra = _vllm_extra()
    assert (extra["spec_name"], extra["spec_module_path"]) == (
        "TieredOffloadingSpec",
        "kvtier.integrations.vllm",
    )
    kvtier, integration = kvtier_settings(extra)  # what TieredOffloadingSpec does first
    config = load_config(kvtier)
    assert [(t.name, t.kind) for t in config.tiers] == [("cpu", "cpu"), ("nvme", "lmdb")]
    assert config.block_size_tokens == 256 and 256 % 16 == 0  # whole GPU blocks of vLLM's 16
    assert integration == {"kvtier_stats_log_interval_s": 10}
    # the same stack, scaled, opens and reports every figure kvtier's log line quotes
    manager = build_manager({**kvtier, "tiers": _scaled(kvtier["tiers"], tmp_path)}, block_bytes=64 * 1024)
    try:
        figures = manager.stats()
    finally:
        manager.shutdown()
    names = _logged_names(_quoted_line(VLLM_PAGE, "kvtier: "), "kvtier: ")
    assert {"cpu_hits", "nvme.promotions", "nvme.demotions"} <= set(names)
    assert set(names) <= set(figures), sorted(set(names) - set(figures))


@pytest.mark.parametrize(
    "page", ["README.md", "docs/vllm.md", "docs/quickstart/vllm.md", "docs/deployment.md"]
)
def test_every_vllm_command_shown_parses_with_a_disk_sized_block(page, monkeypatch):
    monkeypatch.chdir(ROOT)  # a relative kvtier_config is taken from where vllm serve runs
    monkeypatch.setenv("KVTIER_CONFIG", str(ROOT / "examples" / "vllm" / "tiers.yaml"))
    shown = re.findall(r"--kv-transfer-config '(\{.*?\})'", (ROOT / page).read_text(), re.S)
    assert shown, page
    for text in shown:
        extra = json.loads(text)["kv_connector_extra_config"]
        if extra["spec_name"] != "TieredOffloadingSpec":
            continue
        kvtier, _ = kvtier_settings(extra)
        assert load_config(kvtier).block_size_tokens == 256, text  # not vLLM's 16-token default


def test_the_request_is_what_both_quickstarts_send(tmp_path):
    for page, port in ((VLLM_PAGE, 8000), (SGLANG_PAGE, 30000)):
        (block,) = [b for b in _bash_blocks(page) if "request.json" in b]
        make = block.split("> request.json")[0] + "> request.json"
        subprocess.run(["bash", "-c", make], cwd=tmp_path, check=True)
        request = json.loads((tmp_path / "request.json").read_text())
        option = "--model-path" if page == SGLANG_PAGE else "vllm serve"
        served = re.search(re.escape(option) + r" (\S+)", page.read_text()).group(1)
        assert request["model"] == served
        # about 2,000 tokens: 200 sentences of ten words
        assert request["prompt"].count("fox") == 200 and request["max_tokens"] > 0
        assert f"localhost:{port}/v1/completions" in block


def test_the_block_size_arithmetic_is_kvtiers(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN_CONFIG))
    shown = subprocess.run(
        [str(Path(sys.executable).parent / "kvtier"), "model", str(config), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    per_token = json.loads(shown.stdout)["model"]["kv_bytes_per_token"]
    assert per_token == 12 * 1024
    vllm_text, sglang_text = VLLM_PAGE.read_text(), SGLANG_PAGE.read_text()
    assert "12 KiB of KV per token" in vllm_text and "12 KiB of KV" in sglang_text
    assert 16 * per_token == 192 * 1024 and "192 KiB" in vllm_text  # vLLM's default block
    assert 256 * per_token == 3 << 20 and "3 MiB" in vllm_text  # the quickstart's
    assert 64 * per_token == 768 * 1024 and "768 KiB in two I/Os of 384 KiB" in sglang_text


def test_the_metrics_named_are_exported():
    names = {metric.name for metric in METRICS}
    named = re.findall(r"\b(kvtier_[a-z_]+_total)\b", VLLM_PAGE.read_text())
    assert "kvtier_lookup_hits_blocks_total" in named
    assert set(named) <= names, sorted(set(named) - names)


def test_the_sglang_command_parses_as_the_backend_parses_it():
    command = _command(SGLANG_PAGE, "sglang.launch_server")
    extra = _quoted_json(command, "--hicache-storage-backend-extra-config")
    assert (extra["backend_name"], extra["module_path"], extra["class_name"]) == (
        "kvtier",
        "kvtier.integrations.sglang",
        "KvtierHiCacheStorage",
    )
    settings = resolve_settings(extra)  # what KvtierHiCacheStorage does first
    assert [(t.name, t.kind) for t in settings.lower_tiers] == [("nvme", "lmdb")]
    assert settings.interface_v1
    assert "--page-size 64" in command and "--hicache-mem-layout page_first" in command


def test_the_store_a_quickstart_checks_is_the_one_it_configures():
    stores = {
        VLLM_PAGE: _vllm_extra()["tiers"][1]["path"],
        SGLANG_PAGE: _quoted_json(
            _command(SGLANG_PAGE, "sglang.launch_server"), "--hicache-storage-backend-extra-config"
        )["tiers"][0]["path"],
    }
    for page, path in stores.items():
        assert f"kvtier check {path}" in page.read_text(), page.name


def test_the_systemd_unit_takes_its_stack_from_the_environment(monkeypatch):
    text = DEPLOYMENT_PAGE.read_text()
    (unit,) = re.findall(r"```ini\n(.*?)```", text, re.S)
    (path,) = re.findall(r"^Environment=KVTIER_CONFIG=(\S+)$", unit, re.M)
    (start,) = re.findall(r"^ExecStart=(.*)$", unit, re.M)
    transfer = _quoted_json(start, "--kv-transfer-config")
    monkeypatch.setenv("KVTIER_CONFIG", path)
    kvtier, _ = kvtier_settings(transfer["kv_connector_extra_config"])
    assert kvtier["kvtier_config"] == path  # the environment's YAML is the stack
    assert "kvtier check --fix" in unit and "LimitNOFILE=" in unit and "TimeoutStopSec=" in unit


def test_the_kubernetes_pod_gives_dev_shm_memory():
    (pod,) = [
        block
        for block in re.findall(r"```yaml\n(.*?)```", DEPLOYMENT_PAGE.read_text(), re.S)
        if "emptyDir" in block
    ]
    spec = yaml.safe_load(pod)["spec"]
    volumes = {volume["name"]: volume for volume in spec["volumes"]}
    (container,) = spec["containers"]
    mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert {"name": "KVTIER_CONFIG", "value": "/etc/kvtier/tiers.yaml"} in container["env"]
    assert mounts["/etc/kvtier"] == "kvtier-config"


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm: scripts/test-vllm.sh")
def test_vllm_logs_the_lines_the_quickstart_quotes(tmp_path, caplog):
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm_support import STEP_END, offloading_config

    extra = _vllm_extra()
    extra = {**extra, "tiers": _scaled(extra["tiers"], tmp_path), "kvtier_stats_log_interval_s": 0.001}
    spec = OffloadingSpecFactory.create_spec(offloading_config(extra, blocks_per_chunk=16))
    manager = spec.get_manager()
    caplog.set_level(logging.INFO, logger="vllm.kvtier")
    time.sleep(0.01)
    manager.on_schedule_end(STEP_END)
    manager.shutdown()
    logged = [r.getMessage() for r in caplog.records if r.name == "vllm.kvtier"]
    for prefix in ("kvtier: ", "kvtier at shutdown: "):
        (message,) = [m for m in logged if m.startswith(prefix)]
        shown = re.findall(r"([\w.]+)=", message)
        quoted = _logged_names(_quoted_line(VLLM_PAGE, prefix), prefix)
        assert [name for name in shown if name in quoted] == quoted  # each, in the order logged


@pytest.mark.sglang
@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs sglang: scripts/test-sglang.sh")
def test_sglang_logs_the_line_the_quickstart_quotes(tmp_path, caplog):
    from sglang_support import build_backend, mha_pool

    extra = _quoted_json(
        _command(SGLANG_PAGE, "sglang.launch_server"), "--hicache-storage-backend-extra-config"
    )
    extra = {**extra, "tiers": _scaled(extra["tiers"], tmp_path)}
    caplog.set_level(logging.INFO, logger="sglang.kvtier")
    pool = mha_pool("page_first")
    backend = build_backend(pool, extra)
    assert backend.tiers  # the stores open at the first page operation (a request's lookup)
    backend.close()
    quoted = _quoted_line(SGLANG_PAGE, "pool, page_first")
    pattern = re.escape(quoted[quoted.index("kvtier: ") :]).replace(re.escape("..."), ".*")
    pattern = pattern.replace("64", r"\d+")  # the test pool's page size, not the quickstart's
    assert any(re.fullmatch(pattern, r.getMessage()) for r in caplog.records), [
        r.getMessage() for r in caplog.records
    ]
