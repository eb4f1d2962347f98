"""What an MoE layer counts beyond (or instead of) a dense MLP: the columns
its active parameters multiply each token by (the FLOPs), its MoE layers
per stage, the load of one rank's experts and the activations it keeps
(ptdp.model.moe.MoELayer is the work counted). What it costs in time is
ptdp.perf.price.moe.

Notation: T = b·s/c tokens of a microbatch on a context rank, h hidden, E
experts, k top-k, F each expert's width (--moe-ffn-hidden-size), S the
shared experts' width, up = 2 with SwiGLU (the first matrix is [2F, h]),
else 1; e bytes per element; EP, ETP the expert layout, G = ETP·EP the
expert-dispatch group.

Load (`expert_load`): without dispatch (EP = 1, ETP = t) each tensor rank
runs its 1/t of all E experts on the k·T (token, expert) pairs; with
dispatch each rank sends its own tokens (T/t under sequence parallelism)
to the G ranks that hold every expert once, and each rank runs its E/EP
local experts, 1/ETP of each, on the pairs routed to them: k·G·T_local/E
rows per expert when balanced. With a capacity factor f the rows are the
capacity, min(f, E/k)·(the balanced rows) per expert, at most all of the
group's pairs on one rank.

Activations (`moe_saved_bytes`): what MoELayer saves for its backward on
one rank, measured with ptdp.perf.analytic.saved.SavedTensorBytes on one process
(tests/test_moe_perf.py): see the function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ptdp.config import ModelConfig

FP32, INT64 = 4, 8


# ---------------------------------------------------------------- FLOPs

def mlp_columns(model: ModelConfig) -> list[int]:
    """Per layer, the columns the MLP multiplies each token's h values by,
    counting active parameters only: (up + 1)·f for a dense MLP; in an MoE
    layer the router's E, the k routed experts' k·(up + 1)·F and the shared
    expert's (up + 1)·S. Megatron-LM's num_floating_point_operations counts
    the same routed and shared experts and the dense layers --moe-layer-freq
    leaves dense, but not the router: `router_columns` is the difference."""
    up = 2 if model.gated_linear_unit else 1
    if not model.is_moe:
        return [(up + 1) * model.ffn_size] * model.num_layers
    moe = (model.num_experts + model.moe_router_topk * (up + 1) * model.moe_ffn_size
           + (up + 1) * (model.moe_shared_expert_intermediate_size or 0))
    return [moe if is_moe else (up + 1) * model.ffn_size for is_moe in model.moe_layer_pattern]


def router_columns(model: ModelConfig) -> int:
    """Σ over MoE layers of the router's E columns: what ptdp's model FLOPs
    count beyond Megatron-LM's (6·B·s·h times this)."""
    return model.num_experts * sum(model.moe_layer_pattern) if model.is_moe else 0


# ---------------------------------------------------------------- layout

def stage_moe_layers(model: ModelConfig, stage_layers: list[int], stage: int) -> int:
    """The MoE layers of virtual stage `stage` (its layers are the next
    stage_layers[stage] after the earlier stages')."""
    if not model.is_moe:
        return 0
    first = sum(stage_layers[:stage])
    return sum(model.moe_layer_pattern[first:first + stage_layers[stage]])


@dataclass(frozen=True)
class ExpertLoad:
    """What one rank's routed experts do per microbatch."""
    routed_tokens: int     # T: the tokens each tensor rank routes
    local_tokens: int      # the tokens this rank sends to the experts (T/t under SP)
    group: int             # G: ranks whose tokens reach this rank's experts (1 without dispatch)
    local_experts: int     # E/EP (E without dispatch)
    width: int             # F/ETP
    rows: int              # per local expert: balanced, or at the capacity
    pairs: int             # rows over all local experts (what is permuted and stored)
    dispatches: bool


