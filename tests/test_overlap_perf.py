"""The performance model's communication overlaps: ptdp's gradient buckets
under the last backward, and the two overlaps of other trainers that
published runs are priced with (the weight all-gather under the next
forward, tensor collectives pipelined with GEMMs); and the fused kernels
such runs use where ptdp runs eager operators (rotary embeddings, the
optimizer step)."""

from __future__ import annotations

import dataclasses

import pytest

from ptdp.config import ModelConfig
from ptdp.perf.analytic import counts as analytic
from ptdp.perf.price.after_flush import after_flush
from ptdp.perf.simulate.bounds import compute_lower_bound
from ptdp.perf.calibrate.calibration_point import paper_kernels
from ptdp.perf.layout import Layout, Workload
from ptdp.perf.price.machine import Machine
from ptdp.perf.price.operator_bytes import (OPTIMIZER_BYTES_PER_PARAMETER,
                                           optimizer_bytes_per_parameter)
from ptdp.perf.simulate.predict import simulate
from ptdp.perf.price.pricing import OperatorModel
from ptdp.perf.price.profiles import load_profile
from ptdp.perf.price.stage_costs import operator_model, parameter_counts

GPT = ModelConfig(num_layers=16, hidden_size=4096, num_attention_heads=32, seq_length=2048,
                  vocab_size=51200)
H100 = load_profile("h100")
AFTER_FLUSH = ("data-parallel reduction", "optimizer")


def _after(workload, layout, profile):
    return after_flush(workload, layout, profile, operator_model(workload, layout, profile))


@pytest.mark.parametrize("layout", [Layout(d=8, b=2), Layout(p=2, d=4, b=2),
                                    Layout(p=2, d=4, b=1, v=2), Layout(t=2, p=2, d=2, b=2),
                                    Layout(p=2, d=4, b=2, schedule="zb-h1")],
                         ids=["d8", "1f1b", "interleaved", "tp", "zb-h1"])
def test_gradient_buckets_hide_under_the_last_backward_but_not_their_last_bucket(layout):
    """Overlapped, a rank's reduction follows its last computation by at
    least its last bucket and at most all of it; after the flush (the 2021
    software) by all of it; the iteration is shorter overlapped, and no
    iteration beats the planner's bound."""
    workload = Workload(GPT, 32, "bf16")
    overlapped, serial = H100, dataclasses.replace(H100, overlap_grad_reduce=False)
    after = _after(workload, layout, overlapped)
    fast, slow = simulate(workload, layout, overlapped), simulate(workload, layout, serial)
    assert fast.iteration_seconds < slow.iteration_seconds
    for r in range(layout.p):
        exposed = fast.categories_by_rank[r]["data-parallel reduction"]
        whole = slow.categories_by_rank[r]["data-parallel reduction"]
        embedding = after.embedding if r in after.ends else 0.0
        assert whole == pytest.approx(after.bucketed[r] - after.partial_sums[r] + embedding)
        assert after.last_bucket[r] * (1 - 1e-9) <= exposed + fast.categories_by_rank[r][
            "tensor all-reduce"] and exposed < whole
    for profile, prediction in ((overlapped, fast), (serial, slow)):
        assert compute_lower_bound(workload, layout, profile) <= prediction.iteration_seconds * (
            1 + 1e-9)


def test_ptdp_overlaps_its_gradient_buckets_and_nothing_it_does_not_run():
    assert H100.overlap_grad_reduce is True and not H100.overlap_param_gather
    assert not H100.tensor_comm_overlap
    assert paper_kernels(H100).overlap_grad_reduce is True    # the row says how it reduced


def test_a_weight_gather_under_the_next_forward_hides_all_but_its_first_bucket():
    """--overlap-param-gather (published Megatron runs): the distributed
    optimizer's all-gather leaves the step as far as the rank's first
    forwards cover it; never its first bucket; nothing without the
    distributed optimizer."""
    workload = Workload(GPT, 16, "bf16")
    overlapping = dataclasses.replace(H100, overlap_param_gather=True)
    layout = Layout(p=2, d=8, b=1, v=2, distributed_optimizer=True)
    after = _after(workload, layout, overlapping)
    plain = simulate(workload, layout, H100)
    hidden = simulate(workload, layout, overlapping)
    for r in range(layout.p):
        gather = plain.categories_by_rank[r]["optimizer"] - hidden.categories_by_rank[r][
            "optimizer"]
        assert 0 < gather <= after.hideable_gather[r] * (1 + 1e-9)
        assert hidden.categories_by_rank[r]["optimizer"] >= after.optimizer_at_least(r) * (
            1 - 1e-9)
    assert hidden.iteration_seconds < plain.iteration_seconds
    assert compute_lower_bound(workload, layout, overlapping) <= hidden.iteration_seconds
    replicated = Layout(p=2, d=8, b=1, v=2)
    assert _after(workload, replicated, overlapping).hideable_gather == [0.0, 0.0]
    assert (simulate(workload, replicated, overlapping).iteration_seconds
            == simulate(workload, replicated, H100).iteration_seconds)


