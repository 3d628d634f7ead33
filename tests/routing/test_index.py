"""The prefix index: who holds which blocks where, and how much of a request's prefix each engine has."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.routing import BlockEvent, PrefixIndex
from kvtier.routing.index import DEFAULT_MEDIUM_WEIGHTS

GPU, CPU = DEFAULT_MEDIUM_WEIGHTS["GPU"], DEFAULT_MEDIUM_WEIGHTS["CPU"]


def stored(medium, *hashes):
    return BlockEvent("stored", medium, list(hashes))


def removed(medium, *hashes):
    return BlockEvent("removed", medium, list(hashes))


def test_an_engine_scores_the_leading_blocks_it_holds_by_their_fastest_medium():
    index = PrefixIndex(3)
    index.apply(0, [stored("GPU", 1, 2, 3)])
    index.apply(1, [stored("CPU", 1, 2), stored("GPU", 2)])  # block 2 on both: the GPU counts
    index.apply(2, [stored("GPU", 2, 3)])  # no block 1: no prefix at all
    assert index.score([1, 2, 3, 4]) == [3 * GPU, CPU + GPU, 0.0]
    assert index.score([9, 1]) == [0.0, 0.0, 0.0]  # the prefix starts with a block no one has


def test_a_shared_medium_counts_for_every_engine():
    index = PrefixIndex(2)
    index.apply(1, [stored("VALKEY", 1, 2)])  # engine 1 wrote them to the shared server
    index.apply(0, [stored("GPU", 1)])
    shared = DEFAULT_MEDIUM_WEIGHTS["VALKEY"]
    assert index.score([1, 2]) == [GPU + shared, 2 * shared]
    assert index.holders(1) == {0: {"GPU"}, 2: {"VALKEY"}}  # holder 2: the fleet's shared media


def test_repeated_announcements_are_counted_until_each_is_removed():
    # vLLM announces a block once per offloaded chunk overlapping it, and removes it as often
    index = PrefixIndex(1)
    index.apply(0, [stored("CPU", 1), stored("CPU", 1)])
    index.apply(0, [removed("CPU", 1)])
    assert index.score([1]) == [CPU]
    index.apply(0, [removed("CPU", 1), removed("CPU", 1), removed("GPU", 7)])  # extra ones: no-ops
    assert index.score([1]) == [0.0] and len(index) == 0


def test_clearing_an_engines_gpu_cache_or_forgetting_it_leaves_the_others():
    index = PrefixIndex(2)
    index.apply(0, [stored("GPU", 1, 2), stored("CPU", 1)])
    index.apply(1, [stored("GPU", 1, 2)])
    index.apply(0, [BlockEvent("cleared", "GPU")])
    assert index.score([1, 2]) == [CPU, 2 * GPU]  # engine 0 keeps its CPU copy of block 1
    index.forget_engine(1)
    assert index.score([1, 2]) == [CPU, 0.0] and len(index) == 1


def test_the_index_keeps_at_most_max_blocks_forgetting_the_longest_unused():
    index = PrefixIndex(1, max_blocks=3)
    index.apply(0, [stored("GPU", 1, 2, 3)])
    assert index.score([1]) == [GPU]  # block 1 was used: block 2 is now the oldest
    index.apply(0, [stored("GPU", 4)])
    assert len(index) == 3 and index.forgotten_blocks == 1
    assert index.holders(2) == {} and index.score([2, 3]) == [0.0] and index.score([3, 4]) == [2 * GPU]


def test_weights_are_the_callers_and_an_unknown_medium_gets_the_default():
    index = PrefixIndex(1, weights={"GPU": 1.0, "NVME": 0.25})
    index.apply(0, [stored("NVME", 1), stored("TAPE", 2)])
    assert index.score([1, 2]) == [0.25 + index.weight("TAPE")]


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"engines": 0}, "engines"),
        ({"engines": 2, "max_blocks": 0}, "max_blocks"),
        ({"engines": 1, "weights": {"GPU": 2}}, "GPU"),
    ],
)
def test_bad_settings_are_refused_by_name(options, named):
    with pytest.raises(ValueError, match=named):
        PrefixIndex(**options)


def test_an_event_for_an_engine_outside_the_fleet_or_of_no_known_kind_is_refused():
    with pytest.raises(ValueError, match="engine 2"):
        PrefixIndex(2).apply(2, [stored("GPU", 1)])
    with pytest.raises(ValueError, match="'pinned'"):
        PrefixIndex(2).apply(0, [BlockEvent("pinned", "GPU", [1])])


ENGINES = 3
MEDIA = ("GPU", "CPU", "LMDB", "VALKEY")
events = st.lists(
    st.tuples(
        st.integers(0, ENGINES - 1),
        st.booleans(),
        st.sampled_from(MEDIA),
        st.lists(st.integers(0, 7), min_size=1, max_size=4),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(events, st.lists(st.integers(0, 7), max_size=8))
def test_scores_match_a_plain_count_of_what_each_engine_holds(history, request_blocks):
    index = PrefixIndex(ENGINES)
    model: Counter = Counter()  # (holder, medium, block) -> stores not yet removed
    for engine, is_store, medium, blocks in history:
        holder = ENGINES if medium == "VALKEY" else engine
        index.apply(engine, [BlockEvent("stored" if is_store else "removed", medium, blocks)])
        for block in blocks:
            if is_store:
                model[holder, medium, block] += 1
            elif model[holder, medium, block]:
                model[holder, medium, block] -= 1

    def weight(engine, block):
        held = [m for m in MEDIA if model[engine, m, block] or model[ENGINES, m, block]]
        return max((DEFAULT_MEDIUM_WEIGHTS[m] for m in held), default=0.0)

    expected = []
    for engine in range(ENGINES):
        total = 0.0
        for block in request_blocks:
            if not weight(engine, block):
                break
            total += weight(engine, block)
        expected.append(total)
    assert index.score(request_blocks) == pytest.approx(expected)
    assert len(index) == len({block for (_, _, block), count in model.items() if count})
