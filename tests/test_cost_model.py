"""The schedule-pricing simulator (ptdp/perf/simulate/predict.py and the
modules it prices with: pricing, stage_costs, machine, player, after_flush),
hardware profiles (ptdp/perf/price/profiles.py) and `ptdp calibrate`
(ptdp/perf/calibrate/, ptdp/commands/calibrate.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from ptdp.config import ModelConfig
from ptdp.schedules import simulate as unit
from ptdp.schedules.build import build_schedule
from ptdp.schedules.actions import Exchange, ScheduleError
from ptdp.perf.calibrate.calibration_point import (CALIBRATION_TFLOPS, KORTHIKANTI_LAYER_MS,
                                                   attention_ratios, calibration_point,
                                                   fit_attention, fit_attention_core_fraction,
                                                   fit_paper_kernels, fit_to_calibration_point,
                                                   fit_to_matmul, korthikanti_layer_ms,
                                                   paper_kernels, selective_overhead_ms)
from ptdp.perf.price.machine import Machine
from ptdp.schedules.player import play
from ptdp.perf.simulate.predict import CATEGORIES, simulate, simulate_uniform
from ptdp.perf.price.pricing import OperatorModel
from ptdp.perf.layout import Layout, Workload
from ptdp.perf.price.profiles import (ACHIEVED_HBM_FRACTION, CALIBRATED_GEMM_EFFICIENCY,
                                      HOPPER_ATTENTION_EFFICIENCY, HOPPER_GEMM_EFFICIENCY,
                                      HOPPER_MATMUL, PAPER_ATTENTION_CORE_FRACTION, HardwareProfile,
                                      load_profile, save_profile)
from ptdp.perf.analytic.flops import model_flops_per_iteration

ROOT = Path(__file__).resolve().parents[1]

# A GPT large enough that every GEMM runs near e_max on the GPU profiles.
BIG = ModelConfig(num_layers=16, hidden_size=4096, num_attention_heads=32, seq_length=2048,
                  vocab_size=51200, hidden_dropout=0.1, attention_dropout=0.1)


def _cpu_profile(cores: int) -> HardwareProfile:
    return HardwareProfile(name="cpu-test", kind="cpu", devices_per_server=256, peak_tflops=0.1,
                           peak_tflops_fp32=0.1, gemm_efficiency=1.0, gemm_ramp_seconds=2e-6,
                           memory_bandwidth=10e9, intra_bandwidth=1e9, intra_latency=1e-4,
                           inter_bandwidth=1e9, inter_latency=1e-4, launch_overhead=3e-6,
                           cores=cores)


# ------------------------------------------------------------------ bubbles with uniform costs

@pytest.mark.parametrize("kind,p,m,v", [
    ("gpipe", 2, 4, 1), ("gpipe", 4, 8, 1), ("gpipe", 8, 3, 1),
    ("1f1b", 2, 2, 1), ("1f1b", 4, 8, 1), ("1f1b", 8, 16, 1), ("1f1b", 4, 1, 1),
    ("interleaved", 2, 4, 2), ("interleaved", 4, 8, 2), ("interleaved", 4, 12, 3),
    ("interleaved", 8, 16, 4),
])
def test_uniform_costs_reproduce_the_paper_bubble(kind, p, m, v):
    makespan, bubble = simulate_uniform(kind, p, m, v, forward=1, backward=2)
    assert bubble == Fraction(p - 1, m * (v if kind == "interleaved" else 1))
    # ... and the same makespan as the unit-time simulator of the executor's schedules.
    assert makespan == unit.simulate(build_schedule(kind, p, m, v)).makespan


def test_uniform_bubble_does_not_depend_on_the_cost_ratio():
    _, bubble = simulate_uniform("1f1b", 4, 8, forward=Fraction(1, 3), backward=Fraction(5, 7))
    assert bubble == Fraction(3, 8)


def test_play_reports_a_deadlock():
    schedule = build_schedule("1f1b", 2, 2)
    # Rank 1 never receives: drop its exchanges, so rank 0's first send has no other end.
    broken = dataclasses.replace(schedule, ranks=(schedule.ranks[0],
                                                  tuple(a for a in schedule.ranks[1]
                                                        if not isinstance(a, Exchange))))
    with pytest.raises(ScheduleError):
        play(broken, lambda r, a: (1, 0), lambda r, a: 0)


# ------------------------------------------------------------------ the calibration point

def test_a100_predicts_the_calibration_point_and_the_fit_is_reproducible():
    workload, layout = calibration_point()
    # The paper's run, with the paper's kernels (attention as GEMMs and a softmax pass).
    prediction = simulate(workload, layout, paper_kernels(load_profile("a100")))
    assert prediction.tflops_per_device == pytest.approx(CALIBRATION_TFLOPS, rel=0.01)
    assert prediction.tflops_per_device / 312.0 == pytest.approx(0.44, abs=0.005)
    # ptdp runs it with flash attention: faster, on the same fitted GEMMs.
    flash = simulate(workload, layout, load_profile("a100"))
    assert load_profile("a100").fused_attention
    assert flash.tflops_per_device > prediction.tflops_per_device
    fitted = fit_to_calibration_point()
    assert fitted == pytest.approx(CALIBRATED_GEMM_EFFICIENCY, abs=1e-3)
    assert 0 < fitted <= 1
    # The paper's F over n devices and the predicted time.
    flops = model_flops_per_iteration(workload.model, workload.global_batch, recompute="full")
    assert prediction.tflops_per_device == pytest.approx(
        flops / (32 * prediction.iteration_seconds) / 1e12, rel=1e-9)


def test_the_paper_attention_core_is_fitted_to_korthikanti_layer_and_prices_it():
    """The paper's attention-core passes run at the fraction of the HBM data
    sheet for which the a100 profile prices selective recomputation's
    overhead in Korthikanti et al.'s Table 4 (1.3 ms on a 22B layer) as
    measured; that fraction and e_max are one fixed point (each fit at the
    other's rounded value returns it). At them the five measured layer
    times, a reference the fits saw only through that one difference, are
    priced within 10 %, and the differences between them keep their signs:
    sequence parallelism saves time, selective recomputation costs a sixth
    of what full recomputation does."""
    fraction = fit_attention_core_fraction(CALIBRATED_GEMM_EFFICIENCY)
    assert fraction == pytest.approx(PAPER_ATTENTION_CORE_FRACTION, abs=1e-3)
    assert fit_paper_kernels() == pytest.approx(
        (CALIBRATED_GEMM_EFFICIENCY, PAPER_ATTENTION_CORE_FRACTION), abs=1e-3)
    assert 0.3 < fraction < ACHIEVED_HBM_FRACTION     # slower than a streaming copy
    profile = paper_kernels(load_profile("a100"))
    assert profile.op_bandwidth["attention_core"] == pytest.approx(
        fraction * 2039e9, rel=1e-3)
    priced = korthikanti_layer_ms(profile)
    assert selective_overhead_ms(priced) == pytest.approx(
        selective_overhead_ms(KORTHIKANTI_LAYER_MS), rel=0.01)
    for setting, measured in KORTHIKANTI_LAYER_MS.items():
        assert priced[setting] == pytest.approx(measured, rel=0.10), setting
    assert priced[None, True] < priced[None, False]
    full, selective = (priced["full", False] - priced[None, False],
                       priced["selective", False] - priced[None, False])
    assert 3 < full / selective < 12      # measured: 7.6 / 1.3


def test_full_recomputation_reruns_the_whole_layer_only_where_the_run_does():
    """ptdp's non-re-entrant checkpoint stops once the last tensor the
    backward needs is rebuilt: without hidden dropout before each layer's
    last GEMM (and its all-reduce and residual add), with it after them
    (the dropout's mask is saved last). A run whose checkpoint reruns the
    whole layer (Megatron-LM's re-entrant one, paper_kernels) recomputes
    exactly the layer's forward either way."""
    layout = Layout(t=2, p=1, d=1, b=2, recompute="full")
    ours = load_profile("a100")
    theirs = dataclasses.replace(ours, recompute_whole_layer=True)
    assert not ours.recompute_whole_layer and paper_kernels(ours).recompute_whole_layer
    machine = Machine(layout, ours)
    no_dropout = dataclasses.replace(BIG, hidden_dropout=0.0)
    for model, profile, whole in ((BIG, ours, True), (BIG, theirs, True),
                                  (no_dropout, theirs, True), (no_dropout, ours, False)):
        ops = OperatorModel(Workload(model, global_batch=8, precision="bf16"), layout, profile,
                            machine)
        forward, recomputed = ops.layer_forward("recompute"), ops.layer_recompute("full")
        if whole:
            assert recomputed.work == forward.work and recomputed.comm == forward.comm
        else:
            last_gemm = ops.gemm(*ops.layer_gemms()["mlp_down"][:3])
            assert recomputed.total_work < forward.total_work - last_gemm * 0.99
            assert recomputed.comm < forward.comm
    workload = Workload(no_dropout, global_batch=8, precision="bf16")
    assert (simulate(workload, layout, theirs).iteration_seconds
            > simulate(workload, layout, ours).iteration_seconds)


def test_ptdp_recomputes_the_last_gemm_exactly_when_hidden_dropout_is_on():
    """What the pricing above assumes of ptdp's checkpoint, on a real layer:
    the backward of a checkpointed layer runs its 8 gradient GEMMs and
    recomputes 3 of its 4 forward GEMMs without hidden dropout, all 4 with it."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from ptdp.model.gpt import TransformerLayer
    from ptdp.model.recompute import checkpoint
    from ptdp.parallel.tensor import RNGStreams
    from ptdp.parallel.topology import ParallelContext

    class CountProducts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func.__name__.split(".")[0] in ("mm", "addmm")
            return func(*args, **(kwargs or {}))

    for dropout, products in ((0.0, 8 + 3), (0.1, 8 + 4)):
        config = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=16,
                             vocab_size=128, hidden_dropout=dropout, attention_dropout=0.0)
        rng = RNGStreams(torch.device("cpu"))
        layer = TransformerLayer(config, ParallelContext.single(), rng)
        out = checkpoint(layer, rng, torch.randn(16, 2, 64, requires_grad=True))
        counter = CountProducts()
        with counter:
            out.sum().backward()
        assert counter.count == products, (dropout, counter.count)


def test_h100_and_h200_take_e_max_from_the_measured_matmul_and_run_faster():
    """Their e_max is the one for which the tile model prices the H200's
    measured 8192³ bf16 matmul at its measured rate, not the a100 fit."""
    fitted = fit_to_matmul()
    assert fitted == pytest.approx(HOPPER_GEMM_EFFICIENCY, abs=1e-4)
    size, tflops = HOPPER_MATMUL
    workload, layout = calibration_point()
    a100 = simulate(workload, layout, load_profile("a100"))
    for name in ("h100", "h200"):
        profile = load_profile(name)
        assert profile.gemm_efficiency == HOPPER_GEMM_EFFICIENCY != CALIBRATED_GEMM_EFFICIENCY
        priced = 2 * size ** 3 / profile.gemm_seconds(size, size, size) / 1e12
        assert priced == pytest.approx(tflops, rel=1e-3)
        assert simulate(workload, layout, profile).iteration_seconds < a100.iteration_seconds
    assert load_profile("h200").memory_bytes > load_profile("h100").memory_bytes


@pytest.mark.parametrize("kernel", ["flash2", "cudnn"])
def test_hopper_attention_takes_its_fraction_from_published_kernel_benchmarks(kernel):
    """Each kernel's attention_efficiency is the one for which the flash
    block model prices the FlashAttention-3 paper's H100 benchmarks of it too
    fast as often as too slow; at it, the points at 2k positions and more
    are priced within 20 % of what was measured (shorter ones cost the
    kernels more than the model's fixed cost per block; cuDNN's forward
    without a mask peaks at 2k, which no block model follows). h100 and h200 price
    ptdp's attention as PyTorch's default FlashAttention-2."""
    fitted = fit_attention(kernel)
    assert fitted == pytest.approx(HOPPER_ATTENTION_EFFICIENCY[kernel], abs=1e-4)
    profile = dataclasses.replace(load_profile("h100"), attention_efficiency=fitted)
    ratios = attention_ratios(profile, kernel)
    assert sorted(ratios)[len(ratios) // 2] == pytest.approx(1.0, abs=0.02)
    long_sequences = [r for i, r in enumerate(ratios) if i % 6 >= 2]   # s = 2k..16k of each series
    assert all(0.8 < r < 1.2 for r in long_sequences), long_sequences
    assert 0 < fitted < HOPPER_GEMM_EFFICIENCY
    for name in ("h100", "h200"):
        assert load_profile(name).attention_efficiency == HOPPER_ATTENTION_EFFICIENCY["flash2"]
    assert HOPPER_ATTENTION_EFFICIENCY["flash2"] < HOPPER_ATTENTION_EFFICIENCY["cudnn"]


# ------------------------------------------------------------------ placement of the ranks

def test_tensor_parallelism_across_servers_costs_more_than_within_one():
    workload = Workload(BIG, global_batch=64, precision="bf16")
    layout = Layout(t=16, p=1, d=1, b=1)
    across = simulate(workload, layout, load_profile("a100"))          # 8 GPUs per server
    within = simulate(workload, layout, dataclasses.replace(load_profile("a100"),
                                                            devices_per_server=16))
    assert (across.seconds_by_category["tensor all-reduce"]
            > 3 * within.seconds_by_category["tensor all-reduce"])
    assert across.iteration_seconds > within.iteration_seconds
    # t = 8 within a server vs t = 16 across two: the 16-way all-reduces take longer
    # although each moves the same b·s·h bytes.
    inside = simulate(workload, Layout(t=8, p=1, d=2, b=1), load_profile("a100"))
    assert (across.seconds_by_category["tensor all-reduce"]
            > inside.seconds_by_category["tensor all-reduce"])


def test_scatter_gather_cuts_pipeline_transfers_between_servers():
    workload = Workload(BIG, global_batch=64, precision="bf16")
    a100 = load_profile("a100")

    def transfer(scatter_gather: bool, profile: HardwareProfile) -> float:
        layout = Layout(t=8, p=4, d=1, b=1, scatter_gather=scatter_gather)
        prediction = simulate(workload, layout, profile)
        return sum(c["pipeline transfer"] for c in prediction.categories_by_rank)

    # t·d = 8 = devices per server: every pipeline neighbour is on another server.
    with_sg, without_sg = transfer(True, a100), transfer(False, a100)
    assert with_sg < 0.5 * without_sg
    # Neighbours on one server (NVSwitch) move their bytes much faster either way.
    one_server = dataclasses.replace(a100, devices_per_server=32)
    assert transfer(False, one_server) < 0.2 * without_sg


# ------------------------------------------------------------------ recomputation

@pytest.mark.parametrize("hidden_dropout", [0.1, 0.0])
def test_full_recomputation_adds_the_layers_forward_once_more(hidden_dropout):
    model = dataclasses.replace(BIG, hidden_dropout=hidden_dropout)
    workload = Workload(model, global_batch=32, precision="bf16")
    a100 = load_profile("a100")
    base = simulate(workload, Layout(b=2), a100)
    full = simulate(workload, Layout(b=2, recompute="full"), a100)
    added = full.iteration_seconds - base.iteration_seconds
    assert added == pytest.approx(full.seconds_by_category["recompute"], rel=1e-9)
    assert base.seconds_by_category["recompute"] == 0
    # The layers' forward again; without hidden dropout less the MLP's last
    # GEMM (the non-re-entrant checkpoint stops once every saved tensor is
    # rebuilt, and the dropout's mask is what follows that GEMM).
    layout = Layout(b=2)
    ops = OperatorModel(workload, layout, a100, Machine(layout, a100))
    m, l = layout.microbatches(32), model.num_layers
    layers_forward = m * l * ops.layer_forward().total_work
    mlp_down = m * l * ops.gemm(*ops.layer_gemms()["mlp_down"][:3])
    skipped = 0.0 if hidden_dropout else mlp_down
    assert added == pytest.approx(layers_forward - skipped, rel=0.05)
    assert added <= layers_forward * (1 + 1e-9) < base.seconds_by_category["forward compute"]
    # The paper's FLOPs count the recomputed forward: F_full / F_none = 4/3 without logits.
    assert full.flops_per_iteration > base.flops_per_iteration


@pytest.mark.parametrize("fused", [True, False])
def test_selective_recomputation_adds_the_attention_core_only(fused):
    workload = Workload(BIG, global_batch=32, precision="bf16")
    a100 = dataclasses.replace(load_profile("a100"), fused_attention=fused)
    layout = Layout(b=2, recompute="selective")
    selective = simulate(workload, layout, a100)
    base = simulate(workload, Layout(b=2), a100)
    ops = OperatorModel(workload, layout, a100, Machine(layout, a100))
    shapes = ops.layer_gemms()
    if fused:   # the flash-attention kernel's forward again
        core = ops.fused_attention_seconds()[0] + ops.launches(8)
    else:       # the score and context GEMMs and the softmax (and dropout) pass
        core = (ops.gemm(*shapes["scores"][:3], shapes["scores"][3])
                + ops.gemm(*shapes["context"][:3], shapes["context"][3])
                + ops.memory_ops_seconds(ops.attention_core_ops(), False) + ops.launches(8))
    m = layout.microbatches(32)
    assert selective.seconds_by_category["recompute"] == pytest.approx(m * BIG.num_layers * core)
    assert (selective.iteration_seconds - base.iteration_seconds
            == pytest.approx(m * BIG.num_layers * core))


@pytest.mark.parametrize("hidden_dropout, repeated", [(0.1, 2), (0.0, 1)])
def test_full_recomputation_repeats_the_forward_all_reduces_it_reruns(hidden_dropout, repeated):
    """Both of a layer's forward all-reduces with hidden dropout (the whole
    layer reruns), the attention's alone without (the recomputation stops
    before the MLP's second GEMM): analytic/counts.py counts the same."""
    from ptdp.perf.analytic.counts import tensor_collectives_per_layer

    model = dataclasses.replace(BIG, hidden_dropout=hidden_dropout)
    workload = Workload(model, global_batch=8, precision="bf16")
    a100 = load_profile("a100")
    base = simulate(workload, Layout(t=4, b=1), a100)
    full = simulate(workload, Layout(t=4, b=1, recompute="full"), a100)
    layout = Layout(t=4, b=1)
    one = Machine(layout, a100).tensor_allreduce(1 * model.seq_length * model.hidden_size * 2)
    extra = full.seconds_by_category["tensor all-reduce"] - base.seconds_by_category["tensor all-reduce"]
    assert extra == pytest.approx(8 * model.num_layers * repeated * one)
    counted = tensor_collectives_per_layer(workload, Layout(t=4, b=1, recompute="full"))
    assert counted["all_reduce"] == 4 + repeated


# ------------------------------------------------------------------ the rest of the iteration

def test_iteration_breakdown_sums_to_the_iteration_on_every_rank():
    workload = Workload(BIG, global_batch=64, precision="bf16")
    prediction = simulate(workload, Layout(t=2, p=4, d=2, b=2, v=2), load_profile("a100"))
    for categories in prediction.categories_by_rank:
        assert set(categories) == set(CATEGORIES)
        assert sum(categories.values()) == pytest.approx(prediction.iteration_seconds)
        assert all(seconds >= -1e-12 for seconds in categories.values())
    assert prediction.seconds_by_category is prediction.categories_by_rank[prediction.critical_rank]
    assert 0 < prediction.bubble_fraction < 0.5
    assert len(prediction.timelines) == 4


def test_interleaving_shrinks_the_bubble_and_data_parallelism_adds_a_reduction():
    workload = Workload(BIG, global_batch=32, precision="bf16")
    a100 = load_profile("a100")
    plain = simulate(workload, Layout(p=4, d=1, b=1), a100)
    interleaved = simulate(workload, Layout(p=4, d=1, b=1, v=2), a100)
    assert interleaved.bubble_fraction < plain.bubble_fraction
    assert plain.bubble_fraction == pytest.approx(3 / 32, rel=0.25)
    replicated = simulate(workload, Layout(p=4, d=2, b=1), a100)
    assert replicated.seconds_by_category["data-parallel reduction"] > 0
    sharded = simulate(workload, Layout(p=4, d=2, b=1, distributed_optimizer=True), a100)
    assert (sharded.seconds_by_category["optimizer"]
            < replicated.seconds_by_category["optimizer"])


def test_cpu_contention_shares_the_cores():
    model = ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=64,
                        vocab_size=512)
    workload = Workload(model, global_batch=8, precision="fp32")
    layout = Layout(d=4, b=1)           # 4 processes computing at once, 1 thread each
    roomy = simulate(workload, layout, _cpu_profile(cores=4))
    crowded = simulate(workload, layout, _cpu_profile(cores=2))
    for category in ("forward compute", "backward compute"):
        assert crowded.seconds_by_category[category] == pytest.approx(
            2 * roomy.seconds_by_category[category], rel=1e-9)
    # A pipeline's ranks only compete while they compute at the same time: 2 ranks on
    # 2 cores never slow each other; 4 ranks on 2 cores do, but by less than 2x overall.
    pipeline = Layout(p=4, b=1)
    alone = simulate(workload, pipeline, _cpu_profile(cores=4))
    shared = simulate(workload, pipeline, _cpu_profile(cores=2))
    assert alone.pipeline_seconds < shared.pipeline_seconds < 2 * alone.pipeline_seconds


def test_draw_writes_a_png(tmp_path):
    model = ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=64,
                        vocab_size=512)
    prediction = simulate(Workload(model, 8, "fp32"), Layout(p=2, b=1, v=2), _cpu_profile(2))
    path = prediction.draw(tmp_path / "timeline.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_invalid_layouts_are_refused():
    workload = Workload(BIG, global_batch=32)
    with pytest.raises(ValueError, match="p·v"):
        simulate(workload, Layout(p=3), load_profile("a100"))


# ------------------------------------------------------------------ profiles as JSON

def test_profile_json_round_trip(tmp_path):
    profile = dataclasses.replace(
        load_profile("h200"), op_bandwidth={"gelu": 1e9}, op_thread_speedup={"gelu": 1.5},
        collective_seconds={"allreduce": {"4": 1e-4, "1024": 2e-4}}, measurements={"x": [1, 2]})
    path = save_profile(profile, tmp_path / "h200.json")
    assert json.loads(path.read_text())["name"] == "h200"
    assert load_profile(path) == profile
    for name in ("a100", "h100", "h200"):
        builtin = load_profile(name)
        assert load_profile(save_profile(builtin, tmp_path / f"{name}.json")) == builtin


def test_a_class_measured_by_direction_prices_each_direction_at_its_own_rate():
    """A CPU profile's classes carry a forward and a backward rate where
    `ptdp calibrate` measured them apart (a dropout mask is drawn in the
    forward only): the layer's forward and its recomputation take the
    forward rate, its backward the backward one; a class or direction not
    measured falls back to the class's rate, then to memory_bandwidth."""
    base = _cpu_profile(1)
    classes = ("layer_norm", "gelu", "residual", "attention_core", "elementwise")
    plain = dataclasses.replace(base, op_bandwidth={c: 1e9 for c in classes})
    split = dataclasses.replace(base, op_bandwidth={
        **{c: 1e9 for c in classes}, **{f"{c}:forward": 0.5e9 for c in classes},
        **{f"{c}:backward": 2e9 for c in classes}})
    assert split.memory_seconds(1e9, "gelu", "forward") == 2.0
    assert split.memory_seconds(1e9, "gelu", "backward") == 0.5
    assert split.memory_seconds(1e9, "gelu") == 1.0 == plain.memory_seconds(1e9, "gelu", "forward")
    assert split.memory_seconds(1e9, "optimizer", "forward") == 1e9 / base.memory_bandwidth
    workload, layout = Workload(BIG, 8, "fp32"), Layout(b=1, recompute="full")
    machine = Machine(layout, base)
    ours, theirs = (OperatorModel(workload, layout, p, machine) for p in (split, plain))
    memory = ours.layer_memory()
    forward_bytes, backward_bytes = sum(op[1] for op in memory), sum(op[2] for op in memory)
    assert (ours.layer_forward().total_work - theirs.layer_forward().total_work
            == pytest.approx(forward_bytes / 1e9))          # at 0.5 GB/s instead of 1
    assert (theirs.layer_backward().total_work - ours.layer_backward().total_work
            == pytest.approx(backward_bytes / 2e9))         # at 2 GB/s instead of 1
    assert ours.layer_recompute("full").total_work == pytest.approx(
        ours.layer_forward().total_work)                    # BIG has hidden dropout


def test_profile_json_rejects_unknown_fields(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"name": "x", "peak_tflopz": 3}))
    with pytest.raises(ValueError, match="peak_tflopz"):
        load_profile(path)
    with pytest.raises(FileNotFoundError):
        load_profile(tmp_path / "missing.json")


