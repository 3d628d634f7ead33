"""ShardPlacement (each rank's place in a row) and RankResultAggregator (one result per job)."""

from __future__ import annotations

import pytest

from kvtier import ConfigError
from kvtier.base import TransferResult
from kvtier.worker import RankResultAggregator, ShardPlacement


def test_ranks_sit_side_by_side_in_rank_order():
    places = [ShardPlacement(world_size=4, rank=r, shard_bytes=3000) for r in range(4)]
    assert [p.offset for p in places] == [0, 3000, 6000, 9000]
    assert all(p.writes and p.row_bytes == 12000 and p.num_shards == 4 for p in places)


def test_replicated_ranks_share_one_shard_written_by_the_first():
    # TP=2 x PP=2 of an MLA model: the two TP ranks of a stage hold the same latent cache
    places = [ShardPlacement(world_size=4, rank=r, shard_bytes=100, kv_replicas=2) for r in range(4)]
    assert [p.shard for p in places] == [0, 0, 1, 1]
    assert [p.offset for p in places] == [0, 0, 100, 100]
    assert [p.writes for p in places] == [True, False, True, False]
    assert places[0].row_bytes == 200


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"world_size": 2, "rank": 2}, "rank"),
        ({"world_size": 0, "rank": 0}, "world_size"),
        ({"world_size": 4, "rank": 0, "kv_replicas": 3}, "kv_replicas"),
        ({"world_size": 2, "rank": -1}, "rank"),
    ],
)
def test_bad_placements_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        ShardPlacement(shard_bytes=64, **kwargs)


def test_a_job_completes_once_every_rank_reported_it():
    aggregator = RankResultAggregator(3)
    assert aggregator.add(0, [TransferResult(7, True, 10, 0.5)]) == []
    assert aggregator.add(2, [TransferResult(7, True, 10, 0.25)]) == []
    assert aggregator.pending() == {7: {1}}
    assert aggregator.add(1, [TransferResult(7, True, 0, 0.75)]) == [TransferResult(7, True, 20, 0.75)]
    assert aggregator.pending() == {}


def test_one_failed_rank_fails_the_job():
    aggregator = RankResultAggregator(2)
    aggregator.add(0, [TransferResult(1, True, 10, 0.1), TransferResult(2, True, 10, None)])
    done = aggregator.add(1, [TransferResult(1, False, 0, None), TransferResult(2, True, 10, 0.2)])
    assert done == [TransferResult(1, False, 0, None), TransferResult(2, True, 20, None)]


def test_a_rank_reporting_a_job_twice_is_a_driver_bug():
    aggregator = RankResultAggregator(2)
    aggregator.add(0, [TransferResult(1, True, 1)])
    with pytest.raises(ValueError, match="twice"):
        aggregator.add(0, [TransferResult(1, True, 1)])
    with pytest.raises(ValueError, match="rank 5"):
        aggregator.add(5, [])
