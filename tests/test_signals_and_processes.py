"""Signals and processes (issue 30): one graceful request however many
copies of it arrive and whenever (a rank that saved, a launcher whose ranks
left, Python's own shutdown); Ctrl-C after a request says what was saved;
no worker trains on after torchrun's agent dies; torchrun's summary carries
ptdp's message; error reports are new private files, never a file someone
planted a link at."""

import io
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from ptdp import cli
from ptdp import stop_requests as stopping
from ptdp.errors import print_user_error, report_to_torchrun
from ptdp.stop_requests import StopRequests
from ptdp.checkpoint.store import read_metadata, resolve
from ptdp.train.stopping import GracefulExit
from tests.test_fault_matrix import INJECTOR, _torchrun
from tests.test_train_cli import _spawned_children

needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--mock-data", "--vocab-size", "128", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "8"]
# Generous for a loaded 2-core machine.
BOUND_SECONDS = 90


@pytest.fixture(autouse=True)
def private_temp_dir(tmp_path, monkeypatch):
    """Error reports land in this test's folder; this process's record of
    graceful requests starts empty and is put back afterwards."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(stopping, "STOP_REQUESTS", StopRequests())
    yield
    if GracefulExit._lingering is not None:  # a request's handler, kept after its run
        GracefulExit._lingering.uninstall()


def _env(**extra) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS",
                "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"):
        env.pop(var, None)
    return env


def _start(argv, launcher=None, **popen) -> subprocess.Popen:
    command = (launcher or [sys.executable, "-m", "ptdp"]) + ["train", *argv]
    options = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_env())
    options.update(popen)
    return subprocess.Popen(command, cwd=ROOT, text=True, start_new_session=True, **options)


def _stalled_env(phase: str, stamp: Path) -> dict:
    """Every rank sleeps 60 s on reaching `phase` (tests/fault_injection);
    rank 0 writes the time it began to `stamp`."""
    return _env(PTDP_TEST_STALL=f"{phase}:60", PTDP_TEST_FAULT_STAMP=str(stamp),
                PYTHONPATH=os.pathsep.join([str(INJECTOR), os.environ.get("PYTHONPATH", "")]))


def _servers(launcher: int) -> list[int]:
    """The fork server and resource tracker `launcher` started (Linux /proc)."""
    found = []
    for pid in _children(launcher):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"multiprocessing.forkserver" in cmdline or b"resource_tracker" in cmdline:
            found.append(pid)
    return found


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _wait_until(condition, process, seconds=120.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert process.poll() is None, process.stdout.read() if process.stdout else "exited"
        assert time.monotonic() < deadline, "the job did not get there in time"
        time.sleep(0.02)


def _finish(process: subprocess.Popen) -> str:
    try:
        output, _ = process.communicate(timeout=BOUND_SECONDS)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return output


def _gone(pid: int) -> bool:
    try:
        return "zombie" in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True


# ------------------------------------------------------------------ one request, many copies


@needs_proc
def test_repeats_from_several_senders_within_the_window_count_as_one_and_the_job_exits_0(tmp_path):
    """SIGTERM to `ptdp train`, then to its whole process group 0.3 s and
    1 s later (a scheduler, a terminal): the ranks save quickly and leave,
    so the copies reach ranks in Python's shutdown (which puts the default
    actions back) and the launcher after its ranks left. One request: the
    checkpoint is saved and the job exits 0."""
    save, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    process = _start([*TINY, "-d", "2", "--train-iters", "100000", "--save", str(save),
                      "--metrics-file", str(metrics)])
    _wait_until(lambda: _lines(metrics) >= 2, process)
    started = time.monotonic()
    os.kill(process.pid, signal.SIGTERM)
    for at in (0.3, 1.0):
        time.sleep(max(0.0, started + at - time.monotonic()))
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            break  # everything already gone: nothing left to misjudge
    output = _finish(process)
    assert process.returncode == 0, output
    assert "failed" not in output and "killed by" not in output
    stopped = read_metadata(resolve(save))["iteration"]
    assert (f"stopped after iteration {stopped} of 100000: SIGTERM received; saved "
            f"{save}/iter_{stopped:07d}") in output


def test_after_a_request_the_handler_outlives_the_run_and_repeats_still_count_once():
    previous = signal.getsignal(signal.SIGUSR1)
    handler = GracefulExit(("SIGUSR1",), announce=False)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while not handler.requested and time.monotonic() < deadline:
            time.sleep(0.01)
        assert handler.requested == signal.SIGUSR1
        assert stopping.STOP_REQUESTS.first.signal == signal.SIGUSR1
        handler.close()  # the run is over, on this request
        assert signal.getsignal(signal.SIGUSR1) != previous  # still counting
        os.kill(os.getpid(), signal.SIGUSR1)  # a late copy: this process lives on
        time.sleep(0.2)
        assert handler.requested == signal.SIGUSR1
    finally:
        handler.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == previous
    # Without a request, close puts the previous handler back at once.
    quiet = GracefulExit(("SIGUSR1",), announce=False)
    quiet.close()
    assert signal.getsignal(signal.SIGUSR1) == previous


AT_EXIT = textwrap.dedent("""
    import atexit, os, signal, sys, time
    from ptdp.train import stopping
    stopping.REPEAT_WINDOW_SECONDS = float(sys.argv[1])
    # Registered first, so it runs after the handler's own exit hook (LIFO):
    # what a signal arriving from then on meets.
    atexit.register(lambda: print(signal.getsignal(signal.SIGTERM) == signal.SIG_IGN, flush=True))
    handler = stopping.GracefulExit(("SIGTERM",), announce=False)
    os.kill(os.getpid(), signal.SIGTERM)
    while not handler.requested:
        time.sleep(0.01)
    handler.close()
    time.sleep(float(sys.argv[2]))
