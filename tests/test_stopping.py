"""Runs that stop before --train-iters: graceful-exit signals, --exit-interval,
--exit-duration-in-mins, and divergence (a non-finite loss or gradient norm,
or too many skipped fp16 steps). The multi-process cases (a signal to one
rank, to the launcher, to torchrun; bitwise resume) are in test_faults.py."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ptdp.checkpoint.store import read_metadata, resolve
from ptdp.config import signal_from_name
from ptdp.train.stopping import GracefulExit

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ["train", "--mock-data", "--vocab-size", "128", "--num-layers", "2", "--hidden-size", "32",
         "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
         "--hidden-dropout", "0", "--attention-dropout", "0"]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(autouse=True)
def private_temp_dir(tmp_path, monkeypatch):
    """The jobs' error reports (tracebacks kept for bug reports) land in this
    test's folder, not the machine's temp dir."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))


def _train(*argv, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ptdp", *TRAIN, *argv], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def train_here(tmp_path, monkeypatch, capsys):
    """_train for a one-process run that needs no process of its own (no
    signal, no clock from the process's start): through ptdp's entry point
    in this process, its error reports in this test's folder as well."""
    import tempfile

    from ptdp.cli import main

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def train(*argv) -> subprocess.CompletedProcess:
        capsys.readouterr()
        status = main([*TRAIN, *argv])
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["ptdp", *TRAIN, *argv], status, out, err)
    return train


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_signal_names_in_every_spelling():
    assert signal_from_name("SIGTERM") == signal.SIGTERM
    assert signal_from_name("term") == signal.SIGTERM
    assert signal_from_name("USR2") == signal.SIGUSR2
    with pytest.raises(KeyError):
        signal_from_name("SIGNOPE")


def _wait_for(condition, seconds=10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_a_signal_requests_a_stop_and_repeats_within_the_window_count_once():
    previous = signal.getsignal(signal.SIGUSR1)
    handler = GracefulExit(("SIGUSR1",), announce=False)
    try:
        assert handler.requested == 0
        os.kill(os.getpid(), signal.SIGUSR1)
        assert _wait_for(lambda: handler.requested == signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)  # the same request arriving a second way
        time.sleep(0.2)
        assert handler.requested == signal.SIGUSR1  # and this process is still alive
    finally:
        handler.uninstall()  # (close keeps it after a request: test_signals_and_processes.py)
    assert signal.getsignal(signal.SIGUSR1) == previous


SECOND_SIGNAL = textwrap.dedent("""
    import os, signal, time
    from ptdp.train import stopping
    stopping.REPEAT_WINDOW_SECONDS = 0.2
    handler = stopping.GracefulExit(("SIGTERM",), announce=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.6)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(600)
""")


def test_a_second_signal_after_the_window_stops_at_once():
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", SECOND_SIGNAL], cwd=ROOT, env=_env(),
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 128 + signal.SIGTERM, result.stderr
    assert "SIGTERM received: saving and stopping after the current iteration" in result.stdout
    assert "second SIGTERM: stopping at once" in result.stderr
    assert time.monotonic() - started < 300  # long before the 600 s sleep ends


def test_exit_interval_stops_saving_and_the_run_resumes(tmp_path, train_here):
    save = tmp_path / "ckpt"
    result = train_here("--train-iters", "10", "--exit-interval", "3", "--save", str(save))
    assert result.returncode == 0, result.stderr
    assert ("ptdp: stopped after iteration 3 of 10: --exit-interval 3 reached; saved "
            f"{save}/iter_0000003; resume with --load {save}") in result.stdout
    assert read_metadata(resolve(save))["iteration"] == 3
    # Megatron-LM's meaning: stop whenever the iteration is a multiple of N.
    again = train_here("--train-iters", "10", "--exit-interval", "3", "--load", str(save),
                       "--save", str(save))
    assert again.returncode == 0, again.stderr
    assert "stopped after iteration 6 of 10" in again.stdout


def test_exit_duration_stops_before_the_limit(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    # 6 ms: after the first iteration one more would not fit.
    result = _train("--train-iters", "50", "--exit-duration-in-mins", "0.0001",
                    "--metrics-file", str(metrics))
    assert result.returncode == 0, result.stderr
    assert "stopped after iteration 1 of 50: --exit-duration-in-mins 0.0001 would be passed" \
        in result.stdout
    assert "no --save given, so nothing was saved" in result.stdout
    assert [r["iteration"] for r in _records(metrics)] == [1]


def test_divergence_stops_the_run_without_saving_over_good_checkpoints(tmp_path, train_here):
    save, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    result = train_here("--train-iters", "20", "--lr", "1e6", "--clip-grad", "0", "--save",
                        str(save), "--save-interval", "1", "--metrics-file", str(metrics))
    assert result.returncode == 1, result.stdout + result.stderr
    records = _records(metrics)
    bad = records[-1]
    assert not all(map(_finite, (bad["loss"], bad["grad_norm"])))
    assert all(_finite(r["loss"]) and _finite(r["grad_norm"]) for r in records[:-1])
    assert f"iteration {bad['iteration']}: the" in result.stderr
    assert "training has diverged" in result.stderr and "Traceback" not in result.stderr
    # The newest checkpoint is the last good iteration's; nothing after it.
    assert read_metadata(resolve(save))["iteration"] == bad["iteration"] - 1
    assert not list(save.glob(f"iter_{bad['iteration']:07d}*"))


def _finite(value) -> bool:
    return value is not None and abs(value) != float("inf") and value == value


def test_divergence_check_can_be_turned_off(tmp_path, train_here):
    metrics = tmp_path / "metrics.jsonl"
    result = train_here("--train-iters", "5", "--lr", "1e6", "--clip-grad", "0",
                        "--no-check-for-nan-in-loss-and-grad", "--metrics-file", str(metrics))
    assert result.returncode == 0, result.stderr
    records = _records(metrics)
    assert len(records) == 5 and records[-1]["skipped"]


def test_fp16_stops_after_too_many_skipped_steps_in_a_row(tmp_path, train_here):
    metrics = tmp_path / "metrics.jsonl"
    result = train_here("--train-iters", "40", "--fp16", "--lr", "1e6", "--clip-grad", "0",
                        "--initial-loss-scale", "1024", "--hysteresis", "1",
                        "--max-consecutive-skipped-iterations", "4", "--metrics-file",
                        str(metrics))
    assert result.returncode == 1, result.stdout + result.stderr
    records = _records(metrics)
    assert [r["skipped"] for r in records[-4:]] == [True] * 4
    assert len(records) < 40
    assert f"iteration {records[-1]['iteration']}: 4 steps in a row were skipped" in result.stderr
    assert "--max-consecutive-skipped-iterations" in result.stderr
