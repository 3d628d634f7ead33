"""Exit 0 if this Python's kvtier is this checkout's and every package kvtier depends on is
installed, else 1: an engine's environment made by hand, or before kvtier gained a dependency,
then gets `pip install -e .` (scripts/test-vllm.sh, scripts/test-sglang.sh)."""

import importlib.metadata as md
import os
import sys

from packaging.requirements import Requirement

import kvtier


def installed(requirement: str) -> bool:
    try:
        md.version(Requirement(requirement).name)
    except md.PackageNotFoundError:
        return False
    return True


here = os.path.realpath(kvtier.__file__).startswith(os.path.realpath("src"))
needed = [r for r in md.requires("kvtier") or [] if "extra ==" not in r]
sys.exit(0 if here and all(map(installed, needed)) else 1)