def expert_load(model: ModelConfig, t: int, tokens: int, sequence_parallel: bool, ep: int,
                etp: int | None, *, balanced: bool = False) -> ExpertLoad:
    """The load of one rank's experts for T = `tokens` routed per tensor
    rank (module docstring); `balanced` ignores the capacity factor."""
    E, k = model.num_experts, model.moe_router_topk
    etp = t if etp is None else etp
    dispatches = (ep, etp) != (1, t)
    local = tokens // t if dispatches and sequence_parallel and t > 1 else tokens
    group = ep * etp if dispatches else 1
    arriving = k * group * local            # pairs of the tokens that reach these experts
    per_expert = arriving / E
    factor = model.moe_expert_capacity_factor
    if factor is not None and not balanced:
        per_expert *= min(factor, E / k)
    local_experts = E // ep if dispatches else E
    rows = math.ceil(per_expert)
    pairs = min(rows * local_experts, arriving)
    return ExpertLoad(tokens, local, group, local_experts, model.moe_ffn_size // etp, rows, pairs,
                      dispatches)


# ---------------------------------------------------------------- memory

def moe_saved_bytes(model: ModelConfig, t: int, b: int, e: int, *, sequence_parallel: bool,
                    recompute: str | None, ep: int = 1, etp: int | None = None, c: int = 1,
                    kernels: str = "cuda") -> int:
    """Bytes an MoE MLP saves for its backward per microbatch on one rank,
    its input included (what replaces the dense MLP's input and its
    up·f/t + f/t per token; ptdp.model.moe, measured exactly on one CPU
    process for dropless routing, tests/test_moe_perf.py; the routed rows
    are the capacity-priced ones, so under a capacity that drops this is
    an upper bound):
      input: the tokens the router multiplies, T·h·4 (fp32: the MLP input
        itself; 16-bit: its fp32 copy, and the input T·h·e as well when a
        shared expert keeps it);
      router: the fp32 logits T·E·4 (the gather of the chosen ones keeps
        them; pre-softmax and sigmoid scores: see the code), the fp32 copy
        of the router weight E·h·4 (16-bit only), the top-k indices T·k·8
        and their softmax T·k·4; balancing: the softmax over all experts
        T·E·4 and the counts E·4 (per sequence, b·E·4, for seq_aux_loss);
        z-loss: the log-sum-exp T·4 (the logits are kept already); under
        a capacity below T, the kept mask T·E (the per-expert top-cap's
        indices are saved by a node that is freed at once, its values
        unused, so they are not held);
      pairs (P rows on this rank): the expert and token indices P·8 each,
        their probabilities P·4, the permuted tokens P·h·e and the experts'
        outputs P·h·e (the sum onto the tokens keeps them);
      experts: the first product's output up·W, the activation W and the
        probability-scaled activation W per row (W = F/ETP); grouped GEMMs
        also the stacked local weights of both matrices (n·(up + 1)·W·h·e)
        and the int32 offsets (n·4, counted 4 per matrix pair);
      shared expert: its first product's output up·S/t and activation
        S/t per token (S split over t); with the gate, the gate's sigmoid
        (one value per token) and the shared output it scales (h per token).
    Full recomputation keeps none of it; selective keeps all of it but what
    its --recompute-modules recompute: moe keeps the layer's input alone
    (the second norm's output); moe_act frees the activation and its
    scaled output (the first product's output stays, the checkpoint's
    input); shared_experts keeps only the shared expert's input (the
    tokens, kept anyway); layernorm frees the second norm's output where
    it is what the router or the checkpoint keeps (not a gathered copy)."""
    if recompute == "full":
        return 0
    modules = frozenset(model.recompute_modules) if recompute == "selective" else frozenset()
    s = model.seq_length // c
    T = b * s
    h, E, k = model.hidden_size, model.num_experts, model.moe_router_topk
    # The second norm's output is the layer's input itself (no gather):
    # freed under --recompute-modules layernorm.
    freed_input = "layernorm" in modules and not (sequence_parallel and t > 1)
    if "moe" in modules:   # the checkpoint keeps the layer's input
        rows = T // t if sequence_parallel and t > 1 else T
        return 0 if "layernorm" in modules else rows * h * e
    up = 2 if model.gated_linear_unit else 1
    load = expert_load(model, t, T, sequence_parallel, ep, etp)
    shared_width = model.moe_shared_expert_intermediate_size or 0
    # The MLP's input as the router keeps it (fp32: the tokens themselves,
    # gathered under sequence parallelism; 16-bit: an fp32 copy, and the
    # tokens only where the shared expert keeps them).
    router = (0 if e == FP32 and freed_input else T * h * FP32) + (
        T * h * e if e != FP32 and shared_width and not freed_input else 0)
    router += T * k * (INT64 + FP32) + T * E * FP32
    # (measured) --moe-router-pre-softmax keeps the softmax over all E
    # experts instead of over the k chosen; sigmoid scores (DeepSeek-V3)
    # keep the sigmoid's output T·E·4 besides, and with k > 1 two fp32
    # values per token for the renormalisation. Both gather the chosen from
    # the scores, so the logits stay only where the z-loss keeps them.
    # Group-limited routing keeps nothing more (its choice carries no gradient).
    logits_freed = 0 if model.moe_z_loss_coeff else T * E * FP32
    if model.moe_router_score_function == "sigmoid":
        router += T * E * FP32 + (2 * T * FP32 if k > 1 else 0) - logits_freed
    elif model.moe_router_pre_softmax:
        router += T * E * FP32 - T * k * FP32 - logits_freed
    if e != FP32:
        router += E * h * FP32
    balancing = model.moe_router_load_balancing_type in ("aux_loss", "seq_aux_loss",
                                                         "global_aux_loss")
    if balancing and model.moe_aux_loss_coeff > 0:
        # (the counts per sequence under seq_aux_loss)
        router += T * E * FP32 + E * FP32 * (b if model.moe_router_load_balancing_type
                                             == "seq_aux_loss" else 1)
    if model.moe_z_loss_coeff:
        router += T * FP32
    factor = model.moe_expert_capacity_factor
    if factor is not None:
        cap = math.ceil(T * k / E * min(factor, E / k))  # E/k: every token fits
        if cap < T:
            router += T * E
    P, W = load.pairs, load.width
    pairs = P * (2 * INT64 + FP32) + 2 * P * h * e
    experts = P * (up + (0 if "moe_act" in modules else 2)) * W * e
    if model.moe_grouped_gemm:
        experts += load.local_experts * ((up + 1) * W * h * e + FP32)
    S = (model.moe_shared_expert_intermediate_size or 0) // t
    shared = T * (up + 1) * S * e if S else 0
    if S and model.moe_shared_expert_gate:
        shared += T * e + T * h * e
    if "shared_experts" in modules:
        shared = 0
    return router + pairs + experts + shared


