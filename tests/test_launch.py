"""The local launcher supervises its ranks: a failing or vanished rank ends the
whole job quickly with its error, and no collective waits for ever."""

import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ptdp import cli
from ptdp.launch import LocalJobFailed, detect_env, init_process_group, launch_local

# Long enough that a job that relied on it to end would fail the test's bound.
LONG_TIMEOUT = timedelta(minutes=10)
# Generous for a loaded 2-core machine, far below LONG_TIMEOUT.
PROMPT_SECONDS = 60


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


def test_a_lost_peer_ends_in_the_collective_timeout():
    start = time.monotonic()
    with pytest.raises(LocalJobFailed) as failure:
        launch_local(2, _lost_peer, None)
    assert failure.value.rank == 0
    assert "timed out" in failure.value.error.lower() or "timeout" in failure.value.error.lower()
    assert time.monotonic() - start < PROMPT_SECONDS


def test_a_healthy_job_returns():
    launch_local(3, _succeeds, None)


def test_cli_reports_the_failing_rank_and_exits_non_zero(monkeypatch, capsys):
    """`ptdp train` turns a failed rank into exit code 1 and prints its error."""
    monkeypatch.setattr("ptdp.launch.launch_local",
                        lambda world, entry, payload: launch_local(world, _raise_on_rank_1, "via cli"))
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
