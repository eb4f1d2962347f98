"""The local launcher supervises its ranks: a failing or vanished rank ends the
whole job quickly with its error, and no collective waits for ever. The rank
where a failure began is reported, not the peers that lost their connection
to it; a user's mistake is one paragraph without a traceback; signals to the
launcher reach every rank; a local job listens on loopback only."""

import contextlib
import errno
import importlib
import io
import ipaddress
import json
import multiprocessing
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from ptdp import cli
from ptdp.errors import (DivergenceError, RankFailure, UserError, describe, is_lost_peer_text,
                         is_user_error, print_user_error)
from ptdp.distributed import detect_env, init_process_group
from ptdp.launch import CPU_RANK_MODULES, LocalJobFailed, _Ranks, _RepeatsAbsorbed, launch_local

# Long enough that a job that relied on it to end would fail the test's bound.
LONG_TIMEOUT = timedelta(minutes=10)
# Generous for a loaded 2-core machine, far below LONG_TIMEOUT.
PROMPT_SECONDS = 60
# The launcher's waits shortened where a test's verdict cannot depend on
# them: no report is still to come (the silent rank never sends one), and a
# rank that outlives SIGTERM is killed after the grace, however long.
SHORT_WAIT_SECONDS = 1.0


@pytest.fixture
def short_launcher_waits(monkeypatch):
    """COLLECT_SECONDS and STOP_GRACE_SECONDS (5 s and 3 s) cut to
    SHORT_WAIT_SECONDS: what the test checks happens either way, sooner."""
    import ptdp.launch

    monkeypatch.setattr(ptdp.launch, "COLLECT_SECONDS", SHORT_WAIT_SECONDS)
    monkeypatch.setattr(ptdp.launch, "STOP_GRACE_SECONDS", SHORT_WAIT_SECONDS)


def _raise_on_rank_1(env, payload):
    init_process_group(env, "gloo", LONG_TIMEOUT)
    if env.rank == 1:
        raise ValueError(f"boom from rank {env.rank}: {payload}")
    # The others block in a collective that rank 1 never joins.
    dist.all_reduce(torch.ones(1))
    dist.barrier()


def _killed_on_rank_2(env, payload):
    init_process_group(env, "gloo", LONG_TIMEOUT)
    if env.rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def _lost_peer(env, payload):
    init_process_group(env, "gloo", timedelta(seconds=3))
    if env.rank == 1:
        time.sleep(120)  # alive but never joins: only the collective timeout helps
    dist.all_reduce(torch.ones(1))


def _succeeds(env, payload):
    init_process_group(env, "gloo", LONG_TIMEOUT)
    value = torch.tensor([float(env.rank)])
    dist.all_reduce(value)
    assert value.item() == sum(range(env.world_size))
    dist.destroy_process_group()


def test_a_raising_rank_stops_the_job_with_its_error():
    start = time.monotonic()
    with pytest.raises(LocalJobFailed) as failure:
        launch_local(3, _raise_on_rank_1, "bad input")
    assert failure.value.rank == 1
    assert "ValueError: boom from rank 1: bad input" in failure.value.error
    assert "rank 1 failed (exit code 1)" in str(failure.value)
    assert time.monotonic() - start < PROMPT_SECONDS


def test_a_killed_rank_is_reported_with_its_signal():
    with pytest.raises(LocalJobFailed, match="rank 2 failed \\(killed by SIGKILL\\)"):
        launch_local(3, _killed_on_rank_2, None)


def test_a_lost_peer_ends_in_the_collective_timeout(short_launcher_waits):
    """Rank 0 times out waiting for rank 1, which is alive but never joins:
    rank 1 is named, with what rank 0 saw."""
    start = time.monotonic()
    with pytest.raises(LocalJobFailed) as failure:
        launch_local(2, _lost_peer, None)
    assert failure.value.rank == 1 and failure.value.unresponsive
    assert "rank 1 stopped responding" in str(failure.value)
    assert "timed out" in failure.value.error.lower() or "timeout" in failure.value.error.lower()
    assert time.monotonic() - start < PROMPT_SECONDS


