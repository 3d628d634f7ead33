"""The suite follows the registry: a registered kind without a harness fails, loudly."""

from __future__ import annotations

import sys

import pytest
from kvtier_testing.conformance import tier_harness

from kvtier.config import TIER_KINDS


def test_every_registered_lower_kind_has_a_harness():
    kinds = tier_harness.lower_kinds()
    assert {"lmdb", "files", "valkey", "redis"} <= set(kinds) and "cpu" not in kinds
    missing = [kind for kind in kinds if not tier_harness.harnesses_for(kind)]
    assert not missing, f"register a conformance harness for kind(s) {missing} (see tier_harness.py)"


def test_a_kind_registered_without_a_harness_fails_every_scenario(request, tmp_path, monkeypatch):
    monkeypatch.setattr(
        TIER_KINDS, "_entries", {**TIER_KINDS._entries, "newkind": "kvtier.tiers.disk.config:DiskTierConfig"}
    )
    found = dict(tier_harness.cases())
    assert found["newkind-no-harness"] == "newkind"
    harness = tier_harness.MissingHarness(request, tmp_path, "newkind")
    with pytest.raises(pytest.fail.Exception, match="register a conformance harness for kind 'newkind'"):
        harness.place("round trip")


def test_a_kind_from_outside_brings_its_harness_by_environment(tmp_path, monkeypatch):
    (tmp_path / "my_kind_harness.py").write_text(
        "from kvtier_testing.conformance.tier_harness import Harness, register\n"
        "@register\n"
        "class MyHarness(Harness):\n"
        "    kind = 'my_pkg.tiers:MyTierConfig'\n"
        "    label = 'my-kind'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(tier_harness.ENV_MODULES, "my_kind_harness")
    monkeypatch.setattr(tier_harness, "_HARNESSES", {k: list(v) for k, v in tier_harness._HARNESSES.items()})
    try:
        labels = [label for label, _ in tier_harness.cases()]
    finally:
        sys.modules.pop("my_kind_harness", None)
    assert "my-kind" in labels and "remote_tier" in labels and "memory" in labels


def test_a_harness_that_neither_implements_nor_declines_a_fault_fails(request, tmp_path):
    class Silent(tier_harness.Harness):
        kind, label = "x:Y", "silent"

    with pytest.raises(pytest.fail.Exception, match="neither implements corrupt"):
        Silent(request, tmp_path).corrupt(None, [])
