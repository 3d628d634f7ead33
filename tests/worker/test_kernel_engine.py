"""The kernel copy engine's kernel, proven on the CPU through Triton's interpreter.

The engine itself runs on CUDA only (``test_cpu_gpu.py`` runs every handler test on it as
``cuda-kernel`` under ``@pytest.mark.gpu``); here its kernel copies the descriptors of real
plans on CPU memory and must match the thread engine's memmove byte for byte.
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest

from kvtier.worker.engines.kernel import element_bytes


def test_element_width_divides_every_address_and_size():
    u64 = lambda *values: np.array(values, dtype=np.uint64)  # noqa: E731
    assert element_bytes(u64(4096, 8192), u64(64, 128), u64(48, 16)) == 8
    assert element_bytes(u64(4096), u64(68), u64(48)) == 4  # one source only 4-aligned
    assert element_bytes(u64(4096), u64(64), u64(6)) == 2
    assert element_bytes(u64(4097), u64(64), u64(48)) == 1
    assert element_bytes(u64(), u64(), u64()) == 8


@pytest.mark.slow
@pytest.mark.skipif(find_spec("triton") is None, reason="needs Triton (pip install triton)")
def test_kernel_copies_what_memmove_copies():
    script = Path(__file__).with_name("kernel_check.py")
    result = subprocess.run(
        [sys.executable, str(script)],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok: "), result.stdout
