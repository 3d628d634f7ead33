"""The routers: round-robin, least loaded, and prefix-aware within a load bound."""

import pytest

from kvtier.errors import ConfigError
from kvtier.routing import ROUTERS, BlockEvent, EngineLoad, LeastLoadedRouter, PrefixRouter, RoundRobinRouter


def test_the_registry_names_every_router_and_refuses_others():
    assert ROUTERS.names() == ("round_robin", "least_loaded", "prefix")
    assert ROUTERS.resolve("prefix", field="--router") is PrefixRouter
    with pytest.raises(ConfigError, match="round_robin, least_loaded, prefix"):
        ROUTERS.resolve("random", field="--router")


def test_round_robin_deals_in_turn_whatever_the_prefix():
    router = RoundRobinRouter(3)
    assert [router.route([1, 2], now_s=0.0) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert router.sent == [3, 2, 2]


def test_load_counts_the_requests_of_the_last_window():
    load = EngineLoad(2, window_s=10.0)
    for now in (0.0, 1.0, 2.0):
        load.add(0, now)
    load.add(1, 5.0)
    assert load.counts(5.0) == [3, 1]
    assert load.counts(11.5) == [1, 1]  # the requests at 0 and 1 s left the window
    assert load.counts(20.0) == [0, 0]
    with pytest.raises(ValueError, match="window_s"):
        EngineLoad(2, window_s=0)


def test_least_loaded_picks_the_idlest_and_rotates_among_equals():
    router = LeastLoadedRouter(3, window_s=10.0)
    assert [router.route([], now_s=0.0) for _ in range(3)] == [0, 1, 2]  # ties rotate
    assert router.route([], now_s=11.0) == 0  # all idle again: the next in turn
    router.route([], now_s=11.0)  # engine 1
    assert router.route([], now_s=11.0) == 2


def fed(router, engine, *hashes):
    router.feed(engine, [BlockEvent("stored", "GPU", list(hashes))])


def test_prefix_sends_a_request_where_its_prefix_is():
    router = PrefixRouter(4)
    fed(router, 2, 10, 11, 12)
    fed(router, 1, 10, 11)
    assert router.route([10, 11, 12, 13], now_s=0.0) == 2
    assert router.route([10, 11, 99], now_s=0.0) == 1  # 2 is now busier, and 1 holds as much
    assert router.route([50, 51], now_s=0.0) in (0, 3)  # nothing held: the idle ones


def test_prefix_takes_kvtier_and_vllm_events_alike():
    from kvtier.base import OffloadingEvent, make_offload_key

    router = PrefixRouter(2)
    h = bytes(32)
    router.feed(1, [OffloadingEvent([make_offload_key(h, 0)], 4096, "CPU", False)])
    assert router.index is not None and router.index.score([h]) == [0.0, 0.8]
    router.feed(1, [{"type": "BlockRemoved", "block_hashes": [h], "medium": "CPU"}])
    assert router.index.score([h]) == [0.0, 0.0]


def test_a_hot_prefix_spreads_once_its_engine_is_balance_times_the_mean():
    engines, balance = 4, 1.2
    router = PrefixRouter(engines, balance=balance, window_s=1000.0)
    fed(router, 0, 1, 2, 3)  # only engine 0 holds the prefix every request shares
    chosen = [router.route([1, 2, 3], now_s=float(t)) for t in range(200)]
    mean = len(chosen) / engines
    assert max(router.sent) <= balance * mean + 1  # the bound holds at every step
    assert router.sent[0] == max(router.sent) > mean  # yet the holder got the most
    assert chosen[0] == 0


def test_balance_below_one_is_refused():
    with pytest.raises(ValueError, match="balance"):
        PrefixRouter(2, balance=0.9)
