"""Mixture of experts: Megatron-Core's MoE layer in place of a layer's MLP.

    tokens ─ router ─ top-k experts per token (probabilities, capacity) ─┐
       │                                                                 ├─ Σ_e p_e · expert_e(x) (+ shared expert)
       └─────────────── experts (each an MLP of --moe-ffn-hidden-size) ──┘

The meanings are Megatron-Core's (megatron/core/transformer/moe/); the code is
ptdp's own:

* Router: logits = x Wᵀ (+ b) in --moe-router-dtype. softmax: top-k of the
  logits, then a softmax over those k (or, with --moe-router-pre-softmax,
  top-k of the softmax over all experts, not renormalised); sigmoid: top-k
  of the sigmoid scores, renormalised when k > 1. Group-limited routing picks
  --moe-router-group-topk groups first (a group's score: the sum of its
  top k/group-topk scores). --moe-router-topk-scaling-factor multiplies
  the probabilities.
* Experts: the probability multiplies the expert's activation, before its
  second matrix (whose bias is scaled too), as Megatron-Core does.
* Capacity (--moe-expert-capacity-factor f): each expert takes at most
  ceil(T·k/E · f) of the microbatch's T tokens, the most probable ones
  ("probs") or the first ones in token order ("position", as Megatron-Core
  documents it; its code picks among equal flags with torch.topk, whose
  order is not defined). A dropped assignment's contribution is zero; the
  token's other probabilities are not renormalised.
* Load balancing (coefficient-free values are recorded for the log):
  aux_loss = coeff · E/(k·T²) · Σ_e (Σ_t S_te) · c_e over the microbatch,
  S the softmax over all experts (sigmoid: normalised over all experts) and
  c_e the counts of a plain top-k of S; seq_aux_loss the same per sequence,
  averaged over the batch; z-loss = coeff · mean_t logsumexp(logits_t)².
  Each loss enters the backward pass at the main loss's scale
  (`aux_loss_scale`, set by the trainer: loss scale / microbatches), never
  the forward value.

Tensor parallelism (expert tensor-parallel size = t, one expert-parallel
rank): every tensor rank routes all of the microbatch's tokens (under
sequence parallelism they are gathered first), holds 1/t of each expert's
width (the dense MLP's split) and adds its partial outputs; one all-reduce
(or reduce-scatter to s/t positions) completes them. The router's weight,
replicated, gets a partial gradient on each rank (summed over the tensor
group), and the losses computed identically on every tensor rank enter the
backward at 1/t each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ptdp.config import ModelConfig
from ptdp.model.fused import swiglu
from ptdp.parallel.sharding import SHARD_ATTR, TensorShard, set_init
from ptdp.parallel.tensor import (
    RNGStreams,
    copy_to_tensor_region,
    gather_from_sequence_region,
    mark_partial_grad,
    reduce_from_tensor_region,
    reduce_scatter_to_sequence_region,
    scaled_init_std,
)
from ptdp.parallel.topology import ParallelContext
from ptdp.parallel.weight_grad import deferrable_linear

DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


class _AttachLoss(torch.autograd.Function):
    """Identity on `x` forward; backward also starts `loss`'s gradient at
    `scale` (Megatron-Core's MoEAuxLossAutoScaler): a loss that shapes the
    gradients without entering the pipeline's loss value."""

    @staticmethod
    def forward(ctx, x, loss, scale):
        ctx.scale = scale
        ctx.loss_shape = loss.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full(ctx.loss_shape, ctx.scale, dtype=torch.float32,
                                device=grad.device), None


@dataclass
class Routing:
    probs: torch.Tensor    # [T, E], router dtype; zero where a token does not go
    routed: torch.Tensor   # [T, E] bool


def _top_k(scores: torch.Tensor, k: int, groups: int | None, group_k: int | None) -> torch.Tensor:
    """Indices [T, k] of the top-k scores, within the best `group_k` of
    `groups` contiguous expert groups when group-limited."""
    if groups is None or group_k is None:
        return scores.topk(k, dim=-1).indices
    tokens, experts = scores.shape
    grouped = scores.view(tokens, groups, experts // groups)
    group_scores = grouped.topk(k // group_k, dim=-1).values.sum(dim=-1)
    chosen = group_scores.topk(group_k, dim=-1).indices
    keep = torch.zeros(tokens, groups, dtype=torch.bool, device=scores.device)
    keep.scatter_(1, chosen, True)
    masked = scores.masked_fill(~keep.repeat_interleave(experts // groups, dim=1), float("-inf"))
    return masked.topk(k, dim=-1).indices


class Router(nn.Module):
    def __init__(self, config: ModelConfig, tokens_are_replicated: bool):
        super().__init__()
        self.config = config
        E, h = config.num_experts, config.hidden_size
        self.weight = set_init(nn.Parameter(torch.empty(E, h)), "normal", config.init_method_std)
        if config.bias:  # Megatron-Core's router bias (with linear biases), normal like the weight
            self.bias = set_init(nn.Parameter(torch.empty(E)), "normal", config.init_method_std)
        else:
            self.register_parameter("bias", None)
        if tokens_are_replicated:
            # Each tensor rank's gradient holds its experts' partial outputs.
            for param in self.parameters():
                mark_partial_grad(param)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        dtype = DTYPES[self.config.moe_router_dtype]
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(x.to(dtype), self.weight.to(dtype), bias)

    def route(self, logits: torch.Tensor) -> Routing:
        c = self.config
        k = c.moe_router_topk
        groups, group_k = c.moe_router_num_groups, c.moe_router_group_topk
        if c.moe_router_score_function == "sigmoid":
            scores = torch.sigmoid(logits)
            index = _top_k(scores, k, groups, group_k)
            chosen = scores.gather(1, index)
            if k > 1:
                chosen = chosen / (chosen.sum(dim=-1, keepdim=True) + 1e-20)
        elif c.moe_router_pre_softmax:
            scores = torch.softmax(logits, dim=-1)
            index = _top_k(scores, k, groups, group_k)
            chosen = scores.gather(1, index)
        else:
            index = _top_k(logits, k, groups, group_k)
            chosen = torch.softmax(logits.gather(1, index), dim=-1)
        if c.moe_router_topk_scaling_factor is not None:
            chosen = chosen * c.moe_router_topk_scaling_factor
        probs = torch.zeros_like(logits).scatter(1, index, chosen)
        routed = torch.zeros_like(logits, dtype=torch.bool).scatter(1, index, True)
        return _drop_over_capacity(Routing(probs, routed), c)


def _drop_over_capacity(routing: Routing, c: ModelConfig) -> Routing:
    factor = c.moe_expert_capacity_factor
    if factor is None:
        return routing
    tokens, experts = routing.routed.shape
    capacity = math.ceil(tokens * c.moe_router_topk / experts * factor)
    if capacity >= tokens:
        return routing
    if c.moe_token_drop_policy == "position":
        kept = routing.routed & (routing.routed.long().cumsum(dim=0) <= capacity)
    else:
        best = routing.probs.topk(capacity, dim=0).indices  # per expert, its most probable tokens
        kept = routing.routed & torch.zeros_like(routing.routed).scatter(0, best, True)
    return Routing(routing.probs * kept, kept)


def balancing_scores(logits: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """S [T, E] of the load-balancing losses: the softmax over all experts
    (sigmoid: the sigmoid scores normalised over all experts), in fp32."""
    if config.moe_router_score_function == "sigmoid":
        scores = torch.sigmoid(logits.float())
        return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    return torch.softmax(logits.float(), dim=-1)


def switch_loss(scores: torch.Tensor, k: int) -> torch.Tensor:
    """E/(k·T²) · Σ_e (Σ_t S_te) · c_e, c from a plain top-k of S (no
    capacity, no groups): the coefficient-free Switch-Transformer loss (a
    uniform router gives exactly 1)."""
    tokens, experts = scores.shape
    counts = torch.zeros_like(scores).scatter(1, scores.topk(k, dim=-1).indices, 1.0).sum(dim=0)
    return experts / (k * tokens * tokens) * (scores.sum(dim=0) * counts).sum()


class ExpertLinear(nn.Module):
    """One expert's matrix, this tensor rank's part of it (split by `dim`:
    0 output rows, as a column-parallel layer; 1 input columns, as a
    row-parallel one), without communication: the MoE layer reduces once.
    `weight_grads` as in ColumnParallelLinear (zero-bubble schedules)."""

    def __init__(self, rows: int, columns: int, ctx: ParallelContext, dim: int, *, bias: bool,
                 init_std: float, blocks: int = 1):
        super().__init__()
        t = ctx.tp_size
        local = (rows // t, columns) if dim == 0 else (rows, columns // t)
        self.weight = set_init(nn.Parameter(torch.empty(*local)), "normal", init_std)
        setattr(self.weight, SHARD_ATTR, TensorShard(dim=dim, parts=t, index=ctx.tp_rank,
                                                     blocks=blocks))
        self.weight_grads = None
        if bias:
            self.bias = set_init(nn.Parameter(torch.empty(local[0])), "zeros")
            if dim == 0:
                setattr(self.bias, SHARD_ATTR, TensorShard(dim=0, parts=t, index=ctx.tp_rank,
                                                           blocks=blocks))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        return deferrable_linear(x, self.weight, self.bias if bias else None, self.weight_grads)


class Expert(nn.Module):
    """An MLP of width `ffn` (SwiGLU or GeLU, as the dense MLP), its output
    scaled by each token's probability before the second matrix."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, ffn: int):
        super().__init__()
        h, gated = config.hidden_size, config.swiglu
        self.gated = gated
        self.dense_h_to_4h = ExpertLinear(2 * ffn if gated else ffn, h, ctx, 0, bias=config.bias,
                                          init_std=config.init_method_std, blocks=2 if gated else 1)
        self.dense_4h_to_h = ExpertLinear(h, ffn, ctx, 1, bias=config.bias,
                                          init_std=scaled_init_std(config.init_method_std,
                                                                   config.num_layers))

    def forward(self, x: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
        y = self.dense_h_to_4h(x)
        a = swiglu(y) if self.gated else F.gelu(y, approximate="tanh")
        if probs is not None:
            a = (a * probs.unsqueeze(-1)).to(a.dtype)
        out = self.dense_4h_to_h(a, bias=False)
        if self.dense_4h_to_h.bias is not None:  # (biases only at t = 1, checked before launch)
            scale = 1.0 if probs is None else probs.unsqueeze(-1).to(out.dtype)
            out = out + self.dense_4h_to_h.bias * scale
        return out


class MoELayer(nn.Module):
    """The MLP of an MoE layer: (out, None) for x [s, b, h] ([s/t, b, h]
    under sequence parallelism), like ptdp.model.gpt.MLP."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, rng: RNGStreams,
                 sequence_parallel: bool = False):
        super().__init__()
        self.config, self.ctx, self.rng = config, ctx, rng
        self.sequence_parallel = sequence_parallel and ctx.tp_group is not None
        self.router = Router(config, tokens_are_replicated=ctx.tp_size > 1)
        self.experts = nn.ModuleDict({str(e): Expert(config, ctx, config.moe_ffn_size)
                                      for e in range(config.num_experts)})
        shared = config.moe_shared_expert_intermediate_size
        self.shared_expert = Expert(config, ctx, shared) if shared else None
        if shared and config.moe_shared_expert_gate:
            self.shared_expert_gate = set_init(nn.Parameter(torch.empty(1, config.hidden_size)),
                                               "normal", config.init_method_std)
            if ctx.tp_size > 1:
                mark_partial_grad(self.shared_expert_gate)
        else:
            self.register_parameter("shared_expert_gate", None)
        # The backward scale of the load-balancing losses (the trainer sets
        # loss scale / microbatches) and their coefficient-free values of
        # the forwards since `take_metrics` (tensors: no device sync here).
        self.aux_loss_scale = 1.0
        self.metrics: dict[str, list[torch.Tensor]] = {}

    def forward(self, x: torch.Tensor):
        c, group = self.config, self.ctx.tp_group
        tokens = (gather_from_sequence_region(x, group) if self.sequence_parallel
                  else copy_to_tensor_region(x, group))
        s, b, h = tokens.shape
        flat = tokens.reshape(s * b, h)
        logits = self.router.logits(flat)
        logits = self._balance(logits, s, b)
        routing = self.router.route(logits)
        out = self._experts(flat, routing)
        if self.shared_expert is not None:
            shared = self.shared_expert(flat, None)
            if self.shared_expert_gate is not None:
                shared = shared * torch.sigmoid(F.linear(flat, self.shared_expert_gate))
            out = out + shared
        out = out.view(s, b, h)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_region(out, group), None
        return reduce_from_tensor_region(out, group), None

    def _experts(self, flat: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Σ_e p_e · expert_e(x) for each token, expert by expert. An expert
        no token chose still runs (on no rows): its gradient, zero, must
        reach the data-parallel buckets on every replica alike."""
        out = torch.zeros_like(flat)
        for e, expert in self.experts.items():
            chosen = routing.routed[:, int(e)].nonzero().squeeze(1)
            y = expert(flat.index_select(0, chosen), routing.probs.index_select(0, chosen)[:, int(e)])
            out = out.index_add(0, chosen, y.to(out.dtype))
        return out

    def _balance(self, logits: torch.Tensor, s: int, b: int) -> torch.Tensor:
        """Attach the load-balancing and z losses to the logits (training
        with gradients only) and record their coefficient-free values."""
        c = self.config
        if not (self.training and torch.is_grad_enabled()):
            return logits
        # Every tensor rank computes the same losses over the same tokens:
        # each brings 1/t of the gradient.
        scale = self.aux_loss_scale / self.ctx.tp_size
        kind, coeff = c.moe_router_load_balancing_type, c.moe_aux_loss_coeff
        if kind in ("aux_loss", "seq_aux_loss") and coeff > 0:
            scores = balancing_scores(logits, c)
            if kind == "aux_loss":
                value = switch_loss(scores, c.moe_router_topk)
            else:  # per sequence: tokens are [s, b] flattened, sequence b at b, b + B, ...
                per_sequence = scores.view(s, b, -1).transpose(0, 1)
                value = torch.stack([switch_loss(seq, c.moe_router_topk)
                                     for seq in per_sequence]).mean()
            self._record("load_balancing_loss" if kind == "aux_loss" else "seq_load_balancing_loss",
                         value)
            logits = _AttachLoss.apply(logits, coeff * value, scale)
        if c.moe_z_loss_coeff:
            z = torch.logsumexp(logits.float(), dim=-1).square().mean()
            self._record("z_loss", z)
            logits = _AttachLoss.apply(logits, c.moe_z_loss_coeff * z, scale)
        return logits

    def _record(self, name: str, value: torch.Tensor) -> None:
        if not self.rng.replaying:  # a recomputation repeats a forward
            self.metrics.setdefault(name, []).append(value.detach())

    def take_metrics(self) -> dict[str, list[torch.Tensor]]:
        taken, self.metrics = self.metrics, {}
        return taken
