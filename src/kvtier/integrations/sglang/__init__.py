"""kvtier inside SGLang 0.5.23: HiCache's L3 storage backend, the only part of kvtier that imports SGLang.

SGLang loads it from settings alone (``--hicache-storage-backend dynamic``)::

    --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.integrations.sglang", "class_name": "KvtierHiCacheStorage",
        "interface_v1": 1, "config": "tiers.yaml"}'

:class:`KvtierHiCacheStorage` subclasses SGLang's ``HiCacheStorage``, so it is imported only
when asked for (``kvtier.integrations.sglang.KvtierHiCacheStorage``); the rest of this package
(settings, keys, fingerprint, the host pool's rows) imports without SGLang.
``examples/sglang/README.md`` has the command and docs/sglang.md what differs from vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvtierHiCacheStorage"]


def __getattr__(name: str) -> Any:
    if name == "KvtierHiCacheStorage":
        try:
            from kvtier.integrations.sglang.storage import KvtierHiCacheStorage
        except ImportError as exc:
            raise ImportError(
                f"kvtier.integrations.sglang.KvtierHiCacheStorage subclasses SGLang's HiCacheStorage, "
                f"and SGLang's storage module does not import here ({exc}); install sglang==0.5.23 "
                f"(on a CPU machine: scripts/sglang-cpu-env.sh)"
            ) from exc
        return KvtierHiCacheStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
