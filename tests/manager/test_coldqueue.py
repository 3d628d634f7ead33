"""The stack manager's queue of blocks waiting to be saved: coldest first, refreshed by use."""

from helpers import key
from kvtier.manager.coldqueue import ColdQueue


def test_pops_a_prefix_tail_first_and_a_refreshed_key_goes_last():
    queue = ColdQueue()
    queue.add_new([key(i) for i in range(5)])  # one request's, head first: its tail coldest
    queue.refresh([key(1), key(3), key(99)])  # key(99) is not waiting: ignored
    assert len(queue) == 5 and key(1) in queue and key(99) not in queue
    taken, visited = queue.pop_coldest(3)
    # the older copies of key(3) and key(1) are passed over: they now wait behind key(0)
    assert taken == [key(4), key(2), key(0)] and visited == 5
    assert queue.pop_coldest(10) == ([key(3), key(1)], 2)
    assert not queue and queue.pop_coldest(1) == ([], 0)


def test_refreshed_twice_is_passed_over_twice_and_popped_once():
    queue = ColdQueue()
    queue.add_new([key(0), key(1)])
    queue.refresh([key(0)])
    queue.refresh([key(0)])
    assert queue.pop_coldest(2) == ([key(1), key(0)], 4)
    assert len(queue) == 0


def test_clear_forgets_order_and_copies():
    queue = ColdQueue()
    queue.add_new([key(0), key(1)])
    queue.refresh([key(0)])
    queue.clear()
    assert queue.pop_coldest(5) == ([], 0)
    queue.add_new([key(0)])
    assert queue.pop_coldest(5) == ([key(0)], 1)  # no stale copy of key(0) is left to skip


def test_a_key_removed_behind_its_back_is_skipped_not_returned():
    queue = ColdQueue()
    queue.add_new([key(0), key(1)])
    queue.discard(key(0))
    assert queue.pop_coldest(2) == ([key(1)], 2)