def test_measured_collective_tables_interpolate():
    profile = dataclasses.replace(_cpu_profile(2), collective_seconds={
        "allreduce": {"4": 1e-3, "1000004": 3e-3, "2000004": 4e-3}})
    assert profile.measured_seconds("allreduce", 1) == 1e-3
    assert profile.measured_seconds("allreduce", 500004) == pytest.approx(2e-3)
    assert profile.measured_seconds("allreduce", 3000004) == pytest.approx(5e-3)
    assert profile.measured_seconds("exchange", 10) is None
    machine = Machine(Layout(t=2), profile)
    assert machine.tensor_allreduce(500004) == pytest.approx(2e-3)


# ------------------------------------------------------------------ ptdp calibrate

def test_calibrate_quick_writes_a_loadable_profile(tmp_path):
    out = tmp_path / "local.json"
    result = subprocess.run([sys.executable, "-m", "ptdp.commands.calibrate", "calibrate",
                             "--quick", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                            timeout=900)  # a hang guard: about 10 s on 2 idle cores
    assert result.returncode == 0, result.stderr
    profile = load_profile(out)
    assert profile.kind == "cpu" and profile.cores >= 1
    assert profile.peak_tflops_fp32 > 0 and profile.memory_bandwidth > 0
    classes = {"layer_norm", "gelu", "residual", "attention_core", "elementwise", "cross_entropy"}
    assert set(profile.op_bandwidth) == (classes | {"optimizer"}
                                         | {f"{c}:{d}" for c in classes
                                            for d in ("forward", "backward")})
    assert all(rate > 0 for rate in profile.op_bandwidth.values())
    assert set(profile.collective_seconds) == {"allreduce", "exchange"}
    # How long calibration took, and what the profile predicts, depend on the
    # machine's speed and load: only their being real durations is checked.
    assert math.isfinite(profile.measurements["seconds"]) and profile.measurements["seconds"] > 0
    model = ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=64,
                        vocab_size=512)
    prediction = simulate(Workload(model, 8, "fp32"), Layout(t=2, p=2, b=1), profile)
    assert math.isfinite(prediction.iteration_seconds) and prediction.iteration_seconds > 0
