import pytest

from tests.multiproc import Pools


@pytest.fixture(scope="session")
def pools():
    """pools(n) -> a live ProcessPool of n gloo ranks, shared by the session."""
    registry = Pools()
    yield registry
    registry.close()
