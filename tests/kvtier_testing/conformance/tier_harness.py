"""What the conformance suite needs from each lower-tier kind: its section, and its faults.

A :class:`Harness` says how to configure one kind (the section below the CPU tier, with the
path or URL a test may use) and how to damage or disturb that kind's medium behind the tier's
back. The scenarios (``test_conformance.py``, ``test_conformance_replay.py``) are written once
against this interface and run for every harness.

Which harnesses run is decided by the registry: every kind in :data:`kvtier.config.TIER_KINDS`
that builds a tier below the CPU tier needs at least one harness registered for it
(:func:`register`, keyed by ``Harness.kind``); a registered kind without one fails every
scenario with "register a conformance harness for kind X". Kinds outside the registry (the
in-memory test double, a kind named by class path) run when a harness names them.

A harness module is imported from :data:`HARNESS_MODULES`, plus the modules named in the
environment variable ``KVTIER_CONFORMANCE_HARNESSES`` (comma-separated, importable module
names): that is how a kind written outside kvtier brings its own harness to the suite.

A fault method either does what it says or calls :meth:`Harness.cannot` with the reason the
kind cannot express it, which skips the scenario naming the kind: never a silent pass.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from pathlib import Path
from typing import ClassVar

import pytest

from kvtier.base import OffloadKey
from kvtier.config import TIER_KINDS
from kvtier.tiers.base import SecondaryTier

__all__ = ["BLOCK", "HARNESS_MODULES", "Harness", "MissingHarness", "cases", "register"]

#: payload bytes of one block in the scenarios: not a multiple of 4096, so disk tiers move
#: padded rows (the case that needs care)
BLOCK = 12_000

#: the harness modules of the kinds kvtier ships, and of the out-of-tree example
HARNESS_MODULES = (
    "kvtier_testing.conformance.harness_disk",
    "kvtier_testing.conformance.harness_valkey",
    "kvtier_testing.conformance.harness_memory",
    "remote_tier_harness",
)
#: comma-separated module names of more harnesses (a kind from outside kvtier)
ENV_MODULES = "KVTIER_CONFORMANCE_HARNESSES"

_HARNESSES: dict[str, list[type[Harness]]] = {}


def register(cls: type[Harness]) -> type[Harness]:
    """Class decorator: ``cls`` is a harness for the kind ``cls.kind``."""
    found = _HARNESSES.setdefault(cls.kind, [])
    if all(existing.label != cls.label for existing in found):
        found.append(cls)
    return cls


class Harness:
    """One kind (and variant: a valkey server or a cluster) as the scenarios drive it.

    An instance lives for one test: ``request`` gives it fixtures (a server), ``tmp_path``
    a private directory; :attr:`exits` unwinds what it set up (mounts, servers), after the
    test has shut its stack down.
    """

    #: the ``kind:`` of the section: a name in TIER_KINDS, or a class path
    kind: ClassVar[str] = ""
    #: the test id (a kind may have several variants)
    label: ClassVar[str] = ""
    #: the tier's own stats names (``<tier>.<name>`` in the manager's stats) for: blocks
    #: stored, blocks loaded, loads that found no block, blocks that failed verification,
    #: keys of failed jobs, keys refused for lack of room, outages, and the bytes its medium
    #: was given for the blocks stored (with a codec, the encoded ones); None where the kind
    #: does not count it
    counters: ClassVar[dict[str, str | None]] = {
        "stored": "stored",
        "loaded": "loaded",
        "missing": "missing",
        "corrupt": "corrupt",
        "failed": "failed_keys",
        "full": "failed_ENOSPC",
        "down": None,
        "stored_bytes": None,
    }

    #: the per-check counter a damaged block adds to, per damage scenario (``corrupt_<check>``
    #: of a :class:`~kvtier.tiers.base.Failure`); a scenario left out is not checked
    checks: ClassVar[dict[str, str]] = {
        "corrupt": "corrupt_checksum",
        "short": "corrupt_truncated",
        "other layout": "corrupt_other_layout",
    }

    def __init__(self, request: pytest.FixtureRequest, tmp_path: Path):
        self.request = request
        self.tmp_path = tmp_path
        self.exits = contextlib.ExitStack()
        self.scenario = ""

    # -- configuration ---------------------------------------------------------------------------

    def place(self, scenario: str) -> None:
        """Called once before the first stack of ``scenario`` is built (mount a small
        filesystem for ``full`` ...); a kind that cannot express ``scenario`` calls
        :meth:`cannot` here. The default only records the scenario."""
        self.scenario = scenario

    def section(self, blocks: int, block_bytes: int) -> dict:
        """The tier's section (``name`` is added by the caller), holding at least ``blocks``."""
        raise NotImplementedError

    # -- damage behind the tier's back -------------------------------------------------------------

    def victim(self, tier: SecondaryTier, keys: list[OffloadKey]) -> OffloadKey:
        """The key a single-block damage hits (a disk slab can only be cut at its end)."""
        return keys[len(keys) // 2]

    def remove(self, tier: SecondaryTier, keys: list[OffloadKey]) -> None:
        """Remove the stored blocks of ``keys`` from the medium, as another process would."""
        self._undecided("remove")

    def corrupt(self, tier: SecondaryTier, keys: list[OffloadKey]) -> None:
        """Alter one payload byte of each stored block of ``keys``."""
        self._undecided("corrupt")

    def truncate(self, tier: SecondaryTier, keys: list[OffloadKey]) -> None:
        """Cut each stored block of ``keys`` short (its header survives)."""
        self._undecided("truncate")

    def relayout(self, tier: SecondaryTier, keys: list[OffloadKey]) -> None:
        """Replace each block of ``keys`` by a complete, self-consistent block of the same key
        and bytes written under another layout (another model)."""
        self._undecided("relayout")

    def listed(self, tier: SecondaryTier) -> list[OffloadKey]:
        """Every key the medium holds now (for damage between two replays)."""
        self._undecided("listed")

    # -- the medium disturbed ------------------------------------------------------------------------

    def go_down(self, tier: SecondaryTier) -> None:
        """The medium fails every operation from now on (a dead server, a failed device)."""
        self._undecided("go_down")

    def come_back(self, tier: SecondaryTier) -> bool:
        """Undo :meth:`go_down`; whether the same tier can go on (True), or only a restart
        would recover (False: the scenario stops there)."""
        self._undecided("come_back")

    def hang(self, tier: SecondaryTier) -> None:
        """The medium stops answering, longer than the tier's timeout."""
        self._undecided("hang")

    def unhang(self, tier: SecondaryTier) -> None:
        self._undecided("unhang")

    def fill(self, tier: SecondaryTier) -> None:
        """The medium has no room left for new blocks (ENOSPC, a server out of memory)."""
        self._undecided("fill")

    def unfill(self, tier: SecondaryTier) -> None:
        self._undecided("unfill")

    def hold_reads(self, tier: SecondaryTier) -> None:
        """Reads from the medium wait (slower than many steps) until :meth:`release_reads`."""
        self._undecided("hold_reads")

    def release_reads(self, tier: SecondaryTier) -> None:
        self._undecided("release_reads")

    def recovered(self, tier: SecondaryTier) -> bool:
        """Whether the tier serves again after :meth:`come_back`/:meth:`unhang` (the caller
        steps the manager while this is False)."""
        return True

    #: whether a tier opened again on the same section finds the blocks an earlier one stored
    persistent: ClassVar[bool] = True
    #: what a read of a stored block does once the medium is down: "fail" (the read is sent
    #: and fails: a promotion failure) or "miss" (the tier knows it is down: a lookup miss)
    reads_when_down: ClassVar[str] = "fail"

    # -- helpers ---------------------------------------------------------------------------------

    def cannot(self, what: str, why: str) -> None:
        """Skip: this kind cannot express ``what``, because ``why``."""
        pytest.skip(f"{self.label} cannot express {what}: {why}")

    def _undecided(self, method: str) -> None:
        pytest.fail(
            f"conformance harness {type(self).__name__} ({self.label}) neither implements "
            f"{method}() nor says why its kind cannot (call self.cannot(what, why))"
        )

    def close(self) -> None:
        self.exits.close()


class MissingHarness(Harness):
    """Stands in for a registered kind nobody wrote a harness for: every scenario fails."""

    def __init__(self, request, tmp_path, kind: str = ""):
        super().__init__(request, tmp_path)
        self.missing_kind = kind

    def place(self, scenario: str) -> None:
        pytest.fail(
            f"register a conformance harness for kind {self.missing_kind!r}: a Harness subclass "
            f"with kind = {self.missing_kind!r}, decorated with tier_harness.register, in a "
            f"module of tier_harness.HARNESS_MODULES or of ${ENV_MODULES}"
        )


def load_modules() -> None:
    """Import every harness module (each registers its harnesses)."""
    extra = [name.strip() for name in os.environ.get(ENV_MODULES, "").split(",") if name.strip()]
    for name in (*HARNESS_MODULES, *extra):
        importlib.import_module(name)


def lower_kinds() -> list[str]:
    """The registered kinds that build a tier below the CPU tier."""
    names = []
    for name in TIER_KINDS.names():
        section = TIER_KINDS.resolve(name, field="tiers[1].kind")
        if section.role == "lower":
            names.append(name)
    return names


def cases() -> list[tuple[str, type[Harness] | str]]:
    """``(test id, harness class)`` for every registered lower kind (``(id, kind)`` where it
    has none, so the scenarios fail naming it), then for the harnesses of unregistered kinds."""
    load_modules()
    found: list[tuple[str, type[Harness] | str]] = []
    registered = lower_kinds()
    for name in registered:
        harnesses = _HARNESSES.get(name)
        if not harnesses:
            found.append((f"{name}-no-harness", name))
        for cls in harnesses or ():
            found.append((cls.label, cls))
    for kind, harnesses in _HARNESSES.items():
        if kind not in registered:
            found.extend((cls.label, cls) for cls in harnesses)
    return found


def harnesses_for(kind: str) -> list[type[Harness]]:
    load_modules()
    return list(_HARNESSES.get(kind, ()))
