"""Resume hygiene and one job per --save (issue 30, items 5 and 6): metrics
files are appended to behind a marker; a finished run resumed trains
nothing and says so; --save inside a checkpoint is refused; a --save
directory another job holds is refused naming the holder."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ptdp.cli import main
from ptdp.checkpoint.lock import LOCK_FILE, SaveDirectoryInUse, SaveLock

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length",
        "32", "--vocab-size", "512", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--mock-data", "--lr", "1e-3"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """SAVE after 2 iterations, and the metrics file that run wrote."""
    folder = tmp_path_factory.mktemp("hygiene")
    save, metrics = folder / "ckpt", folder / "m.jsonl"
    assert main(["train", *TINY, "--save", str(save), "--train-iters", "2", "--metrics-file",
                 str(metrics)]) == 0
    return save, metrics


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_resumed_run_appends_to_the_metrics_file_behind_a_marker(trained, tmp_path):
    save, first = trained
    metrics = tmp_path / "m.jsonl"
    metrics.write_bytes(first.read_bytes())
    assert main(["train", *TINY, "--load", str(save), "--save", str(tmp_path / "more"),
                 "--train-iters", "3", "--use-checkpoint-opt_param-scheduler", "--metrics-file",
                 str(metrics)]) == 0
    records = _records(metrics)
    assert [r.get("iteration") for r in records] == [1, 2, 2, 3]
    assert records[:2] == _records(first)  # the first run's lines, untouched
    marker = records[2]
    assert marker["event"] == "resume" and marker["checkpoint"].endswith("iter_0000002")
    assert "loss" not in marker and "loss" in records[3]


def test_resuming_a_finished_run_trains_nothing_and_says_so(trained, capsys):
    save, _ = trained
    before = sorted(p.name for p in save.iterdir())
    for iters, words in (("2", "ends there"), ("1", "ended before it")):
        assert main(["train", *TINY, "--load", str(save), "--save", str(save), "--train-iters",
                     iters]) == 0
        out = capsys.readouterr().out
        assert f"ptdp: nothing to train: --load {save}/iter_0000002 is at iteration 2, and " \
               f"--train-iters {iters} {words}; give a larger --train-iters" in out
        assert "starting" not in out
    assert sorted(p.name for p in save.iterdir()) == before


def test_save_inside_a_checkpoint_is_refused(trained, capsys):
    save, _ = trained
    for inside in (save / "iter_0000002", save / "iter_0000002" / "more", save / "iter_0000009"):
        assert main(["train", *TINY, "--load", str(save), "--save", str(inside),
                     "--train-iters", "4"]) == 2
        err = capsys.readouterr().err
        assert "is the directory that holds the iter_* checkpoints" in err, err
        assert f"use --save {save}" in err
    assert not (save / "iter_0000002" / "more").exists()
    # Another program's metadata.json above --save is no checkpoint.
    (save.parent / "metadata.json").write_text('{"format": "something else"}')
    from ptdp.checkpoint.store import save_inside_a_checkpoint
    assert save_inside_a_checkpoint(save.parent / "runs" / "ckpt") is None
    (save.parent / "metadata.json").unlink()


def test_a_save_directory_in_use_is_refused_naming_its_holder(tmp_path, capsys):
    save = tmp_path / "ckpt"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from ptdp.checkpoint.lock import SaveLock; "
         f"lock = SaveLock({str(save)!r}); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(["train", *TINY, "--save", str(save), "--train-iters", "1"]) == 2
        err = capsys.readouterr().err
        assert f"--save {save} is in use by another job, process {holder.pid} on " in err
        assert "Wait for it to end, or give this run another --save" in err
        with pytest.raises(SaveDirectoryInUse, match=f"process {holder.pid}"):
            SaveLock(save)  # what the first rank meets if both jobs passed the check together
        assert list(save.iterdir()) == [save / LOCK_FILE]  # nothing written meanwhile
    finally:
        holder.kill()
        holder.wait()
    # Killed: the kernel released its lock; the file it left locks nothing.
    assert (save / LOCK_FILE).exists()
    assert main(["train", *TINY, "--save", str(save), "--train-iters", "1"]) == 0
    assert sorted(p.name for p in save.iterdir()) == ["iter_0000001", "latest"]


def test_the_lock_is_held_for_the_run_and_removed_after(tmp_path):
    lock = SaveLock(tmp_path)
    record = json.loads((tmp_path / LOCK_FILE).read_text())
    assert record["pid"] == os.getpid() and record["command"]
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()
    with SaveLock(tmp_path):
        with pytest.raises(SaveDirectoryInUse):
            SaveLock(tmp_path)


def test_many_more_processes_than_cores_are_said_to_be_slow(tmp_path, capsys, monkeypatch):
    """-t 4 -p 4 -d 4 on 2 cores started 64 processes with no word about it."""
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    monkeypatch.setattr("ptdp.launch.launch_local", lambda *args, **kwargs: None)  # no job
    assert main(["train", *TINY, "--train-iters", "1", "-d", "4"]) == 0
    out = capsys.readouterr().out
    assert "ptdp: note: 4 processes share 1 CPU core: each waits for the others" in out
    monkeypatch.setattr(os, "cpu_count", lambda: 2)  # two processes a core: no note
    assert main(["train", *TINY, "--train-iters", "1", "-d", "4"]) == 0
    assert "share" not in capsys.readouterr().out
