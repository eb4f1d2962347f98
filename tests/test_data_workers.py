"""Data loading (issue 17): --num-workers N reads the training microbatches
in N background processes, giving the batches of N = 0 bit for bit (also in
a resumed run and along a batch-size ramp), ending with the run, also when a
SIGTERM to every process of the job asks it to save and stop;
--no-mmap-bin-files reads the tokens a memory map gives."""

import dataclasses
import json
import os
import pickle
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from ptdp.config import Config, ConfigError, DataConfig, ModelConfig, ParallelConfig, TrainConfig, validate
from ptdp.data.indexed import IndexedDataset, write_documents
from ptdp.data.loader import DataSettingsError, TrainingBatches
from ptdp.data.mock import MockGPTDataset
from ptdp.parallel.topology import ParallelContext
from ptdp.train.loop import Trainer

ROOT = Path(__file__).resolve().parents[1]
MEGATRON = ROOT / "tests" / "fixtures" / "megatron-indexed" / "megatron_gpt2_uint16"
CPU = torch.device("cpu")
EOD = 256
MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=257, make_vocab_size_divisible_by=8)
# A ramp from 4 to 8 samples: iterations of 2, then 4 microbatches of 2.
TRAIN = TrainConfig(micro_batch_size=2, global_batch_size=8, train_samples=48, lr=1e-2, seed=5,
                    lr_warmup_iters=1, rampup_batch_size=[4, 4, 8])


def _corpus(directory: Path) -> str:
    rng = np.random.default_rng(0)
    documents = [np.append(rng.integers(0, 256, rng.integers(10, 120)), EOD) for _ in range(40)]
    write_documents(directory / "corpus", documents, dtype=np.uint16)
    return str(directory / "corpus")


def _config(prefix: str, cache: Path, **data) -> Config:
    return Config(model=MODEL, parallel=ParallelConfig(), train=TRAIN,
                  data=DataConfig(data_path=[prefix], tokenizer_type="ByteLevelTokenizer",
                                  split="90,10,0", data_cache_path=str(cache), **data))


def _run(config: Config, start: tuple[int, int] = (0, 0)):
    """Each iteration's microbatches (as the step reads them) and loss."""
    trainer = Trainer(config, ParallelContext.single(), CPU, start=start)
    seen = []
    try:
        for iteration in range(trainer.start_iteration, trainer.train_iters):
            read = trainer.train_batches.read
            trainer.train_batches.read = lambda indices: seen.append(read(indices)) or seen[-1]
            record, _ = trainer.step(iteration)
            trainer.train_batches.read = read
            seen.append(record["loss"])
        workers = _worker_processes(trainer.train_batches)
    finally:
        trainer.train_batches.close()
    assert not any(process.is_alive() for process in workers)  # closed with the run
    return seen, bool(workers), trainer.consumed


def _worker_processes(batches: TrainingBatches) -> list:
    return list(batches._workers._workers) if batches._workers is not None else []


def _same(a, b) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


def test_workers_give_the_batches_of_the_training_process(tmp_path):
    prefix = _corpus(tmp_path)
    config = _config(prefix, tmp_path / "cache")
    alone, used_workers, consumed = _run(config)
    assert not used_workers and len(alone) > 10
    background, used_workers, _ = _run(dataclasses.replace(
        config, data=dataclasses.replace(config.data, num_workers=2)))
    assert used_workers and _same(alone, background)
    # Resumed after iteration 3, mid-ramp: the rest of the straight run's batches.
    resumed, _, _ = _run(dataclasses.replace(config, data=dataclasses.replace(config.data,
                                                                              num_workers=2)),
                         start=(3, consumed.before(3)))
    tensors = [x for x in alone if isinstance(x, torch.Tensor)]
    assert _same([x for x in resumed if isinstance(x, torch.Tensor)],
                 tensors[len(tensors) - sum(isinstance(x, torch.Tensor) for x in resumed):])