def moe_layer_activation_delta(model: ModelConfig, t: int, b: int, e: int, *,
                               sequence_parallel: bool, recompute: str | None, ep: int = 1,
                               etp: int | None = None, c: int = 1) -> int:
    """What an MoE layer saves minus what the dense layer's figure
    (ptdp.perf.analytic.memory) counts for its MLP: the MLP input (s/t of the
    positions under sequence parallelism) and the dense activations
    (up + 1)·f/t per token. 0 under full recomputation (both keep the
    layer input only)."""
    if recompute == "full":
        return 0
    modules = frozenset(model.recompute_modules) if recompute == "selective" else frozenset()
    T = b * model.seq_length // c
    rows = T // t if sequence_parallel and t > 1 else T
    # (as the dense figure counts them: the second norm's output unless
    # --recompute-modules layernorm, the activations unless mlp)
    dense = ((0 if "layernorm" in modules else rows * model.hidden_size * e)
             + (0 if "mlp" in modules else
                (3 if model.gated_linear_unit else 2) * T * model.ffn_size // t * e))
    return moe_saved_bytes(model, t, b, e, sequence_parallel=sequence_parallel,
                           recompute=recompute, ep=ep, etp=etp, c=c) - dense


def chunk_moe_layers(model: ModelConfig, layout, rank: int, chunk: int) -> int:
    """The MoE layers of (rank, chunk) of `layout` (its virtual stage's)."""
    from ptdp.schedules.kinds import virtual_stage_of

    if not model.is_moe:
        return 0
    stage = virtual_stage_of(layout.schedule_kind, layout.p, layout.v, rank, chunk)
    return stage_moe_layers(model, layout.stage_layers(model.num_layers), stage)