def _layer_comm(profile, layout, model=GPT):
    workload = Workload(model, 64, "bf16")
    ops = OperatorModel(workload, layout, profile, Machine(layout, profile))
    return ops, ops.layer_forward().comm, ops.layer_backward().comm


def test_tensor_collectives_pipelined_with_gemms_expose_what_outlasts_them_plus_one_step():
    """--tp-comm-overlap: each sequence-parallel collective next to a GEMM
    costs max(0, collective - GEMM) + collective / t; without sequence
    parallelism, or run by ptdp, each costs the whole collective."""
    overlapping = dataclasses.replace(H100, tensor_comm_overlap=True)
    sp = Layout(t=8, b=1, d=1, sequence_parallel=True)
    ops, forward, backward = _layer_comm(overlapping, sp)
    _, whole_forward, whole_backward = _layer_comm(H100, sp)
    collective = ops.tensor_collectives(gathers=1)
    assert whole_forward == pytest.approx(4 * collective)
    shapes = ops.layer_gemms()
    expected = sum(max(0.0, collective - ops.gemm(*shapes[name][:3])) + collective / 8
                   for name in ("qkv", "proj", "mlp_up", "mlp_down"))
    assert forward == pytest.approx(expected)
    assert 4 * collective / 8 <= forward < whole_forward
    assert backward < whole_backward
    # Without sequence parallelism the all-reduces stay whole (Megatron needs SP for it).
    plain = Layout(t=8, b=1, d=1)
    assert _layer_comm(overlapping, plain)[1:] == _layer_comm(H100, plain)[1:]


def test_moe_layers_keep_their_tensor_collectives_whole():
    moe = dataclasses.replace(GPT, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=4096)
    overlapping = dataclasses.replace(H100, tensor_comm_overlap=True)
    sp = Layout(t=2, b=1, d=1, sequence_parallel=True)
    assert _layer_comm(overlapping, sp, moe)[1:] == _layer_comm(H100, sp, moe)[1:]


def test_rotary_embeddings_cost_ptdps_eager_passes_unless_the_run_fuses_them():
    """ptdp rotates q and k eagerly: five passes (10 reads and writes of
    the rotated elements each way, 12 launches forward); a run with a fused
    RoPE kernel (published Megatron runs) one read and one write, 2 launches."""
    llama = dataclasses.replace(GPT, normalization="RMSNorm", swiglu=True,
                                position_embedding_type="rope", group_query_attention=True,
                                num_query_groups=8, disable_bias_linear=True)
    layout = Layout(t=2, b=1, d=1)
    fused = dataclasses.replace(H100, fused_rope=True)
    rotated = 1 * 2048 * (32 + 8) * 128 // 2
    for profile, passes in ((H100, 10), (fused, 2)):
        ops = OperatorModel(Workload(llama, 8, "bf16"), layout, profile, Machine(layout, profile))
        rotary = [op for op in ops.layer_memory() if op[0] == "elementwise"][1]
        assert rotary[1:] == (passes * rotated * 2, passes * rotated * 2)
    eager = OperatorModel(Workload(llama, 8, "bf16"), layout, H100, Machine(layout, H100))
    quick = OperatorModel(Workload(llama, 8, "bf16"), layout, fused, Machine(layout, fused))
    assert eager._rotary_ops() == 12 and quick._rotary_ops() == 2
    assert quick.layer_forward().total_work < eager.layer_forward().total_work


@pytest.mark.parametrize("precision,fused_bytes", [("bf16", 32), ("fp16", 40)])
def test_a_fused_optimizer_moves_its_kernels_bytes_not_ptdps_eager_passes(precision, fused_bytes):
    """Megatron-LM's step (fused multi-tensor Adam, the gradient norm, and
    with fp16 the unscale) moves 32 bytes per owned parameter, 40 with fp16;
    ptdp's eager AdamW 112. The difference is exactly those bytes at the
    optimizer class's bandwidth, on the parameters each rank owns (1/d with
    the distributed optimizer); the paper's software runs the fused one."""
    assert optimizer_bytes_per_parameter(False, precision) == OPTIMIZER_BYTES_PER_PARAMETER == 112
    assert optimizer_bytes_per_parameter(True, precision) == fused_bytes
    assert paper_kernels(H100).fused_optimizer and not H100.fused_optimizer
    fused = dataclasses.replace(H100, fused_optimizer=True)
    workload = Workload(GPT, 32, precision)
    for layout in (Layout(t=2, p=2, d=2, b=2), Layout(t=2, p=2, d=2, b=2, distributed_optimizer=True)):
        ops = operator_model(workload, layout, H100)
        params = parameter_counts(ops.model_key, analytic.placement_of_parameters(layout))
        eager, quick = _after(workload, layout, H100), _after(workload, layout, fused)
        for r in range(layout.p):
            owned = sum(params[r]) / (layout.d if layout.distributed_optimizer else 1)
            saved = H100.memory_seconds((112 - fused_bytes) * owned, "optimizer")
            assert eager.optimizer[r] - quick.optimizer[r] == pytest.approx(saved, rel=1e-9)
            assert saved > 0
