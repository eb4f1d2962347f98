"""Training on indexed datasets: the data flags, the demo corpus, which rank
reads what, the global batch under every d, exact resume, --eod-mask-loss,
and a parallel run on real data equal to one process."""

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ptdp.cli import main
from ptdp.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from ptdp.data.corpus import read_works
from ptdp.data.gpt_dataset import build_gpt_datasets, split_document_ranges
from ptdp.data.indexed import write_documents
from ptdp.data.loader import DataSettingsError, collate
from ptdp.data.sampler import microbatch_indices
from ptdp.parallel.topology import ParallelContext, RankGrid
from ptdp.train.loop import Trainer

EOD = 256
MODEL = ModelConfig(num_layers=6, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=257, make_vocab_size_divisible_by=8, hidden_dropout=0.0,
                    attention_dropout=0.0)
TRAIN = TrainConfig(micro_batch_size=2, global_batch_size=8, train_iters=4, lr=1e-2, seed=5,
                    lr_warmup_iters=1)
ROOT = Path(__file__).resolve().parents[1]


def _write_corpus(prefix: Path, documents: int = 40, seed: int = 0) -> str:
    """Documents of byte tokens, each ending in the end-of-document token."""
    rng = np.random.default_rng(seed)
    docs = [np.append(rng.integers(0, 256, rng.integers(10, 120)), EOD) for _ in range(documents)]
    write_documents(prefix, docs, dtype=np.uint16)
    return str(prefix)


def _config(data_path, t=1, p=1, d=1, cache=None, **data) -> Config:
    return Config(model=MODEL,
                  parallel=ParallelConfig(tensor_model_parallel_size=t, pipeline_model_parallel_size=p,
                                          data_parallel_size=d),
                  train=TRAIN,
                  data=DataConfig(data_path=data_path, tokenizer_type="ByteLevelTokenizer",
                                  split="90,10,0", data_cache_path=cache, **data))


def test_demo_corpus():
    works = read_works()
    assert len(works) == 42 and sum(len(text) for _, text in works) == 5_057_198
    assert not any(name.endswith("_gut_f.txt") for name, _ in works)  # no First Folio repeats
    assert any(text.startswith("THE TRAGEDY OF HAMLET") or "HAMLET" in text[:200] for _, text in works)
    # One document per work and contiguous splits: validation is whole works.
    train, valid, test = split_document_ranges(42, "949,50,1")
    assert (train, valid, test) == (range(0, 40), range(40, 42), range(42, 42))
    assert [name for name, _ in works[40:]] == ["two_gentlemen_of_verona_gut.txt",
                                               "winters_tale_gut.txt"]


