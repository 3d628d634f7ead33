"""kvtier inside vLLM 0.33: the only part of kvtier that imports vLLM.

Two ways in, both from settings alone (``--kv-transfer-config``):

* :class:`TieredOffloadingSpec` — kvtier's whole stack (its CPU tier, then its disk tiers) as
  vLLM's offloading spec: ``"spec_name": "TieredOffloadingSpec", "spec_module_path":
  "kvtier.integrations.vllm"``, with ``"kvtier_config": "tiers.yaml"`` or inline kvtier keys;
* :class:`KvtierDiskTier` — kvtier's lmdb/files tier as a secondary tier of vLLM's own
  ``TieringOffloadingSpec``: ``"secondary_tiers": [{"type": "KvtierDiskTier",
  "module_path": "kvtier.integrations.vllm", "kind": "lmdb", "path": ..., "capacity": ...}]``.

vLLM finds both by importing this module and taking the class by name, so both are
attributes here. ``examples/vllm/README.md`` has the commands and what each setting does.
"""

from kvtier.integrations.vllm.disk_tier import KvtierDiskTier
from kvtier.integrations.vllm.manager import KvtierOffloadingManager
from kvtier.integrations.vllm.spec import TieredOffloadingSpec
from kvtier.integrations.vllm.worker import KvtierOffloadingWorker

__all__ = [
    "KvtierDiskTier",
    "KvtierOffloadingManager",
    "KvtierOffloadingWorker",
    "TieredOffloadingSpec",
]
