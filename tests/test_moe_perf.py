"""The performance model's MoE terms (ptdp.perf.price.moe, ptdp.perf.analytic.moe): limits,
monotonicity, Megatron-LM's FLOP count, and the saved activations of a
real MoE layer on the CPU against the model, byte for byte."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ptdp.config import ModelConfig
from ptdp.model.moe import MoELayer
from ptdp.parallel.tensor import RNGStreams
from ptdp.parallel.topology import ParallelContext
from ptdp.perf.analytic import moe as moe_counts
from ptdp.perf.price import moe as moe_costs
from ptdp.perf.analytic.flops import model_flops_per_iteration, router_flops_per_iteration
from ptdp.perf.layout import Layout, Workload
from ptdp.perf.analytic.memory import memory_per_rank
from ptdp.perf.price.profiles import builtin_profile
from ptdp.perf.analytic.saved import SavedTensorBytes
from ptdp.perf.price.stage_costs import operator_model, stage_costs

H100 = builtin_profile("h100")
DENSE = ModelConfig(num_layers=8, hidden_size=2048, num_attention_heads=16, seq_length=2048,
                    vocab_size=32000, swiglu=True, ffn_hidden_size=5632, disable_bias_linear=True,
                    normalization="RMSNorm", position_embedding_type="rope",
                    hidden_dropout=0.0, attention_dropout=0.0)
ONE_EXPERT = dataclasses.replace(DENSE, num_experts=1, moe_router_topk=1,
                                 moe_ffn_hidden_size=5632)
MOE = dataclasses.replace(DENSE, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=1408,
                          moe_layer_freq="([0]+[1]*7)")


def _layer(model: ModelConfig, layout: Layout, recompute=None, zero_bubble=False, moe_layers=1):
    ops = operator_model(Workload(model, 8 * layout.d, "bf16"), layout, H100)
    return ops, stage_costs(ops, recompute, zero_bubble, False, False, 1, moe_layers,
                            (layout.ep, layout.etp))


@pytest.mark.parametrize("t,sp", [(1, False), (2, True), (2, False)])
def test_one_expert_top1_prices_the_dense_layer_plus_its_router(t, sp):
    layout = Layout(t=t, b=1, sequence_parallel=sp)
    ops, dense = _layer(DENSE, layout, moe_layers=0)
    moe_ops, moe = _layer(ONE_EXPERT, layout)
    pieces = moe_costs.moe_mlp(moe_ops, 1, None)
    # The expert's GEMMs and activation are the dense MLP's, to the last bit.
    assert pieces.parts["experts"] == moe_costs.dense_mlp(ops).forward
    extra = pieces.parts["router"] + pieces.parts["permute"] + pieces.parts["launches"]
    assert 0 < pieces.parts["router"] < 0.15 * pieces.parts["experts"]   # a small part of it
    assert moe.forward.total_work == pytest.approx(dense.forward.total_work + extra, rel=1e-12)
    assert moe.forward.comm == dense.forward.comm
    # FLOPs: the dense model's plus the routers' 6·B·s·h·E per layer.
    B = 16
    assert (model_flops_per_iteration(ONE_EXPERT, B, recompute=None)
            - model_flops_per_iteration(DENSE, B, recompute=None)) \
        == router_flops_per_iteration(ONE_EXPERT, B) == 6 * B * 2048 * 2048 * 1 * 8


def test_dense_layers_of_an_moe_model_price_as_dense():
    layout = Layout(t=1, b=1)
    _, dense = _layer(DENSE, layout, moe_layers=0)
    _, same = _layer(MOE, layout, moe_layers=0)   # (MOE's dense MLP is DENSE's)
    assert same.forward.work == dense.forward.work


@pytest.mark.parametrize("hidden_dropout, whole", [(0.1, True), (0.0, False)])
def test_full_recomputation_of_an_moe_layer_reruns_what_its_checkpoint_does(hidden_dropout,
                                                                            whole):
    """As for a dense layer (test_cost_model): under hidden dropout the
    checkpoint reruns the whole layer, the experts' second products and the
    return trip included; without it it stops before them."""
    model = dataclasses.replace(MOE, hidden_dropout=hidden_dropout, attention_dropout=0.0)
    ops = operator_model(Workload(model, 8, "bf16"), Layout(t=1, d=8, b=1, ep=8), H100)
    assert ops.recomputes_whole_layer == whole
    moe, dense = moe_costs.moe_mlp(ops, 8, 1), moe_costs.dense_mlp(ops)
    if whole:
        assert moe.recompute == moe.forward and moe.dispatch_recompute == moe.dispatch_forward
        assert dense.recompute == pytest.approx(dense.forward)
    else:
        assert moe.recompute < moe.forward and moe.dispatch_recompute < moe.dispatch_forward
        assert dense.recompute < dense.forward


def test_capacity_prices_the_busiest_expert():
    layout = Layout(t=1, d=8, b=1, ep=8)
    capped = dataclasses.replace(MOE, moe_expert_capacity_factor=1.0)
    ops = operator_model(Workload(capped, 8, "bf16"), layout, H100)
    balanced = moe_costs.moe_mlp(ops, 8, 1, balanced=True).forward
    assert moe_costs.moe_mlp(ops, 8, 1).forward >= balanced
    loose = dataclasses.replace(capped, moe_expert_capacity_factor=2.0)
    ops2 = operator_model(Workload(loose, 8, "bf16"), layout, H100)
    assert moe_costs.moe_mlp(ops2, 8, 1).forward > balanced
    # Rows: at most the capacity, never more than every token (f ≥ E/k).
    T = 2048
    assert moe_counts.expert_load(loose, 1, T, False, 8, 1).rows == 2 * 2 * 8 * T // 8
    huge = dataclasses.replace(MOE, moe_expert_capacity_factor=100.0)
    assert moe_counts.expert_load(huge, 1, T, False, 8, 1).rows == 8 * T


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_dispatch_traffic_is_zero_without_expert_parallelism(dispatcher):
    model = dataclasses.replace(MOE, moe_token_dispatcher_type=dispatcher)
    for layout, zero in [(Layout(t=1, d=8, b=1), True), (Layout(t=2, d=4, b=1, sequence_parallel=True), True),
                         (Layout(t=1, d=8, b=1, ep=2), False), (Layout(t=1, d=8, b=1, ep=8), False)]:
        ops = operator_model(Workload(model, 8, "bf16"), layout, H100)
        load = moe_counts.expert_load(model, layout.t, ops.b * ops.s, ops.sp, layout.ep, layout.etp)
        seconds = moe_costs.dispatch_seconds(ops, load, layout.ep, layout.expert_tensor)
        assert (seconds == (0.0, 0.0, 0.0)) == zero, layout


def test_dispatch_across_servers_pays_the_slower_link():
    model = dataclasses.replace(MOE, moe_token_dispatcher_type="alltoall")
    layout = Layout(t=1, d=16, b=1)
    ops = operator_model(Workload(model, 16, "bf16"), layout, H100)
    inside = moe_counts.expert_load(model, 1, ops.b * ops.s, False, 8, 1)
    across = moe_counts.expert_load(model, 1, ops.b * ops.s, False, 8, 2)  # EP 8 × ETP 2: 16 ranks
    assert H100.devices_per_server == 8
    assert ops.machine.spans_servers(moe_costs.expert_group(8, 2))
    assert not ops.machine.spans_servers(moe_costs.expert_group(8, 1))
    assert moe_costs.dispatch_seconds(ops, across, 8, 2)[0] > \
        moe_costs.dispatch_seconds(ops, inside, 8, 1)[0]


def test_more_expert_parallelism_never_raises_expert_memory_per_rank():
    model = dataclasses.replace(MOE, moe_grouped_gemm=True)
    for sharded in (False, True):
        last = None
        for ep in (1, 2, 4, 8):
            layout = Layout(t=1, d=8, b=1, ep=ep, distributed_optimizer=sharded)
            memory = memory_per_rank(Workload(model, 16, "bf16"), layout)[0]
            state = memory["weights"] + memory["gradients"] + memory["optimizer"]
            if last is not None:
                assert state < last[0] and memory["activations"] <= last[1], (ep, sharded)
            last = (state, memory["activations"])


def _megatron_flops(B, s, h, l, a, g, d, f, V, swiglu, E=None, k=0, F=0, S=0, moe_layers=0):
    """Megatron-LM's num_floating_point_operations (megatron/training/
    training.py, standard transformer, no MTP, unpadded BSHD), by hand."""
    ffn = 3 if swiglu else 2
    dense_layers = l - moe_layers
    attn_linear = 3 * 2 * (h * (a * d + 2 * g * d) + a * d * h)
    attn_core = 3 * 2 * a * d / 2 * 2
    mlp = 3 * 2 * h * (f * ffn * dense_layers + (F * k * ffn + S * ffn) * moe_layers)
    return B * s * (mlp + attn_linear * l + 3 * 2 * h * V) + B * s * s * attn_core * l


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b"])
def test_active_flops_match_megatron_lm(name):
    """ptdp counts the paper's attention core (all s² scores; Megatron-LM
    halves it for the causal mask) and the router (Megatron-LM does not):
    beyond those two terms the counts are equal."""
    if name == "mixtral-8x7b":   # 32 layers, h 4096, 32 heads / 8 kv, experts 8 × 14336, top-2
        shape = dict(h=4096, l=32, a=32, g=8, d=128, f=14336, V=32000, E=8, k=2, F=14336, S=0)
        model = ModelConfig(num_layers=32, hidden_size=4096, num_attention_heads=32,
                            num_query_groups=8, group_query_attention=True, seq_length=4096,
                            vocab_size=32000, swiglu=True, ffn_hidden_size=14336,
                            num_experts=8, moe_router_topk=2)
        moe_layers = 32
    else:   # 48 layers, h 2048, 32 heads of 128 / 4 kv, 128 experts × 768, top-8
        shape = dict(h=2048, l=48, a=32, g=4, d=128, f=6144, V=151936, E=128, k=8, F=768, S=0)
        model = ModelConfig(num_layers=48, hidden_size=2048, num_attention_heads=32,
                            kv_channels=128, num_query_groups=4, group_query_attention=True,
                            seq_length=4096, vocab_size=151936, swiglu=True, ffn_hidden_size=6144,
                            num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768)
        moe_layers = 48
    B, s = 512, 4096
    megatron = _megatron_flops(B, s, swiglu=True, moe_layers=moe_layers, **shape)
    ptdp = model_flops_per_iteration(model, B, recompute=None)
    causal_half = 3 * 2 * B * s * s * shape["a"] * shape["d"] * shape["l"]
    router = 6 * B * s * shape["h"] * shape["E"] * moe_layers
    assert router_flops_per_iteration(model, B) == router
    assert ptdp == pytest.approx(megatron + causal_half + router, rel=1e-15)
    # And by hand, Mixtral's routed experts: 2 of 8, 3 matrices of 4096 × 14336.
    if name == "mixtral-8x7b":
        assert moe_counts.mlp_columns(model)[0] == 8 + 2 * 3 * 14336


SMALL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=100, hidden_dropout=0.0, attention_dropout=0.0, swiglu=True,
                    ffn_hidden_size=64, disable_bias_linear=True, num_experts=8,
                    moe_ffn_hidden_size=32, moe_router_topk=2)
SAVED_CASES = {
    "plain": {},
    "shared expert and gate": dict(moe_shared_expert_intermediate_size=48,
                                   moe_shared_expert_gate=True),
    "aux and z losses": dict(moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3),
    "gelu": dict(swiglu=False),
    "grouped gemm": dict(moe_grouped_gemm=True),
    "capacity 2": dict(moe_expert_capacity_factor=2.0),
    "one expert top-1": dict(num_experts=1, moe_router_topk=1),
}


@pytest.mark.parametrize("name", list(SAVED_CASES))
def test_saved_bytes_equal_the_model(name):
    """What one MoE layer saves for backward (one CPU process, dropless or
    a capacity that drops nothing at this seed), fp32 and bf16."""
    model = dataclasses.replace(SMALL, **SAVED_CASES[name])
    for dtype, e in ((torch.float32, 4), (torch.bfloat16, 2)):
        torch.manual_seed(0)
        layer = MoELayer(model, ParallelContext.single(), RNGStreams(torch.device("cpu")))
        for param in layer.parameters():
            torch.nn.init.normal_(param, std=0.02)
        layer = layer.to(dtype).train()
        b = 2
        x = torch.randn(model.seq_length, b, model.hidden_size, dtype=dtype, requires_grad=True)
        with SavedTensorBytes(layer.parameters()) as saved:
            layer(x)
        expected = moe_counts.moe_saved_bytes(model, 1, b, e, sequence_parallel=False,
                                             recompute=None)
        # Under a capacity the per-expert top-k's indices are packed by a
        # node freed at once (its values are unused): the hooks see them
        # unless their storage is reused at once, and nothing holds them.
        transient = {0}
        if model.moe_expert_capacity_factor:
            transient.add(16 * model.num_experts * 8)   # cap = ceil(T·k/E·f) = 16 rows
        assert saved.bytes - expected in transient, (name, dtype)


def test_a_capacity_that_drops_keeps_at_most_the_model():
    model = dataclasses.replace(SMALL, moe_expert_capacity_factor=1.0)
    torch.manual_seed(0)
    layer = MoELayer(model, ParallelContext.single(), RNGStreams(torch.device("cpu")))
    for param in layer.parameters():   # (built, a layer's parameters are not initialised)
        torch.nn.init.normal_(param, std=0.02)
    layer = layer.train()
    x = torch.randn(model.seq_length, 2, model.hidden_size, requires_grad=True)
    with SavedTensorBytes(layer.parameters()) as saved:
        out, _ = layer(x)
    assert layer.metrics["tokens_per_expert"][0].sum() < 2 * model.seq_length * 2  # some dropped
    bound = moe_counts.moe_saved_bytes(model, 1, 2, 4, sequence_parallel=False, recompute=None)
    assert bound / 2 < saved.bytes <= bound


def test_moe_activations_in_memory_per_rank():
    """Each MoE layer adds its delta to the dense layer's figure (p = 1:
    one microbatch in flight); full recomputation keeps the input only."""
    dense_model = dataclasses.replace(MOE, num_experts=None)
    for recompute in (None, "selective", "full"):
        layout = Layout(b=1, d=8, recompute=recompute)
        moe = memory_per_rank(Workload(MOE, 8, "bf16"), layout)[0]["activations"]
        dense = memory_per_rank(Workload(dense_model, 8, "bf16"), layout)[0]["activations"]
        delta = moe_counts.moe_layer_activation_delta(MOE, 1, 1, 2, sequence_parallel=False,
                                                     recompute=recompute)
        assert moe - dense == 7 * delta
        assert (delta == 0) == (recompute == "full")
