"""A shared tier's outage as the metrics show it: a real server, killed under a running stack."""

from __future__ import annotations

import time
import urllib.request

from kvtier_testing import key, store_blocks
from kvtier_testing.running import free_port
from kvtier_testing.valkey_tier import BLOCK_BYTES, SETTLE_S

import kvtier
from kvtier import ReqContext
from kvtier.metrics.view import parse_text, read_series, summarize


def scrape(port: int) -> dict:
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(name, tuple(sorted(labels.items()))): value for name, labels, value in parse_text(page)}


def test_an_outage_shows_as_down_counted_and_timed(valkey_server):
    port = free_port()
    config = {
        "tiers": [
            {"name": "cpu", "kind": "cpu", "capacity": 16 * (BLOCK_BYTES + 4096), "pin_memory": "off"},
            {"name": "shared", "kind": "valkey", "url": valkey_server.url, "timeout_s": 0.5},
        ],
        "cascade": {"write_policy": "write_through"},
        "metrics": {"port": port},
    }
    manager = kvtier.build_manager(config, block_bytes=BLOCK_BYTES)
    ctx = ReqContext("r")
    try:
        store_blocks(manager, [key(i) for i in range(4)], ctx)
        manager.on_schedule_end()
        shared = (("tier", "shared"),)
        before = scrape(port)
        assert before[("kvtier_tier_down", shared)] == 0
        assert before[("kvtier_outages_total", shared)] == 0
        failures = "kvtier_tier_failures_blocks_total"
        reasons = {
            dict(labels)["reason"]: value for (name, labels), value in before.items() if name == failures
        }
        assert set(reasons) >= {"unavailable_timeout", "unavailable_refused", "unavailable_connection"}
        assert set(reasons.values()) == {0}  # every series exists before the first failure
        valkey_server.kill()
        store_blocks(manager, [key(10 + i) for i in range(4)], ctx)
        deadline = time.monotonic() + SETTLE_S
        while (
            manager.has_pending_work() or not manager.stats()["shared.down"]
        ) and time.monotonic() < deadline:
            manager.on_schedule_end()
            time.sleep(0.005)
        during = scrape(port)
        figures = manager.stats()
        assert during[("kvtier_tier_down", shared)] == figures["shared.down"] == 1
        assert during[("kvtier_outages_total", shared)] == figures["shared.outages"] == 1
        assert during[("kvtier_outage_seconds_total", shared)] > 0
        store_failed = during[("kvtier_failed_blocks_total", (("direction", "store"), *shared))]
        assert store_failed == figures["shared.demote_failures"] >= 4
        grown = {
            dict(labels)["reason"]: value
            for (name, labels), value in during.items()
            if name == failures and value > reasons.get(dict(labels)["reason"], -1)
        }
        assert grown and set(grown) <= set(reasons), grown  # the outage counts under a series scraped at 0
        # what kvtier stats reads from the same endpoint
        tier = summarize(read_series(f"http://127.0.0.1:{port}/metrics"))["tiers"]["shared"]
        assert tier["down"] == 1 and tier["outages"] == 1
    finally:
        manager.shutdown()