""")


@pytest.mark.parametrize("window, linger, ignored", [(30.0, 0.0, True), (0.2, 0.5, False)])
def test_at_exit_a_request_s_signals_are_ignored_while_its_window_is_open(window, linger, ignored):
    """Python's shutdown puts SIG_DFL back before torch's teardown: a repeat
    then killed ranks that had saved (`rank N failed (killed by SIGTERM)`).
    Within the window the signals are ignored from the exit hooks on; after
    it, the default (stop at once) stays."""
    done = subprocess.run([sys.executable, "-c", AT_EXIT, str(window), str(linger)], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(ignored)]


def test_the_launcher_absorbs_repeats_within_the_window_then_hands_back(monkeypatch):
    from ptdp.launch import _RepeatsAbsorbed

    seen = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: seen.append(signum))
    try:
        handed_back = signal.getsignal(signal.SIGUSR2)
        signal.signal(signal.SIGUSR2, _RepeatsAbsorbed(handed_back, time.monotonic() + 0.3))
        os.kill(os.getpid(), signal.SIGUSR2)  # within the window: the same request
        time.sleep(0.05)
        assert seen == []
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGUSR2)  # after it: the previous handler takes it
        time.sleep(0.05)
        assert seen == [signal.SIGUSR2] and signal.getsignal(signal.SIGUSR2) is handed_back
    finally:
        signal.signal(signal.SIGUSR2, previous)


# ------------------------------------------------------------------ Ctrl-C after a request


def _request(save: Path | None, signum=signal.SIGTERM) -> StopRequests:
    requests = StopRequests()
    requests.new_run(None if save is None else str(save))
    requests.note(signum)
    return requests


def _point_latest(save: Path, iteration: int) -> None:
    save.mkdir(exist_ok=True)
    (save / "latest").write_text(f"iter_{iteration:07d}\n")


def test_ctrl_c_after_a_request_says_what_was_saved(tmp_path):
    save = tmp_path / "ckpt"
    head = "ptdp: interrupted (Ctrl-C) during the graceful stop SIGTERM asked for"
    assert StopRequests().interrupted() == "ptdp: interrupted by the user (Ctrl-C)"  # no run
    assert _request(None).interrupted() == f"{head}; no --save given, so nothing was saved"
    assert _request(save).interrupted() == (f"{head}: nothing was saved, and {save} holds no "
                                            f"checkpoint")
    _point_latest(save, 4)
    requested = _request(save)
    assert requested.interrupted() == (
        f"{head}: nothing was saved after the SIGTERM; the newest checkpoint is "
        f"{save}/iter_0000004, from before it (resume with --load {save})")
    _point_latest(save, 5)  # the stop's own save finished before the Ctrl-C
    assert requested.interrupted() == (f"{head}: {save}/iter_0000005 was saved after the "
                                       f"SIGTERM; resume with --load {save}")


def test_ctrl_c_during_the_stop_s_save_is_reported_as_the_last_line(tmp_path, monkeypatch, capsys):
    """One process, in this one: SIGTERM during iteration 3 (iteration 2 was
    saved), Ctrl-C as the stop's save begins. The last line says that nothing
    was saved after the SIGTERM and names iteration 2's checkpoint."""
    from ptdp.train.loop import Trainer

    save = tmp_path / "ckpt"
    step, write = Trainer.step, Trainer.save

    def step_signalled_at_3(self, iteration, *args, **kwargs):
        if iteration == 2:  # 0-based: the third
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 10  # the handler's thread counts it
            while stopping.STOP_REQUESTS.first is None and time.monotonic() < deadline:
                time.sleep(0.01)
        return step(self, iteration, *args, **kwargs)

    def ctrl_c_before_the_stop_s_save(self, directory, iteration):
        if stopping.STOP_REQUESTS.first is not None:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)  # KeyboardInterrupt comes first
        return write(self, directory, iteration)

    monkeypatch.setattr(Trainer, "step", step_signalled_at_3)
    monkeypatch.setattr(Trainer, "save", ctrl_c_before_the_stop_s_save)
    code = cli.main(["train", *TINY, "--train-iters", "100", "--save", str(save),
                     "--save-interval", "2"])
    captured = capsys.readouterr()
    assert code == 130
    assert "SIGTERM received: saving and stopping" in captured.out
    assert captured.err.splitlines()[-1] == (
        f"ptdp: interrupted (Ctrl-C) during the graceful stop SIGTERM asked for: nothing was "
        f"saved after the SIGTERM; the newest checkpoint is {save}/iter_0000002, from before it "
        f"(resume with --load {save})")
    assert read_metadata(resolve(save))["iteration"] == 2


