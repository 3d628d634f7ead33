"""The CUDA driver calls kvtier makes through ctypes, checked without a GPU.

``driver_standin.c`` implements ``cuDriverGetVersion``, ``cuGetProcAddress_v2``, the CUDA 12.8
form of ``cuMemcpyBatchAsync`` (as a host memcpy) and ``cuMemHostGetDevicePointer_v2`` from
their prototypes, and checks every argument. Built as ``libcuda.so.1`` and put first on the
loader's path of a fresh process, it receives exactly the calls the real driver would: the
batched copy must move the bytes of real plans as the thread engine's memmove does, with the
source order each direction asks for, and a refused copy must come back with its index.
The real driver's half (that it accepts these calls) is checked on a GPU by
``test_engines.py::test_batched_copy_moves_bytes_both_ways``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
COMPILER = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


@pytest.mark.skipif(COMPILER is None, reason="needs a C compiler to build the driver stand-in")
def test_driver_calls_match_the_cuda_prototypes(tmp_path):
    library = tmp_path / "libcuda.so.1"
    subprocess.run(
        [
            COMPILER,
            "-shared",
            "-fPIC",
            "-O1",
            "-Wall",
            "-Werror",
            "-o",
            str(library),
            str(HERE / "driver_standin.c"),
        ],
        check=True,
    )
    env = {**os.environ, "LD_LIBRARY_PATH": f"{tmp_path}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    env.pop("STANDIN_UNMAPPED", None)
    env.pop("STANDIN_CUDA_VERSION", None)
    result = subprocess.run(
        [sys.executable, str(HERE / "driver_abi_check.py")],
        env=env,
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok: "), result.stdout
