"""The SGLang integration's parts that need no SGLang: settings, shards, keys, fingerprint.

Runs in the default CI (no SGLang installed); the backend itself is tested against SGLang's
own classes in test_sglang_backend.py (marked ``sglang``).
"""

from __future__ import annotations

import hashlib
import json
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvtier.base import get_offload_block_hash, get_offload_group_idx
from kvtier.errors import ConfigError
from kvtier.integrations.sglang.settings import (
    HOST_TIER_NAME,
    PoolFacts,
    ShardFacts,
    check_pool_name,
    layout_fingerprint,
    page_key,
    pool_tiers,
    resolve_settings,
)
from kvtier.tiers.disk.format import on_disk_block_bytes

FACTORY = {
    "backend_name": "kvtier",
    "module_path": "kvtier.integrations.sglang",
    "class_name": "KvtierHiCacheStorage",
}
LMDB = {"name": "nvme", "kind": "lmdb", "path": "/srv/kvtier/sglang", "capacity": "2GiB"}


def storage_config(**changes):
    """The fields of SGLang's HiCacheStorageConfig this integration reads."""
    fields = dict(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        model_name="org/model-7b",
        should_split_heads=False,
        dcp_size=1,
        extra_config={},
    )
    fields.update(changes)
    return SimpleNamespace(**fields)


# -- the extra config ------------------------------------------------------------------------


def test_inline_lower_tiers_get_a_host_tier_in_front():
    settings = resolve_settings({**FACTORY, "interface_v1": 1, "tiers": [LMDB]})
    assert settings.config.tiers[0].name == HOST_TIER_NAME and settings.config.tiers[0].kind == "cpu"
    assert [(t.name, t.kind, t.capacity_bytes) for t in settings.lower_tiers] == [("nvme", "lmdb", 2 << 30)]
    assert settings.interface_v1 and settings.staging_pages == 16


def test_a_vllm_yaml_is_taken_as_it_is(tmp_path):
    path = tmp_path / "tiers.yaml"
    path.write_text(
        "tiers:\n"
        "  - {name: cpu, kind: cpu, capacity: 8GiB}\n"
        "  - {name: nvme, kind: files, path: /srv/kvtier/f, capacity: 1TiB, admit: reuse}\n"
    )
    settings = resolve_settings({**FACTORY, "config": str(path), "kvtier_staging_pages": 4})
    assert [t.name for t in settings.config.tiers] == ["cpu", "nvme"]
    assert settings.lower_tiers[0].admission()[:2] == ("reuse", 2)
    assert settings.staging_pages == 4 and not settings.interface_v1


def test_a_yaml_of_lower_tiers_only(tmp_path):
    path = tmp_path / "tiers.yaml"
    path.write_text("tiers:\n  - {name: nvme, kind: lmdb, path: /srv/kvtier/l, capacity: 1GiB}\n")
    assert [t.name for t in resolve_settings({"kvtier_config": str(path)}).lower_tiers] == ["nvme"]


@pytest.mark.parametrize(
    "extra, field",
    [
        ({**FACTORY}, "hicache-storage-backend-extra-config"),
        ({"config": "a.yaml", "tiers": [LMDB]}, "hicache-storage-backend-extra-config"),
        ({"config": "a.yaml", "kvtier_config": "b.yaml"}, "kvtier_config"),
        ({"config": 3}, "config"),
        ({"tiers": [LMDB], "block_size_tokens": 64}, "block_size_tokens"),
        ({"tiers": [{"name": "cpu", "kind": "cpu", "capacity": "1GiB"}]}, "tiers"),
        ({"tiers": [{**LMDB, "capacty": "1GiB"}]}, "capacty"),
        ({"tiers": [LMDB], "kvtier_staging_pages": 0}, "kvtier_staging_pages"),
    ],
)
def test_bad_extra_config_names_the_setting(extra, field):
    with pytest.raises(ConfigError) as error:
        resolve_settings(extra)
    assert field in str(error.value)


