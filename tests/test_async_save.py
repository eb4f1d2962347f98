"""--async-save: the snapshot in host memory, the write in the background,
the publication only when every rank's part is complete; its checkpoints
equal a synchronous save's byte for byte and resume the same bitwise; a
failed write is one paragraph and leaves `latest` alone; a SIGTERM during a
background write waits for it and exits 0."""

import dataclasses
import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import ptdp.checkpoint.snapshot as checkpoint_save
from ptdp.config import Config, ConfigError, ModelConfig, ParallelConfig, TrainConfig, validate
from ptdp.errors import RankFailure
from ptdp.parallel.topology import ParallelContext, RankGrid
from ptdp.checkpoint.async_writer import AsyncSaveError, AsyncSaver
from ptdp.checkpoint.store import read_metadata, resolve
from ptdp.checkpoint.integrity import SEAL
from ptdp.train.loop import Trainer
from ptdp.checkpoint.retention import LINEAGE
from tests.test_checkpoint import CPU, MODEL, _config
from tests.test_fault_matrix import mount_tmpfs, small_disk  # noqa: F401 - fixtures

DROPOUT = dataclasses.replace(MODEL, hidden_dropout=0.1, attention_dropout=0.1)


def _trainer(**train) -> Trainer:
    return Trainer(_config(model=DROPOUT, **train), ParallelContext.single(), CPU)


def _published(saver: AsyncSaver, seconds: float = 60.0) -> Path:
    """Poll, as iteration boundaries do, until the save is published."""
    deadline = time.monotonic() + seconds
    while (published := saver.poll()) is None:
        assert time.monotonic() < deadline, "the background write never completed"
        time.sleep(0.01)
    return published


def _contents(directory: Path) -> dict:
    """A checkpoint's files but its metadata, by name: each tensor file as its
    tensors' bytes (with their dtypes and shapes) and its header's metadata,
    every other file (the random states) as its bytes. (A tensor file's own
    bytes are not compared: safetensors writes the header's metadata in no
    fixed order.)"""
    from safetensors import safe_open

    contents = {}
    for path in sorted(directory.rglob("*")):
        name = path.relative_to(directory).as_posix()
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as file:
                contents[name] = (file.metadata(), {
                    key: (file.get_tensor(key).dtype, file.get_tensor(key).shape,
                          file.get_tensor(key).contiguous().view(torch.uint8).flatten().tolist())
                    for key in file.keys()})
        elif path.is_file() and path.name != "metadata.json":
            contents[name] = path.read_bytes()
    return contents


def _same_checkpoint(got: Path, want: Path) -> None:
    """The same tensors byte for byte, the same random states, and metadata
    equal but for the run's identity (each trainer is a run of its own) and
    the seal over it."""
    wanted = _contents(want)
    assert any(name.endswith(".safetensors") for name in wanted) and any(
        name.startswith("rng/") for name in wanted)
    assert _contents(got) == wanted
    ours, theirs = (json.loads((d / "metadata.json").read_text()) for d in (got, want))
    for metadata in (ours, theirs):
        metadata.pop(LINEAGE), metadata.pop(SEAL)
        metadata.pop("files")  # (the tensor files' sha256: their headers' order, above)
    assert ours == theirs


@pytest.fixture
def held_writes(monkeypatch):
    """Background tensor writes wait until `.set()`; `.started` is set when one begins."""
    gate, started = threading.Event(), threading.Event()
    write = checkpoint_save.write_safetensors

    def held(path, tensors):
        if threading.current_thread() is not threading.main_thread():
            started.set()
            assert gate.wait(120), "the test never released the write"
        write(path, tensors)

    monkeypatch.setattr(checkpoint_save, "write_safetensors", held)
    gate.started = started
    yield gate
    gate.set()


# ------------------------------------------------------------------ the writer, one process


def test_training_goes_on_during_the_write_and_only_a_complete_checkpoint_is_published(
        tmp_path, held_writes):
    # One trainer after the other: their random streams include the process's own.
    twin = _trainer()
    twin.step(0)
    synchronous = twin.save(str(tmp_path / "sync"), 1)
    trainer = _trainer()
    trainer.step(0)
    saver = AsyncSaver(trainer, tmp_path / "async")
    saver.save(1)
    assert held_writes.started.wait(60)
    # The weights and optimizer state change under the write: the snapshot is a copy.
    trainer.step(1)
    save = tmp_path / "async"
    for _ in range(3):  # writer still busy: nothing is published
        assert saver.poll() is None
    assert (save / "iter_0000001.partial").is_dir()
    assert not (save / "iter_0000001").exists() and not (save / "latest").exists()
    held_writes.set()
    published = _published(saver)
    assert published == save / "iter_0000001" == resolve(save)
    assert not (save / "iter_0000001.partial").exists()
    _same_checkpoint(published, synchronous)
    read_metadata(published)  # sealed and consistent