def test_a_healthy_job_returns():
    launch_local(3, _succeeds, None)


def _reports_its_start(env, folder):
    Path(folder, f"rank{env.rank}.json").write_text(json.dumps(
        {"value": os.environ.get("PTDP_TEST_LAUNCH_VALUE"), "parent": os.getppid(),
         "loaded": "ptdp.train.loop" in sys.modules}))


@pytest.mark.skipif(not sys.platform.startswith("linux")
                    or "forkserver" not in multiprocessing.get_all_start_methods(),
                    reason="ranks fork from a server on Linux only")
def test_forked_ranks_take_the_launchers_environment_of_each_launch(tmp_path, monkeypatch):
    """CPU ranks fork from a server that imported ptdp before they start; the
    server outlives a launch and keeps the environment it started with, yet
    every rank sees the launcher's as it is when that launch starts."""
    for value in ("first", "second"):
        monkeypatch.setenv("PTDP_TEST_LAUNCH_VALUE", value)
        folder = tmp_path / value
        folder.mkdir()
        launch_local(2, _reports_its_start, str(folder), preload=CPU_RANK_MODULES)
        for rank in range(2):
            seen = json.loads((folder / f"rank{rank}.json").read_text())
            assert seen["value"] == value and seen["loaded"]
            assert seen["parent"] != os.getpid()  # the fork server's child, not this process's


def _interrupted_on_rank_1(env, payload):
    init_process_group(env, "gloo", LONG_TIMEOUT)
    if env.rank == 1:
        os.kill(os.getpid(), signal.SIGINT)  # to this process alone, not the terminal's group
        time.sleep(60)
    dist.barrier()  # (where a rank of an MoE job waits in its all-to-all)


def test_sigint_to_one_rank_is_one_paragraph(monkeypatch, tmp_path):
    """SIGINT sent to one rank (not a terminal's Ctrl-C, which the launcher
    handles) stops that rank at once: a paragraph that says so and names the
    newest checkpoint, its traceback in a file, not on the screen."""
    from ptdp.launch import INTERRUPTED_ALONE
    from ptdp import stop_requests as stopping

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / "latest").write_text("iter_0000003\n")
    requests = stopping.StopRequests()
    requests.new_run(str(save))
    monkeypatch.setattr(stopping, "STOP_REQUESTS", requests)
    with pytest.raises(LocalJobFailed) as failure:
        launch_local(2, _interrupted_on_rank_1, None)
    assert failure.value.rank == 1 and failure.value.user_error
    out = io.StringIO()
    failure.value.report(out)
    assert out.getvalue().splitlines()[-1] == (
        f"ptdp: error: rank 1: {INTERRUPTED_ALONE}; the newest checkpoint is "
        f"{save}/iter_0000003 (resume with --load {save})")
    assert "Traceback" not in out.getvalue() and "KeyboardInterrupt" not in out.getvalue()


