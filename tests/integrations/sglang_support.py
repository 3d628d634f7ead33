"""Real SGLang host pools and storage configs on the CPU, for the sglang-marked tests.

SGLang's host pools are built from a description of the device pool's buffers
(``MHABufferInfo`` / ``MLABufferInfo``, SGLang's own structs), which on a CPU machine are
CPU tensors; the host pool then allocates its own buffer in the requested layout, unpinned.
The backend is built as SGLang's cache controller builds it: ``StorageBackendFactory`` with
the ``dynamic`` backend and settings alone, then ``register_mem_pool_host``.
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo, MLABufferInfo
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

LAYERS, HEADS, HEAD_DIM, PAGE = 3, 2, 64, 4
MLA_LORA, MLA_ROPE = 48, 16
DEVICE_TOKENS = 64


def _ptrs(tensors) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def mha_pool(layout: str = "page_first", dtype=torch.bfloat16, layers: int = LAYERS) -> MHATokenToKVPoolHost:
    """A real MHA host pool (3 layers, 2 heads of 64, pages of 4 tokens) in ``layout``."""
    k = tuple(torch.zeros(DEVICE_TOKENS, HEADS, HEAD_DIM, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(DEVICE_TOKENS, HEADS, HEAD_DIM, dtype=dtype) for _ in range(layers))
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=_ptrs(k), v_data_ptrs=_ptrs(v), layout=KVBufferLayout.NHD),
        page_size=PAGE,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        v_head_dim=HEAD_DIM,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    return MHATokenToKVPoolHost(
        info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=DEVICE_TOKENS, start_layer=0, end_layer=layers,
    )  # fmt: skip


def mla_pool(layout: str = "page_first", dtype=torch.bfloat16, layers: int = LAYERS) -> MLATokenToKVPoolHost:
    """A real MLA host pool (3 layers, rows of 48 + 16) in ``layout``."""
    dim = MLA_LORA + MLA_ROPE
    rows = tuple(torch.zeros(DEVICE_TOKENS, 1, dim, dtype=dtype) for _ in range(layers))
    info = MLABufferInfo(
        buffers=rows,
        data_ptrs=_ptrs(rows),
        layer_indices=tuple(range(layers)),
        device_layer_num=layers,
        page_size=PAGE,
        kv_lora_rank=MLA_LORA,
        qk_rope_head_dim=MLA_ROPE,
        kv_cache_dim=dim,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    return MLATokenToKVPoolHost(
        info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=DEVICE_TOKENS, start_layer=0, end_layer=layers, target_layer_num=layers,
    )  # fmt: skip


def extra_config(tiers: list[dict], **more) -> dict:
    """The JSON of --hicache-storage-backend-extra-config naming kvtier, with inline tiers."""
    return {
        "backend_name": "kvtier",
        "module_path": "kvtier.integrations.sglang",
        "class_name": "KvtierHiCacheStorage",
        "interface_v1": 1,
        "tiers": tiers,
        **more,
    }


def storage_config(
    extra: dict, *, tp_rank=0, tp_size=1, mla=False, model="org/model-7b", layout="page_first"
):
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=True,
        is_page_first_layout=layout == "page_first",
        model_name=model,
        extra_config=dict(extra),
    )


def build_backend(pool, extra: dict, **config):
    """The backend as SGLang's cache controller makes it: the factory's dynamic backend from
    settings alone, then the host pool registered."""
    cfg = storage_config(extra, layout=pool.layout, **config)
    backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    backend.register_mem_pool_host(pool)
    return backend


def fill_pages(pool, count: int, seed: int, slots=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Allocate ``count`` pages in ``pool`` (or take ``slots``: a sidecar pool shares the KV
    pool's), fill them with random bytes; (slots, each page's flat bytes as SGLang's
    get_data_page gives them, copied)."""
    slots = pool.alloc(count * pool.page_size) if slots is None else slots
    assert slots is not None
    generator = torch.Generator().manual_seed(seed)
    pages = []
    for i in range(count):
        start = int(slots[i * pool.page_size])
        flat = pool.get_dummy_flat_data_page()
        noise = torch.randint(
            0, 256, (flat.numel() * flat.element_size(),), dtype=torch.uint8, generator=generator
        )
        pool.set_from_flat_data_page(start, noise.view(flat.dtype))
        pages.append(pool.get_data_page(start, flat=True).view(torch.uint8).clone())
    return slots, pages


def page_bytes(pool, slots: torch.Tensor, count: int) -> list[torch.Tensor]:
    """The flat bytes of the ``count`` pages at ``slots`` now."""
    return [
        pool.get_data_page(int(slots[i * pool.page_size]), flat=True).view(torch.uint8).clone()
        for i in range(count)
    ]


def keys(count: int, salt: int = 0) -> list[str]:
    """SGLang-style page keys (64 hex digits)."""
    import hashlib

    return [hashlib.sha256(f"page-{salt}-{i}".encode()).hexdigest() for i in range(count)]


def file_backend(pool, path, **config):
    """SGLang's own file backend (HiCacheFile), the reference the tests hold kvtier to."""
    cfg = storage_config({"file_storage_path": str(path)}, layout=pool.layout, **config)
    backend = StorageBackendFactory.create_backend("file", cfg, pool)
    backend.register_mem_pool_host(pool)
    return backend, cfg


def controller(backend, cfg, pool, zero_copy: bool, draft=None):
    """SGLang's HybridCacheController with what its storage paths read, as its attach sets it
    (the page functions by ``zero_copy``, interface_v1's switch), over a real host pool group
    (the KV pool, and ``draft`` as the draft model's sidecar pool). Made without __init__: no
    device pool, storage threads or process groups (the rank reductions run over none), so
    the test calls SGLang's own backup, hit-query and prefetch methods in its thread."""
    from queue import Queue

    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.pool_host import HostPoolGroup, PoolEntry

    entries = [PoolEntry(PoolName.KV, pool, None, lambda i: i, is_primary_index_anchor=True)]
    if draft is not None:
        entries.append(PoolEntry(PoolName.DRAFT, draft, None, lambda i: i))
    ctl = HybridCacheController.__new__(HybridCacheController)
    ctl.storage_backend, ctl.storage_config, ctl.storage_backend_type = backend, cfg, "dynamic"
    ctl.mem_pool_host, ctl.storage_host_pool, ctl.page_size = HostPoolGroup(entries), pool, pool.page_size
    ctl.prefetch_sync_queue = Queue()
    ctl.prefetch_hits_sync_groups, ctl.prefetch_completion_sync_groups = [], []
    if zero_copy:
        ctl.page_get_func, ctl.page_set_func = ctl._page_get_zero_copy, ctl._page_set_zero_copy
    else:
        ctl.page_get_func, ctl.page_set_func = ctl._generic_page_get, ctl._generic_page_set
    # what SGLang's hybrid attach and its draft sidecar registration do after the anchor pool
    for entry in entries:
        backend.register_mem_host_pool_v2(entry.host_pool, entry.name)
    backend.on_host_pools_registered()
    return ctl