def test_a_failed_background_write_is_one_paragraph_and_latest_does_not_move(tmp_path, monkeypatch):
    trainer = _trainer()
    trainer.step(0)
    saver = AsyncSaver(trainer, tmp_path)
    saver.save(1)
    assert saver.wait() == tmp_path / "iter_0000001"

    def full_disk(path, tensors):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(checkpoint_save, "write_safetensors", full_disk)
    trainer.step(1)
    saver.save(2)  # the snapshot is taken; the write fails in the background
    with pytest.raises(AsyncSaveError) as raised:
        saver.wait()
    message = str(raised.value)
    assert "\n" not in message
    assert f"{tmp_path / 'iter_0000002.partial'}/part-pp0-tp0.safetensors: No space left on device" \
        in message
    assert f"`latest` still names {tmp_path / 'iter_0000001'}" in message
    assert (tmp_path / "latest").read_text().strip() == "iter_0000001"
    assert not (tmp_path / "iter_0000002.partial").exists() and not (tmp_path / "iter_0000002").exists()
    report = RankFailure.from_exception(0, raised.value)  # what the launcher shows: no traceback
    assert report.user_error and report.message == message
    assert saver.in_flight is None and resolve(tmp_path) == tmp_path / "iter_0000001"


def test_one_save_in_flight_and_keep_last(tmp_path):
    """A save first publishes the one in flight; --keep-last prunes as a
    synchronous save does, never the checkpoint `latest` names."""
    trainer = _trainer(keep_last=2)
    saver = AsyncSaver(trainer, tmp_path, keep_last=2)
    for i in range(4):
        trainer.step(i)
        previous = saver.save(i + 1)
        assert previous == (tmp_path / f"iter_{i:07d}" if i else None)
        if i:  # published before the new snapshot was taken
            assert (tmp_path / "latest").read_text().strip() == f"iter_{i:07d}"
    assert saver.wait() == tmp_path / "iter_0000004"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000003", "iter_0000004", "latest"]


def test_async_save_needs_save():
    config = Config(model=ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4),
                    train=TrainConfig(async_save=True))
    with pytest.raises(ConfigError, match="--async-save writes checkpoints in the background, but "
                                          "no --save DIR is given"):
        validate(config)


# ------------------------------------------------------------------ every rank, resumed bitwise

# (no attention dropout: context parallelism's attention has none yet)
MOE = dataclasses.replace(DROPOUT, attention_dropout=0.0, num_experts=4, moe_ffn_hidden_size=32,
                          moe_router_topk=2, moe_aux_loss_coeff=0.01)
LAYOUTS = {  # four ranks each: tensor × pipeline (distributed optimizer), experts × context
    "t2-p2": (RankGrid(tp=2, dp=1, pp=2), DROPOUT, {"use_distributed_optimizer": True,
                                                     "bf16": True}),
    "c2-d2-ep2": (RankGrid(tp=1, dp=2, pp=1, cp=2, ep=2, etp=1), MOE, {}),
}
STOP, MORE = 2, 2


