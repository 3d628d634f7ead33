"""The replay engine's KV events, fed to an index, say what its GPU cache and CPU tier hold."""

import random

from kvtier.base import ReqContext, get_offload_block_hash
from kvtier.replay.engine import ReplayEngine, block_key
from kvtier.replay.trace import Request
from kvtier.routing import PrefixRouter
from kvtier.spec import TieredOffloadingSpec

BLOCK = 4096


def test_an_index_fed_by_a_replay_engine_holds_what_the_engine_holds(tmp_path):
    spec = TieredOffloadingSpec(
        {
            "block_size_tokens": 512,
            "tiers": [
                {"kind": "cpu", "capacity": 10 * BLOCK, "path": str(tmp_path / "cpu"), "pin_memory": "off"}
            ],
        },
        gpu_block_size_tokens=512,
        page_bytes=[BLOCK],
    )
    engine = ReplayEngine(spec, gpu_blocks=6, deterministic=True)  # each step's stores complete in it
    engine.kv_events = []
    router = PrefixRouter(1)
    index = router.index
    rng = random.Random(7)
    prefixes = [[rng.randrange(1000) for _ in range(3)] for _ in range(4)]
    requests = [
        Request(t, 2048, 1, tuple(rng.choice(prefixes)[: rng.randint(1, 3)] + [rng.randrange(1000)]))
        for t in range(60)
    ]
    seen = {h: get_offload_block_hash(block_key(h)) for request in requests for h in request.hash_ids}
    ctx = ReqContext("probe")
    checked = 0

    def compare(_):
        nonlocal checked
        router.feed(0, engine.take_kv_events())
        cached = {get_offload_block_hash(key) for key in engine._gpu_cache}
        on_cpu = {seen[h] for h in seen if engine.manager.lookup(block_key(h), ctx)}
        assert {block for block in seen.values() if "GPU" in index.holders(block).get(0, ())} == cached
        assert {block for block in seen.values() if "CPU" in index.holders(block).get(0, ())} == on_cpu
        checked += 1

    try:
        engine.run(requests, progress=compare)
    finally:
        engine.close()
    assert checked == len(requests) and engine.counts.hits["gpu"] > 0 and engine.counts.hits["cpu"] > 0
