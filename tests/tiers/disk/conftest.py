"""Fixtures every disk-tier test module shares."""

import pytest
from kvtier_testing.store import KINDS, region


@pytest.fixture
def shm():
    """A CPU-tier region of 64 rows, closed (and removed) after the test."""
    r = region(64)
    yield r
    r.close()


@pytest.fixture(params=KINDS)
def kind(request):
    """Each disk-tier kind in turn."""
    return request.param
