"""Checkpoints: exact resume on the same layout, resharding across layouts
(t, p and d each change, distributed optimizer on and off), integrity."""

import dataclasses

import pytest
import torch

from ptdp.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from ptdp.parallel.sharding import SHARD_ATTR, gather_logical
from ptdp.parallel.topology import ParallelContext, RankGrid
from ptdp.checkpoint.store import (CheckpointError, load_logical_model, read_metadata, resolve,
                                   save_logical_model)
from ptdp.train.loop import Trainer

MODEL = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=100, make_vocab_size_divisible_by=8, hidden_dropout=0.0,
                    attention_dropout=0.0)
TRAIN = TrainConfig(micro_batch_size=1, global_batch_size=8, train_iters=8, lr=1e-2, min_lr=1e-3,
                    lr_warmup_iters=2, lr_decay_style="cosine", clip_grad=0.5, weight_decay=0.1,
                    seed=21, ddp_bucket_size=1500)
CPU = torch.device("cpu")


def _config(t=1, p=1, d=1, k=None, model=MODEL, sequence_parallel=False, **train):
    return Config(model=model,
                  parallel=ParallelConfig(tensor_model_parallel_size=t, pipeline_model_parallel_size=p,
                                          data_parallel_size=d, num_layers_per_virtual_pipeline_stage=k,
                                          sequence_parallel=sequence_parallel),
                  train=dataclasses.replace(TRAIN, **train), data=DataConfig(mock_data=True))


def _losses(records):
    return [r["loss"] for r in records]


def stop_save_resume(config, ctx, save, stop: int, total: int):
    """`total` iterations straight, and `stop` of them, a save and a new
    trainer that loads it and runs the rest: (the resumed records, the
    straight run's records of the same iterations, whether the final
    weights are bitwise equal, the checkpoint's metadata)."""
    straight = Trainer(config, ctx, CPU)
    expected = [straight.step(i)[0] for i in range(total)]
    first = Trainer(config, ctx, CPU)
    for i in range(stop):
        first.step(i)
    first.save(save, stop)
    metadata = read_metadata(resolve(save))
    resumed = Trainer(config, ctx, CPU, start=(metadata["iteration"], metadata["consumed_samples"]))
    resumed.load(save)
    got = [resumed.step(i)[0] for i in range(stop, total)]
    same_weights = torch.equal(resumed.buffer.param_data, straight.buffer.param_data)
    return got, expected[stop:], same_weights, metadata


def _resume_same_layout(rank, save, dtype_flags, sequence_parallel=False):
    """6 iterations straight vs 3, save, a new trainer loads, 3 more: the
    last three losses and the final weights are bitwise the same (dropout on,
    so the random streams must be restored too)."""
    ctx = ParallelContext.build(RankGrid(tp=2, dp=2, pp=2))
    model = dataclasses.replace(MODEL, hidden_dropout=0.1, attention_dropout=0.1)
    config = _config(2, 2, 2, 1, model=model, sequence_parallel=sequence_parallel, train_iters=6,
                     **dtype_flags)
    got, expected, same_weights, _ = stop_save_resume(config, ctx, save, 3, 6)
    return _losses(got), _losses(expected), same_weights, [r["consumed_samples"] for r in got]


@pytest.mark.parametrize("flags", [{}, {"bf16": True, "use_distributed_optimizer": True}],
                         ids=["fp32", "bf16-distributed-optimizer"])
def test_resume_is_bitwise_exact_on_the_same_layout(pools, tmp_path, flags):
    for got, expected, same_weights, consumed in pools(8).run(_resume_same_layout, str(tmp_path),
                                                             flags):
        assert got == expected  # bitwise: == on Python floats (None off the last stage)
        assert same_weights
        assert consumed == [8 * i for i in range(4, 7)]


LAYOUTS = [  # (t, p, d, k, distributed optimizer): t, p and d each change at every hop
    (2, 2, 2, 1, True),
    (1, 4, 2, None, False),
    (4, 1, 2, None, True),
    (1, 2, 4, 1, False),
]


def _train_leg(rank, save, leg):
    t, p, d, k, distributed = LAYOUTS[leg]
    ctx = ParallelContext.build(RankGrid(tp=t, dp=d, pp=p))
    config = _config(t, p, d, k, use_distributed_optimizer=distributed)
    start = (0, 0)
    if leg > 0:
        metadata = read_metadata(resolve(save))
        start = (metadata["iteration"], metadata["consumed_samples"])
    trainer = Trainer(config, ctx, CPU, start=start)
    if leg > 0:
        trainer.load(save)
    records = [trainer.step(i)[0] for i in range(2 * leg, 2 * leg + 2)]
    trainer.save(save, 2 * leg + 2)
    return _losses(records)