def test_a_local_launch_the_machine_cannot_carry_is_refused_before_anything_starts(
        monkeypatch, capsys):
    """Ranks per core and memory per rank, held against the machine before
    anything is forked: 8 or 32 ranks on 2 cores stay allowed (the tests'
    and the README's equivalence checks), 33 or 1,024 are refused in one
    paragraph with the estimate; --allow-oversubscribe insists; under
    torchrun or SLURM their launcher decides."""
    from ptdp.config.parallel import ParallelConfig
    from ptdp.perf.local_processes import local_process_problems

    gib = 2**30

    def problems(env=None, memory=23 * gib, **layout):
        return local_process_problems(ParallelConfig(device="cpu", **layout), env, cores=2,
                                      memory=memory)

    assert problems(data_parallel_size=8) == problems(data_parallel_size=32) == []
    [cores] = problems(data_parallel_size=33)
    assert "more than 16 per core (32 here)" in cores and "GiB (80 MiB each" not in cores
    [memory] = problems(tensor_model_parallel_size=2, data_parallel_size=8, memory=gib)
    assert ("starts 16 processes on this machine, which has 2 CPU cores and 1.0 GiB of memory: "
            "the processes alone would need about 1.2 GiB (80 MiB each") in memory
    assert problems(data_parallel_size=1024, allow_oversubscribe=True) == []
    assert problems(SimpleNamespace(rank=0), data_parallel_size=1024) == []  # torchrun, SLURM
    # The command: the paragraph, and nothing started.
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr("ptdp.perf.fits.host_memory_bytes", lambda: 23 * gib)
    monkeypatch.setattr("ptdp.launch.launch_local", lambda *a, **k: pytest.fail("launched"))
    code = cli.main(["train", "--mock-data", "--vocab-size", "64", "--num-layers", "1",
                     "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
                     "--micro-batch-size", "1", "--global-batch-size", "1024", "-d", "1024",
                     "--train-iters", "1"])
    out, err = capsys.readouterr()
    assert code == 2 and "ptdp: starting" not in out
    assert err == (
        "ptdp: error: invalid configuration:\n  - the layout t=1 × c=1 × p=1 × d=1024 starts "
        "1024 processes on this machine, which has 2 CPU cores and 23.0 GiB of memory: the "
        "processes alone would need about 80.0 GiB (80 MiB each for Python, torch and gloo, "
        "before the model); and that is more than 16 per core (32 here), where each waits for "
        "the others nearly all the time. Start fewer (a smaller -d, -t, -p or "
        "--context-parallel-size), spread the job over several machines with torchrun or "
        "SLURM, or pass --allow-oversubscribe to start them anyway\n")


def test_cli_reports_the_failing_rank_and_exits_non_zero(monkeypatch, capsys):
    """`ptdp train` turns a failed rank into exit code 1 and prints its error."""
    monkeypatch.setattr("ptdp.launch.launch_local", lambda world, entry, payload, **options:
                        launch_local(world, _raise_on_rank_1, "via cli"))
    code = cli.main(["train", "--mock-data", "-t", "2", "--vocab-size", "64", "--train-iters", "1"])
    err = capsys.readouterr().err
    assert code == 1
    assert "ptdp: error: rank 1 failed" in err and "boom from rank 1: via cli" in err
    assert "stopped the 1 other rank\n" in err


@pytest.mark.parametrize("environ,expected", [
    ({}, None),
    ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
      "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"},
     ("torchrun", 3, 8, 1, 2, "10.0.0.1", 1234)),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
      "SLURM_NTASKS_PER_NODE": "8(x2)", "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.9"},
     ("slurm", 5, 16, 1, 8, "10.0.0.9", 29500)),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, None),  # one task: ptdp launches itself
])
def test_environment_detection(environ, expected):
    env = detect_env(environ)
    if expected is None:
        assert env is None
    else:
        assert (env.source, env.rank, env.world_size, env.local_rank, env.local_world_size,
                env.master_addr, env.master_port) == expected


def test_malformed_launcher_environment_is_a_clear_error():
    with pytest.raises(RuntimeError, match="RANK='x' is missing or not an integer"):
        detect_env({"RANK": "x", "WORLD_SIZE": "2"})


# --------------------------------------------------------------------------- root causes

