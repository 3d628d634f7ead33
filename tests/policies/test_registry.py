import sys
import textwrap

import pytest

from kvtier.errors import ConfigError
from kvtier.policies import EvictionPolicy, get_policy_class, registered_policies
from kvtier.policies.arc import ARCPolicy
from kvtier.policies.lru import LRUPolicy


def test_builtin_names():
    assert registered_policies() == ("lru", "arc", "s3fifo", "sieve", "chain")
    assert get_policy_class("lru") is LRUPolicy
    assert get_policy_class("arc") is ARCPolicy


def test_unknown_name_lists_the_choices():
    with pytest.raises(ConfigError) as err:
        get_policy_class("mru", field="tiers[0].eviction")
    assert "tiers[0].eviction" in str(err.value) and "lru, arc, s3fifo, sieve, chain" in str(err.value)


def test_out_of_tree_policy_by_module_path(tmp_path, monkeypatch):
    (tmp_path / "my_policies.py").write_text(
        textwrap.dedent(
            """
            from kvtier.policies.lru import LRUPolicy

            class FIFOPolicy(LRUPolicy):
                def touch(self, keys):
                    return None  # first in, first out: use does not reorder

            NotAPolicy = int
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cls = get_policy_class("FIFOPolicy", "my_policies")
    assert issubclass(cls, EvictionPolicy) and cls.__name__ == "FIFOPolicy"
    with pytest.raises(ConfigError, match="EvictionPolicy subclass"):
        get_policy_class("NotAPolicy", "my_policies")
    with pytest.raises(ConfigError, match="importable module"):
        get_policy_class("X", "no_such_module_kvtier")
    sys.modules.pop("my_policies", None)


def test_a_policy_without_native_holds_still_never_evicts_a_held_key():
    from collections import OrderedDict

    from kvtier_testing import key

    class PlainFIFO(EvictionPolicy):  # knows nothing of holds: the base class keeps them
        def __init__(self, capacity_blocks):
            super().__init__(capacity_blocks)
            self._blocks = OrderedDict()

        def get(self, k):
            return self._blocks.get(k)

        def insert(self, keys, block_ids):
            self._blocks.update(zip(keys, block_ids))

        def remove(self, k):
            return self._blocks.pop(k, None)

        def touch(self, keys):
            """FIFO order ignores uses."""

        def evict(self, count, skip):
            victims = [k for k in self._blocks if k not in skip][:count]
            if len(victims) < count:
                return None
            return [(k, self._blocks.pop(k)) for k in victims]

        def __len__(self):
            return len(self._blocks)

        def __iter__(self):
            return iter(self._blocks)

    policy = PlainFIFO(3)
    policy.insert([key(0), key(1), key(2)], [0, 1, 2])
    policy.hold(key(0))
    assert policy.evictable_blocks() == 2
    assert policy.evict_unheld(1, [key(1)]) == [(key(2), 2)]
    assert policy.evict_unheld(1) == [(key(1), 1)]
    assert policy.evict_unheld(1) is None
    policy.release(key(0))
    assert policy.evict_unheld(1) == [(key(0), 0)]


def test_config_accepts_exactly_the_registered_names():
    from kvtier.config import load_config

    assert set(registered_policies()) == {"lru", "arc", "s3fifo", "sieve", "chain"}
    for name in registered_policies():
        config = load_config({"tiers": [{"kind": "cpu", "capacity": "1MiB", "eviction": name}]})
        assert config.tiers[0].eviction == name