def test_resharding_across_layouts(pools, tmp_path):
    """Eight iterations in four legs of two, each under another layout, with
    a save and load between legs, against one process training straight."""
    serial = Trainer(_config(), ParallelContext.single(), CPU)
    expected = _losses(serial.step(i)[0] for i in range(8))
    got = []
    for leg in range(len(LAYOUTS)):
        results = pools(8).run(_train_leg, str(tmp_path), leg)
        losses = [r for r in results if r[0] is not None][0]
        got += losses
    assert got == pytest.approx(expected, rel=1e-5)
    # and the final weights are the one-process weights
    config, weights, metadata = load_logical_model(tmp_path)
    assert metadata["iteration"] == 8 and config.model == MODEL
    # Weights: Adam divides each gradient by its own magnitude, so elements
    # whose gradient is near zero (the attention key biases' is exactly zero)
    # turn rounding noise into visible differences: a bound of 1e-4 (1% of
    # one step's motion at lr 1e-2) on each element, and a mean difference
    # at rounding level. A lost optimizer moment would move weights by ~lr.
    total, count = 0.0, 0
    for name, param in serial.chunks[0].named_parameters():
        logical = gather_logical(param.detach(), getattr(param, SHARD_ATTR, None), None)
        torch.testing.assert_close(weights[name], logical, rtol=0, atol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")
        total += (weights[name] - logical).abs().sum().item()
        count += logical.numel()
    assert total / count < 1e-7


def _save_one(tmp_path, **train):
    trainer = Trainer(_config(**train), ParallelContext.single(), CPU)
    trainer.step(0)
    trainer.save(str(tmp_path), 1)
    return trainer


def test_integrity_checks(tmp_path):
    _save_one(tmp_path)
    directory = resolve(tmp_path)
    assert directory.name == "iter_0000001" and (tmp_path / "latest").read_text().strip() == directory.name
    part = next(directory.glob("part-*.safetensors"))
    data = bytearray(part.read_bytes())
    data[-3] ^= 0xFF
    part.write_bytes(bytes(data))
    trainer = Trainer(_config(), ParallelContext.single(), CPU)
    with pytest.raises(CheckpointError, match="sha256 differs"):
        trainer.load(str(tmp_path))
    part.unlink()
    with pytest.raises(CheckpointError, match="missing"):
        trainer.load(str(tmp_path))
    (tmp_path / "latest").write_text("iter_0000009\n")
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        trainer.load(str(tmp_path))
    with pytest.raises(CheckpointError, match="no such directory"):
        trainer.load(str(tmp_path / "nowhere"))


def test_another_model_size_is_refused(tmp_path):
    _save_one(tmp_path)
    bigger = dataclasses.replace(MODEL, hidden_size=64)
    trainer = Trainer(_config(model=bigger), ParallelContext.single(), CPU)
    with pytest.raises(CheckpointError, match="--hidden-size: checkpoint 32, requested 64"):
        trainer.load(str(tmp_path))


def test_keep_last_and_partial_leftovers(tmp_path):
    trainer = Trainer(_config(keep_last=2), ParallelContext.single(), CPU)
    (tmp_path / "iter_0000004.partial").mkdir(parents=True)  # a save killed midway
    for i in range(4):
        trainer.step(i)
        trainer.save(str(tmp_path), i + 1)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["iter_0000003", "iter_0000004", "latest"]


def test_model_only_checkpoint_round_trip(tmp_path):
    """Logical weights saved without an optimizer (e.g. an imported model)
    load into a trainer, which starts a fresh optimizer from them."""
    source = Trainer(_config(), ParallelContext.single(), CPU)
    source.step(0)
    weights = {name: p.detach().clone() for name, p in source.chunks[0].named_parameters()}
    weights["embedding.word_embeddings.weight"] = weights["embedding.word_embeddings.weight"][:100]
    save_logical_model(tmp_path, _config(), weights)
    config, loaded, _ = load_logical_model(tmp_path)
    assert all(torch.equal(loaded[n], w) for n, w in weights.items())
    target = Trainer(_config(), ParallelContext.single(), CPU)
    target.load(str(tmp_path))
    assert torch.equal(target.buffer.param_data, source.buffer.param_data)
    assert target.optimizer.steps == 0 and not target.optimizer.exp_avg.any()
