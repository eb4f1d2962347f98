import os
import shutil
import signal
import tempfile

import pytest

from tests.multiproc import Pools


def pytest_configure(config):
    """In a worker of a suite split across processes, each worker's torch,
    and the processes its tests start without their own OMP_NUM_THREADS,
    get its share of the cores: two workers with a thread per core each
    would oversubscribe them, and waiting threads spin."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        import torch
        torch.set_num_threads(threads)


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


@pytest.fixture(scope="session", autouse=True)
def ctrl_c_as_a_terminal_sends_it():
    """The Ctrl-C tests need SIGINT to raise KeyboardInterrupt, here and in
    the jobs they start. A suite started in the background by a shell
    without job control (`cmd &` in a script) inherits SIGINT ignored, and
    an ignored signal stays ignored across exec: Python then installs no
    KeyboardInterrupt handler, in this process or in its children. A Python
    handler here is reset to the default action in every child."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield


@pytest.fixture(scope="session")
def pools():
    """pools(n) -> a live ProcessPool of n gloo ranks, shared by the session."""
    registry = Pools()
    yield registry
    registry.close()


@pytest.fixture(scope="session")
def one_process_run(tmp_path_factory):
    """test_train_cli's model trained by one process: the run every layout of
    test_train_cli and test_multinode must equal (records, printed losses,
    stdout)."""
    from tests.test_train_cli import _ptdp
    return _ptdp([], tmp_path_factory.mktemp("serial"), "serial")


@pytest.fixture
def no_launch(monkeypatch):
    """`main` as a local launch whose process start fails the test if reached
    (for checks that must refuse a configuration before launching)."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID",
                 "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)

    def tripwire(*args, **kwargs):
        raise AssertionError("a training process was started")

    import ptdp.launch
    import ptdp.train.loop
    monkeypatch.setattr(ptdp.launch, "launch_local", tripwire)
    monkeypatch.setattr(ptdp.train.loop, "worker", tripwire)
    return tripwire
