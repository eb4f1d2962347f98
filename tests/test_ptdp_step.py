"""The full PTD-P step: t = 2, p = 2, d = 2 (8 processes) trains exactly as one
process does, with AdamW, warm-up, clipping, bucketed data-parallel
reduction and (optionally) the distributed optimizer.

Tolerance: the layouts reorder floating-point sums (tensor all-reduces,
data-parallel averaging, the global norm), so after 5 AdamW steps losses
agree to rtol 1e-5 and weights to atol 1e-5. Most weights agree to 1e-7; the
largest difference (observed 3.3e-6) is in the attention key biases, whose
gradient is mathematically zero (softmax ignores a shift shared by all keys):
it is pure rounding noise, which Adam divides by its own magnitude. Each step
moves weights by up to lr = 1e-2, so 1e-5 is 1e-4 of five steps' motion.
"""

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch.testing import assert_close

from ptdp.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from ptdp.parallel.sharding import SHARD_ATTR, gather_logical
from ptdp.parallel.topology import ParallelContext, RankGrid
from ptdp.train.loop import Trainer

MODEL = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=100, make_vocab_size_divisible_by=8, hidden_dropout=0.0,
                    attention_dropout=0.0)
TRAIN = TrainConfig(micro_batch_size=1, global_batch_size=8, train_iters=5, lr=1e-2, min_lr=1e-3,
                    lr_warmup_iters=2, lr_decay_style="cosine", clip_grad=0.5, weight_decay=0.1,
                    seed=17, ddp_bucket_size=2000, log_params_norm=True,
                    log_num_zeros_in_grad=True)
LOSS_TOL = dict(rel=1e-5)
WEIGHT_TOL = dict(rtol=0.0, atol=1e-5)


def _config(t=1, p=1, d=1, k=None, model=MODEL, sequence_parallel=False, **train):
    return Config(model=model,
                  parallel=ParallelConfig(tensor_model_parallel_size=t, pipeline_model_parallel_size=p,
                                          data_parallel_size=d, num_layers_per_virtual_pipeline_stage=k,
                                          sequence_parallel=sequence_parallel),
                  train=dataclasses.replace(TRAIN, **train), data=DataConfig(mock_data=True))


def _logical_weights(trainer, ctx):
    weights = {}
    for chunk in trainer.chunks:
        for name, param in chunk.named_parameters():
            weights[name] = gather_logical(param.detach().float(), getattr(param, SHARD_ATTR, None),
                                           ctx.tp_group)
    return weights


