"""Faults, run as real processes: a rank killed mid-training, a job killed
while writing a checkpoint, Ctrl-C. The job ends promptly with a clear
message, no rank is left behind, and the last complete checkpoint resumes."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ptdp.checkpoint.store import read_metadata, resolve, verify_file
from tests.test_train_cli import _spawned_children

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ["train", "--mock-data", "--vocab-size", "256", "--num-layers", "2", "--hidden-size", "32",
         "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
         "--hidden-dropout", "0", "--attention-dropout", "0"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _start(*argv) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ptdp", *TRAIN, *argv], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _gone(pids) -> bool:
    return all(not Path(f"/proc/{pid}").exists()
               or "zombie" in Path(f"/proc/{pid}/status").read_text() for pid in pids)


def _check_complete(save: Path) -> dict:
    directory = resolve(save)
    metadata = read_metadata(directory)
    for file in metadata["files"]:
        verify_file(directory, file, metadata)
    return metadata


def test_killed_rank_ends_the_job_and_the_last_checkpoint_resumes(tmp_path):
    save = tmp_path / "ckpt"
    process = _start("-d", "2", "--train-iters", "100000", "--save", str(save),
                     "--save-interval", "3")
    try:
        deadline = time.monotonic() + 120
        while not (save / "latest").exists():  # a checkpoint exists, training goes on
            assert time.monotonic() < deadline and process.poll() is None, process.stderr.read()
            time.sleep(0.2)
        ranks = _spawned_children(process.pid)
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], signal.SIGKILL)
        killed_at = time.monotonic()
        _, stderr = process.communicate(timeout=120)
        assert time.monotonic() - killed_at < 60
    finally:
        process.kill()
    assert process.returncode == 1
    assert "ptdp: error: rank 1 failed (killed by SIGKILL)" in stderr, stderr
    assert _gone(ranks)
    metadata = _check_complete(save)  # whatever was being written, latest is whole
    done = metadata["iteration"]
    assert done % 3 == 0 and done >= 3
    resumed = subprocess.run([sys.executable, "-m", "ptdp", *TRAIN, "-d", "2", "--train-iters",
                              str(done + 2), "--load", str(save),
                              "--use-checkpoint-opt_param-scheduler"], cwd=ROOT, env=ENV,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {resolve(save)} after iteration {done}" in resumed.stdout
    assert f"iteration {done + 2:>5}/{done + 2}" in resumed.stdout


KILL_WHILE_SAVING = textwrap.dedent("""
    import os, signal, sys
    import torch
    from ptdp.config import Config, DataConfig, ModelConfig, TrainConfig
    from ptdp.parallel.topology import ParallelContext
    from ptdp.checkpoint import snapshot as checkpoint_save
    from ptdp.train.loop import Trainer

    save, stage = sys.argv[1], sys.argv[2]
    config = Config(model=ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                                      seq_length=16, vocab_size=64),
                    train=TrainConfig(train_iters=4), data=DataConfig(mock_data=True))
    trainer = Trainer(config, ParallelContext.single(), torch.device("cpu"))
    trainer.step(0)
    trainer.save(save, 1)
    trainer.step(1)

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    # Killed after the tensors are written but before the rename ("rename"),
    # or between the rename and moving `latest` ("latest").
    if stage == "rename":
        checkpoint_save.publish_directory = die
    else:
        checkpoint_save.point_latest = die
    trainer.save(save, 2)
""")


@pytest.mark.parametrize("stage", ["rename", "latest"])
def test_killed_while_saving_leaves_latest_on_the_complete_checkpoint(tmp_path, stage, capsys):
    save = tmp_path / "ckpt"
    result = subprocess.run([sys.executable, "-c", KILL_WHILE_SAVING, str(save), stage], cwd=ROOT,
                            env=ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert (save / "latest").read_text().strip() == "iter_0000001"
    assert _check_complete(save)["iteration"] == 1
    # The next run resumes from it and its own save replaces the leftovers
    # (one process: through ptdp's entry point in this process).
    from ptdp.cli import main

    capsys.readouterr()
    status = main([*TRAIN, "--vocab-size", "64", "--train-iters", "2", "--load", str(save),
                   "--save", str(save), "--use-checkpoint-opt_param-scheduler"])
    resumed = capsys.readouterr()
    assert status == 0, resumed.err
    assert "after iteration 1" in resumed.out
    assert _check_complete(save)["iteration"] == 2
    assert not list(save.glob("*.partial"))


def test_ctrl_c_stops_every_rank(tmp_path):
    process = _start("-d", "2", "--train-iters", "100000")
    try:
        assert "ptdp: starting 2 processes" in process.stdout.readline()
        assert "ptdp: 2 processes" in process.stdout.readline()
        assert "iteration" in process.stdout.readline()
        ranks = _spawned_children(process.pid)
        assert len(ranks) == 2
        os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130 and "ptdp: interrupted" in stderr
    deadline = time.monotonic() + 10
    while not _gone(ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(ranks)