def test_errors_name_the_users_own_tier_index():
    with pytest.raises(ConfigError) as error:
        resolve_settings({"tiers": [LMDB, {**LMDB, "name": "b", "capacity": "lots"}]})
    assert error.value.field.startswith("tiers[1]")
    assert resolve_settings({"tiers": [LMDB]}).tier_field(1) == "tiers[0]"


def test_an_extra_config_that_is_not_a_mapping_is_refused():
    with pytest.raises(ConfigError, match="JSON object"):
        resolve_settings(["tiers"])  # type: ignore[arg-type]


def test_a_missing_yaml_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="missing.yaml"):
        resolve_settings({"config": str(tmp_path / "missing.yaml")})


# -- shards, keys and the fingerprint ----------------------------------------------------------


def test_each_tensor_rank_has_its_own_shard_and_mla_ranks_share_one():
    mha = [ShardFacts.from_storage_config(storage_config(tp_rank=r, tp_size=4)) for r in range(4)]
    assert [s.shard for s in mha] == [0, 1, 2, 3] and all(s.writer for s in mha)
    mla = [
        ShardFacts.from_storage_config(storage_config(tp_rank=r, tp_size=4, is_mla_model=True))
        for r in range(4)
    ]
    assert {s.shard for s in mla} == {0}
    assert [s.writer for s in mla] == [True, False, False, False]
    # pipeline stages hold different layers: a shard each, MLA or not
    stage = ShardFacts.from_storage_config(storage_config(pp_rank=1, pp_size=2, is_mla_model=True))
    assert stage.shard == 1
    # SGLang's own answer wins where it gives one
    assert not ShardFacts.from_storage_config(
        storage_config(is_mla_model=True, is_storage_writer=False)
    ).writer


@pytest.mark.parametrize(
    "changes, field",
    [({"should_split_heads": True, "tp_lcm_size": 8}, "tp_lcm_size"), ({"dcp_size": 2}, "dcp_size")],
)
def test_layouts_kvtier_does_not_store_are_refused(changes, field):
    with pytest.raises(ConfigError, match=field):
        ShardFacts.from_storage_config(storage_config(**changes))


def test_page_keys_keep_sglangs_hash_and_tell_shards_and_parts_apart():
    name = hashlib.sha256(b"page").hexdigest()
    key = page_key(name, shard=3, part=1)
    assert get_offload_block_hash(key) == bytes.fromhex(name)
    assert len({page_key(name, s, p) for s in range(4) for p in range(2)}) == 8
    assert get_offload_group_idx(page_key(name, 2, 0)) != get_offload_group_idx(page_key(name, 0, 2))
    # a key that is not SGLang's hex digest (a custom hash, a sidecar's name) is hashed
    other = page_key(name + ".mamba", 0, 0)
    assert get_offload_block_hash(other) == hashlib.sha256(b"sglang:" + (name + ".mamba").encode()).digest()
    with pytest.raises(ValueError):
        page_key(name, 0, 4)
    with pytest.raises(TypeError):
        page_key(b"bytes", 0, 0)  # type: ignore[arg-type]


_FLAT_PAGE_METHODS = ("get_data_page", "get_dummy_flat_data_page", "set_from_flat_data_page")


def _pool(**changes) -> PoolFacts:
    fields = dict(
        dtype="torch.bfloat16",
        page_size=64,
        layout="page_first",
        layer_num=32,
        head_num=8,
        head_dim=128,
        v_head_dim=128,
    )
    fields.update(changes)
    methods = {name: lambda *args, **kwargs: None for name in _FLAT_PAGE_METHODS}
    pool = type("MHATokenToKVPoolHost", (), methods)()
    pool.__dict__.update(fields)
    return PoolFacts.from_host_pool(pool)


def _digest(pool: PoolFacts, **shard) -> bytes:
    facts = ShardFacts.from_storage_config(storage_config(**shard))
    return layout_fingerprint(pool, facts, block_bytes=4 << 20, parts=2, staged=False).digest()