def computed_once(compute):
    """`compute()`, a one-process reference that every rank of a pooled
    call would compute alike, run on rank 0 only and its result sent to the
    others, which wait instead of repeating it (the pool has more ranks than
    the machine has cores)."""
    result = [compute() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(result, src=0)
    return result[0]


# Each model's one-process run, once per process: the pool's rank 0 lives on
# from test to test (and file to file) that compares the same model with it.
_serial_runs: dict[tuple[str, bool], tuple] = {}


def _serial_run(model, distributed):
    """The one-process run _ptdp_vs_serial compares with: its records, its
    weights after 5 steps and the initial weights."""
    key = repr(model), distributed
    if key not in _serial_runs:
        serial = Trainer(_config(model=model, use_distributed_optimizer=distributed),
                         ParallelContext.single(), torch.device("cpu"))
        serial_records = [serial.step(i)[0] for i in range(5)]
        initial = Trainer(_config(model=model), ParallelContext.single(), torch.device("cpu"))
        _serial_runs[key] = (serial_records, _logical_weights(serial, ParallelContext.single()),
                             _logical_weights(initial, ParallelContext.single()))
    return _serial_runs[key]


def _ptdp_vs_serial(rank, k, distributed, model=MODEL, weight_tol=WEIGHT_TOL,
                    sequence_parallel=False):
    ctx = ParallelContext.build(RankGrid(tp=2, dp=2, pp=2))
    trainer = Trainer(_config(2, 2, 2, k, model, sequence_parallel,
                              use_distributed_optimizer=distributed), ctx, torch.device("cpu"))
    records = [trainer.step(i)[0] for i in range(5)]
    serial_records, serial_weights, initial_weights = computed_once(
        lambda: _serial_run(model, distributed))

    for got, want in zip(records, serial_records):
        assert got["lr"] == want["lr"] and not got["skipped"]
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
        # Each weight and gradient element counted once over shards and replicas.
        assert got["params_norm"] == pytest.approx(want["params_norm"], rel=1e-6)
        # Zeros: the padded vocabulary's rows (their number depends on t, as in
        # Megatron-LM), of the word embedding and of an untied output layer.
        padding = (model.padded_vocab_size(2) - model.padded_vocab_size(1)) * model.hidden_size
        matrices = 1 if model.tied_output else 2
        assert got["num_zeros"] == want["num_zeros"] + matrices * padding, (got, want)
        if ctx.is_last_stage:
            assert got["loss"] == pytest.approx(want["loss"], **LOSS_TOL)
    assert any(r["grad_norm"] > 0.5 for r in serial_records)  # clipping was active

    worst = 0.0
    for name, weight in _logical_weights(trainer, ctx).items():
        assert_close(weight, serial_weights[name], **weight_tol,
                     msg=lambda m, name=name: f"{name}: {m}")
        worst = max(worst, (weight - serial_weights[name]).abs().max().item())
        assert not torch.equal(weight, initial_weights[name]), f"{name} never moved"
    return [r["loss"] for r in records], trainer.optimizer.state_bytes, worst


@pytest.mark.parametrize("k", [None, 1], ids=["1f1b", "interleaved"])
@pytest.mark.parametrize("distributed", [False, True], ids=["adamw", "distributed-optimizer"])
def test_ptdp_trains_like_one_process(pools, k, distributed):
    results = pools(8).run(_ptdp_vs_serial, k, distributed)
    losses = [r[0] for r in results]
    assert all(math.isfinite(x) for x in losses[-1])  # the last rank holds the loss
    assert max(r[2] for r in results) < 1e-5


def _state_bytes(rank, d, distributed):
    ctx = ParallelContext.build(RankGrid(tp=1, dp=d, pp=1))
    trainer = Trainer(_config(d=d, use_distributed_optimizer=distributed, bf16=True), ctx,
                      torch.device("cpu"))
    trainer.step(0)
    return trainer.optimizer.state_bytes, trainer.buffer.numel


@pytest.mark.parametrize("d", [2, 4])
def test_distributed_optimizer_state_falls_as_one_over_d(pools, d):
    """Measured from the tensors the optimizer holds (bf16 model): fp32 main
    weights and two Adam moments, for the whole buffer or for 1/d of it."""
    plain = pools(d).run(_state_bytes, d, False)
    sharded = pools(d).run(_state_bytes, d, True)
    for (plain_bytes, numel), (shard_bytes, padded) in zip(plain, sharded):
        assert plain_bytes == 3 * 4 * numel
        assert shard_bytes == 3 * 4 * padded // d
        assert shard_bytes * d <= plain_bytes * 1.01  # padding to multiples of d only


def _overflow(rank, **sharding):
    """fp16, d = 2: an inf in one rank's gradient (where its optimizer reads
    it: the full buffer, or under ZeRO-2/3 its shard) skips the step on every
    rank, halves the scale and changes no weight. `sharding`: TrainConfig's
    sharding settings (tests/test_sharded_data_parallel.py)."""
    ctx = ParallelContext.build(RankGrid(tp=1, dp=2, pp=1))
    trainer = Trainer(_config(d=2, fp16=True, initial_loss_scale=1024.0, hysteresis=1,
                              **sharding), ctx, torch.device("cpu"))
    records = [trainer.step(0)[0]]
    before = trainer.buffer.param_data.clone()
    main_before = trainer.optimizer.main.clone()
    finish = trainer.buffer.finish

    def finish_then_inject():
        finish()
        if rank == 1:
            trainer.buffer.reduced_grads[7] = float("inf")

    trainer.buffer.finish = finish_then_inject
    records.append(trainer.step(1)[0])
    trainer.buffer.finish = finish
    assert torch.equal(trainer.buffer.param_data, before)
    assert torch.equal(trainer.optimizer.main, main_before)
    records.append(trainer.step(2)[0])
    assert torch.isfinite(trainer.buffer.param_data.float()).all()
    assert not torch.equal(trainer.buffer.param_data, before)
    return [(r["skipped"], r["loss_scale"]) for r in records]


def test_fp16_overflow_skips_that_step_everywhere(pools):
    for result in pools(2).run(_overflow):
        assert result == [(False, 1024.0), (True, 1024.0), (False, 512.0)]


def _buckets_launch_during_backward(rank):
    ctx = ParallelContext.build(RankGrid(tp=1, dp=2, pp=1))
    trainer = Trainer(_config(d=2, ddp_bucket_size=500), ctx, torch.device("cpu"))
    calls = []
    original = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        trainer.model.train()
        trainer.buffer.start_iteration(trainer.num_micro)
        trainer.executor.run(trainer.schedule, trainer.microbatch_fn(0))
        launched_in_backward = [b.launched for b in trainer.buffer.buckets]
        calls_in_backward = len(calls)
        trainer.buffer.finish()
    finally:
        dist.all_reduce = original
    return launched_in_backward, calls_in_backward, len(calls), len(trainer.buffer.buckets), trainer.num_micro


def test_bucket_reductions_start_during_backward_once_per_iteration(pools):
    for launched, in_backward, total, buckets, microbatches in pools(2).run(_buckets_launch_during_backward):
        assert microbatches == 4 and buckets > 3
        # Every bucket's reduction started from the gradient hooks, while the
        # last microbatch's backward was still running, and exactly once.
        assert all(launched)
        assert in_backward == total == buckets


def _recompute_vs_off(rank, recompute, sequence_parallel=False):
    """The same 8-process interleaved layout, with dropout on, trained with and
    without recomputation: the recomputed forwards replay every dropout mask
    (tensor-replicated and per-rank streams), so the runs are bitwise equal."""
    ctx = ParallelContext.build(RankGrid(tp=2, dp=2, pp=2))
    model = dataclasses.replace(MODEL, hidden_dropout=0.1, attention_dropout=0.1)
    runs = []
    for layout in ({}, recompute):
        config = _config(2, 2, 2, 1, sequence_parallel=sequence_parallel, train_iters=3)
        config = dataclasses.replace(config, model=dataclasses.replace(model, **layout))
        trainer = Trainer(config, ctx, torch.device("cpu"))
        calls = []
        original = torch.utils.checkpoint.checkpoint

        def counting_checkpoint(*args, **kwargs):
            calls.append(1)
            return original(*args, **kwargs)

        torch.utils.checkpoint.checkpoint = counting_checkpoint
        try:
            losses = [trainer.step(i)[0]["loss"] for i in range(3)]
        finally:
            torch.utils.checkpoint.checkpoint = original
        runs.append((losses, trainer.buffer.param_data.clone(), len(calls)))
    (losses_off, weights_off, calls_off), (losses_on, weights_on, calls_on) = runs
    assert calls_off == 0 and calls_on > 0  # the flags reached the model
    return losses_off == losses_on, torch.equal(weights_off, weights_on), losses_on


@pytest.mark.parametrize("recompute", [
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    dict(recompute_granularity="selective"),
], ids=["full-uniform", "full-block", "selective"])
def test_recomputation_in_the_full_step_changes_nothing(pools, recompute):
    results = pools(8).run(_recompute_vs_off, recompute)
    for same_losses, same_weights, losses in results:
        assert same_losses and same_weights
    assert all(math.isfinite(x) for x in results[-1][2])
