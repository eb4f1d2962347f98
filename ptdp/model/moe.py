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
* Aux-loss-free balancing (--moe-router-enable-expert-bias, sigmoid
  scores): a per-expert bias added to the scores for the top-k only (the
  probabilities stay unbiased); after each iteration's backward it moves by
  --moe-router-bias-update-rate towards balance: + for an expert that took
  fewer tokens than the mean over experts, − for more (counts over the
  global batch; ptdp.train.moe_metrics.update_expert_biases).
* Load balancing (coefficient-free values are recorded for the log):
  aux_loss = coeff · E/(k·T²) · Σ_e (Σ_t S_te) · c_e over the microbatch,
  S the softmax over all experts (sigmoid: normalised over all experts) and
  c_e the counts of a plain top-k of S; seq_aux_loss the same per sequence,
  averaged over the batch; z-loss = coeff · mean_t logsumexp(logits_t)².
  Each loss enters the backward pass at the main loss's scale
  (`aux_loss_scale`, set by the trainer: loss scale / microbatches), never
  the forward value.

Parallelism. Every tensor rank routes its replica's whole microbatch (the
sequence gathered under sequence parallelism), so everything decided over a
microbatch (balancing losses, capacity, expert-bias counts) is one process's
under any layout; the losses, computed identically on every tensor rank,
enter the backward at 1/t each, and the router's weight gets a partial
gradient on each (summed over the tensor group). With the experts split
like the dense MLP (EP = 1, ETP = t) each tensor rank holds 1/t of every
expert, runs it on all tokens, and one all-reduce (or reduce-scatter)
completes them. Otherwise (expert parallelism, ptdp.parallel.topology's
folding) a rank holds E/EP experts, 1/ETP of each, and its own s/t
positions travel to them and back (a token dispatcher of
ptdp.parallel.expert: allgather or alltoall over the ETP × EP ranks that
hold every expert once).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ptdp.config import ModelConfig
from ptdp.model.fused import mlp_activation
from ptdp.model.grouped_experts import grouped_experts, grouped_gemm_used
from ptdp.model.recompute import checkpoint, recompute_active, recompute_discarding
from ptdp.model.router_noise import force_balanced
from ptdp.parallel.context_layout import rank_positions
from ptdp.parallel.expert import Dispatched, LocalExperts, token_dispatcher
from ptdp.parallel.sharding import EXPERT_ATTR, SHARD_ATTR, TensorShard, set_init
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


# The coefficient-free value each --moe-router-load-balancing-type logs (Megatron-LM's names).
BALANCING_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                   "global_aux_loss": "global_load_balancing_loss"}


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
        if config.moe_router_enable_expert_bias:
            # Aux-loss-free balancing (DeepSeek-V3): a bias on the selection
            # only, in fp32, saved with the model; and the tokens each expert
            # took since the last update (see ptdp.train.moe_metrics).
            self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32))
            self.register_buffer("tokens_per_expert", torch.zeros(E, dtype=torch.float32),
                                 persistent=False)
        else:
            self.expert_bias = None

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
            biased = scores if self.expert_bias is None else scores + self.expert_bias
            index = _top_k(biased, k, groups, group_k)
            chosen = scores.gather(1, index)  # the bias picks the experts, not their weights
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
    # At E/k an expert may take every token: a larger factor drops nothing
    # more (and 1e308 would overflow the product).
    k = c.moe_router_topk
    capacity = math.ceil(tokens * k / experts * min(factor, experts / k))
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


def top_k_counts(scores: torch.Tensor, k: int) -> torch.Tensor:
    """c [E]: the tokens a plain top-k of S (no capacity, no groups) gives each expert."""
    return torch.zeros_like(scores).scatter(1, scores.topk(k, dim=-1).indices, 1.0).sum(dim=0)


def switch_loss(scores: torch.Tensor, k: int, counts: torch.Tensor | None = None,
                tokens: int | None = None) -> torch.Tensor:
    """E/(k·T²) · Σ_e (Σ_t S_te) · c_e, c from a plain top-k of S (no
    capacity, no groups): the coefficient-free Switch-Transformer loss (a
    uniform router gives exactly 1). global_aux_loss gives its own counts
    and token count T (the replicas' together)."""
    experts = scores.shape[1]
    tokens = scores.shape[0] if tokens is None else tokens
    counts = top_k_counts(scores, k) if counts is None else counts
    return experts / (k * tokens * tokens) * (scores.sum(dim=0) * counts).sum()


