"""Only kvtier.integrations.vllm imports vLLM: everything else works without it.

Runs in the default CI (no vLLM installed, where a stray import would fail) and in the vLLM
environment (where it would succeed silently, which is what this test catches).
"""

import subprocess
import sys

import pytest

# Imports every kvtier module except the vLLM integration, in a fresh interpreter (the test
# process may have imported vLLM already), then reports any vllm module loaded.
# Modules are listed from the files, not with pkgutil.walk_packages, which imports every
# package it walks into (the integration included).
_PROBE = r"""
import importlib, os, sys
import kvtier, kvtier.integrations
root = os.path.dirname(kvtier.__file__)
names = []
for folder, dirs, files in os.walk(root):
    rel = os.path.relpath(folder, os.path.dirname(root))
    if rel.replace(os.sep, ".").startswith("kvtier.integrations.vllm"):
        continue
    if rel.replace(os.sep, ".") == "kvtier.integrations.sglang":
        files = [f for f in files if f != "storage.py"]  # subclasses SGLang's class: needs SGLang
    for file in files:
        if file.endswith(".py"):
            module = os.path.join(rel, file[:-3]).replace(os.sep, ".")
            names.append(module.removesuffix(".__init__"))
for name in names:
    importlib.import_module(name)
loaded = sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))
print(len(names), "modules;", "vllm modules loaded:", loaded)
sys.exit(1 if loaded else 0)
"""


@pytest.mark.slow
def test_kvtier_and_its_modules_import_without_importing_vllm():
    result = subprocess.run(
        [sys.executable, "-c", _PROBE], check=False, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    count = int(result.stdout.split()[0])
    assert count > 30  # the walk found the package's modules, not an empty list
