"""The performance model under uneven pipeline splits (issue 15): per-stage
layer counts from ptdp.schedules.split in the simulator, the
parameter and memory counts, Layout.valid_for and the planner."""

from __future__ import annotations

import dataclasses

import pytest

from ptdp.config import ModelConfig
from ptdp.schedules.split import LayerSplit
from ptdp.perf.analytic.counts import parameters_per_rank
from ptdp.perf.analytic.memory import memory_per_rank
from ptdp.perf.simulate.predict import simulate
from ptdp.perf.layout import Layout, Workload
from ptdp.perf.plan.planner import describe, search, table
from ptdp.perf.price.profiles import HardwareProfile

# bench/peers.py's GPT: the output layer (V = 8192, h = 256) costs several layers.
PEERS = ModelConfig(num_layers=8, hidden_size=256, num_attention_heads=8, seq_length=128,
                    vocab_size=8192, hidden_dropout=0.0, attention_dropout=0.0)
WORKLOAD = Workload(PEERS, 16, "fp32")
CPU = HardwareProfile(name="cpu-test", kind="cpu", devices_per_server=256, peak_tflops=0.1,
                      peak_tflops_fp32=0.1, gemm_efficiency=1.0, gemm_ramp_seconds=2e-6,
                      memory_bandwidth=10e9, intra_bandwidth=1e9, intra_latency=1e-4,
                      inter_bandwidth=1e9, inter_latency=1e-4, launch_overhead=3e-6, cores=4)


@pytest.mark.parametrize("layout", [Layout(p=2, b=2), Layout(p=4, b=2, schedule="zb-h1"),
                                    Layout(p=2, b=2, v=2, schedule="zbv"),
                                    Layout(t=2, p=2, b=2, v=2)])
def test_an_explicit_even_split_changes_nothing(layout):
    even = dataclasses.replace(layout, split=LayerSplit())
    assert even == layout and not layout.valid_for(PEERS, 16)
    assert layout.stage_layers(8) == [8 // (layout.p * layout.v)] * (layout.p * layout.v)
    assert simulate(WORKLOAD, layout, CPU).iteration_seconds == \
        simulate(WORKLOAD, even, CPU).iteration_seconds
    assert parameters_per_rank(PEERS, layout) == parameters_per_rank(PEERS, even)


@pytest.mark.parametrize("p,schedule,split", [
    (2, "1f1b", LayerSplit(last=3)), (2, "zb-h1", LayerSplit(last=3)),
    (4, "1f1b", LayerSplit(first=1, last=1)), (4, "zb-h1", LayerSplit(first=1, last=1))])
def test_moving_layers_off_the_heavy_last_stage_is_faster(p, schedule, split):
    even = Layout(p=p, b=2, schedule=schedule)
    uneven = dataclasses.replace(even, split=split)
    assert not uneven.valid_for(PEERS, 16)
    assert simulate(WORKLOAD, uneven, CPU).iteration_seconds < \
        0.95 * simulate(WORKLOAD, even, CPU).iteration_seconds


def test_parameters_and_memory_follow_the_stage_counts():
    even = Layout(p=2, b=2)
    uneven = dataclasses.replace(even, split=LayerSplit(last=3))
    assert uneven.stage_layers(8) == [5, 3]
    layer = (parameters_per_rank(PEERS, Layout(p=2, b=2, split=LayerSplit(first=5)))[0]
             - parameters_per_rank(PEERS, even)[0])   # one layer more on rank 0
    assert layer == 12 * 256 * 256 + 13 * 256
    before, after = parameters_per_rank(PEERS, even), parameters_per_rank(PEERS, uneven)
    assert after == [before[0] + layer, before[1] - layer]
    assert sum(after) == sum(before)
    mem_before, mem_after = memory_per_rank(WORKLOAD, even), memory_per_rank(WORKLOAD, uneven)
    assert mem_after[0]["weights"] > mem_before[0]["weights"]
    assert mem_after[1]["weights"] < mem_before[1]["weights"]
    assert mem_after[1]["activations"] < mem_before[1]["activations"]
    # The accounting flags under zbv: rank 0 holds the first and last stage.
    ten = dataclasses.replace(PEERS, num_layers=10)
    zbv = Layout(p=2, b=2, v=2, schedule="zbv", split=LayerSplit(embedding=True, loss=True))
    assert not zbv.valid_for(ten, 16) and zbv.stage_layers(10) == [2, 3, 3, 2]
    assert [zbv.chunk_layers(10, r, c) for r in (0, 1) for c in (0, 1)] == [2, 2, 3, 3]
    assert parameters_per_rank(ten, zbv)[1] == 6 * layer


def test_valid_for_messages():
    assert not Layout(p=2, split=LayerSplit(last=3)).valid_for(PEERS, 16)
    interleaved = Layout(p=2, v=2, split=LayerSplit(last=2)).valid_for(PEERS, 16)
    assert len(interleaved) == 1 and "interleaved" in interleaved[0]
    assert "--decoder-last-pipeline-num-layers 2" in interleaved[0]
    zbv = Layout(p=2, v=2, schedule="zbv", split=LayerSplit(last=2)).valid_for(PEERS, 16)
    assert any("not defined under zbv" in problem for problem in zbv)
    assert any("must split evenly" in problem
               for problem in Layout(p=4, split=LayerSplit(last=1)).valid_for(PEERS, 16))
    # A split can make a layer count valid that does not divide evenly.
    assert Layout(p=3).valid_for(PEERS, 15) and not Layout(
        p=3, split=LayerSplit(first=2, last=2)).valid_for(PEERS, 15)
    # The even messages are as before.
    assert Layout(p=3).valid_for(PEERS, 15) == ["p·v=3 does not divide the 8 layers"]
    flags = Layout(p=2, split=LayerSplit(last=3)).train_flags(PEERS, 16)
    assert flags[-2:] == ["--decoder-last-pipeline-num-layers", "3"]


def test_the_plan_considers_uneven_splits():
    results = search(WORKLOAD, 4, CPU, microbatch_sizes=(2,), recompute=(None,),
                     distributed_optimizer=(False,), sequence_parallel=(False,))
    uneven = [e for e in results if not e.layout.split.even]
    assert uneven
    best = min((e for e in uneven if e.layout.p == 4), key=lambda e: e.seconds)
    even = next(e for e in results if e.layout == dataclasses.replace(best.layout,
                                                                      split=LayerSplit()))
    assert best.seconds < even.seconds
    assert "layers per stage 1,3,3,1" in describe(best.layout, PEERS)
    assert "| 1,3,3,1 |" in table([best], 1)


def test_plan_prints_the_split_flags(capsys):
    from ptdp.cli import main

    argv = ["plan", "--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8",
            "--seq-length", "128", "--vocab-size", "8192", "--gpus", "4", "--gpu", "h100",
            "--global-batch-size", "16", "-p", "4", "--micro-batch-size", "2",
            "--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers",
            "1", "--print-flags"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "layers per stage 1,3,3,1" in out
    assert out.strip().splitlines()[-1].endswith(
        "--decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 1")
