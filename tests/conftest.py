import os
import shutil
import tempfile

import pytest

from tests.multiproc import Pools


@pytest.fixture(scope="session", autouse=True)
def private_cache():
    """Derived data (the tokenized demo corpus) goes to a directory of this
    test session, never to the user's cache; subprocesses inherit it."""
    folder = tempfile.mkdtemp(prefix="ptdp-test-cache-")
    previous = os.environ.get("PTDP_CACHE")
    os.environ["PTDP_CACHE"] = folder
    yield folder
    if previous is None:
        os.environ.pop("PTDP_CACHE", None)
    else:
        os.environ["PTDP_CACHE"] = previous
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def pools():
    """pools(n) -> a live ProcessPool of n gloo ranks, shared by the session."""
    registry = Pools()
    yield registry
    registry.close()
