"""The memory model of the sharding strategies (issue 42, item 4:
ptdp.perf.analytic.sharding) against a real Trainer's tensors at d = 2, its
ordering across strategies, ZeRO-3's figures, and the planner and the
memory check choosing a strategy that fits.

Measured (bf16 model, small buckets so that a microbatch's backward runs
through many of them): the flat parameter buffer, the fp32 gradient buffer
and shard, the optimizer's fp32 main weights and Adam moments (exact), and
ShardedGradBuffer.peak_full_grad_bytes, the most full fp32 gradients ZeRO-2
held at once (the model bounds it)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ptdp.config import Config, ModelConfig, ParallelConfig, TrainConfig
from ptdp.parallel import sharded_grads
from ptdp.parallel.topology import ParallelContext, RankGrid
from ptdp.perf.analytic import sharding as model_sharding
from ptdp.perf.analytic.counts import (cut_placed_buckets, owned_elements, padded_elements,
                                       parameters_per_rank, placement_of_parameters)
from ptdp.perf.analytic.memory import memory_per_rank
from ptdp.perf.layout import ByValue, Layout, Workload
from ptdp.train.loop import Trainer
from tests import test_ptdp_step as step

BUCKET = 1500         # elements: the model's ~40k parameters in ~30 buckets
BATCH = 8             # m = 4 microbatches per replica at d = 2, b = 1
STRATEGIES = ("no_shard", "optim", "optim_grads")


def _config(d: int, strategy: str) -> Config:
    return step._config(d=d, bf16=True, ddp_bucket_size=BUCKET, global_batch_size=BATCH,
                        use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy)


def _measured(rank: int, d: int) -> list[dict]:
    """Each strategy's tensors on this rank after an iteration (ZeRO-2's
    peak is reached in every iteration alike)."""
    ctx = ParallelContext.build(RankGrid(tp=1, dp=d, pp=1))
    results = []
    for strategy in STRATEGIES:
        trainer = Trainer(_config(d, strategy), ctx, torch.device("cpu"))
        trainer.step(0)
        buffer = trainer.buffer
        grad_data = buffer.grad_data
        results.append({
            "strategy": strategy,
            "weights": buffer.param_data.nbytes,
            "grad_data": 0 if grad_data is None else grad_data.nbytes,
            "grad_shard": 0 if buffer.grad_shard is None else buffer.grad_shard.nbytes,
            "optimizer": trainer.optimizer.state_bytes,
            "peak_full_grads": getattr(buffer, "peak_full_grad_bytes", None),
            "in_flight": sharded_grads.IN_FLIGHT})
    return results


@pytest.fixture(scope="module")
def measured(pools):
    """One row per (rank, strategy) at d = 2."""
    return [row for rows in pools(2).run(_measured, 2) for row in rows]


def test_the_model_counts_what_each_strategy_holds(measured):
    workload = Workload(step.MODEL, BATCH, "bf16")
    for row in measured:
        layout = Layout(d=2, sharding=row["strategy"])
        (figures,) = memory_per_rank(workload, layout, kernels="cpu", bucket_size=BUCKET)
        where = row["strategy"]
        assert row["in_flight"] == model_sharding.IN_FLIGHT
        assert figures["weights"] == row["weights"], where
        assert figures["optimizer"] == row["optimizer"], where
        buckets = cut_placed_buckets(ByValue(step.MODEL), placement_of_parameters(layout), 0,
                                     BUCKET)
        if row["strategy"] != "optim_grads":
            assert row["peak_full_grads"] is None
            assert figures["gradients"] == row["grad_data"] + row["grad_shard"], where
            continue
        # ZeRO-2: no full buffer; the shard exact, the buckets in flight bounded.
        assert row["grad_data"] == 0
        assert row["grad_shard"] == 4 * owned_elements(buckets, layout), where
        transient = 4 * model_sharding.transient_gradient_elements(buckets, layout)
        assert figures["gradients"] == row["grad_shard"] + transient
        assert 0 < row["peak_full_grads"] <= transient, where
        # ... and well below the full buffer ZeRO-1 keeps beside its shard.
        assert row["peak_full_grads"] < 4 * padded_elements(buckets, layout), where


def test_each_strategy_holds_less_than_the_one_before(measured):
    def state(row):
        return (row["weights"] + row["grad_data"] + row["grad_shard"] + row["optimizer"]
                + (row["peak_full_grads"] or 0))

    for rank in range(2):
        rows = {row["strategy"]: row for row in measured[3 * rank:3 * rank + 3]}
        assert state(rows["no_shard"]) > state(rows["optim"]) > state(rows["optim_grads"])
    workload = Workload(step.MODEL, BATCH, "bf16")
    totals = [memory_per_rank(workload, Layout(d=2, sharding=strategy), kernels="cpu",
                              bucket_size=BUCKET)[0]["total"]
              for strategy in (*STRATEGIES, "optim_grads_params")]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4
