"""The memory model of the sharding strategies (issue 42, item 4:
ptdp.perf.analytic.sharding) against a real Trainer's tensors at d = 4, its
ordering across strategies, ZeRO-3's figures, and the planner and the
memory check before launch choosing a strategy that fits.

Measured (bf16 model, small buckets so that a microbatch's backward runs
through many of them): the flat parameter buffer, the fp32 gradient buffer
and shard, the optimizer's fp32 main weights and Adam moments (exact), and
ShardedGradBuffer.peak_full_grad_bytes, the most full fp32 gradients ZeRO-2
held at once (the model bounds it)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ptdp.cli import main
from ptdp.config import Config, ModelConfig, ParallelConfig, TrainConfig
from ptdp.config.lora import LoRAConfig
from ptdp.parallel import sharded_grads
from ptdp.parallel.topology import ParallelContext, RankGrid
from ptdp.perf.analytic import sharding as model_sharding
from ptdp.perf.analytic.counts import (buffer_elements, communication_per_rank,
                                       cut_placed_buckets, owned_elements, padded_elements,
                                       parameters_per_rank, placement_of_parameters)
from ptdp.perf.analytic.memory import memory_per_rank
from ptdp.perf import layout as perf_layout
from ptdp.perf.fits import memory_problems
from ptdp.perf.layout import ByValue, Layout, LoRAWork, Workload
from ptdp.perf.plan.candidates import candidate_layouts
from ptdp.perf.plan.planner import search, train_command
from ptdp.perf.price.profiles import load_profile
from ptdp.perf.simulate.bounds import compute_lower_bound
from ptdp.perf.simulate.predict import simulate
from ptdp.train.loop import Trainer
from tests import test_ptdp_step as step

BUCKET = 1500         # elements: the model's ~40k parameters in ~30 buckets
BATCH = 8             # m = 2 microbatches per replica at d = 4, b = 1
D = 4
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def _config(d: int, strategy: str) -> Config:
    return step._config(d=d, bf16=True, ddp_bucket_size=BUCKET, global_batch_size=BATCH,
                        use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy)


def trace_gathers(trainer: Trainer) -> list[int]:
    """Under ZeRO-3, a one-element list that keeps the most bytes of whole
    (gathered) parameters the trainer's buffer holds at once from now on
    (sampled after every gather starts); None otherwise."""
    buffer = trainer.buffer
    if not hasattr(buffer, "full_param_bytes"):
        return None
    peak, start = [0], buffer._start_gather

    def traced(unit: int) -> None:
        start(unit)
        peak[0] = max(peak[0], buffer.full_param_bytes)
    buffer._start_gather = traced
    return peak


def state_tensors(trainer: Trainer, gathers: list[int] | None = None) -> dict:
    """The bytes of a Trainer's model state (after an iteration): its flat
    parameter buffer (ZeRO-3: the shard, and the most gathered at once that
    `gathers`, from trace_gathers, saw), fp32 gradient buffer and shard,
    optimizer state, and under ZeRO-2/3 the most full gradients it held at
    once."""
    buffer = trainer.buffer
    return {"weights": buffer.param_data.nbytes,
            "peak_full_params": None if gathers is None else gathers[0],
            "grad_data": 0 if buffer.grad_data is None else buffer.grad_data.nbytes,
            "grad_shard": 0 if buffer.grad_shard is None else buffer.grad_shard.nbytes,
            "optimizer": trainer.optimizer.state_bytes,
            "peak_full_grads": getattr(buffer, "peak_full_grad_bytes", None)}


def check_state_tensors(measured: dict, workload: Workload, layout: Layout, pipeline_rank: int,
                        bucket_size: int) -> None:
    """`state_tensors` of one device against the memory model (kernels and
    activations aside): weights (ZeRO-3: the shard), optimizer state and
    gradients exact, but for ZeRO-2/3's buckets in flight and ZeRO-3's
    gathered units, which the model bounds. (A pooled run of another layout
    can call it with its own Trainer's tensors.)"""
    figures = memory_per_rank(workload, layout, kernels="cpu",
                              bucket_size=bucket_size)[pipeline_rank]
    where = f"{layout.sharding} p={layout.p} v={layout.v} {layout.schedule} rank {pipeline_rank}"
    e = workload.bytes_per_element
    assert figures["optimizer"] == measured["optimizer"], where
    if layout.shards_parameters:
        buckets = model_sharding.unit_buckets(workload.model, layout, pipeline_rank, bucket_size)
        assert measured["weights"] == e * owned_elements(buckets, layout), where
        gathered = e * model_sharding.gathered_elements(workload.model, layout, pipeline_rank,
                                                        bucket_size)
        assert figures["weights"] == measured["weights"] + gathered, where
        assert 0 < measured["peak_full_params"] <= gathered, where
    else:
        buckets = cut_placed_buckets(ByValue(workload.model), placement_of_parameters(layout),
                                     pipeline_rank, bucket_size)
        assert figures["weights"] == measured["weights"], where
    if not layout.shards_gradients:
        assert measured["peak_full_grads"] is None
        assert figures["gradients"] == measured["grad_data"] + measured["grad_shard"], where
        return
    # ZeRO-2/3: no full buffer; the shard exact, the buckets in flight bounded.
    assert measured["grad_data"] == 0
    assert measured["grad_shard"] == 4 * owned_elements(buckets, layout), where
    transient = 4 * model_sharding.transient_gradient_elements(buckets, layout)
    assert figures["gradients"] == measured["grad_shard"] + transient
    assert 0 < measured["peak_full_grads"] <= transient, where
    # ... and below the full buffer ZeRO-1 keeps beside its shard.
    assert measured["peak_full_grads"] < 4 * padded_elements(buckets, layout), where


def _measured(rank: int, d: int) -> list[dict]:
    """Each strategy's tensors on this rank after an iteration (ZeRO-2's
    peak is reached in every iteration alike)."""
    ctx = ParallelContext.build(RankGrid(tp=1, dp=d, pp=1))
    results = []
    for strategy, reshard in [(name, True) for name in STRATEGIES] + [(STRATEGIES[-1], False)]:
        config = _config(d, strategy)
        config.train.fsdp_reshard_after_forward = reshard
        trainer = Trainer(config, ctx, torch.device("cpu"))
        gathers = trace_gathers(trainer)
        trainer.step(0)
        results.append({"strategy": strategy, "reshard": reshard,
                        "in_flight": sharded_grads.IN_FLIGHT, **state_tensors(trainer, gathers)})
    # LoRA under ZeRO-3: the adapters' shards, the frozen base's, and the
    # most whole parameters (adapters and base) at once.
    config = _config(d, STRATEGIES[-1])
    config.lora = LORA
    trainer = Trainer(config, ctx, torch.device("cpu"))
    gathers = trace_gathers(trainer)
    trainer.step(0)
    buffer = trainer.buffer
    results.append({"strategy": "lora", "shards": buffer.param_shards.nbytes,
                    "frozen": buffer.frozen_shards.nbytes, "peak_full_params": gathers[0],
                    "units": len(buffer._unit_buckets), "optimizer": trainer.optimizer.state_bytes,
                    "grad_shard": buffer.grad_shard.nbytes})
    return results


@pytest.fixture(scope="module")
def measured(pools):
    """One row per (rank, strategy) at d = 4 (ZeRO-3 also without
    reshard-after-forward, the last)."""
    return [row for rows in pools(D).run(_measured, D) for row in rows]


def test_the_model_counts_what_each_strategy_holds(measured):
    workload = Workload(step.MODEL, BATCH, "bf16")
    for row in (row for row in measured if row["strategy"] != "lora"):
        assert row["in_flight"] == model_sharding.IN_FLIGHT
        layout = Layout(d=D, sharding=row["strategy"], reshard_after_forward=row["reshard"])
        check_state_tensors(row, workload, layout, 0, BUCKET)
        if layout.shards_parameters:   # one stage: the ends and two layers gathered, or all
            assert row["peak_full_params"] == 2 * model_sharding.gathered_elements(
                step.MODEL, layout, 0, BUCKET)


def _measured_at_p2(rank: int) -> list[dict]:
    """ZeRO-2 and ZeRO-3 (both reshard policies) at p = 2, d = 2: each
    rank's tensors after an iteration, with its pipeline rank."""
    ctx = ParallelContext.build(RankGrid(tp=1, dp=2, pp=2))
    results = []
    for strategy, reshard in (("optim_grads", True), (STRATEGIES[-1], True),
                              (STRATEGIES[-1], False)):
        config = step._config(p=2, d=2, bf16=True, ddp_bucket_size=BUCKET,
                              global_batch_size=BATCH, use_megatron_fsdp=True,
                              data_parallel_sharding_strategy=strategy,
                              fsdp_reshard_after_forward=reshard)
        trainer = Trainer(config, ctx, torch.device("cpu"))
        gathers = trace_gathers(trainer)
        trainer.step(0)
        results.append({"strategy": strategy, "reshard": reshard, "stage": ctx.pp_rank,
                        **state_tensors(trainer, gathers)})
    return results


def test_the_model_counts_each_pipeline_stage(pools):
    """At p = 2 (1F1B, m = 4 per replica) the model's figures for each
    stage's weights, gradients and optimizer state are the measured ones,
    and bound what ZeRO-2/3 held in flight, under both reshard policies."""
    workload = Workload(step.MODEL, BATCH, "bf16")
    rows = [row for rows in pools(4).run(_measured_at_p2) for row in rows]
    assert {row["stage"] for row in rows} == {0, 1}
    for row in rows:
        layout = Layout(p=2, d=2, sharding=row["strategy"], reshard_after_forward=row["reshard"])
        check_state_tensors(row, workload, layout, row["stage"], BUCKET)


LORA = LoRAConfig(lora_rank=4, lora_target_modules=["linear_qkv", "linear_fc2"])


def test_the_model_counts_a_sharded_frozen_base_under_lora(measured):
    """ZeRO-3 with adapters: the model's weights are the adapters' shard and
    whole copy (tiny), the frozen base's 1/d (its buckets' padding aside:
    the model cuts them as the trained parameters', the buffer one per unit
    and kind) and its gathered units, which bound what was whole at once."""
    workload = Workload(step.MODEL, BATCH, "bf16", LoRAWork.of(LORA))
    layout = Layout(d=D, sharding=STRATEGIES[-1])
    figures = memory_per_rank(workload, layout, kernels="cpu", bucket_size=BUCKET)[0]
    base = sum(b.size for b in model_sharding.unit_buckets(step.MODEL, layout, 0, BUCKET))
    gathered = model_sharding.gathered_elements(step.MODEL, layout, 0, BUCKET)
    rows = [row for row in measured if row["strategy"] == "lora"]
    assert len(rows) == D
    for row in rows:
        assert row["optimizer"] == figures["optimizer"]
        assert base // D - D * row["units"] <= row["frozen"] // 2 <= base // D + D * row["units"]
        adapters = row["shards"] // 2 * D
        assert figures["weights"] == row["shards"] + 2 * (adapters + base // D + gathered)
        assert 0 < row["peak_full_params"] <= 2 * (adapters + gathered)


def test_each_strategy_holds_less_than_the_one_before(measured):
    """Measured: no_shard > optim > optim_grads. ZeRO-3 saves only where a
    layer is a small share of the model (this one's two gathered layers and
    ends are more than half of it): by the model, at 1.3B, d = 8."""
    def state(row):
        return (row["weights"] + (row["peak_full_params"] or 0) + row["grad_data"]
                + row["grad_shard"] + row["optimizer"] + (row["peak_full_grads"] or 0))

    for rank in range(D):
        rows = {row["strategy"]: row for row in measured[6 * rank:6 * rank + 3]}
        assert state(rows["no_shard"]) > state(rows["optim"]) > state(rows["optim_grads"])
    workload = Workload(GPT_1B, 64, "bf16")
    totals = [memory_per_rank(workload, dataclasses.replace(_zero3(8), sharding=strategy))[0]
              for strategy in STRATEGIES]
    assert [total["total"] for total in totals] == sorted((total["total"] for total in totals),
                                                          reverse=True)
    assert len({total["total"] for total in totals}) == 4


# A 1.3B GPT on 8 devices, t = p = 1, d = 8 (the planner's other dimensions fixed).
GPT_1B = ModelConfig(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=1024,
                     vocab_size=51200)
FIXED = dict(tensor_sizes=(1,), pipeline_sizes=(1,), microbatch_sizes=(1,), recompute=("full",),
             context_sizes=(1,), sequence_parallel=(False,))


def _profile(gib: float):
    return dataclasses.replace(load_profile("a100"), memory_bytes=gib * 2**30)


def _zero3(d: int, reshard: bool = True) -> Layout:
    return Layout(d=d, b=1, recompute="full", sharding="optim_grads_params",
                  reshard_after_forward=reshard)


def test_zero3_keeps_a_shard_and_the_units_it_gathers():
    """ZeRO-3 at 1.3B against the model's own parameter counts: a bucket
    holds one unit's parameters (each transformer layer; the ends: the
    embeddings, the final norm, whose tied output matrix is the embedding's
    on one stage), 1/d of every bucket of weights, gradients and optimizer
    state kept, plus the ends and two layers gathered (every unit without
    reshard-after-forward); gradients as ZeRO-2's over these buckets."""
    workload, d = Workload(GPT_1B, 64, "bf16"), 4
    h, word = GPT_1B.hidden_size, GPT_1B.padded_vocab_size(1) * GPT_1B.hidden_size
    layer = 12 * h * h + 13 * h                                     # f = 4h, biases, LayerNorms
    ends = word + GPT_1B.seq_length * h + 2 * h                     # embeddings, final norm
    buckets = model_sharding.unit_buckets(GPT_1B, _zero3(d), 0, TrainConfig().ddp_bucket_size)
    sizes = [bucket.size for bucket in buckets]
    assert all(size % d == 0 for size in sizes)                     # (no padding at h = 2048)
    assert sum(sizes) == parameters_per_rank(GPT_1B, _zero3(d))[0] == ends + 24 * layer
    # Buckets end at every unit: with no size limit, one per unit (ZeRO-1/2: one in all).
    assert len(model_sharding.unit_buckets(GPT_1B, _zero3(d), 0, 10**12)) == 1 + 24 + 1
    assert len(cut_placed_buckets(ByValue(GPT_1B), Layout(), 0, 10**12)) == 1
    (zero3,) = memory_per_rank(workload, _zero3(d))
    (zero2,) = memory_per_rank(workload, dataclasses.replace(_zero3(d), sharding="optim_grads"))
    (kept,) = memory_per_rank(workload, _zero3(d, reshard=False))
    (replicated,) = memory_per_rank(workload, dataclasses.replace(_zero3(d), sharding="no_shard"))
    shard, gathered = sum(sizes) // d, ends + 2 * layer
    assert zero3["weights"] == 2 * (shard + gathered)
    assert kept["weights"] == 2 * (shard + sum(sizes))
    assert zero3["optimizer"] == 12 * shard == zero2["optimizer"]
    transient = model_sharding.transient_gradient_elements(buckets, _zero3(d))
    assert zero3["gradients"] == 4 * (shard + transient)
    # Parameters, gradients and optimizer state are 1/d of the replicated
    # ones but for the gathered units and the buckets in flight.
    whole = replicated["weights"] + replicated["gradients"] + replicated["optimizer"]
    assert zero3["weights"] + zero3["gradients"] + zero3["optimizer"] == \
        whole // d + 2 * gathered + 4 * transient
    # In fp32 the parameter shard is the optimizer's main copy.
    (fp32,) = memory_per_rank(Workload(GPT_1B, 64, "fp32"), _zero3(d))
    assert fp32["optimizer"] == 8 * shard and fp32["weights"] == 4 * (shard + gathered)


def test_the_planner_shards_gradients_when_the_optimizer_alone_does_not_fit(monkeypatch):
    monkeypatch.setattr(perf_layout, "PARAMETER_SHARDING_TRAINS", False)
    workload = Workload(GPT_1B, 64, "bf16")
    profile = _profile(8)   # ZeRO-1 needs 10.1 GiB, ZeRO-2 6.2 of the 7.2 usable
    found = search(workload, 8, profile, **FIXED)
    assert found and {e.layout.sharding for e in found} == {"optim_grads"}
    assert not search(workload, 8, profile, sharding=("no_shard", "optim"), **FIXED)
    command = train_command(GPT_1B, found[0].layout, 64, "bf16")
    assert command.endswith("--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads")
    # ZeRO-3 (4.3 GiB) is not proposed while ptdp train refuses it ...
    small = _profile(6)
    assert not search(workload, 8, small, **FIXED)
    assert "optim_grads_params" not in {layout.sharding for layout in
                                        candidate_layouts(workload, 8, **FIXED)}
    # ... and is, with its reshard policy, once it trains.
    monkeypatch.setattr(perf_layout, "PARAMETER_SHARDING_TRAINS", True)
    found = search(workload, 8, small, **FIXED)
    assert found and {(e.layout.sharding, e.layout.reshard_after_forward)
                      for e in found} == {("optim_grads_params", True)}
    assert "--data-parallel-sharding-strategy optim_grads_params --fsdp-reshard-after-forward" \
        in train_command(GPT_1B, found[0].layout, 64, "bf16")
    assert found[0].prediction.seconds_by_category["parameter all-gather"] > 0


PLAN = ["plan", "--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
        "--seq-length", "1024", "--gpus", "8", "--global-batch-size", "64", "-t", "1", "-p", "1",
        "--micro-batch-size", "1", "--recompute-granularity", "full"]


@pytest.mark.parametrize("zero3_trains", [False, True], ids=["zero3-gated", "zero3-trains"])
def test_plan_takes_the_sharding_flags_and_prints_them(capsys, monkeypatch, zero3_trains):
    monkeypatch.setattr(perf_layout, "PARAMETER_SHARDING_TRAINS", zero3_trains)
    assert main([*PLAN, "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads",
                 "--print-flags"]) == 0
    out = capsys.readouterr().out
    assert "| optim_grads |" in out and "sharding=optim_grads" in out
    assert out.rstrip().endswith("--use-megatron-fsdp --data-parallel-sharding-strategy "
                                 "optim_grads")
    assert main([*PLAN, "--use-distributed-optimizer", "--fix-all", "--print-flags"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("--use-distributed-optimizer")
    # Searched: every strategy ptdp train runs is in the table (ZeRO-3 with both policies).
    assert main([*PLAN, "--top", "20"]) == 0
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ")]
    column = [cell.strip() for cell in rows[0]].index("sharding")
    assert {row[column].strip() for row in rows[1:]} == {"-", "optim", "optim_grads"} | (
        {"optim_grads_params", "optim_grads_params+keep"} if zero3_trains else set())
    assert main([*PLAN, "--data-parallel-sharding-strategy", "optim_grads"]) == 2
    assert "add --use-megatron-fsdp" in capsys.readouterr().err
    zero3 = (["--use-megatron-fsdp"], ["--use-megatron-fsdp", "--fix-all"],
             ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"])
    if not zero3_trains:   # refused (--use-megatron-fsdp's default strategy) until it trains
        for flags in zero3:
            assert main([*PLAN, *flags]) == 2
            err = capsys.readouterr().err
            assert "optim_grads_params (ZeRO-3" in err and "not built yet" in err, flags
        return
    for flags in zero3:   # (the search picks a reshard policy; --fix-all takes the default)
        assert main([*PLAN, *flags, "--print-flags"]) == 0
        command = capsys.readouterr().out.rstrip()
        assert "--data-parallel-sharding-strategy optim_grads_params --" in command
        assert command.endswith(" --fsdp-reshard-after-forward") or "--fix-all" not in flags
    assert main([*PLAN, *zero3[0], "--no-fsdp-reshard-after-forward", "--print-flags"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("--data-parallel-sharding-strategy "
                                                     "optim_grads_params "
                                                     "--no-fsdp-reshard-after-forward")


def test_the_memory_check_names_the_sharding_that_fits(monkeypatch):
    """fits.memory_problems on 8 GPUs, d = 8: the weakest strategy under
    which the model's estimate fits the GPU (ZeRO-1 needs 10.1 GiB, ZeRO-2
    6.2 GiB; no sharding 22.4 GiB), as `ptdp train`'s flags."""
    monkeypatch.setattr(perf_layout, "PARAMETER_SHARDING_TRAINS", False)
    config = Config(model=dataclasses.replace(GPT_1B, recompute_granularity="full"),
                    parallel=ParallelConfig(data_parallel_size=8),
                    train=TrainConfig(micro_batch_size=1, global_batch_size=64, bf16=True))
    (problem,) = memory_problems(config, kind="cuda", local_processes=8, device_memory=12 << 30)
    assert "--use-distributed-optimizer (shards the optimizer state" in problem
    assert "the run then fits" in problem and "--use-megatron-fsdp" not in problem
    (problem,) = memory_problems(config, kind="cuda", local_processes=8, device_memory=8 << 30)
    assert ("--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads (shards "
            "gradients and optimizer state") in problem and "the run then fits" in problem
    assert "--use-distributed-optimizer" not in problem
    # Under ZeRO-1 already: ZeRO-2 is what is left to name.
    config.train.use_distributed_optimizer = True
    (problem,) = memory_problems(config, kind="cuda", local_processes=8, device_memory=8 << 30)
    assert "--data-parallel-sharding-strategy optim_grads" in problem
    # Nothing fits 5 GiB but ZeRO-3 (4.3 GiB): until ptdp train runs it, ZeRO-2
    # is named as what shrinks the state, without a promise; then ZeRO-3.
    (problem,) = memory_problems(config, kind="cuda", local_processes=8, device_memory=5 << 30)
    assert "--data-parallel-sharding-strategy optim_grads (shards" in problem
    assert "optim_grads_params" not in problem and "then fits" not in problem
    monkeypatch.setattr(perf_layout, "PARAMETER_SHARDING_TRAINS", True)
    (problem,) = memory_problems(config, kind="cuda", local_processes=8, device_memory=5 << 30)
    assert ("--data-parallel-sharding-strategy optim_grads_params --fsdp-reshard-after-forward "
            "(shards parameters, gradients and optimizer state over the data-parallel ranks; by "
            "the memory model the run then fits)") in problem
    config.train = dataclasses.replace(config.train, use_megatron_fsdp=True,
                                       data_parallel_sharding_strategy="optim_grads")
    assert memory_problems(config, kind="cuda", local_processes=8, device_memory=7 << 30) == []


def test_zero2_and_zero3_pay_their_collectives():
    """ZeRO-2 reduce-scatters every microbatch (m times ZeRO-1's volume),
    ZeRO-3 also gathers each unit per forward and backward (once an
    iteration without reshard-after-forward) instead of the updated weights;
    on links slow enough that the computation cannot hide them they cost
    time, and the planner's lower bound stays below the simulation."""
    workload, d, m = Workload(GPT_1B, 64, "bf16"), 16, 4
    a100 = load_profile("a100")
    slow = dataclasses.replace(a100, inter_bandwidth=a100.inter_bandwidth / 20,
                               intra_bandwidth=a100.intra_bandwidth / 20)
    layouts = {name: dataclasses.replace(_zero3(d), sharding=strategy, reshard_after_forward=reshard)
               for name, strategy, reshard in (("zero1", "optim", True),
                                               ("zero2", "optim_grads", True),
                                               ("zero3", "optim_grads_params", True),
                                               ("zero3-keep", "optim_grads_params", False))}
    n = buffer_elements(GPT_1B, layouts["zero1"], 0)
    ring = (d - 1) / d * n
    volume = {name: communication_per_rank(workload, layout)[0]["data"]
              for name, layout in layouts.items()}
    assert volume == pytest.approx({"zero1": ring * (4 + 2), "zero2": ring * (4 * m + 2),
                                    "zero3": ring * (4 * m + 2 * m * 2),
                                    "zero3-keep": ring * (4 * m + 2)})
    predicted = {name: simulate(workload, layout, slow) for name, layout in layouts.items()}
    for name, prediction in predicted.items():
        assert compute_lower_bound(workload, layouts[name], slow) <= prediction.iteration_seconds
        assert ("parameter all-gather" in prediction.seconds_by_category) == name.startswith("zero3")
    seconds = {name: prediction.iteration_seconds for name, prediction in predicted.items()}
    assert seconds["zero1"] < seconds["zero2"]
    reduction = {name: p.seconds_by_category["data-parallel reduction"]
                 for name, p in predicted.items()}
    assert reduction["zero2"] > 2 * reduction["zero1"]
    gathers = {name: predicted[name].seconds_by_category["parameter all-gather"]
               for name in ("zero3", "zero3-keep")}
    assert gathers["zero3"] > 4 * gathers["zero3-keep"] > 0
    # ZeRO-3 gathers no updated weights after the step.
    assert predicted["zero3"].seconds_by_category["optimizer"] < \
        predicted["zero2"].seconds_by_category["optimizer"] / 4


def test_under_pipelines_zero_3_keeps_its_parameters_unless_they_would_not_fit(monkeypatch):
    """--fsdp-reshard-after-forward not given: on at p = 1; off at p = 2
    (one gather per layer and iteration: bench/reshard.py), but on, with a
    note, where by the memory model the kept parameters would not fit this
    machine and letting them go would."""
    from ptdp.commands import train_checks
    from ptdp.perf import fits

    assert TrainConfig().reshard_after_forward(1) and not TrainConfig().reshard_after_forward(2)
    assert TrainConfig(fsdp_reshard_after_forward=True).reshard_after_forward(2)

    def config(p: int) -> Config:
        return Config(model=dataclasses.replace(GPT_1B, recompute_granularity="full"),
                      parallel=ParallelConfig(pipeline_model_parallel_size=p, data_parallel_size=2,
                                              device="cpu"),
                      train=TrainConfig(micro_batch_size=1, global_batch_size=64, bf16=True,
                                        use_megatron_fsdp=True))

    needs = {}
    for reshard in (True, False):
        run = config(2)
        run.train.fsdp_reshard_after_forward = reshard
        needs[reshard] = fits._host_bytes(run, fits.estimate(run, "cpu"),
                                          run.parallel.world_size)[0]
    assert needs[False] > needs[True]
    for memory, kept in ((needs[False] + 2**30, True), ((needs[False] + needs[True]) // 2, False)):
        monkeypatch.setattr(fits, "host_memory_bytes", lambda memory=memory: memory)
        run = config(2)
        notes = train_checks.resolve_reshard_after_forward(run, None)
        assert run.train.fsdp_reshard_after_forward is (not kept), memory
        assert bool(notes) is (not kept) and all("--fsdp-reshard-after-forward" in n for n in notes)
    one_stage = config(1)  # nothing to decide: on, left to the default
    assert train_checks.resolve_reshard_after_forward(one_stage, None) == []
    assert one_stage.train.fsdp_reshard_after_forward is None