# Texts of real failures, produced by gloo processes on torch 2.13 (a peer
# killed, a peer that tore down its process group, a peer that never answers,
# the rank hosting the store killed under a torchrun-like layout), and by
# NCCL as documented by torch. (type names of the exception's MRO, text)
LOST_PEER_TEXTS = [
    (("RuntimeError",), "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
     "Connection closed by peer [127.0.0.1]:2193. This is typically caused by a remote worker "
     "crashing. Check the logs of the remote worker before reporting an error. GLHF! 🏖️"),
    (("RuntimeError",), "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] "
     "Read error [127.0.0.1]:6052: Connection reset by peer. This is typically caused by a remote "
     "worker hanging or bugs in the application."),
    (("RuntimeError",), "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
     "unbound_buffer.cc:78] Timed out waiting 4000ms for recv operation to complete"),
    (("RuntimeError",), "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:133] Timed out "
     "waiting 1800000ms for send operation to complete"),
    (("DistStoreError", "DistError", "RuntimeError"), "wait timeout after 4000ms, keys: /0//cpu//0/1"),
    (("DistNetworkError", "DistError", "RuntimeError"),
     "Failed to recv, got 0 bytes. Connection was likely closed. Did the remote server shutdown "
     "or crash?"),
    (("DistNetworkError", "DistError", "RuntimeError"), "Broken pipe"),
    (("DistStoreError", "DistError", "RuntimeError"),
     "Timed out after 901 seconds waiting for clients. 1/2 clients joined."),
    (("DistBackendError", "DistError", "RuntimeError"),
     "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, "
     "NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600027 milliseconds before timing out."),
    (("DistBackendError", "DistError", "RuntimeError"),
     "NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network "
     "error, NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to a network error "
     "or a remote process exiting prematurely."),
]
ROOT_CAUSE_TEXTS = [
    (("ValueError",), "boom from rank 1: bad input"),
    (("RuntimeError",), "CUDA out of memory. Tried to allocate 2.00 GiB"),
    (("RuntimeError",), "Timed out waiting for the tokenizer download"),  # not from collectives
    (("ConnectionResetError", "ConnectionError", "OSError"), "[Errno 104] Connection reset by peer"),
    (("DistBackendError", "DistError", "RuntimeError"),
     "NCCL error in: ProcessGroupNCCL.cpp:1970, invalid usage (run with NCCL_DEBUG=WARN for "
     "details), NCCL version 2.21.5"),
    (("RuntimeError",), "[/__w/pytorch/pytorch/third_party/gloo/gloo/allreduce.cc:39] "
     "Expected buffers of equal size"),
]


@pytest.mark.parametrize("names,text", LOST_PEER_TEXTS)
def test_a_lost_peer_is_recognised_in_real_texts(names, text):
    assert is_lost_peer_text(names, text)


@pytest.mark.parametrize("names,text", ROOT_CAUSE_TEXTS)
def test_other_failures_are_root_causes(names, text):
    assert not is_lost_peer_text(names, text)


def _gloo_error(text=LOST_PEER_TEXTS[0][1]) -> RuntimeError:
    return RuntimeError(text)


def test_the_first_exception_of_a_chain_decides_and_the_real_cause_is_reported():
    disk_full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "ckpt/iter_0000003/part.safetensors")
    # The full disk first; losing a peer while cleaning up comes after it.
    try:
        try:
            raise disk_full
        finally:
            raise _gloo_error()
    except RuntimeError as error:
        report = RankFailure.from_exception(0, error)
    assert not report.lost_peer and report.user_error
    assert report.message == "ckpt/iter_0000003/part.safetensors: No space left on device"
    assert "Traceback" in report.traceback and "Connection closed by peer" in report.traceback
    # A lost peer first: whatever the rank raises while handling it is an echo.
    try:
        try:
            raise _gloo_error()
        except RuntimeError:
            raise ValueError("I/O operation on closed file")
    except ValueError as error:
        report = RankFailure.from_exception(1, error)
    assert report.lost_peer and report.message == "ValueError: I/O operation on closed file"
    # A lost peer alone: its text without gloo's source location.
    report = RankFailure.from_exception(2, _gloo_error())
    assert report.lost_peer and report.message.startswith("Connection closed by peer [127.0.0.1]")


