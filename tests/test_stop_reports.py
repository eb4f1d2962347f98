"""What a job stopped by signals says (issue 38): the launcher's last line
when ranks died of a request before their handler, or stopped at once on a
second one; and a signal while `ptdp train` still checks its settings."""

import os
import signal
import subprocess
import sys
import time

import pytest

from ptdp import stop_requests as stopping
from ptdp.stop_requests import StopRequests
from tests.test_fault_matrix import INJECTOR
from tests.test_signals_and_processes import ROOT, TINY, _env, _point_latest


@pytest.fixture(autouse=True)
def fresh_requests(monkeypatch):
    monkeypatch.setattr(stopping, "STOP_REQUESTS", StopRequests())


def test_the_stop_requests_read_the_checkpoints_own_latest_pointer():
    from ptdp.checkpoint.retention import LATEST

    assert stopping.LATEST == LATEST


def test_a_job_stopped_by_signals_reports_what_is_on_disk(tmp_path):
    """The launcher's last line when ranks died of a request (before their
    handler) or stopped at once on a second one: the newest checkpoint on
    disk, and whether this run saved it."""
    from types import SimpleNamespace

    from ptdp.launch import _Ranks

    save = tmp_path / "ckpt"
    _point_latest(save, 4)  # a resumed run: iteration 4 is from before it
    requests = StopRequests()
    requests.new_run(str(save))
    requests.note(signal.SIGTERM)
    assert requests.stopped_while_starting(signal.SIGTERM, "every rank") == (
        f"SIGTERM came while the ranks were starting, before they could take it as a request to "
        f"save and stop: every rank stopped at once, so nothing was saved; the newest checkpoint "
        f"is {save}/iter_0000004, from before this run (resume with --load {save})")
    assert requests.stopped_at_once(signal.SIGTERM, "rank 1") == (
        f"a second SIGTERM came more than 3 s after the first request (SIGTERM) and stopped "
        f"rank 1 at once, without saving; the newest checkpoint is {save}/iter_0000004, from "
        f"before the first request (resume with --load {save})")
    _point_latest(save, 6)  # saved after the first request, before the second
    assert requests.stopped_at_once(signal.SIGTERM, "rank 1").endswith(
        f"the newest checkpoint is {save}/iter_0000006, saved by this run before that second "
        f"signal (resume with --load {save})")
    assert requests.stopped_while_starting(signal.SIGTERM, "rank 0") == (
        f"SIGTERM came before the ranks could take it as a request to save and stop: rank 0 "
        f"stopped at once; the newest checkpoint is {save}/iter_0000006, saved by this run "
        f"(resume with --load {save})")
    # The verdict: 128 + a job signal is the handler's stop at once, not a failure.
    stopping.STOP_REQUESTS = requests
    ranks = _Ranks([SimpleNamespace(pid=None, sentinel=rank) for rank in range(2)], [], set(),
                   (int(signal.SIGTERM), int(signal.SIGHUP)))
    ranks.exits = {0: (128 + signal.SIGTERM, 1.0), 1: (128 + signal.SIGTERM, 1.1)}
    assert str(ranks.verdict()).startswith("a second SIGTERM came more than 3 s after the first "
                                           "request (SIGTERM) and stopped every rank at once")
    ranks.exits[1] = (128 + signal.SIGUSR2, 1.1)  # not a signal the job handles: a failure
    assert str(ranks.verdict()) == "rank 1 failed (exit code 140 = 128 + SIGUSR2)"


def test_a_signal_while_the_settings_are_checked_is_one_paragraph(tmp_path):
    """Before any rank starts (the checks, which read datasets and
    checkpoints, can take seconds), a SIGTERM ended `ptdp train` silently."""
    save, stamp = tmp_path / "ckpt", tmp_path / "stamp"
    _point_latest(save, 4)
    env = _env(PTDP_TEST_STALL="checks:60", PTDP_TEST_FAULT_STAMP=str(stamp),
               PYTHONPATH=os.pathsep.join([str(INJECTOR), os.environ.get("PYTHONPATH", "")]))
    job = subprocess.Popen([sys.executable, "-m", "ptdp", "train", *TINY, "--train-iters", "2",
                            "--save", str(save)], cwd=ROOT, env=env, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not stamp.exists() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert stamp.exists(), job.communicate()
        job.send_signal(signal.SIGTERM)
        out, err = job.communicate(timeout=30)
    finally:
        job.kill()
    assert job.returncode == 128 + signal.SIGTERM
    assert err.strip().splitlines()[-1] == (
        f"ptdp: SIGTERM came while ptdp train was checking its settings, before any rank "
        f"started: nothing was started or saved; the newest checkpoint is {save}/iter_0000004 "
        f"(resume with --load {save})")
    assert "Traceback" not in err and "starting" not in out