def _async_and_sync_resume(rank, save, name):
    """Two identical runs save after STOP iterations, one asynchronously
    (training one more iteration while it writes), one synchronously; each
    checkpoint is resumed by a new trainer for MORE iterations. Returns the
    checks of this rank: same files, same losses, same weights."""
    grid, model, flags = LAYOUTS[name]
    ctx = ParallelContext.build(grid)
    config = Config(model=model,
                    parallel=ParallelConfig(tensor_model_parallel_size=grid.tp,
                                            pipeline_model_parallel_size=grid.pp,
                                            data_parallel_size=grid.dp,
                                            context_parallel_size=grid.cp,
                                            expert_model_parallel_size=grid.ep,
                                            expert_tensor_parallel_size=grid.etp),
                    train=dataclasses.replace(_config().train, train_iters=STOP + MORE, **flags),
                    data=_config().data)
    validate(config, world_size=4)
    directories = {kind: Path(save) / name / kind for kind in ("async", "sync")}
    for kind, directory in directories.items():
        trainer = Trainer(config, ctx, CPU)
        for i in range(STOP):
            trainer.step(i)
        if kind == "sync":
            trainer.save(str(directory), STOP)
            continue
        saver = AsyncSaver(trainer, directory, announce=False)
        saver.save(STOP)
        trainer.step(STOP)  # the write runs under training
        saver.poll()
        saver.wait()
    results = {}
    for kind, directory in directories.items():
        resumed = Trainer(config, ctx, CPU, start=(STOP, STOP * 8))
        resumed.load(str(directory))
        losses = [resumed.step(i)[0]["loss"] for i in range(STOP, STOP + MORE)]
        results[kind] = (losses, resumed.buffer.param_data.clone(), resumed.optimizer.exp_avg.clone())
    same_files = _contents(resolve(directories["async"])) == _contents(resolve(directories["sync"]))
    (got_losses, got_weights, got_moment), (want_losses, want_weights, want_moment) = \
        results["async"], results["sync"]
    return (same_files, got_losses == want_losses, torch.equal(got_weights, want_weights),
            torch.equal(got_moment, want_moment), got_losses)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_resume_from_an_async_checkpoint_equals_resume_from_a_sync_one_bitwise(pools, tmp_path,
                                                                              name):
    results = pools(4).run(_async_and_sync_resume, str(tmp_path), name)
    for rank, (same_files, same_losses, same_weights, same_moment, _) in enumerate(results):
        assert same_files and same_losses and same_weights and same_moment, rank
    assert any(losses[0] is not None for *_, losses in results)  # a rank computed the loss


# ------------------------------------------------------------------ a SIGTERM during a write

SLOW_WRITES = textwrap.dedent('''
    """Test hook: every background checkpoint write announces itself, then takes
    PTDP_TEST_WRITE_SECONDS (only the checkpoint PTDP_TEST_SLOW_ONLY names, if set)."""
    import os
    import threading
    import time

    def _install():
        import ptdp.checkpoint.snapshot as checkpoint_save
        write = checkpoint_save.Snapshot.write

        def slow(self, durable=False):
            slow_only = os.environ.get("PTDP_TEST_SLOW_ONLY")
            if durable and slow_only in (None, self.final.name):
                stamp = os.path.join(os.environ["PTDP_TEST_STAMPS"], self.final.name)
                with open(stamp, "w"):
                    pass
                time.sleep(float(os.environ["PTDP_TEST_WRITE_SECONDS"]))
            return write(self, durable)

        checkpoint_save.Snapshot.write = slow

    if os.environ.get("PTDP_TEST_STAMPS"):
        _install()
''')