def test_user_errors_are_ptdps_own_and_disk_or_permission_problems():
    for dotted in ("ptdp.config.ConfigError", "ptdp.checkpoint.errors.CheckpointError",
                   "ptdp.data.loader.DataSettingsError", "ptdp.data.gpt_dataset.DataError",
                   "ptdp.data.tokenizer.TokenizerError", "ptdp.data.indexed.IndexedDatasetError"):
        module, name = dotted.rsplit(".", 1)
        error_type = getattr(importlib.import_module(module), name)
        assert issubclass(error_type, UserError) and issubclass(error_type, ValueError)
        assert is_user_error(error_type.__new__(error_type))
    assert is_user_error(DivergenceError("the loss is not finite"))
    assert is_user_error(PermissionError(errno.EACCES, "Permission denied", "ckpt"))
    assert is_user_error(OSError(errno.EROFS, "Read-only file system"))
    assert is_user_error(NotADirectoryError(errno.ENOTDIR, "Not a directory", "file/ckpt"))
    # safetensors (Rust) reports a full disk in its own exception type
    assert is_user_error(type("SafetensorError", (Exception,), {})(
        "Error while serializing: I/O error: No space left on device (os error 28)"))
    assert not is_user_error(ValueError("a bug"))
    assert not is_user_error(FileNotFoundError(errno.ENOENT, "No such file or directory", "x"))
    assert not is_user_error(_gloo_error())
    assert describe(OSError(errno.EISDIR, "Is a directory", "a", None, "b")) == "a -> b: Is a directory"


def _kept_traceback(line: str, rank: int, folder: Path) -> Path:
    """The file a "the traceback of rank R is in FILE" line names: a new
    private file in `folder` (the temporary directory)."""
    head, tail = f"ptdp: the traceback of rank {rank} is in ", " (PTDP_TRACEBACK=1 prints it instead)"
    assert line.startswith(head) and line.endswith(tail), line
    saved = Path(line[len(head):-len(tail)])
    assert saved.parent == folder and saved.name.startswith(f"ptdp-error-rank{rank}-")
    assert saved.is_file() and not saved.is_symlink() and saved.stat().st_mode & 0o777 == 0o600
    return saved


def test_a_user_error_prints_one_paragraph_and_keeps_the_traceback(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("PTDP_TRACEBACK", raising=False)
    out = io.StringIO()
    print_user_error(3, "ckpt/part.safetensors: sha256 differs", "Traceback (most recent...)\n", out)
    lines = out.getvalue().splitlines()
    assert lines[1:] == ["ptdp: error: rank 3: ckpt/part.safetensors: sha256 differs"]
    assert _kept_traceback(lines[0], 3, tmp_path).read_text() == "Traceback (most recent...)\n"
    monkeypatch.setenv("PTDP_TRACEBACK", "1")
    out = io.StringIO()
    print_user_error(3, "ckpt/part.safetensors: sha256 differs", "Traceback (most recent...)\n", out)
    assert out.getvalue().splitlines() == ["Traceback (most recent...)",
                                           "ptdp: error: rank 3: ckpt/part.safetensors: sha256 differs"]


def _report(rank, at, lost_peer, message="boom"):
    return RankFailure(rank=rank, time=at, lost_peer=lost_peer, user_error=False,
                       message=message, traceback=f"Traceback\nValueError: {message}\n")


def _ranks(processes=3, reports=(), exits=None, running=()):
    ranks = _Ranks([SimpleNamespace(pid=None, sentinel=rank) for rank in range(processes)], [],
                   set())
    ranks.running = {rank: rank for rank in running}
    ranks.reports = {report.rank: report for report in reports}
    ranks.exits = exits or {}
    return ranks


def test_the_verdict_prefers_the_earliest_root_cause_over_earlier_echoes():
    ranks = _ranks(reports=[_report(1, 10.0, True), _report(2, 11.0, True),
                            _report(0, 13.0, False, "disk full")], exits={1: (1, 10.1), 2: (1, 11.1)})
    assert ranks.verdict().rank == 0 and "disk full" in ranks.verdict().error
    ranks = _ranks(reports=[_report(0, 13.0, False, "later"), _report(2, 12.0, False, "first")])
    assert ranks.verdict().rank == 2
    # Killed (no report) counts as a root cause, at the moment it was seen.
    ranks = _ranks(reports=[_report(0, 10.0, True), _report(1, 12.0, False)],
                   exits={0: (1, 10.1), 2: (-signal.SIGKILL, 11.0)})
    assert str(ranks.verdict()) == "rank 2 failed (killed by SIGKILL)"


def test_the_verdict_names_the_silent_rank_when_every_report_is_an_echo():
    ranks = _ranks(reports=[_report(0, 10.0, True, "Timed out waiting 3000ms for recv operation")],
                   exits={0: (1, 10.1)}, running=[1, 2])
    ranks.reports[2] = _report(2, 10.5, True)
    verdict = ranks.verdict()
    assert verdict.rank == 1 and verdict.unresponsive
    assert str(verdict) == ("rank 1 stopped responding; the other ranks gave up waiting (rank 0: "
                            "Timed out waiting 3000ms for recv operation)")
    # Nobody silent: the first echo, with its traceback.
    ranks = _ranks(reports=[_report(0, 10.0, True, "closed"), _report(1, 9.0, True, "reset")])
    assert ranks.verdict().rank == 1 and "reset" in str(ranks.verdict())


def _disk_full_on_rank_0(env, payload):
    init_process_group(env, "gloo", LONG_TIMEOUT)
    if env.rank != 0:
        dist.all_reduce(torch.ones(1))  # fails when rank 0 tears down its process group
        return
    try:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "ckpt/iter_0000003.partial/part.st")
    finally:
        dist.destroy_process_group()  # the peers lose their connections now...
        time.sleep(1)  # ...and report before this rank does