@needs_proc
def test_ctrl_c_right_after_a_sigterm_to_the_launcher_reports_what_is_on_disk(tmp_path):
    """The local launcher notes the request it forwards; its last line,
    after every rank is gone, matches what `latest` names."""
    save, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    process = _start([*TINY, "-d", "2", "--train-iters", "100000", "--save", str(save),
                      "--save-interval", "2", "--metrics-file", str(metrics)])
    _wait_until(lambda: _lines(metrics) >= 3, process)
    os.kill(process.pid, signal.SIGTERM)
    time.sleep(0.05)
    os.killpg(process.pid, signal.SIGINT)
    output = _finish(process)
    last = output.strip().splitlines()[-1]
    if process.returncode in (0, -signal.SIGINT):  # stopped before the Ctrl-C came, or as
        assert "SIGTERM received; saved" in last, output  # Python shut down: said so last
        return
    assert process.returncode == 130, output
    head = "ptdp: interrupted (Ctrl-C) during the graceful stop SIGTERM asked for: "
    assert last.startswith(head), output
    newest = resolve(save)
    if not last.startswith(f"{head}nothing was saved"):  # (which also says "was saved after")
        assert last == f"{head}{newest} was saved after the SIGTERM; resume with --load {save}"
    else:
        assert last == (f"{head}nothing was saved after the SIGTERM; the newest checkpoint is "
                        f"{newest}, from before it (resume with --load {save})")



def test_ctrl_c_without_a_request_says_it_was_the_user_and_what_the_run_saved(tmp_path):
    save = tmp_path / "ckpt"
    head = "ptdp: interrupted by the user (Ctrl-C)"
    requests = StopRequests()
    requests.new_run(None)
    assert requests.interrupted() == f"{head}; no --save given, so nothing was saved"
    requests.note_start_up(64, 12)
    assert requests.interrupted() == (f"{head} while 64 processes were starting (12 had "
                                      f"started); nothing was saved")
    requests.note_start_up(8, 0)
    assert requests.interrupted() == (f"{head} while 8 processes were starting (none had "
                                      f"started yet); nothing was saved")
    requests.new_run(str(save))
    assert requests.interrupted() == f"{head}; nothing was saved, and {save} holds no checkpoint"
    _point_latest(save, 4)
    assert requests.interrupted() == (f"{head}; the newest checkpoint is {save}/iter_0000004, "
                                      f"saved by this run (resume with --load {save})")
    requests.new_run(str(save))  # resumed from iteration 4, interrupted before its first save
    assert requests.interrupted() == (f"{head}; this run saved nothing; the newest checkpoint is "
                                      f"{save}/iter_0000004, from before it (resume with --load "
                                      f"{save})")


