import sys
import textwrap

import pytest

from kvtier.errors import ConfigError
from kvtier.policies import EvictionPolicy, get_policy_class, registered_policies
from kvtier.policies.arc import ARCPolicy
from kvtier.policies.lru import LRUPolicy


def test_builtin_names():
    assert registered_policies() == ("lru", "arc")
    assert get_policy_class("lru") is LRUPolicy
    assert get_policy_class("arc") is ARCPolicy


def test_unknown_name_lists_the_choices():
    with pytest.raises(ConfigError) as err:
        get_policy_class("mru", field="tiers[0].eviction")
    assert "tiers[0].eviction" in str(err.value) and "lru, arc" in str(err.value)


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