def test_the_failing_rank_is_reported_not_its_peers_lost_connections():
    start = time.monotonic()
    with pytest.raises(LocalJobFailed) as failure:
        launch_local(3, _disk_full_on_rank_0, None)
    assert failure.value.rank == 0 and failure.value.user_error
    assert str(failure.value) == "rank 0: ckpt/iter_0000003.partial/part.st: No space left on device"
    assert "OSError" in failure.value.error
    assert time.monotonic() - start < PROMPT_SECONDS


def test_cli_prints_a_user_error_as_one_paragraph(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("PTDP_TRACEBACK", raising=False)
    monkeypatch.setattr("ptdp.launch.launch_local", lambda world, entry, payload, **options:
                        launch_local(world, _disk_full_on_rank_0, None))
    code = cli.main(["train", "--mock-data", "-t", "2", "--vocab-size", "64", "--train-iters", "1"])
    err = capsys.readouterr().err
    assert code == 1
    lines = err.splitlines()
    assert lines[-3] == "ptdp: stopped the 1 other rank"
    assert lines[-1] == "ptdp: error: rank 0: ckpt/iter_0000003.partial/part.st: No space left on device"
    saved = _kept_traceback(lines[-2], 0, tmp_path)
    assert "Traceback" not in err and "Traceback" in saved.read_text()


def _raising_worker(error):
    def worker(env, config):
        init_process_group(env, "gloo", LONG_TIMEOUT)
        try:
            raise error
        finally:
            dist.destroy_process_group()
    return worker


def test_under_torchrun_a_user_error_is_one_paragraph_and_a_bug_keeps_its_traceback(
        monkeypatch, capsys, tmp_path):
    """Under torchrun the rank itself prints: `main` knows the rank it joined as."""
    import ptdp.train.loop
    from ptdp.checkpoint.store import CheckpointError

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("PTDP_TRACEBACK", raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    train = ["train", "--mock-data", "--vocab-size", "64", "--train-iters", "1"]
    monkeypatch.setattr(ptdp.train.loop, "worker", _raising_worker(
        CheckpointError("ckpt/iter_0000002/part-pp0-tp0.safetensors: sha256 differs")))
    assert cli.main(train) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == ("ptdp: error: rank 0: ckpt/iter_0000002/part-pp0-tp0.safetensors: "
                                    "sha256 differs")
    assert "Traceback" not in err
    monkeypatch.setattr(ptdp.train.loop, "worker", _raising_worker(ZeroDivisionError("a bug")))
    with pytest.raises(ZeroDivisionError):
        cli.main(train)
    # A mistake found before launching is still a usage error (exit 2).
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name)
    assert cli.main(["train", "--mock-data", "--num-attention-heads", "3", "-t", "2"]) == 2


def _classifies_real_failures(env, folder):
    """Rank 0 receives from a rank that left (1) and from one that is silent (2)."""
    init_process_group(env, "gloo", LONG_TIMEOUT)
    short = dist.new_group([0, 1, 2], timeout=timedelta(seconds=2))
    dist.barrier()
    if env.rank == 1:
        os._exit(0)  # leaves without a word: its connections close
    if env.rank == 2:  # alive, but never sends, until rank 0 has seen its timeout
        _wait_for(lambda: Path(folder, "seen.json").exists())
        os._exit(0)
    seen = {}
    for name, peer in (("left", 1), ("silent", 2)):
        try:
            dist.recv(torch.ones(1), src=peer, group=short)
        except Exception as error:  # noqa: BLE001 - classified below
            report = RankFailure.from_exception(env.rank, error)
            seen[name] = [report.lost_peer, report.user_error, report.message]
    written = Path(folder, "seen.json.partial")
    written.write_text(json.dumps(seen))
    written.rename(Path(folder, "seen.json"))  # whole when rank 2 sees it
    os._exit(0)


def test_real_gloo_failures_of_a_peer_are_recognised(tmp_path):
    launch_local(3, _classifies_real_failures, str(tmp_path))
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["left"][:2] == [True, False] and "by peer" in seen["left"][2].lower()
    assert seen["silent"][:2] == [True, False] and "timed out" in seen["silent"][2].lower()


def _stops_on_rank_1(env, payload):
    init_process_group(env, "gloo", LONG_TIMEOUT)
    short = dist.new_group([0, 1], timeout=timedelta(seconds=3))
    dist.barrier()
    if env.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.all_reduce(torch.ones(1), group=short)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_a_stopped_rank_is_named_when_the_others_time_out(short_launcher_waits):
    start = time.monotonic()
    with pytest.raises(LocalJobFailed) as failure:
        launch_local(2, _stops_on_rank_1, None)
    assert failure.value.rank == 1 and failure.value.unresponsive
    assert str(failure.value).startswith("rank 1 stopped responding: its process is stopped "
                                         "(state T: SIGSTOP, or a debugger)")
    assert time.monotonic() - start < PROMPT_SECONDS


# --------------------------------------------------------------------------- signals

def _wait_for(condition, seconds=PROMPT_SECONDS) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _exits_on_the_second_sigterm(env, folder):
    received = []

    def on_sigterm(signum, frame):
        received.append(signum)
        Path(folder, f"rank{env.rank}-sigterm{len(received)}").touch()

    signal.signal(signal.SIGTERM, on_sigterm)
    Path(folder, f"rank{env.rank}-ready").touch()
    if not _wait_for(lambda: len(received) >= 2):
        raise AssertionError("no second SIGTERM came")


def test_signals_to_the_launcher_reach_every_rank(tmp_path):
    world = 2

    def every_rank_has(name):
        return lambda: all((tmp_path / f"rank{rank}-{name}").exists() for rank in range(world))

    def signal_the_launcher_twice():
        for step in ("ready", "sigterm1"):
            if not _wait_for(every_rank_has(step)):
                return
            os.kill(os.getpid(), signal.SIGTERM)

    stray = []  # a SIGTERM that arrives when launch_local does not forward must not end pytest

    def catch_stray(signum, frame):
        stray.append(signum)

    previous = signal.signal(signal.SIGTERM, catch_stray)
    try:
        sender = threading.Thread(target=signal_the_launcher_twice, daemon=True)
        sender.start()
        launch_local(world, _exits_on_the_second_sigterm, str(tmp_path),
                     forward_signals=(signal.SIGTERM,))  # returns: every rank exited 0
        sender.join(PROMPT_SECONDS)
        assert every_rank_has("sigterm2")() and not stray
        # Put back as it was; within the request's window, behind a guard
        # that absorbs repeats of it first (test_signals_and_processes.py).
        handler = signal.getsignal(signal.SIGTERM)
        assert handler is catch_stray or (isinstance(handler, _RepeatsAbsorbed)
                                          and handler.previous is catch_stray)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _fails_while_rank_1_outlives_sigterm(env, folder):
    if env.rank == 1:
        signal.signal(signal.SIGTERM, lambda signum, frame: None)  # "save at the next iteration"
        Path(folder, "rank1.pid").write_text(str(os.getpid()))
        time.sleep(10 * PROMPT_SECONDS)
    _wait_for(lambda: Path(folder, "rank1.pid").exists())
    raise ValueError("rank 0 fails")


def test_a_failed_job_ends_ranks_that_outlive_sigterm(tmp_path, short_launcher_waits):
    start = time.monotonic()
    with pytest.raises(LocalJobFailed, match="ValueError: rank 0 fails"):
        launch_local(2, _fails_while_rank_1_outlives_sigterm, str(tmp_path))
    assert time.monotonic() - start < PROMPT_SECONDS
    if Path("/proc/self").exists():
        assert not Path(f"/proc/{int((tmp_path / 'rank1.pid').read_text())}").exists()


# --------------------------------------------------------------------------- loopback only

def _listening_addresses(pid: int, *, besides: frozenset = frozenset()) -> list:
    """The addresses process `pid` listens on over TCP (Linux /proc), leaving
    out the sockets (inodes) in `besides`."""
    return [address for inode, address in _listening_sockets(pid) if inode not in besides]


def _listening_sockets(pid: int) -> list[tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address]]:
    """(socket inode, address) of each TCP socket process `pid` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    addresses = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for row in path.read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(fields[1].split(":")[0])
            # The kernel prints each 32-bit word in host (little-endian) order.
            packed = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            addresses.append((fields[9], ipaddress.ip_address(socket.inet_ntop(family, packed))))
    return addresses


def _is_loopback(address) -> bool:
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def _reports_listeners(env, payload):
    folder, supervisor_had = payload
    init_process_group(env, "gloo", LONG_TIMEOUT)
    dist.new_group([0, 1])  # each process group opens its own gloo sockets
    dist.barrier()
    own = [str(a) for a in _listening_addresses(os.getpid())]
    supervisor = ([str(a) for a in _listening_addresses(os.getppid(), besides=supervisor_had)]
                  if env.rank == 0 else [])
    Path(folder, f"rank{env.rank}.json").write_text(json.dumps(
        {"own": own, "supervisor": supervisor, "gloo": os.environ.get("GLOO_SOCKET_IFNAME")}))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc/net/tcp")
def test_a_local_job_listens_on_loopback_only(tmp_path):
    # The test session's own sockets (other tests' process pools) are not the job's.
    before = frozenset(inode for inode, _ in _listening_sockets(os.getpid()))
    launch_local(2, _reports_listeners, (str(tmp_path), before))
    seen = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    supervisor = [ipaddress.ip_address(a) for a in seen[0]["supervisor"]]
    ranks = [ipaddress.ip_address(a) for rank in seen for a in rank["own"]]
    assert supervisor and all(ranks for rank in seen)  # the store and gloo were found
    assert all(_is_loopback(address) for address in supervisor + ranks), (supervisor, ranks)
    # gloo binds where the host name resolves, loopback on some machines only: told to use it
    if "lo" in [name for _, name in socket.if_nameindex()]:
        assert [rank["gloo"] for rank in seen] == ["lo", "lo"]
