"""The runnable examples run, and say what they promise."""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("kind", ["lmdb", "files"])
def test_restart_example_serves_every_block_after_a_restart(kind):
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "restart_survives.py"), "--kind", kind, "--blocks", "80"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "served 80/80 blocks byte for byte, 80 of them read back from disk" in result.stdout