def test_the_fingerprint_is_one_per_engine_and_names_what_the_bytes_mean():
    pool = _pool()
    assert pool.geometry == (("layer_num", 32), ("head_num", 8), ("head_dim", 128), ("v_head_dim", 128))
    # every rank of one engine writes under one fingerprint (one store, one capacity)
    assert _digest(pool, tp_rank=0, tp_size=2) == _digest(pool, tp_rank=1, tp_size=2)
    base = _digest(pool, tp_size=2)
    assert _digest(pool, tp_size=4) != base
    assert _digest(pool, tp_size=2, model_name="org/other") != base
    for changes in (
        {"dtype": "torch.float16"},
        {"layout": "page_first_direct"},
        {"page_size": 32},
        {"head_num": 4},
    ):
        assert _digest(_pool(**changes), tp_size=2) != base, changes
    # MLA: every tensor rank holds the same bytes, so TP=2 and TP=4 engines share blocks
    assert _digest(pool, is_mla_model=True, tp_size=2) == _digest(pool, is_mla_model=True, tp_size=4)
    facts = ShardFacts.from_storage_config(storage_config())
    staged = layout_fingerprint(pool, facts, block_bytes=4 << 20, parts=1, staged=True)
    assert (
        staged.digest()
        != layout_fingerprint(pool, facts, block_bytes=4 << 20, parts=1, staged=False).digest()
    )
    assert staged.tokens_per_block == 64 and staged.block_bytes == 4 << 20


def test_an_extra_pool_is_named_in_its_fingerprint():
    facts = ShardFacts.from_storage_config(storage_config())
    kv = layout_fingerprint(_pool(), facts, block_bytes=4 << 20, parts=2, staged=False)
    draft = layout_fingerprint(_pool(), facts, block_bytes=4 << 20, parts=2, staged=False, pool_name="draft")
    assert "pool=" not in kv.model and kv.model + ";pool=draft" == draft.model
    assert kv.digest() != draft.digest()  # never one store for both, even with one geometry


def test_an_mha_pool_beside_an_mla_model_is_split_per_rank():
    rank = ShardFacts.from_storage_config(storage_config(is_mla_model=True, tp_rank=1, tp_size=2))
    assert (rank.shard, rank.replicated, rank.writer) == (0, True, False)
    mla = _pool(layer_num=1, kv_lora_rank=512, qk_rope_head_dim=64)
    assert mla.latent and rank.for_pool(mla) is rank  # an MLA draft: one copy, rank 0's
    mha = rank.for_pool(_pool(layer_num=1))  # an MHA draft: each rank's own heads
    assert (mha.shard, mha.replicated, mha.writer) == (1, False, True)


def test_a_host_pool_without_sglangs_geometry_is_refused_by_name():
    bare = SimpleNamespace(page_size=64, layout="page_first")
    with pytest.raises(ConfigError) as error:
        PoolFacts.from_host_pool(bare, "draft")
    assert error.value.field == "hicache host pool 'draft'" and error.value.value == "SimpleNamespace"
    assert "lacks dtype, get_data_page, get_dummy_flat_data_page, set_from_flat_data_page" in str(error.value)


# -- SGLang's other pools ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mamba", "swa", "auxiliary_swa", "indexer", "draft_swa", "deepseek_v4_c4"])
def test_pools_kvtier_does_not_store_are_refused(name):
    check_pool_name("kv")
    check_pool_name("draft")
    with pytest.raises(
        ConfigError, match=f"got '{name}'; expected a pool kvtier stores: kv, draft.*file backend"
    ):
        check_pool_name(name)


