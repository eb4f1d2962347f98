"""One transformer layer's parameters on one rank, in module order, as
ptdp.perf.analytic.counts (stages, buckets, memory) and
ptdp.perf.analytic.mtp (the MTP modules' layers) list them: each linear
layer's weight and bias, norms, MLA's projections, an MoE layer's router,
experts and shared expert, each with how its gradient is reduced."""

from __future__ import annotations

from typing import NamedTuple

from ptdp.config import ModelConfig
from ptdp.model.shapes import mla_rank_sizes


def _norm_parameters(model: ModelConfig, size: int | None = None) -> list[int]:
    """A normalization layer's parameters over `size` values (default h):
    LayerNorm's weight and bias, or RMSNorm's weight alone."""
    h = size or model.hidden_size
    return [h, h] if model.normalization == "LayerNorm" else [h]


def _linear_parameters(weight: int, bias: int, model: ModelConfig,
                       has_bias: bool | None = None) -> list[int]:
    """A linear layer's weight and, unless --disable-bias-linear (or
    `has_bias` says otherwise), its bias."""
    return [weight, bias] if (model.bias if has_bias is None else has_bias) else [weight]


class Param(NamedTuple):
    """One parameter of one tensor rank as the gradient buffer sees it."""
    numel: int
    tied: bool = False      # a tied word embedding: GradBuffer gives it a bucket of its own
    partial: bool = False   # sequence parallelism: its gradient is summed over the tensor group
    expert: bool = False    # a routed expert's: in buckets of their own, reduced over EDP


def _layer_parameter_list(model: ModelConfig, t: int = 1, sequence_parallel: bool = False, *,
                          moe: bool = False, ep: int = 1, etp: int | None = None) -> list[Param]:
    """One transformer layer's parameters on one tensor rank, in module order: norm 1, QKV (or
    MLA's: ptdp.model.shapes.mla_rank_sizes), dense, norm 2, h→f, f→h (each weight, then its bias).
    Column-parallel weights and biases (QKV, h→f) and row-parallel weights are split over t;
    norms and row-parallel biases are whole, and under sequence parallelism they see s/t
    positions per rank, so their gradients are partial (summed over the tensor group once per
    iteration). `moe`: the MLP is an MoE layer (`_moe_parameter_list`) under EP and ETP."""
    h, f, d = model.hidden_size, model.ffn_size, model.head_dim
    qkv = (model.num_attention_heads + 2 * model.query_groups) * d   # queries, keys, values
    context = model.num_attention_heads * d                          # the dense layer's input
    up = (2 if model.gated_linear_unit else 1) * f     # gated (SwiGLU, GeGLU): gate and up
    sp = sequence_parallel

    def norm() -> list[Param]:
        return [Param(n, partial=sp) for n in _norm_parameters(model)]

    def linear(weight: int, bias: int, replicated_bias: bool, has_bias: bool | None = None
               ) -> list[Param]:
        weight_and_bias = _linear_parameters(weight, bias, model, has_bias)
        return [Param(weight)] + [Param(bias, partial=sp and replicated_bias)
                                  for bias in weight_and_bias[1:]]

    # --qk-layernorm: two whole norms over d values, each rank's gradient its heads' (partial at t > 1)
    qk_norms = ([Param(n, partial=t > 1) for n in 2 * _norm_parameters(model, d)]
                if model.qk_layernorm else [])
    # learnable sinks: one logit per head, split with the heads
    sinks = [Param(model.num_attention_heads // t)] if model.softmax_type == "learnable" else []
    attention = norm() + ([Param(n, partial=sp and not split) for n, split in mla_rank_sizes(model, t)]
                          if model.multi_latent_attention else
                          sinks + linear(qkv * h // t, qkv // t, False, model.qkv_bias)
                          + qk_norms + linear(h * context // t, h, True)) + norm()
    # --sandwich-norm: the norms after attention and after the MLP (registered last)
    sandwich = norm() + norm() if model.sandwich_norm else []
    if moe:
        return attention + _moe_parameter_list(model, t, ep, t if etp is None else etp) + sandwich
    return attention + linear(up * h // t, up // t, False) + linear(h * f // t, h, True) + sandwich


def _moe_parameter_list(model: ModelConfig, t: int, ep: int, etp: int) -> list[Param]:
    """An MoE layer's MLP on one rank, in module order (ptdp.model.moe.MoELayer:
    its own shared-expert gate [1, h] first, then the router [E, h] (+ [E]),
    this EP rank's E/EP routed experts, the shared expert). Routed experts
    are split over ETP (h→f rows, f→h columns; the f→h bias whole), the
    shared expert over t like the dense MLP; the router and the gate are
    replicated, their gradients partial over the tensor group when t > 1
    (every tensor rank routes all tokens)."""
    h, E, up = model.hidden_size, model.num_experts, 2 if model.gated_linear_unit else 1
    shared = model.moe_shared_expert_intermediate_size or 0

    def expert(width: int, parts: int, routed: bool) -> list[Param]:
        numels = (_linear_parameters(up * width * h // parts, up * width // parts, model)
                  + _linear_parameters(h * width // parts, h, model))
        return [Param(n, expert=routed) for n in numels]

    gate = [Param(h, partial=t > 1)] if shared and model.moe_shared_expert_gate else []
    router = [Param(n, partial=t > 1) for n in _linear_parameters(E * h, E, model)]
    routed = expert(model.moe_ffn_size, etp, True) * (E // ep)
    return gate + router + routed + (expert(shared, t, False) if shared else [])


def _expert_parameters(model: ModelConfig) -> int:
    """One routed expert's logical parameters (both matrices, their biases)."""
    return sum(param.numel for param in _moe_parameter_list(model, 1, model.num_experts, 1)
               if param.expert)


def _layer_parameters(model: ModelConfig, t: int = 1) -> list[int]:
    """The elements of `_layer_parameter_list`, in module order."""
    return [param.numel for param in _layer_parameter_list(model, t)]
