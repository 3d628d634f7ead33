"""Failure: why one key of a lower tier's job did not make it (kvtier.tiers.base)."""

import errno

from kvtier.tiers.base import Failure, FailureKind


def test_failure_from_exception_carries_the_errno():
    import errno

    reason = Failure.from_exception(OSError(errno.ENOSPC, "full"))
    assert reason.kind is FailureKind.OS_ERROR and reason.errno == errno.ENOSPC
    assert str(reason) == "ENOSPC" and reason.counter == "ENOSPC"
    other = Failure.from_exception(ValueError("x"))
    assert other.kind is FailureKind.UNEXPECTED and other.errno is None and str(other) == "error: ValueError"
    corrupt = Failure.corrupt("other key")
    assert corrupt.block_gone and str(corrupt) == "corrupt: other key" and corrupt.counter == "other_key"
    assert Failure.MISSING.block_gone and not Failure.FULL.block_gone


def test_index_failures_keep_the_errno_when_there_is_one():
    with_errno = Failure(FailureKind.INDEX, errno.ENOSPC)
    assert str(with_errno) == "index: ENOSPC" and with_errno.counter == "ENOSPC"
    without = Failure(FailureKind.INDEX, detail="MapFullError")
    assert str(without) == "index: MapFullError" and without.counter == "index_MapFullError"
    assert not with_errno.block_gone
