"""kvtier inside vLLM 0.33: the only part of kvtier that imports vLLM.

Two ways in, both from settings alone (``--kv-transfer-config``):

* :class:`TieredOffloadingSpec` — kvtier's whole stack (its CPU tier, then its disk tiers) as
  vLLM's offloading spec: ``"spec_name": "TieredOffloadingSpec", "spec_module_path":
  "kvtier.integrations.vllm"``, with ``"kvtier_config": "tiers.yaml"`` or inline kvtier keys;
* :class:`KvtierDiskTier` — kvtier's lmdb/files tier as a secondary tier of vLLM's own
  ``TieringOffloadingSpec``: ``"secondary_tiers": [{"type": "KvtierDiskTier",
  "module_path": "kvtier.integrations.vllm", "kind": "lmdb", "path": ..., "capacity": ...}]``.

vLLM finds both by importing this module and taking the class by name (``getattr``), so
both are attributes here, imported when first asked for: :mod:`.settings` (what the extra
config says, checked the way the spec checks it) imports without vLLM, so tools and tests
that only read settings need no vLLM. ``examples/vllm/README.md`` has the commands and what
each setting does.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "KvtierDiskTier",
    "KvtierOffloadingManager",
    "KvtierOffloadingWorker",
    "TieredOffloadingSpec",
]

#: each public class, by the module that defines it (the modules import vLLM)
_HOMES = {
    "KvtierDiskTier": "disk_tier",
    "KvtierOffloadingManager": "manager",
    "KvtierOffloadingWorker": "worker",
    "TieredOffloadingSpec": "spec",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(f"{__name__}.{home}")
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("vllm"):
            raise
        raise ImportError(
            f"kvtier.integrations.vllm.{name} plugs into vLLM's kv_offload API, and vLLM does not "
            f"import here ({exc}); install vllm==0.33.0 beside kvtier (on a CPU machine, for "
            "tests: scripts/vllm-cpu-env.sh)"
        ) from exc
    return getattr(module, name)