def test_reads_twice_and_outside_the_plan():
    """A rank holding the first and last stage (zbv) reads a microbatch
    twice; a request the plan does not hold is read here; a dataset error
    comes back with its own message; close ends the workers."""
    dataset = MockGPTDataset(50, 8, seed=1)
    config = Config(model=dataclasses.replace(MODEL, vocab_size=50),
                    data=DataConfig(mock_data=True, num_workers=2))
    order = [(0, range(0, 2)), (0, range(2, 4)), (1, range(8, 10)), (1, range(10, 12))]
    batches = TrainingBatches(dataset, config, order)
    expected = {r: torch.stack([dataset[i] for i in r]) for _, r in order}
    try:
        for indices in (range(0, 2), range(2, 4), range(0, 2), range(8, 10), range(4, 6),
                        range(10, 12), range(8, 10)):
            want = expected.get(indices, torch.stack([dataset[i] for i in indices]))
            assert torch.equal(batches.read(indices), want)
        workers = _worker_processes(batches)
        assert len(workers) == 2 and all(process.is_alive() for process in workers)
    finally:
        batches.close()
    assert not any(process.is_alive() for process in workers)

    small = Config(model=dataclasses.replace(MODEL, vocab_size=10),
                   data=DataConfig(mock_data=True, num_workers=1))
    failing = TrainingBatches(dataset, small, [(0, range(0, 2))])
    try:
        with pytest.raises(DataSettingsError, match="outside the vocabulary of 10"):
            failing.read(range(0, 2))
    finally:
        failing.close()


def test_num_workers_is_checked():
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="--num-workers"):
            validate(Config(data=DataConfig(mock_data=True, num_workers=bad)))
    validate(Config(data=DataConfig(mock_data=True, num_workers=3)))


def test_no_mmap_reads_the_tokens_of_the_map():
    expected = json.loads(Path(f"{MEGATRON}.expected.json").read_text())
    mapped, read = IndexedDataset(MEGATRON), IndexedDataset(MEGATRON, mmap_bin_files=False)
    assert read._data_map is None and read._bin_fd is not None
    assert [read[i].tolist() for i in range(len(read))] == expected
    for index, offset, length in ((0, 3, 5), (len(read) - 1, 1, None), (2, 0, 0)):
        got = read.get(index, offset, length)
        assert got.dtype == mapped.dtype and np.array_equal(got, mapped.get(index, offset, length))
    again = pickle.loads(pickle.dumps(read))  # a worker under spawn reopens it the same way
    assert again.mmap_bin_files is False and np.array_equal(again[1], mapped[1])


def test_no_mmap_reaches_the_training_data(tmp_path):
    prefix = _corpus(tmp_path)
    config = _config(prefix, tmp_path / "cache", mmap_bin_files=False)
    trainer = Trainer(config, ParallelContext.single(), CPU)
    mapped = Trainer(_config(prefix, tmp_path / "cache"), ParallelContext.single(), CPU)
    assert trainer.data.train.indexed.mmap_bin_files is False
    assert mapped.data.train.indexed.mmap_bin_files is True
    for i in range(12):
        assert np.array_equal(trainer.data.train[i], mapped.data.train[i])


def _processes_with(marker: str) -> list[int]:
    """Live processes whose environment holds `marker` (this user's)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as environ:
                if marker.encode() in environ.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def test_workers_survive_a_graceful_sigterm_and_end_with_the_run(tmp_path):
    """SIGTERM to every process of the job (as SLURM sends it): the run
    finishes its iteration and exits 0; then no process of it is left."""
    marker = f"PTDP_WORKERS_TEST={uuid.uuid4().hex}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PTDP_TEST_MARKER=marker)
    command = [sys.executable, "-m", "ptdp", "train", "--mock-data", "--num-layers", "2",
               "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
               "--vocab-size", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
               "--train-iters", "2000", "--log-interval", "1", "--num-workers", "2"]
    run = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output = []
        for line in run.stdout:
            output.append(line)
            if line.startswith("iteration"):
                running = _processes_with(marker)
                os.killpg(run.pid, signal.SIGTERM)
                break
        output.append(run.stdout.read())
        run.wait(timeout=120)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    text = "".join(output)
    assert len(running) == 3, text  # the run and its two readers
    assert run.returncode == 0 and "stopped after iteration" in text, text
    assert _processes_with(marker) == []