def test_ranks_killed_by_a_stop_request_while_starting_did_not_fail(monkeypatch):
    """SIGTERM to the whole job (a scheduler, `timeout`) before the ranks
    installed their handler: they die of it, which is no rank failure."""
    from types import SimpleNamespace

    from ptdp.launch import _Ranks, starting_line

    ranks = _Ranks([SimpleNamespace(pid=None, sentinel=rank) for rank in range(3)], [], set())
    ranks.exits = {0: (-signal.SIGTERM, 1.0), 1: (-signal.SIGTERM, 1.1)}
    assert ranks.starting and str(ranks.verdict()) == "rank 0 failed (killed by SIGTERM)"
    stopping.STOP_REQUESTS.note(signal.SIGTERM)  # what the launcher's forwarding notes
    assert str(ranks.verdict()) == (
        "SIGTERM came while the ranks were starting, before they could take it as a request to "
        "save and stop: 2 ranks stopped at once, so nothing was saved")
    ranks.exits[2] = (-signal.SIGKILL, 1.2)  # another death is still a failure
    assert str(ranks.verdict()) == "rank 2 failed (killed by SIGKILL)"
    ranks.started = {0, 1, 2}
    assert not ranks.starting
    assert starting_line(64, 12, 20.4) == ("ptdp: waiting for 64 processes to start (12 started, "
                                           "20 s so far)")