@dataclass(frozen=True)
class Split:
    """How an expert's matrices are split: `parts` ranks (ETP for routed
    experts, t for the shared ones), this rank's `index`; `routed` marks
    the parameters as a routed expert's (EXPERT_ATTR)."""
    parts: int
    index: int
    routed: bool


class ExpertLinear(nn.Module):
    """One expert's matrix, this rank's part of it (split by `dim`: 0 output
    rows, as a column-parallel layer; 1 input columns, as a row-parallel
    one), without communication: the MoE layer reduces once.
    `weight_grads` as in ColumnParallelLinear (zero-bubble schedules)."""

    def __init__(self, rows: int, columns: int, split: Split, dim: int, *, bias: bool,
                 init_std: float, blocks: int = 1):
        super().__init__()
        t = split.parts
        local = (rows // t, columns) if dim == 0 else (rows, columns // t)
        self.weight = set_init(nn.Parameter(torch.empty(*local)), "normal", init_std)
        setattr(self.weight, SHARD_ATTR, TensorShard(dim=dim, parts=t, index=split.index,
                                                     blocks=blocks))
        self.weight_grads = None
        self.lora = None  # a low-rank adapter (ptdp.model.adapters), its own or shared
        if bias:
            self.bias = set_init(nn.Parameter(torch.empty(local[0])), "zeros")
            if dim == 0:
                setattr(self.bias, SHARD_ATTR, TensorShard(dim=0, parts=t, index=split.index,
                                                           blocks=blocks))
        else:
            self.register_parameter("bias", None)
        if split.routed:
            for param in self.parameters():
                setattr(param, EXPERT_ATTR, True)

    def forward(self, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        y = deferrable_linear(x, self.weight, self.bias if bias else None, self.weight_grads)
        return y if self.lora is None else y + self.lora.delta(x)


class _OnePartOfASum(torch.autograd.Function):
    """bias / parts in the forward, the whole gradient in the backward."""

    @staticmethod
    def forward(ctx, bias: torch.Tensor, parts: int) -> torch.Tensor:
        return bias / parts

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class Expert(nn.Module):
    """An MLP of width `ffn` (GeLU or a gated unit, as the dense MLP), its
    output scaled by each token's probability before the second matrix."""

    def __init__(self, config: ModelConfig, split: Split, ffn: int):
        super().__init__()
        h, gated = config.hidden_size, config.gated_linear_unit
        self.gated, self.activation = gated, mlp_activation(config)
        self.parts = split.parts
        self.dense_h_to_4h = ExpertLinear(2 * ffn if gated else ffn, h, split, 0, bias=config.bias,
                                          init_std=config.init_method_std, blocks=2 if gated else 1)
        self.dense_4h_to_h = ExpertLinear(h, ffn, split, 1, bias=config.bias,
                                          init_std=scaled_init_std(config.init_method_std,
                                                                   config.num_layers))

    # The MoE layer sets its streams here for --recompute-modules moe_act.
    recompute_act_rng: RNGStreams | None = None

    def forward(self, x: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
        h = self.dense_h_to_4h(x)
        if self.recompute_act_rng is not None and recompute_active(self):
            # The activation's output (what the second matrix keeps) is not
            # kept: Megatron-Core's output-discarding recomputation.
            out = recompute_discarding(self._scaled_activation, self.recompute_act_rng,
                                       lambda a: self.dense_4h_to_h(a, bias=False), h, probs)
        else:
            out = self.dense_4h_to_h(self._scaled_activation(h, probs), bias=False)
        if self.dense_4h_to_h.bias is not None:
            scale = 1.0 if probs is None else probs.unsqueeze(-1).to(out.dtype)
            out = out + self.output_bias() * scale
        return out

    def _scaled_activation(self, h: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
        a = self.activation(h)
        return a if probs is None else (a * probs.unsqueeze(-1)).to(a.dtype)

    def output_bias(self) -> torch.Tensor:
        """The second matrix's bias as this rank adds it to its partial output.

        Split over `parts` ranks whose partial outputs the layer sums, each
        adds bias/parts (exactly, where parts is a power of two), so the sum
        holds the bias once. The gradient is left whole: every part's ranks
        receive the same output gradient (the sum's backward copies it), so
        each holds the bias's full gradient, as a replicated parameter must.
        """
        bias = self.dense_4h_to_h.bias
        return bias if self.parts == 1 else _OnePartOfASum.apply(bias, self.parts)


class MoELayer(nn.Module):
    """The MLP of an MoE layer: (out, None) for x [s, b, h] ([s/t, b, h]
    under sequence parallelism), like ptdp.model.gpt.MLP."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, rng: RNGStreams,
                 sequence_parallel: bool = False, layer_id: int = 0):
        super().__init__()
        self.config, self.ctx, self.rng = config, ctx, rng
        self.layer_id = layer_id  # keys --moe-router-force-load-balancing's draws
        self.sequence_parallel = sequence_parallel and ctx.tp_group is not None
        # Tokens travel to experts on other ranks unless the experts are
        # split exactly like the dense MLP (EP = 1, ETP = t): see `forward`.
        self.dispatches = (ctx.ep_size, ctx.etp_size) != (1, ctx.tp_size)
        if self.dispatches and ctx.tp_size > 1 and not self.sequence_parallel:
            raise ValueError("expert parallelism (or ETP != t) at t > 1 needs sequence "
                             "parallelism: the tokens are dispatched from its shards")
        self.router = Router(config, tokens_are_replicated=ctx.tp_size > 1)
        self.dispatcher = (token_dispatcher(config.dispatcher, ctx,
                                            config.num_experts)
                           if self.dispatches else LocalExperts(ctx, config.num_experts))
        # This expert-parallel rank's E/EP experts, under their global numbers.
        per_rank = config.num_experts // ctx.ep_size
        first = ctx.ep_rank * per_rank
        routed = Split(ctx.etp_size, ctx.etp_rank, routed=True)
        self.experts = nn.ModuleDict({str(e): Expert(config, routed, config.moe_ffn_size)
                                      for e in range(first, first + per_rank)})
        # --moe-grouped-gemm: one grouped product per matrix, where torch has
        # one for these widths (else one product per expert: the same numbers).
        ffn = config.moe_ffn_size // ctx.etp_size
        self.grouped_gemm = config.moe_grouped_gemm
        self._widths = (config.hidden_size, ffn, 2 * ffn if config.gated_linear_unit else ffn)
        # --recompute-modules: moe_act and shared_experts, unless moe
        # recomputes the whole layer (ptdp.model.gpt) anyway.
        whole = config.recomputes("moe")
        if config.recomputes("moe_act") and not whole:
            for expert in self.experts.values():
                expert.recompute_act_rng = rng
        self.recompute_shared = config.recomputes("shared_experts") and not whole
        shared = config.moe_shared_expert_intermediate_size
        self.shared_expert = (Expert(config, Split(ctx.tp_size, ctx.tp_rank, routed=False), shared)
                              if shared else None)
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
        self.start_iteration()

    def forward(self, x: torch.Tensor):
        """Every tensor rank routes the whole microbatch (its sequence
        gathered under sequence parallelism), so the balancing losses and the
        capacity see what one process sees. Then, without dispatch, each
        tensor rank runs its 1/t of every expert on all tokens and one
        reduction completes them. With dispatch, each rank sends only its own
        s/t positions to the expert-dispatch group (ETP × EP ranks holding
        every expert once): the group's tokens are gathered, each rank runs
        its E/EP experts (its 1/ETP of each) on those routed to them, and a
        reduce-scatter over the group sums the experts' and the ETP shards'
        parts back onto the tokens' own ranks."""
        flat, routing = self._route(x)
        shared = self._shared(flat)
        tokens, routing = self._own_tokens(x, flat, routing)
        dispatched = self.dispatcher.dispatch(tokens, routing.probs, routing.routed)
        out = self.dispatcher.combine(self._run_experts(dispatched), dispatched)
        return self._completed(out, shared, x.shape), None

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        """The microbatch's tokens [T, h] (gathered from the sequence shards)
        and their routing, with the balancing losses attached and the
        tokens per expert counted."""
        group = self.ctx.tp_group
        tokens = (gather_from_sequence_region(x, group) if self.sequence_parallel
                  else copy_to_tensor_region(x, group))
        s, b, h = tokens.shape
        flat = tokens.reshape(s * b, h)
        logits = self.router.logits(flat)
        if self.config.moe_router_force_load_balancing:
            logits = force_balanced(logits, self._positions(s, b, flat.device), self.layer_id)
        logits = self._balance(logits, s, b)
        routing = self.router.route(logits)
        if self._counts_tokens():
            taken = routing.routed.sum(dim=0)
            if self.router.expert_bias is not None:
                self.router.tokens_per_expert += taken
            # Each expert's tokens and the assignments the top-k made (more
            # than the tokens taken when a capacity dropped some), for the log.
            self.metrics.setdefault("tokens_per_expert", []).append(taken.detach())
            self.metrics.setdefault("assigned", []).append(
                torch.tensor(float(s * b * self.config.moe_router_topk)))
        return flat, routing

    def _positions(self, s: int, b: int, device: torch.device) -> torch.Tensor:
        """Each row's position in its sequence: rows are [s, b] flattened,
        and a context rank holds positions `rank_positions` of the whole."""
        cp = self.ctx.cp_size
        places = (rank_positions(s * cp, cp, self.ctx.cp_rank, device) if cp > 1
                  else torch.arange(s, device=device))
        return places.repeat_interleave(b)

    def _own_tokens(self, x: torch.Tensor, flat: torch.Tensor,
                    routing: Routing) -> tuple[torch.Tensor, Routing]:
        """The tokens this rank hands its dispatcher: all of the microbatch's
        without dispatch, else its own positions, rows [r·T/t, (r+1)·T/t) of
        the gathered microbatch."""
        if not self.dispatches:
            return flat, routing
        local = x.reshape(-1, flat.shape[-1])
        rows = slice(self.ctx.tp_rank * local.shape[0], (self.ctx.tp_rank + 1) * local.shape[0]) \
            if self.sequence_parallel else slice(None)
        return local, Routing(routing.probs[rows], routing.routed[rows])

    def _completed(self, out: torch.Tensor, shared: torch.Tensor | None,
                   shape: torch.Size) -> torch.Tensor:
        """The layer's output in x's shape: the routed experts' part plus
        the shared experts', both partial over the tensor group, reduced."""
        group = self.ctx.tp_group
        if not self.dispatches:
            out = out if shared is None else out + shared
            out = out.view(-1, *shape[1:])  # [s, b, h], the sequence gathered
            if self.sequence_parallel:
                return reduce_scatter_to_sequence_region(out, group)
            return reduce_from_tensor_region(out, group)
        if shared is not None:
            out = out + (reduce_scatter_to_sequence_region(shared, group)
                         if self.sequence_parallel else shared)
        return out.view(shape)

    def _shared(self, flat: torch.Tensor) -> torch.Tensor | None:
        """The shared experts' output (partial over the tensor group), gated."""
        if self.shared_expert is None:
            return None
        if self.recompute_shared and recompute_active(self):
            return checkpoint(self._gated_shared, self.rng, flat)
        return self._gated_shared(flat)

    def _gated_shared(self, flat: torch.Tensor) -> torch.Tensor:
        shared = self.shared_expert(flat, None)
        if self.shared_expert_gate is not None:
            shared = shared * torch.sigmoid(F.linear(flat, self.shared_expert_gate))
        return shared

    def _run_experts(self, dispatched: Dispatched) -> torch.Tensor:
        """Row i of the dispatched rows through local expert experts[i],
        scaled by probs[i]; the rows in their order. Every expert runs, also
        on no rows: its gradient, zero, must reach the data-parallel buckets
        on every replica alike."""
        x, probs, experts = dispatched.tokens, dispatched.probs, dispatched.experts
        order = None
        if not dispatched.by_expert:
            order = torch.argsort(experts, stable=True)
            x, probs = x.index_select(0, order), probs.index_select(0, order)
            experts = experts.index_select(0, order)
        counts = torch.bincount(experts, minlength=len(self.experts))
        local = list(self.experts.values())
        y = None
        if self.grouped_gemm and grouped_gemm_used(self._widths, x.dtype):
            try:
                y = grouped_experts(local, x, probs, counts)
            except (RuntimeError, NotImplementedError) as error:  # the device's kernel refused
                self.grouped_gemm = False
                warnings.warn(f"--moe-grouped-gemm: torch's grouped_mm refused these experts "
                              f"({error}); they run one product each from now on")
        if y is None:
            sizes = counts.tolist()
            y = torch.cat([expert(rows, row_probs) for expert, rows, row_probs
                           in zip(local, x.split(sizes), probs.split(sizes))])
        return y if order is None else torch.empty_like(y).index_copy(0, order, y)

    def _balance(self, logits: torch.Tensor, s: int, b: int) -> torch.Tensor:
        """Attach the load-balancing and z losses to the logits (training
        with gradients only) and record their coefficient-free values."""
        c = self.config
        if not (self.training and torch.is_grad_enabled()):
            return logits
        # Every tensor rank computes the same losses over the same tokens:
        # each brings 1/t of the gradient. Context ranks hold other tokens:
        # each computes its part of the losses (the top-k counts and token
        # counts summed over the context group, the scores its own), and the
        # parts add up to the one-process value.
        scale = self.aux_loss_scale / self.ctx.tp_size
        k, cp = c.moe_router_topk, self.ctx.cp_size
        kind, coeff = c.moe_router_load_balancing_type, c.moe_aux_loss_coeff
        if kind in ("aux_loss", "seq_aux_loss", "global_aux_loss") and coeff > 0:
            scores = balancing_scores(logits, c)
            if kind == "aux_loss":
                value = switch_loss(scores, k, self._context_counts(scores), scores.shape[0] * cp)
            elif kind == "seq_aux_loss":  # tokens are [s, b] flattened: sequence b at b, b + B, ...
                per_sequence = scores.view(s, b, -1).transpose(0, 1)
                value = torch.stack([switch_loss(seq, k, self._context_counts(seq), s * cp)
                                     for seq in per_sequence]).mean()
            else:
                value = switch_loss(scores, k, self._global_counts(scores),
                                    tokens=scores.shape[0] * self.ctx.grad_reduce_size)
            self._record(BALANCING_NAMES[kind], value)
            logits = _AttachLoss.apply(logits, coeff * value, scale)
        if c.moe_z_loss_coeff:
            z = torch.logsumexp(logits.float(), dim=-1).square().mean() / cp
            self._record("z_loss", z)
            logits = _AttachLoss.apply(logits, c.moe_z_loss_coeff * z, scale)
        return logits

    @torch.no_grad()
    def _context_counts(self, scores: torch.Tensor) -> torch.Tensor:
        """The top-k counts of these tokens, summed over the context group
        (the same sequences' other positions)."""
        counts = top_k_counts(scores, self.config.moe_router_topk)
        if self.ctx.cp_size > 1:
            dist.all_reduce(counts, group=self.ctx.cp_group)
        return counts

    @torch.no_grad()
    def _global_counts(self, scores: torch.Tensor) -> torch.Tensor:
        """global_aux_loss's counts: the top-k counts of this microbatch
        summed over the data-parallel replicas' microbatches (and the
        context ranks' positions of them), averaged with
        the iteration's earlier microbatches' (Megatron-Core's running mean).
        A recomputation reuses what its forward used (microbatches replay in
        their forward order)."""
        if self.rng.replaying:
            return self._global_replays.pop(0)
        counts = top_k_counts(scores, self.config.moe_router_topk)
        if self.ctx.grad_reduce_group is not None:
            dist.all_reduce(counts, group=self.ctx.grad_reduce_group)
        self._global_sum = counts if self._global_sum is None else self._global_sum + counts
        self._global_microbatches += 1
        mean = self._global_sum / self._global_microbatches
        self._global_replays.append(mean)
        return mean

    def start_iteration(self) -> None:
        """A new global batch: global_aux_loss's running mean starts again."""
        self._global_sum, self._global_microbatches, self._global_replays = None, 0, []

    def _counts_tokens(self) -> bool:
        """Whether this forward counts towards the iteration's statistics:
        training, with gradients, and not a recomputation repeating one."""
        return self.training and torch.is_grad_enabled() and not self.rng.replaying

    def _record(self, name: str, value: torch.Tensor) -> None:
        if not self.rng.replaying:  # a recomputation repeats a forward
            self.metrics.setdefault(name, []).append(value.detach())

    def take_metrics(self) -> dict[str, list[torch.Tensor]]:
        taken, self.metrics = self.metrics, {}
        return taken
