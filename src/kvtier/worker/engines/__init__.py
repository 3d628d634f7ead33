"""Copy engines: the part of a handler that moves bytes, one implementation per kind of device.

``make_engine(kind, ...)`` builds one by name; ``auto`` picks ``cuda`` for CUDA tensors and
``thread`` for CPU tensors; ``kernel`` (CUDA tensors, Triton) copies with a kernel instead of
the copy engines. Classes are imported on first use, so naming the registry costs
nothing.
"""

from __future__ import annotations

from kvtier.registry import Registry
from kvtier.worker.engines.base import CopyBuffers, CopyEngine

__all__ = ["ENGINES", "CopyBuffers", "CopyEngine", "make_engine", "resolve_engine_kind"]

#: engine name -> "module:Class", imported lazily
ENGINES: Registry[CopyEngine] = Registry(
    "copy engine",
    CopyEngine,
    {
        "thread": "kvtier.worker.engines.thread:ThreadCopyEngine",
        "cuda": "kvtier.worker.engines.cuda:CudaCopyEngine",
        "kernel": "kvtier.worker.engines.kernel:KernelCopyEngine",
    },
    module_key="engine_module_path",
)


def resolve_engine_kind(kind: str, device_type: str) -> str:
    """The engine name for ``kind`` (a name or ``auto``) and tensors on ``device_type``."""
    if kind == "auto":
        return "cuda" if device_type == "cuda" else "thread"
    if kind not in ENGINES:
        raise ValueError(f"unknown copy engine {kind!r}; choose auto, " + ", ".join(ENGINES.names()))
    return kind


def make_engine(kind: str, buffers: CopyBuffers, gpu_to_cpu: bool, *, priority: int) -> CopyEngine:
    """A new engine of ``kind`` (``auto``, ``thread``, ``cuda`` or ``kernel``) for one direction."""
    name = resolve_engine_kind(kind, buffers.device.type)
    engine_class = ENGINES.resolve(name, field="engine")
    return engine_class(buffers, gpu_to_cpu, priority=priority)