def _global_batches(dataset, d: int, iterations: int, b: int = 2, B: int = 8) -> list[torch.Tensor]:
    """Every iteration's tokens as data-parallel ranks and microbatches read
    them, put back in global order."""
    batches = []
    for iteration in range(iterations):
        parts = [collate(dataset, microbatch_indices(iteration * B, i, rank, micro_batch_size=b,
                                                     global_batch_size=B, data_parallel_size=d), 257)
                 for rank in range(d) for i in range(B // (b * d))]
        batches.append(torch.cat(parts))
    return batches


def test_the_global_batch_is_the_same_whatever_d(tmp_path):
    prefix = _write_corpus(tmp_path / "c")
    train, _, _ = build_gpt_datasets([prefix], "1", (48, 0, 0), seq_length=16, seed=3)
    reference = _global_batches(train, 1, 6)
    for d in (2, 4):
        assert all(torch.equal(a, b) for a, b in zip(_global_batches(train, d, 6), reference))
    # and the batches are real, distinct data
    assert not torch.equal(reference[0], reference[1])


def test_resume_from_consumed_samples_sees_the_same_batches(tmp_path):
    """An interrupted run restarted at iteration k (k·B consumed samples) —
    in a fresh process, from the cached index, even asking for more
    iterations — reads exactly what the uninterrupted run read."""
    prefix = _write_corpus(tmp_path / "c", documents=12)
    cache = str(tmp_path / "cache")
    uninterrupted, _, _ = build_gpt_datasets([prefix], "1", (80, 0, 0), seq_length=16, seed=3,
                                             cache_dir=cache)
    assert uninterrupted.num_epochs > 1  # the run crosses epochs
    expected = _global_batches(uninterrupted, 2, 10)
    script = f"""
import sys, numpy as np
sys.path.insert(0, {str(ROOT)!r})
from ptdp.data.gpt_dataset import build_gpt_datasets
train, _, _ = build_gpt_datasets([{prefix!r}], "1", (160, 0, 0), seq_length=16, seed=3,
                                 cache_dir={cache!r})
np.save(sys.argv[1], np.stack([train[i] for i in range(40, 80)]))
"""
    out = tmp_path / "resumed.npy"
    subprocess.run([sys.executable, "-c", script, str(out)], check=True)
    resumed = torch.from_numpy(np.load(out, allow_pickle=False))
    assert torch.equal(resumed, torch.cat(expected[5:]))


def test_eod_mask_loss(tmp_path):
    prefix = _write_corpus(tmp_path / "c")
    trainer = Trainer(_config([prefix], cache=str(tmp_path / "cache"), eod_mask_loss=True),
                      ParallelContext.single(), torch.device("cpu"))
    inputs, labels, mask = trainer.microbatch_fn(0)(0)
    assert (inputs == EOD).any()
    assert torch.equal(mask, (inputs != EOD).float())
    assert torch.equal(labels[:, :-1], inputs[:, 1:])
    # The masked loss is the mean over the unmasked positions only.
    model = trainer.chunks[0]
    losses = torch.nn.functional.cross_entropy(
        model(inputs).float().transpose(0, 1)[..., :257].reshape(-1, 257), labels.reshape(-1), reduction="none")
    expected = (losses * mask.reshape(-1)).sum() / mask.sum()
    assert model(inputs, labels, mask).item() == pytest.approx(expected.item(), rel=1e-5)
    assert model(inputs, labels).item() != pytest.approx(expected.item(), rel=1e-5)
    no_mask = Trainer(_config([prefix], cache=str(tmp_path / "cache")), ParallelContext.single(),
                      torch.device("cpu"))
    assert len(no_mask.microbatch_fn(0)(0)) == 2


def test_out_of_range_tokens_are_reported(tmp_path):
    """A vocabulary smaller than the tokenizer's is refused up front; tokens
    beyond the vocabulary (data from another tokenizer) when read."""
    prefix = _write_corpus(tmp_path / "c")
    config = _config([prefix], cache=str(tmp_path / "cache"))
    config = dataclasses.replace(config, model=dataclasses.replace(MODEL, vocab_size=200))
    with pytest.raises(DataSettingsError, match="raise --vocab-size"):
        Trainer(config, ParallelContext.single(), torch.device("cpu"))
    train, _, _ = build_gpt_datasets([prefix], "1", (40, 0, 0), seq_length=16, seed=3)
    assert collate(train, range(0, 40), 257).max() > 200  # byte tokens up to 256
    with pytest.raises(DataSettingsError, match="outside the vocabulary of 200"):
        collate(train, range(0, 40), 200)


def _parallel_vs_serial(rank, prefix, cache, p, d):
    ctx = ParallelContext.build(RankGrid(tp=1, dp=d, pp=p))
    trainer = Trainer(_config([prefix], p=p, d=d, cache=cache), ctx, torch.device("cpu"))
    reads = trainer.data.train is not None
    records = [trainer.step(i)[0] for i in range(3)]
    # The one-process reference reads the same dataset (built by rank 0 above).
    data = trainer.data if reads else None
    serial = Trainer(_config([prefix], cache=cache), ParallelContext.single(), torch.device("cpu"),
                     data=data) if reads else None
    serial_losses = [serial.step(i)[0]["loss"] for i in range(3)] if serial else None
    return ctx.pp_rank, reads, [r["loss"] for r in records], serial_losses


@pytest.mark.parametrize("p, d", [(2, 2), (3, 1)])
def test_parallel_training_on_real_data_matches_one_process(pools, tmp_path, p, d):
    """Rank 0 builds the index while the others wait; only the first and
    last pipeline stages open the data; the losses equal one process's."""
    prefix = _write_corpus(tmp_path / "c")
    results = pools(p * d).run(_parallel_vs_serial, prefix, str(tmp_path / "cache"), p, d)
    for pp_rank, reads, losses, serial_losses in results:
        assert reads == (pp_rank in (0, p - 1))
        if pp_rank == p - 1:
            assert all(math.isfinite(x) for x in losses)
            assert losses == pytest.approx(serial_losses, rel=1e-5)


def _run_here(capsys, *argv) -> subprocess.CompletedProcess:
    """A one-process `ptdp` command through ptdp's entry point in this
    process (one rank needs no launch), with its status and output."""
    capsys.readouterr()
    status = main(list(argv))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["ptdp", *argv], status, out, err)


TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length",
        "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2"]


def test_train_on_a_blend_from_the_command_line(tmp_path, capsys):
    a, b = _write_corpus(tmp_path / "a", seed=1), _write_corpus(tmp_path / "b", seed=2)
    result = _run_here(capsys, "train", *TINY, "--data-path", "0.7", a, "0.3", b, "--tokenizer-type",
                  "ByteLevelTokenizer", "--data-cache-path", str(tmp_path / "cache"))
    assert result.returncode == 0, result.stderr
    assert "vocabulary 257" in result.stdout and f"data: 0.7 {a} 0.3 {b}" in result.stdout
    assert "iteration     2/2" in result.stdout


def test_train_on_the_demo_corpus_by_default(tmp_path, capsys):
    result = _run_here(capsys, "train", *TINY, "--hidden-size", "16")
    assert result.returncode == 0, result.stderr
    assert "vocabulary 50257" in result.stdout and "the demo corpus" in result.stdout
    assert "iteration     2/2" in result.stdout


@pytest.mark.parametrize("argv, message", [
    (["--data-path", "no/such/prefix"], "no/such/prefix"),
    (["--data-path", "0.5", "a"], "--data-path"),
    (["--mock-data", "--data-path", "x"], "exclude each other"),
    (["--vocab-size", "1000"], "--vocab-size=1000 disagrees with the GPT2BPETokenizer's 50257"),
    (["--tokenizer-type", "HuggingFaceTokenizer"], "needs --tokenizer-model"),
    (["--split", "90,x,0"], "--split"),
])
def test_bad_data_settings_stop_before_launch(capsys, argv, message):
    assert main(["train", *TINY, *argv]) == 2
    assert message in capsys.readouterr().err


def test_data_problems_stop_before_launch(tmp_path, capsys):
    prefix = tmp_path / "tiny"
    write_documents(prefix, [np.arange(10), np.arange(5)], dtype=np.uint16)
    argv = ["train", *TINY, "--data-path", str(prefix), "--tokenizer-type", "ByteLevelTokenizer",
            "--data-parallel-size", "2"]
    assert main(argv) == 2
    assert "fewer than one sample of --seq-length + 1 = 33" in capsys.readouterr().err
    bin_file = Path(f"{prefix}.bin")
    bin_file.write_bytes(bin_file.read_bytes()[:-4])  # truncated
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{prefix}.bin" in err and "--data-path" in err