@needs_proc
def test_ctrl_c_while_many_ranks_start_is_an_interruption_not_a_failure(tmp_path):
    """Eight ranks on a small machine take seconds to start; a terminal's
    Ctrl-C (SIGINT to the process group) then: no rank failure, no
    KeyboardInterrupt traceback per rank, and the last line says the user
    interrupted and that nothing was saved; every rank is gone."""
    process = _start([*TINY, "-t", "2", "-p", "2", "-d", "2", "--train-iters", "100000"])
    first = process.stdout.readline()
    assert first.startswith("ptdp: starting 8 processes"), first
    _wait_until(lambda: len(_spawned_children(process.pid)) == 8, process, seconds=30)
    ranks = _spawned_children(process.pid)
    time.sleep(2)  # most are importing torch (Ctrl-C at once is the common case too)
    os.killpg(process.pid, signal.SIGINT)
    output = first + _finish(process)
    assert process.returncode == 130, output
    last = output.strip().splitlines()[-1]
    assert last.startswith("ptdp: interrupted by the user (Ctrl-C)"), output
    assert last.endswith("nothing was saved"), output  # starting, or training without --save
    for wrong in ("failed", "killed by", "Traceback", "KeyboardInterrupt", "SIGTERM received"):
        assert wrong not in output, output
    deadline = time.monotonic() + 10
    while not all(_gone(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ranks and all(_gone(pid) for pid in ranks)

# ------------------------------------------------------------------ parents that die


DIES_WITH_PARENT = textwrap.dedent("""
    import os, signal, sys, time
    from ptdp.launch import die_with_parent

    def wait_for(condition):
        deadline = time.monotonic() + 30
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.01)

    got = []
    signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    top = os.getpid()
    if os.fork():
        time.sleep(60)                      # the top process: killed by its child below
    asked = die_with_parent(top)            # the child, its parent alive: asked in time
    os.kill(top, signal.SIGKILL)            # its parent dies: the kernel sends SIGTERM
    wait_for(lambda: got)
    if os.fork():
        time.sleep(60)                      # killed by its own child below
    middle = os.getppid()                   # the grandchild: its parent as it started...
    os.kill(middle, signal.SIGKILL)         # ...dies before the grandchild asks
    wait_for(lambda: os.getppid() != middle)
    with open(sys.argv[1], "w") as out:
        out.write(f"{asked} {got} {die_with_parent(middle)}")
""")


@needs_proc
def test_the_parent_death_signal_comes_and_a_parent_already_gone_is_noticed(tmp_path):
    report = tmp_path / "report"
    subprocess.run([sys.executable, "-c", DIES_WITH_PARENT, str(report)], cwd=ROOT, env=_env(),
                   capture_output=True, text=True, timeout=120)
    deadline = time.monotonic() + 30
    while not report.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert report.read_text() == f"True [{int(signal.SIGTERM)}] False"


def test_a_worker_whose_torchrun_agent_is_gone_stops_before_training(monkeypatch, capsys):
    import ptdp.launch

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    asked = []
    monkeypatch.setattr(ptdp.launch, "die_with_parent",
                        lambda parent: asked.append(parent) or False)  # gone
    assert cli.main(["train", *TINY, "--train-iters", "1"]) == 1
    assert asked == [os.getppid()]
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"ptdp: error: torchrun's agent (process {os.getppid()}) ended before this worker could "
        f"start, so it stops")


@needs_proc
def test_workers_stop_and_save_when_torchrun_s_agent_is_killed(tmp_path):
    """SIGKILL gives torchrun no time to stop its workers: the kernel's
    parent-death signal (SIGTERM) does, and they save as for any SIGTERM."""
    save, metrics, log = tmp_path / "ckpt", tmp_path / "m.jsonl", tmp_path / "log"
    with open(log, "w") as out:
        process = _start([*TINY, "--train-iters", "100000", "--save", str(save),
                          "--metrics-file", str(metrics)], launcher=_torchrun(), stdout=out,
                         stderr=subprocess.STDOUT)
    workers = []
    try:
        _wait_until(lambda: _lines(metrics) >= 2, process)
        workers += _children(process.pid)
        assert len(workers) == 2, workers
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        deadline = time.monotonic() + BOUND_SECONDS
        while not all(_gone(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(_gone(pid) for pid in workers), log.read_text()
    finally:
        for pid in [process.pid, *workers]:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
    text = log.read_text()
    stopped = read_metadata(resolve(save))["iteration"]
    assert f"stopped after iteration {stopped} of 100000: SIGTERM received; saved" in text
    assert _lines(metrics) == stopped  # and nothing trained after


@needs_proc
@pytest.mark.parametrize("phase", ["start-up", "training"])
def test_killing_the_launcher_leaves_nothing_behind_and_frees_the_save_lock(tmp_path, phase):
    """SIGKILL gives `ptdp train` no time to stop its ranks, whose parent is
    the fork server, not the launcher: each rank watches a pipe only the
    launcher holds and takes its end as SIGTERM (saving in training, dying
    at once while starting); the fork server then exits. Within 5 s no rank
    and no server is left, and --save is free: a second job starts there."""
    save, metrics, stamp = tmp_path / "ckpt", tmp_path / "m.jsonl", tmp_path / "stalled"
    env = _stalled_env("startup", stamp) if phase == "start-up" else _env()
    process = _start([*TINY, "-d", "2", "--train-iters", "100000", "--save", str(save),
                      "--metrics-file", str(metrics)], env=env)
    ranks, servers = [], []
    try:
        _wait_until(stamp.exists if phase == "start-up" else lambda: _lines(metrics) >= 2,
                    process)
        ranks, servers = _spawned_children(process.pid), _servers(process.pid)
        assert len(ranks) == 2 and len(servers) == 2, (ranks, servers)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        killed = time.monotonic()
        while not all(_gone(pid) for pid in ranks + servers) and time.monotonic() < killed + 5:
            time.sleep(0.05)
        left = [pid for pid in ranks + servers if not _gone(pid)]
        assert not left, f"alive 5 s after the launcher's SIGKILL: {left}"
    finally:
        for pid in ranks + servers:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
    output = process.stdout.read()
    assert f"the launcher (process {process.pid}) is gone" in output, output
    assert "Traceback" not in output, output
    if phase == "start-up":
        assert not (save / "latest").exists()
        from ptdp.checkpoint.lock import problem
        assert problem(save) is None  # (the file a killed rank leaves locks nothing)
        return
    stopped = read_metadata(resolve(save))["iteration"]
    assert f"SIGTERM received; saved {save}/iter_{stopped:07d}" in output, output
    second = subprocess.run([sys.executable, "-m", "ptdp", "train", *TINY, "-d", "2", "--save",
                             str(save), "--load", str(save), "--train-iters", str(stopped + 1),
                             "--use-checkpoint-opt_param-scheduler"],
                            cwd=ROOT, env=_env(), capture_output=True, text=True,
                            timeout=BOUND_SECONDS)
    assert second.returncode == 0, second.stderr
    assert read_metadata(resolve(save))["iteration"] == stopped + 1


@needs_proc
@pytest.mark.parametrize("moment", ["fork server starting", "ranks building"])
def test_sigterm_to_the_group_while_the_ranks_start_is_one_paragraph(tmp_path, moment):
    """`timeout` or a container's stop signals every process of the job: the
    fork server (while it imports torch) ignores it, so that no rank's start
    fails with its EOFError; the ranks, which have no handler yet, stop; the
    report is the documented paragraph, no traceback."""
    save, stamp = tmp_path / "ckpt", tmp_path / "stalled"
    process = _start([*TINY, "-d", "2", "--train-iters", "100000", "--save", str(save)],
                     env=_stalled_env("startup", stamp))
    if moment == "fork server starting":
        _wait_until(lambda: any(b"forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes()
                                for pid in _children(process.pid)), process)
    else:
        _wait_until(stamp.exists, process)
    os.killpg(process.pid, signal.SIGTERM)
    output = _finish(process)
    assert process.returncode == 1, output
    assert output.strip().splitlines()[-1] == (
        "ptdp: error: SIGTERM came while the ranks were starting, before they could take it as "
        "a request to save and stop: every rank stopped at once, so nothing was saved"), output
    for wrong in ("Traceback", "EOFError", "failed", "exit code 255"):
        assert wrong not in output, output


@needs_proc
def test_a_second_sigterm_during_evaluation_names_the_checkpoint_on_disk(tmp_path):
    """The first SIGTERM comes while the ranks evaluate (after iteration 4,
    iteration 2 saved), the second 3.5 s later: they stop at once, and the
    last line says so and names the newest checkpoint on disk, never that
    the ranks were starting or that nothing was saved."""
    save, stamp = tmp_path / "ckpt", tmp_path / "stalled"
    process = _start([*TINY, "-d", "2", "--train-iters", "100000", "--save", str(save),
                      "--save-interval", "2", "--eval-interval", "4", "--eval-iters", "1"],
                     env=_stalled_env("eval", stamp))
    _wait_until(stamp.exists, process)
    os.killpg(process.pid, signal.SIGTERM)
    time.sleep(stopping.REPEAT_WINDOW_SECONDS + 0.5)
    os.killpg(process.pid, signal.SIGTERM)
    output = _finish(process)
    assert process.returncode == 1, output
    newest = resolve(save)
    assert read_metadata(newest)["iteration"] in (2, 4)
    assert output.strip().splitlines()[-1] == (
        f"ptdp: error: a second SIGTERM came more than 3 s after the first request (SIGTERM) and "
        f"stopped every rank at once, without saving; the newest checkpoint is {newest}, from "
        f"before the first request (resume with --load {save})"), output
    assert "Traceback" not in output and "starting" not in output.splitlines()[-1]


def _children(parent: int) -> list[int]:
    """Processes whose parent is `parent` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                found.append(int(entry.name))
    return found


# ------------------------------------------------------------------ torchrun's summary


def test_torchrun_s_summary_carries_ptdp_s_message(monkeypatch, tmp_path, capsys):
    """torchrun prints its own traceback and a summary last; the worker's
    error file puts ptdp's one-line message in the summary's root cause
    (read back with torch's own code), instead of "To enable traceback"."""
    import ptdp.train.loop
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from ptdp.checkpoint.store import CheckpointError
    from tests.test_launch import _raising_worker

    monkeypatch.delenv("PTDP_TRACEBACK", raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    error_file = tmp_path / "attempt_0" / "0" / "error.json"
    error_file.parent.mkdir(parents=True)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    message = "ckpt/iter_0000002/part-pp0-tp0.safetensors: sha256 differs"
    monkeypatch.setattr(ptdp.train.loop, "worker", _raising_worker(CheckpointError(message)))
    assert cli.main(["train", "--mock-data", "--vocab-size", "64", "--train-iters", "1"]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == f"ptdp: error: rank 0: {message}"
    summary = ChildFailedError("ptdp", {0: ProcessFailure(0, 1234, 1, str(error_file))}).format_msg()
    assert f"traceback : ptdp: error: rank 0: {message}" in summary
    assert "To enable traceback" not in summary
    # A bug keeps its traceback, in the summary too.
    error_file.unlink()
    monkeypatch.setattr(ptdp.train.loop, "worker", _raising_worker(ZeroDivisionError("a bug")))
    with pytest.raises(ZeroDivisionError):
        cli.main(["train", "--mock-data", "--vocab-size", "64", "--train-iters", "1"])
    summary = ChildFailedError("ptdp", {0: ProcessFailure(0, 1234, 1, str(error_file))}).format_msg()
    assert "Traceback (most recent call last)" in summary and "ZeroDivisionError: a bug" in summary


def test_the_torchrun_error_file_never_follows_a_planted_link(monkeypatch, tmp_path):
    victim, error_file = tmp_path / "victim", tmp_path / "error.json"
    victim.write_text("precious")
    error_file.symlink_to(victim)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    assert not report_to_torchrun("ptdp: error: x")
    assert victim.read_text() == "precious"
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")
    assert not report_to_torchrun("ptdp: error: x")  # not under torchrun: nothing written


# ------------------------------------------------------------------ error reports


def test_an_error_report_is_a_new_private_file_never_a_planted_link(monkeypatch, tmp_path):
    """The old name, ptdp-error-<pid>-rank0.txt in the shared temporary
    directory, could be planted as a link to any file the job may write."""
    monkeypatch.delenv("PTDP_TRACEBACK", raising=False)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    planted = tmp_path / f"ptdp-error-{os.getpid()}-rank0.txt"
    planted.symlink_to(victim)
    out = io.StringIO()
    print_user_error(0, "disk full", "Traceback (most recent call last): ...\n", out)
    first = out.getvalue().splitlines()[0]
    path = Path(first.split(" is in ", 1)[1].split(" (PTDP_TRACEBACK", 1)[0])
    assert victim.read_text() == "precious" and planted.is_symlink()
    assert path != planted and path.parent == tmp_path and not path.is_symlink()
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.read_text() == "Traceback (most recent call last): ...\n"
    # Another report of the same rank from the same process gets a file of its own.
    out = io.StringIO()
    print_user_error(0, "disk full", "second\n", out)
    again = Path(out.getvalue().splitlines()[0].split(" is in ", 1)[1].split(" (PTDP_TRACEBACK")[0])
    assert again != path and path.read_text().startswith("Traceback")


def test_error_reports_do_not_pile_up_in_the_temporary_directory(monkeypatch, tmp_path):
    """Each failed run writes a traceback file per rank; only this user's
    newest KEEP_TRACEBACKS stay, and a link of that name is left alone."""
    from ptdp import errors

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    old = []
    for index in range(errors.KEEP_TRACEBACKS + 5):
        path = tmp_path / f"ptdp-error-rank0-old{index:02d}.txt"
        path.write_text("old")
        os.utime(path, ns=(index * 10**9, index * 10**9))
        old.append(path)
    (tmp_path / "ptdp-error-link.txt").symlink_to(old[0])
    (tmp_path / "unrelated.txt").write_text("kept")
    new = errors.keep_traceback(0, "Traceback: new\n")
    left = sorted(p for p in old if p.exists())
    assert new.read_text() == "Traceback: new\n"
    assert left == old[-(errors.KEEP_TRACEBACKS - 1):]  # the newest old ones, and the new one
    assert (tmp_path / "ptdp-error-link.txt").is_symlink() and (tmp_path / "unrelated.txt").exists()


def test_the_start_up_wait_is_reported_on_stderr(monkeypatch, capsys):
    """Stdout is what a command makes (generate's text, a train log piped to
    a file): the launcher's line that a slow start is not a hang goes to stderr."""
    from ptdp import launch

    class StartingRanks:
        processes, started, failed, starting = [0, 1], {0}, False, True
        waits = 0

        @property
        def running(self):
            return self.waits < 2

        def wait(self, timeout):
            self.waits += 1

    monkeypatch.setattr(launch, "PROGRESS_SECONDS", 0.0)
    launch._supervise(StartingRanks())
    out, err = capsys.readouterr()
    assert out == "" and "ptdp: waiting for 2 processes to start (1 started, " in err
