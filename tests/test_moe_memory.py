"""The performance model's parameters and memory for MoE models under expert
parallelism (ptdp.perf.analytic.counts, ptdp.perf.analytic.memory) against built Trainers,
and its total and active parameter counts against a hand computation.

Each rank holds E/EP routed experts of every MoE layer, split over ETP; their
buckets are cut apart from the dense ones and, with the distributed
optimizer, padded to a multiple of EDP = t·d/(ETP·EP) and sharded over it.
One pool call builds every layout's Trainers in turn (no step is taken): the
parameters held, the flat buffer's elements and the weight, gradient and
optimizer bytes must equal the model's exactly. A GeLU model with linear
biases gives the experts odd sizes, so that expert buckets get padded.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ptdp.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from ptdp.config.checks import validate
from ptdp.parallel.sharding import is_expert
from ptdp.parallel.topology import ParallelContext, RankGrid
from ptdp.perf.analytic import counts as analytic
from ptdp.perf.layout import Layout, Workload
from ptdp.perf.analytic.memory import memory_per_rank
from ptdp.train.banner import count_parameters
from ptdp.train.loop import Trainer

# E = 8 SwiGLU experts, top-2, a gated shared expert, a dense first layer.
MOE = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                  vocab_size=100, make_vocab_size_divisible_by=8, hidden_dropout=0.0,
                  attention_dropout=0.0, swiglu=True, ffn_hidden_size=64, disable_bias_linear=True,
                  num_experts=8, moe_ffn_hidden_size=32, moe_router_topk=2,
                  moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True,
                  moe_layer_freq="([0]+[1]*3)")
# GeLU experts of width 17 with biases: 1137 parameters each (odd); ETP 1 and
# no shared expert only (ptdp refuses biases with either).
MOE_BIAS = dataclasses.replace(MOE, swiglu=False, disable_bias_linear=False,
                               moe_ffn_hidden_size=17, moe_shared_expert_intermediate_size=None,
                               moe_shared_expert_gate=False)
BUCKET = 700   # several buckets per rank; expert and dense buckets alike cut and padded


@dataclasses.dataclass(frozen=True)
class Case:
    layout: Layout
    model: ModelConfig
    precision: str = "bf16"


def _layout(t=1, p=1, d=1, ep=1, etp=None, sharded=False) -> Layout:
    sp = t > 1 and (ep > 1 or (etp is not None and etp != t))
    return Layout(t=t, p=p, d=d, b=1, ep=ep, etp=etp, sequence_parallel=sp,
                  distributed_optimizer=sharded)


CASES = [
    Case(_layout(d=2, ep=2), MOE),                                       # EDP 1
    Case(_layout(p=2, d=4, ep=2, sharded=True), MOE_BIAS),               # EDP 2
    Case(_layout(d=4, ep=4, sharded=True), MOE_BIAS, "fp32"),            # EDP 1
    Case(_layout(t=2, d=4, ep=2, etp=1, sharded=True), MOE_BIAS),        # EDP 4
    Case(_layout(t=2, p=2, d=2, ep=2, sharded=True), MOE),               # ETP = t, EDP 1
    Case(_layout(t=2, p=2, d=2, ep=2, etp=1), MOE, "fp32"),              # EDP 2, plain
    Case(_layout(t=2, p=2, d=2, etp=1, sharded=True), MOE),              # EP 1, ETP 1: EDP 4
]


def _config(case: Case) -> Config:
    layout, m = case.layout, 2
    config = Config(
        model=case.model,
        parallel=ParallelConfig(tensor_model_parallel_size=layout.t,
                                pipeline_model_parallel_size=layout.p,
                                data_parallel_size=layout.d,
                                sequence_parallel=layout.sequence_parallel,
                                expert_model_parallel_size=layout.ep,
                                expert_tensor_parallel_size=layout.etp),
        train=TrainConfig(micro_batch_size=layout.b, global_batch_size=m * layout.b * layout.d,
                          train_iters=1, bf16=case.precision == "bf16",
                          use_distributed_optimizer=layout.distributed_optimizer,
                          ddp_bucket_size=BUCKET, seed=3),
        data=DataConfig(mock_data=True))
    validate(config, world_size=layout.devices)
    return config


def _held_by_trainers(rank: int, cases: list[Case]) -> list[dict | None]:
    """Per case, what this rank's Trainer holds (None outside the layout's grid)."""
    results = []
    for case in cases:
        layout = case.layout
        ctx = ParallelContext.build(RankGrid(tp=layout.t, dp=layout.d, pp=layout.p,
                                             ep=layout.ep, etp=layout.etp))
        if ctx is None:
            results.append(None)
            continue
        trainer = Trainer(_config(case), ctx, torch.device("cpu"))
        buffer = trainer.buffer
        results.append(dict(
            pp_rank=ctx.pp_rank, held=sum(p.numel() for p in trainer.model.parameters()),
            logical=count_parameters(trainer.model), numel=buffer.numel,
            expert_buckets=sum(is_expert(bucket.params[0]) for bucket in buffer.buckets),
            weights=buffer.param_data.nbytes,
            gradients=buffer.grad_data.nbytes + (buffer.grad_shard.nbytes
                                                 if buffer.grad_shard is not None else 0),
            optimizer=trainer.optimizer.state_bytes))
        del trainer
        ctx.destroy()
    return results


def test_expert_parameters_and_state_bytes_per_rank_are_exact(pools):
    outcomes = pools(8).run(_held_by_trainers, CASES)
    expert_padding = False
    for index, case in enumerate(CASES):
        layout, model = case.layout, case.model
        work = Workload(model, global_batch=2 * layout.d, precision=case.precision)
        memory = memory_per_rank(work, layout, kernels="cpu", bucket_size=BUCKET)
        held = analytic.parameters_per_rank(model, layout)
        for result in (ranks[index] for ranks in outcomes):
            if result is None:
                continue
            r = result["pp_rank"]
            what = f"{layout} {case.precision} pipeline rank {r}"
            assert result["held"] == held[r], what
            assert result["numel"] == analytic.buffer_elements(model, layout, r, BUCKET), what
            for key in ("weights", "gradients", "optimizer"):
                assert result[key] == memory[r][key], (what, key, result[key], memory[r][key])
            buckets = analytic._cut_buckets(model, layout, r, BUCKET)
            assert result["expert_buckets"] == sum(b.expert for b in buckets), what
            expert_padding |= layout.distributed_optimizer and any(
                b.expert and b.size % layout.edp for b in buckets)
    assert expert_padding   # an expert bucket was padded to a multiple of EDP somewhere


def test_expert_parallelism_divides_the_experts_per_rank():
    """Per rank the routed experts shrink by EP·ETP; the rest stays."""
    one = analytic.parameters_per_rank(MOE, Layout())[0]
    experts = 3 * 8 * 3 * 32 * 32   # 3 MoE layers × 8 experts × (2F·h + h·F)
    assert analytic.parameters_per_rank(MOE, Layout(d=4, ep=4))[0] == one - experts * 3 // 4
    split = Layout(t=2, d=2, ep=2, sequence_parallel=True)   # ETP = t = 2: a quarter each
    dense_at_t2 = analytic.parameters_per_rank(MOE, Layout(t=2))[0] - experts // 2
    assert analytic.parameters_per_rank(MOE, split)[0] == dense_at_t2 + experts // 4


def test_total_and_active_parameters_by_hand():
    h, V, s = 32, 100, 16
    attention = 3 * h * h + h * h + 2 * 2 * h            # QKV, dense, two LayerNorms
    dense_mlp = 2 * 64 * h + 64 * h                      # SwiGLU, f = 64
    expert = 2 * 32 * h + 32 * h                         # SwiGLU, F = 32 (shared: 32 too)
    moe_mlp = 8 * h + h + expert + 8 * expert            # router, gate, shared, 8 routed
    total = V * h + s * h + 4 * attention + dense_mlp + 3 * moe_mlp + 2 * h   # tied output
    assert analytic.parameter_count(MOE) == total == 110_624
    # A token uses the router, the gate, the shared expert and k = 2 routed experts.
    assert analytic.active_parameter_count(MOE) == total - 3 * 6 * expert == 55_328
    dense = dataclasses.replace(MOE, num_experts=None)
    assert analytic.active_parameter_count(dense) == analytic.parameter_count(dense)


def test_expert_layout_is_checked():
    assert Layout(d=4, ep=4).valid_for(MOE, 4) == []
    assert any("--expert-model-parallel-size 3 does not divide --num-experts 8" in problem
               for problem in Layout(d=3, ep=3).valid_for(MOE, 3))
    assert any("needs --sequence-parallel" in problem
               for problem in Layout(t=2, d=2, ep=2).valid_for(MOE, 2))
    dense = dataclasses.replace(MOE, num_experts=None)
    assert any("expert parallelism is for MoE models" in problem
               for problem in Layout(d=2, ep=2).valid_for(dense, 2))
    assert Layout(d=2, ep=2, etp=1).train_flags(MOE, 2)[-4:] == [
        "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]


@pytest.mark.parametrize("layout", [Layout(), Layout(t=2, p=2, d=2, distributed_optimizer=True)])
def test_dense_models_are_unchanged_by_the_expert_fields(layout):
    dense = dataclasses.replace(MOE, num_experts=None)
    work = Workload(dense, global_batch=8)
    assert layout.edp == layout.d   # ETP = t by default: EDP = d
    # No routed experts: no expert bucket, whatever EP and ETP say.
    assert memory_per_rank(work, layout, bucket_size=BUCKET) == memory_per_rank(
        work, dataclasses.replace(layout, ep=2, etp=1), bucket_size=BUCKET)


# ------------------------------------------------------------------ recompute modules, routing

# DeepSeek-V3's routing in small: sigmoid scores with expert biases,
# group-limited, scaled; balancing and z losses; hidden dropout on.
DEEPSEEK_ROUTING = dataclasses.replace(
    MOE, num_layers=1, moe_layer_freq=1, hidden_dropout=0.1, normalization="RMSNorm",
    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
    moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5,
    moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
# Each routing with the --recompute-modules lists tried (None: none).
ROUTINGS = {"deepseek": (DEEPSEEK_ROUTING, [
                None, ["moe"], ["moe_act"], ["shared_experts"], ["layernorm", "moe"],
                ["core_attn", "layernorm", "moe_act", "shared_experts"]]),
            "pre-softmax": (dataclasses.replace(MOE, num_layers=1, moe_layer_freq=1,
                                                moe_router_pre_softmax=True, moe_router_topk=3),
                            [None]),
            # DeepSeek-V3's script: grouped GEMMs, sequence-wise balancing, no z-loss
            "grouped-gemm": (dataclasses.replace(DEEPSEEK_ROUTING, moe_grouped_gemm=True,
                                                 moe_z_loss_coeff=None,
                                                 moe_router_load_balancing_type="seq_aux_loss"),
                             [None, ["layernorm", "shared_experts"]])}


def _held_by_one_layer(model: ModelConfig, dtype: torch.dtype, b: int = 2) -> int:
    """What one MoE transformer layer leaves saved when its forward returns
    (ptdp.perf.analytic.saved.HeldTensorBytes), on one process."""
    from ptdp.model.gpt import GPT
    from ptdp.parallel.tensor import RNGStreams
    from ptdp.perf.analytic.saved import HeldTensorBytes

    rng = RNGStreams(torch.device("cpu"))
    rng.seed(3, ParallelContext.single())
    layer = GPT(model, ParallelContext.single(), rng, pre_process=False, post_process=False)
    layer = layer.initialize(3).to(dtype).train()
    hidden = torch.randn(model.seq_length, b, model.hidden_size, dtype=dtype, requires_grad=True)
    with HeldTensorBytes(layer.parameters()) as saved:
        out = layer(hidden)
    out.float().sum().backward()
    return saved.held_bytes


@pytest.mark.parametrize("routing", ROUTINGS)
def test_moe_layer_activations_under_recompute_modules_equal_the_saved_tensors(routing):
    """One MoE layer (sigmoid, group-limited or pre-softmax routing, grouped
    GEMMs) keeps what the dense layer's figure plus the MoE delta say, with
    each --recompute-modules list, fp32 and bf16."""
    from ptdp.perf.analytic.memory import layer_activation_bytes
    from ptdp.perf.analytic.moe import moe_layer_activation_delta

    base, module_lists = ROUTINGS[routing]
    for modules in module_lists:
        recompute = "selective" if modules else None
        model = dataclasses.replace(base, recompute_granularity=recompute,
                                    recompute_modules=modules or ["core_attn"])
        for dtype in (torch.float32, torch.bfloat16):
            e = dtype.itemsize
            predicted = (layer_activation_bytes(model, 2, dtype=dtype, kernels="cpu")
                         + moe_layer_activation_delta(model, 1, 2, e, sequence_parallel=False,
                                                      recompute=recompute))
            assert _held_by_one_layer(model, dtype) == predicted, (routing, modules, dtype)