def test_sigterm_during_a_background_write_waits_for_it_and_exits_0(tmp_path):
    from tests.test_fault_matrix import EXIT_BOUND_SECONDS, MODEL as SMALL, ROOT, _newest_loads

    save, stamps = tmp_path / "ckpt", tmp_path / "stamps"
    # The write the signal meets is slow; the final save after it need not be.
    env = _slow_writes_env(tmp_path, 3, PTDP_TEST_SLOW_ONLY="iter_0000003")
    process = subprocess.Popen(
        [sys.executable, "-m", "ptdp", "train", *SMALL, "-d", "2", "--train-iters", "100000",
         "--save", str(save), "--save-interval", "3", "--async-save"], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (stamps / "iter_0000003").exists():
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the first save never started"
            time.sleep(0.02)
        os.kill(process.pid, signal.SIGTERM)  # the write of iter_0000003 is under way
        stdout, stderr = process.communicate(timeout=EXIT_BOUND_SECONDS + 60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, stderr
    assert f"ptdp: saved checkpoint {save / 'iter_0000003'} (--async-save: " in stdout
    stopped = int(stdout.split("stopped after iteration ")[1].split()[0])
    assert (f"SIGTERM received; saved {save / f'iter_{stopped:07d}'}; resume with --load "
            f"{save}") in stdout
    assert _newest_loads(save) == stopped  # `latest`: complete, sealed, every file checked
    assert read_metadata(save / "iter_0000003")["iteration"] == 3
    assert not list(save.glob("*.partial"))


def test_a_second_signal_during_a_background_write_leaves_only_a_partial_directory(tmp_path):
    """Stopping at once (a second SIGTERM after the 3 s window) while a write
    is in flight: `latest` stays on the complete checkpoint before it."""
    from tests.test_fault_matrix import EXIT_BOUND_SECONDS, MODEL as SMALL, ROOT, _newest_loads

    save, stamps = tmp_path / "ckpt", tmp_path / "stamps"
    process = subprocess.Popen(
        [sys.executable, "-m", "ptdp", "train", *SMALL, "--train-iters", "100000", "--save",
         str(save), "--save-interval", "2", "--async-save"], cwd=ROOT,
        env=_slow_writes_env(tmp_path, 30, PTDP_TEST_SLOW_ONLY="iter_0000004"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (stamps / "iter_0000004").exists():  # iter_0000002 is published; 4 is writing
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the second save never started"
            time.sleep(0.02)
        os.kill(process.pid, signal.SIGTERM)
        time.sleep(3.5)
        os.kill(process.pid, signal.SIGTERM)
        _, stderr = process.communicate(timeout=EXIT_BOUND_SECONDS)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode != 0 and "second SIGTERM" in stderr, stderr
    assert (save / "latest").read_text().strip() == "iter_0000002"
    assert _newest_loads(save) == 2
    assert sorted(p.name for p in save.iterdir() if p.name.startswith("iter_")) == [
        "iter_0000002", "iter_0000004.partial"]


def test_a_full_disk_under_async_save_is_one_paragraph_and_the_previous_checkpoint_loads(
        small_disk):
    from tests.test_fault_matrix import MODEL as SMALL, ROOT, _env, _newest_loads

    save = small_disk / "ckpt"  # room for one checkpoint and a half
    result = subprocess.run(
        [sys.executable, "-m", "ptdp", "train", *SMALL, "-p", "2", "--train-iters", "6", "--save",
         str(save), "--save-interval", "1", "--async-save"], cwd=ROOT, env=_env(),
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ptdp: error: rank ") and "(--async-save) failed" in last, result.stderr
    assert "No space left on device" in last and f"`latest` still names {save / 'iter_0000001'}" \
        in last, result.stderr
    assert "Traceback" not in result.stderr
    assert _newest_loads(save) == 1 and not list(save.glob("*.partial"))


# ------------------------------------------------------------------ the other stops wait too


def _slow_writes_env(tmp_path: Path, seconds: float, **extra) -> dict:
    """The environment of a job whose background writes take `seconds` each."""
    from tests.test_fault_matrix import ROOT, _env

    hooks, stamps = tmp_path / "hooks", tmp_path / "stamps"
    hooks.mkdir(exist_ok=True)
    stamps.mkdir(exist_ok=True)
    (hooks / "sitecustomize.py").write_text(SLOW_WRITES)
    return _env(PTDP_TEST_STAMPS=str(stamps), PTDP_TEST_WRITE_SECONDS=str(seconds),
                PYTHONPATH=os.pathsep.join([str(hooks), str(ROOT)]), TMPDIR=str(tmp_path), **extra)


def test_exit_interval_and_divergence_stops_wait_for_the_save_in_flight(tmp_path):
    """Each write takes a second, so the stop finds the save in flight."""
    from tests.test_stopping import ROOT, TRAIN, _finite, _records

    def train(*argv):
        return subprocess.run([sys.executable, "-m", "ptdp", *TRAIN, *argv, "--async-save"],
                              cwd=ROOT, env=_slow_writes_env(tmp_path, 1), capture_output=True,
                              text=True, timeout=300)

    save = tmp_path / "ckpt"
    stopped = train("--train-iters", "10", "--exit-interval", "4", "--save", str(save),
                    "--save-interval", "3")
    assert stopped.returncode == 0, stopped.stderr
    assert (f"ptdp: stopped after iteration 4 of 10: --exit-interval 4 reached; saved "
            f"{save}/iter_0000004; resume with --load {save}") in stopped.stdout
    assert f"ptdp: saved checkpoint {save}/iter_0000003 (--async-save" in stopped.stdout
    assert sorted(p.name for p in save.iterdir() if p.name.startswith("iter_")) == [
        "iter_0000003", "iter_0000004"]
    assert read_metadata(resolve(save))["iteration"] == 4

    save, metrics = tmp_path / "diverged", tmp_path / "metrics.jsonl"
    diverged = train("--train-iters", "20", "--lr", "1e6", "--clip-grad", "0", "--save",
                     str(save), "--save-interval", "1", "--metrics-file", str(metrics))
    assert diverged.returncode == 1, diverged.stdout + diverged.stderr
    bad = _records(metrics)[-1]
    assert not all(map(_finite, (bad["loss"], bad["grad_norm"])))
    assert "training has diverged" in diverged.stderr and "Traceback" not in diverged.stderr
    # The save in flight (the last good iteration's) was published before the run stopped.
    newest = save / f"iter_{bad['iteration'] - 1:07d}"
    assert f"saved checkpoint {newest} (--async-save" in diverged.stdout
    assert read_metadata(resolve(save))["iteration"] == bad["iteration"] - 1
    assert not list(save.glob("*.partial")) and not list(save.glob(f"iter_{bad['iteration']:07d}*"))