def test_an_extra_pool_gets_stores_of_its_own_beside_the_kv_pools():
    tiers = [
        LMDB,
        {"name": "blobs", "kind": "files", "path": "/srv/kvtier/f", "capacity": "1GiB"},
        {"name": "shared", "kind": "valkey", "url": "valkey://cache:6379", "namespace": "llama"},
        {"name": "fleet", "kind": "valkey", "url": "valkey://cache:6379"},
    ]
    settings = resolve_settings({**FACTORY, "tiers": tiers})
    kv_page, draft_page = (512 << 10, 2), (96 << 10, 2)  # (block bytes, blocks per page)
    assert pool_tiers(settings, {"kv": kv_page}) == {"kv": settings.lower_tiers}  # alone: as configured
    stores = pool_tiers(settings, {"kv": kv_page, "draft": draft_page})
    kv, draft = stores["kv"], stores["draft"]
    assert [t.name for t in kv] == ["nvme", "blobs", "shared", "fleet"]
    assert [t.name for t in draft] == ["nvme-draft", "blobs-draft", "shared-draft", "fleet-draft"]
    assert [t.kind for t in draft] == ["lmdb", "files", "valkey", "valkey"]
    assert [t.path for t in kv[:2]] == [t.path for t in settings.lower_tiers[:2]]
    assert (draft[0].path, draft[1].path) == ("/srv/kvtier/sglang/draft", "/srv/kvtier/f/draft")
    # an explicit namespace gets the pool's name; one derived from the layout differs already
    assert (draft[2].namespace, draft[3].namespace) == ("llama:draft", None)
    # a disk tier's capacity is split: together the two stores hold at most it, and each as
    # many pages as the other (a Valkey server bounds its own memory)
    kv_disk, draft_disk = (2 * on_disk_block_bytes(b) for b, _ in (kv_page, draft_page))
    for configured, kv_tier, tier in zip(settings.lower_tiers[:2], kv, draft):
        assert kv_tier.capacity_bytes + tier.capacity_bytes <= configured.capacity_bytes
        assert abs(tier.capacity_bytes // draft_disk - kv_tier.capacity_bytes // kv_disk) <= 1
        assert configured.capacity_bytes // (kv_disk + draft_disk) <= kv_tier.capacity_bytes // kv_disk
    assert draft[2].capacity_bytes == draft[3].capacity_bytes == kv[2].capacity_bytes == 0
    assert [t.name for t in settings.lower_tiers] == ["nvme", "blobs", "shared", "fleet"]  # unchanged


def test_a_tier_kind_that_cannot_keep_a_second_store_is_refused_for_an_extra_pool():
    memory = {
        "name": "mem",
        "kind": "kvtier_testing.conformance.harness_memory:MemoryTierConfig",
        "capacity": "1GiB",
    }
    settings = resolve_settings({**FACTORY, "tiers": [LMDB, memory]})
    with pytest.raises(ConfigError, match=r"tiers\[1\].kind: got .*a path or a namespace"):
        pool_tiers(settings, {"kv": (4096, 2), "draft": (4096, 2)})


# -- importing -------------------------------------------------------------------------------

_PROBE = """
import sys
import kvtier, kvtier.integrations.sglang, kvtier.integrations.sglang.settings, kvtier.integrations.sglang.pages
print(sorted(m for m in sys.modules if m == "sglang" or m.startswith("sglang.")))
"""


def test_the_integration_imports_without_importing_sglang():
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed here")
def test_the_backend_class_without_sglang_is_a_clear_error():
    import kvtier.integrations.sglang as integration

    with pytest.raises(ImportError, match="sglang==0.5.23"):
        integration.KvtierHiCacheStorage  # noqa: B018 - the attribute access is what imports


def test_the_example_settings_resolve():
    root = Path(__file__).resolve().parents[2]
    extra = json.loads((root / "examples/sglang/extra-config.json").read_text())
    assert (
        extra["module_path"] == "kvtier.integrations.sglang" and extra["class_name"] == "KvtierHiCacheStorage"
    )
    extra["config"] = str(root / extra["config"])  # the README runs it from the repository root
    settings = resolve_settings(extra)
    assert settings.interface_v1
    assert [(t.name, t.kind, t.admission()[0]) for t in settings.lower_tiers] == [("nvme", "lmdb", "reuse")]
