"""What an MoE layer's MLP costs beyond (or instead of) a dense MLP: its
active FLOPs, its time per microbatch on one rank, and the activations it
keeps (ptdp.model.moe.MoELayer is the work priced).

Notation: T = b·s/c tokens of a microbatch on a context rank, h hidden, E
experts, k top-k, F each expert's width (--moe-ffn-hidden-size), S the
shared experts' width, up = 2 with SwiGLU (the first matrix is [2F, h]),
else 1; e bytes per element; EP, ETP the expert layout, G = ETP·EP the
expert-dispatch group.

Work (`moe_mlp`): every tensor rank routes the whole microbatch (T tokens,
the sequence gathered under sequence parallelism): the router's
[T, h]×[h, E] product in fp32 (--moe-router-dtype; on GPUs a roofline,
not the tile model, which would pad E to a whole tile) and its softmax/top-k,
scatter and balancing passes as memory-bound operators. Without dispatch
(EP = 1, ETP = t) each tensor rank runs its 1/t of all E experts on the
k·T (token, expert) pairs; with dispatch each rank sends its own tokens
(T/t under sequence parallelism) to the G ranks that hold every expert
once, and each rank runs its E/EP local experts, 1/ETP of each, on the
pairs routed to them: k·G·T_local/E rows per expert when balanced. With a
capacity factor f the step is priced at the capacity, min(f, E/k)·(the
balanced rows) per expert (ranks wait for the busiest), at most all of
the group's pairs on one rank. --moe-grouped-gemm: one batched product per
matrix for the local experts; otherwise one product per expert, each with
its launches. The pairs are permuted to the experts (index_select) and
summed back (index_add), and the activation is scaled by the
probabilities: memory-bound passes over k·T·h and k·T·F/ETP elements.

Dispatch traffic (category "expert dispatch", not overlapped): allgather:
forward the all-gather of the group's tokens (G·T_local·h·e), their
probabilities and routing flags (G·T_local·E·5 bytes), and the
reduce-scatter of the outputs (G·T_local·h·e); backward the conjugates.
alltoall: each rank's k·T_local·h·e pairs go out by an all-to-all over the
EP group ((EP − 1)/EP of them leave) with their fp32 probabilities, the
ETP ranks gather what their peers received and reduce-scatter the partial
outputs, and an all-to-all brings the results back; the backward mirrors
it. The groups' ranks are the folding of ptdp.parallel.topology
(rank = etp + ETP·(ep + EP·(edp + EDP·pp)) inside a stage's t·c·d ranks):
the dispatch group is ETP·EP consecutive ranks, the EP group ETP apart;
each pays the slowest link it spans (Machine.link).

Tensor-group collectives: the MoE layer gathers its input over the tensor
group like the dense MLP (under sequence parallelism its backward is a
reduce-scatter not hidden under a GEMM, where the dense MLP's is); with
dispatch the experts' outputs return by the dispatch group, so the dense
MLP's reduce-scatter (and its backward all-gather) run only for the shared
expert.

An MoE layer's costs are the dense layer's with the dense MLP's GEMMs, its
activation pass and its weight-gradient accumulation taken out and these
put in (`moe_layer_costs`), so an MoE with one expert, top-1, of the dense
width, at EP = 1, prices the dense layer plus the router, the permutation
passes and their launches exactly.

Activations (`moe_saved_bytes`): what MoELayer saves for its backward on
one rank, measured with ptdp.perf.saved.SavedTensorBytes on one process
(tests/test_moe_perf.py): see the function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ptdp.config import ModelConfig
from ptdp.perf.operator_bytes import gelu_bytes, swiglu_bytes

EXPERT_DISPATCH = "expert dispatch"   # the time category of the dispatch collectives
FP32, INT64 = 4, 8
GRAD_BYTES = 4
# Operators the MoE layer launches beyond the dense MLP's (ptdp.model.moe,
# eager): routing (linear, cast, top-k, gather, softmax, two scatters), the
# pairs (nonzero, index, index_select, bincount, index_add, add) and, per
# expert run separately, its linear, activation, probability scale, cast,
# linear.
ROUTER_FORWARD_OPS = 14
PER_EXPERT_FORWARD_OPS = 5
GROUPED_FORWARD_OPS = 8


# ---------------------------------------------------------------- FLOPs

def mlp_columns(model: ModelConfig) -> list[int]:
    """Per layer, the columns the MLP multiplies each token's h values by,
    counting active parameters only: (up + 1)·f for a dense MLP; in an MoE
    layer the router's E, the k routed experts' k·(up + 1)·F and the shared
    expert's (up + 1)·S. Megatron-LM's num_floating_point_operations counts
    the same routed and shared experts and the dense layers --moe-layer-freq
    leaves dense, but not the router: `router_columns` is the difference."""
    up = 2 if model.swiglu else 1
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


def dispatch_group(ep: int, etp: int) -> list[int]:
    """Ranks of the first expert-dispatch group (ETP × EP consecutive ranks
    of a stage: ptdp.parallel.topology's folding)."""
    return list(range(ep * etp))


def expert_group(ep: int, etp: int) -> list[int]:
    """Ranks of the first EP group: ETP apart."""
    return [etp * rank for rank in range(ep)]


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


# ---------------------------------------------------------------- time

@dataclass
class MLPPieces:
    """Seconds of an MLP's pieces on one rank for one microbatch: processor
    work forward, backward (fused), B and W (zero-bubble split), and the
    full recomputation's; dispatch seconds forward and backward; changes
    to the tensor-group collectives (in all-gather units of b·s·h)."""
    forward: float = 0.0
    backward: float = 0.0
    b: float = 0.0
    w: float = 0.0
    recompute: float = 0.0
    dispatch_forward: float = 0.0
    dispatch_backward: float = 0.0
    dispatch_recompute: float = 0.0
    parts: dict = field(default_factory=dict)   # forward work by piece (moe_mlp)


def dense_mlp(ops) -> MLPPieces:
    """The dense MLP's share of OperatorModel's layer costs: its two GEMMs,
    its activation pass and its matrices' gradient accumulation (full
    recomputation runs its first GEMM and the activation again, and the
    second GEMM too where the whole layer reruns)."""
    shapes = ops.layer_gemms()
    up, down = shapes["mlp_up"][:3], shapes["mlp_down"][:3]
    act = (swiglu_bytes if ops.w.model.swiglu else gelu_bytes)(ops.b * ops.s * ops.f // ops.t,
                                                               ops.E)
    per_element = 2 * GRAD_BYTES + (GRAD_BYTES if ops.E == 4 else ops.E)
    accumulate = ops.memory((up[1] * up[2] + down[1] * down[2]) * per_element)
    input_grads = ops.gemm(up[0], up[2], up[1]) + ops.gemm(down[0], down[2], down[1])
    weight_grads = ops.gemm(up[2], up[1], up[0]) + ops.gemm(down[2], down[1], down[0])
    return MLPPieces(forward=ops.gemm(*up) + ops.gemm(*down) + ops.memory(act[0], "gelu", "forward"),
                     backward=(input_grads + weight_grads + ops.memory(act[1], "gelu", "backward")
                               + accumulate),
                     b=input_grads + ops.memory(act[1], "gelu", "backward"),
                     w=weight_grads + accumulate,
                     recompute=ops.gemm(*up) + ops.memory(act[0], "gelu", "forward")
                     + (ops.gemm(*down) if ops.recomputes_whole_layer else 0.0))


def _all_to_all(machine, nbytes: float, ranks: list[int]) -> float:
    """All-to-all of a rank's `nbytes`: (n−1)/n of them leave, n−1 steps."""
    n = len(ranks)
    if n <= 1 or nbytes <= 0:
        return 0.0
    bandwidth, latency = machine.link(ranks)
    return (n - 1) / n * nbytes / bandwidth + (n - 1) * latency


def dispatch_seconds(ops, load: ExpertLoad, ep: int, etp: int) -> tuple[float, float, float]:
    """(forward, backward, the return trip's) seconds of the dispatch
    collectives (module docstring); zeros without dispatch."""
    if not load.dispatches:
        return 0.0, 0.0, 0.0
    model, machine, e, h = ops.w.model, ops.machine, ops.E, ops.h
    E, k, local = model.num_experts, model.moe_router_topk, load.local_tokens
    if model.moe_token_dispatcher_type == "alltoall":
        ep_ranks, etp_ranks = expert_group(ep, etp), list(range(etp))
        pairs = k * local
        out = (_all_to_all(machine, pairs * h * e, ep_ranks)
               + _all_to_all(machine, pairs * FP32, ep_ranks)
               + _all_to_all(machine, ep * E // ep * INT64, ep_ranks))        # the counts
        gathered = etp * pairs
        out += machine.gather(gathered * (h * e + FP32 + INT64), etp_ranks)
        back = machine.gather(gathered * h * e, etp_ranks) + _all_to_all(machine, pairs * h * e,
                                                                        ep_ranks)
        backward = (2 * _all_to_all(machine, pairs * h * e, ep_ranks)
                    + _all_to_all(machine, pairs * FP32, ep_ranks)
                    + 2 * machine.gather(gathered * h * e, etp_ranks))
        return out + back, backward, back
    ranks = dispatch_group(ep, etp)
    tokens = load.group * local
    out = machine.gather(tokens * h * e, ranks) + machine.gather(tokens * E * (FP32 + 1), ranks)
    back = machine.gather(tokens * h * e, ranks)
    backward = 2 * machine.gather(tokens * h * e, ranks) + machine.gather(tokens * E * FP32, ranks)
    return out + back, backward, back


def _router_gemm(ops, m: int, n: int, k: int) -> float:
    """A router product in fp32 (E columns, or k = E: skinny). GPUs: a
    roofline, the FLOPs at e_max of the fp32 peak or the operands' bytes
    over the bandwidth, whichever is longer (cuBLAS runs such shapes as
    GEMV-like kernels; the tile model would pad E to a whole tile); CPUs:
    the profile's own roofline."""
    prof = ops.prof
    if prof.kind != "gpu":
        return prof.gemm_seconds(m, n, k, precision="fp32",
                                 bytes_per_element=FP32) / prof.thread_factor(ops.threads)
    return max(2.0 * m * n * k / (prof.peak_flops("fp32") * prof.gemm_efficiency),
               (m * k + k * n + m * n) * FP32 / prof.memory_bandwidth)


def moe_mlp(ops, ep: int, etp: int | None, *, balanced: bool = False) -> MLPPieces:
    """An MoE MLP's pieces on one rank (module docstring)."""
    model = ops.w.model
    etp = ops.t if etp is None else etp
    T, h, e, t = ops.b * ops.s, ops.h, ops.E, ops.t
    E, k = model.num_experts, model.moe_router_topk
    up = 2 if model.swiglu else 1
    load = expert_load(model, t, T, ops.sp, ep, etp, balanced=balanced)
    per_element = 2 * GRAD_BYTES + (GRAD_BYTES if e == 4 else e)
    # The router, in fp32: the cast of the tokens, the product, top-k,
    # softmax and the scatters over [T, E] (balancing losses: the softmax
    # over all experts again, the z-loss's log-sum-exp).
    router_gemm = _router_gemm(ops, T, E, h)
    router_gemm_backward = _router_gemm(ops, T, h, E) + _router_gemm(ops, E, h, T)
    passes = 3 + (2 if model.moe_aux_loss_coeff > 0 else 0) + (1 if model.moe_z_loss_coeff else 0)
    router_memory = ops.memory((T * h * (e + FP32) if e != FP32 else 0) + T * E * (FP32 * passes + 1))
    router_memory_backward = ops.memory(T * E * FP32 * passes)
    router_accumulate = ops.memory(E * h * per_element)
    # The pairs: gathered to the experts, scaled by their probabilities,
    # summed back onto their tokens.
    P, W = load.pairs, load.width
    out_tokens = load.group * load.local_tokens
    permute = ops.memory(2 * P * h * e + P * h * e + 2 * out_tokens * h * e + P * W * (2 * e + FP32))
    permute_backward = ops.memory(2 * P * h * e + 2 * out_tokens * h * e + 3 * P * W * e)
    act = (swiglu_bytes if model.swiglu else gelu_bytes)(P * W, e)
    # The experts' GEMMs: one batched product per matrix, or one each.
    n, R = load.local_experts, load.rows
    first, second = (R, up * W, h), (R, h, W)
    if model.moe_grouped_gemm:
        gemm = lambda m, nn, kk: ops.gemm(m, nn, kk, n)   # noqa: E731
        launches_fwd = GROUPED_FORWARD_OPS
    else:
        gemm = lambda m, nn, kk: n * ops.gemm(m, nn, kk)   # noqa: E731
        launches_fwd = PER_EXPERT_FORWARD_OPS * n
    expert_forward = gemm(*first) + gemm(*second)
    second_forward = gemm(*second)
    input_grads = gemm(R, h, up * W) + gemm(R, W, h)
    weight_grads = gemm(h, up * W, R) + gemm(W, h, R)
    expert_accumulate = ops.memory(n * (up + 1) * W * h * per_element)
    # The shared expert: a dense MLP of width S over the T tokens, split over t.
    S = (model.moe_shared_expert_intermediate_size or 0) // t
    shared_fwd = shared_in = shared_w = shared_act_f = shared_act_b = shared_acc = 0.0
    if S:
        shared_fwd = ops.gemm(T, up * S, h) + ops.gemm(T, h, S)
        shared_in = ops.gemm(T, h, up * S) + ops.gemm(T, S, h)
        shared_w = ops.gemm(h, up * S, T) + ops.gemm(S, h, T)
        sa = (swiglu_bytes if model.swiglu else gelu_bytes)(T * S, e)
        shared_act_f, shared_act_b = ops.memory(sa[0], "gelu"), ops.memory(sa[1], "gelu")
        shared_acc = ops.memory((up + 1) * S * h * per_element)
    launches = ops.launches(ROUTER_FORWARD_OPS + launches_fwd)
    parts = {"router": router_gemm + router_memory, "permute": permute,
             "experts": expert_forward + ops.memory(act[0], "gelu"),
             "shared": shared_fwd + shared_act_f, "launches": launches}
    forward = sum(parts.values())
    b = (router_gemm_backward + router_memory_backward + router_accumulate + permute_backward
         + input_grads + ops.memory(act[1], "gelu") + shared_in + shared_act_b
         + 2 * launches)
    w = weight_grads + expert_accumulate + shared_w + shared_acc
    dispatch_fwd, dispatch_bwd, back = dispatch_seconds(ops, load, ep, etp)
    # Full recomputation stops once every saved tensor is rebuilt: the
    # experts' second products, the sum back and the return trip do not
    # run, unless the whole layer reruns (hidden dropout's mask comes after
    # them; Megatron-LM's re-entrant checkpoint).
    whole = ops.recomputes_whole_layer
    recompute = forward if whole else forward - second_forward - ops.memory(2 * out_tokens * h * e)
    return MLPPieces(forward=forward, backward=b + w, b=b, w=w, recompute=recompute,
                     dispatch_forward=dispatch_fwd, dispatch_backward=dispatch_bwd,
                     dispatch_recompute=dispatch_fwd if whole else dispatch_fwd - back,
                     parts=parts)


def _tensor_gathers(ops, count: int) -> float:
    return ops.tensor_collectives(gathers=count) if count else 0.0


def moe_layer_costs(ops, dense_forward, dense_backward, dense_weight, recompute: str | None,
                    ep: int, etp: int | None):
    """(forward, backward, weight) Costs of an MoE layer, from the dense
    layer's (ptdp.perf.stage_costs: backward includes the recomputation,
    weight is None unless zero-bubble): the dense MLP's pieces out, the MoE
    MLP's in, and the tensor-group collectives the MoE layer changes."""
    dense, moe = dense_mlp(ops), moe_mlp(ops, ep, etp)
    zero_bubble = dense_weight is not None
    load = expert_load(ops.w.model, ops.t, ops.b * ops.s, ops.sp, ep, etp)
    shared = bool(ops.w.model.moe_shared_expert_intermediate_size)
    # Collectives: without dispatch and shared expert the reduce after the
    # experts goes (its backward gather too); under sequence parallelism
    # the gathered input's backward reduce-scatter is exposed instead of
    # hidden, and nothing is re-gathered for a weight gradient.
    returned = 1 if (load.dispatches and not shared and ops.sp) else 0
    forward = _copy(dense_forward)
    forward.add("forward compute", moe.forward - dense.forward)
    forward.add(EXPERT_DISPATCH, moe.dispatch_forward)
    forward.comm -= _tensor_gathers(ops, returned)
    backward = _copy(dense_backward)
    backward.add("backward compute", (moe.b if zero_bubble else moe.backward)
                 - (dense.b if zero_bubble else dense.backward))
    backward.add(EXPERT_DISPATCH, moe.dispatch_backward)
    if ops.sp:
        mlp_up = ops.layer_gemms()["mlp_up"]
        if zero_bubble:
            backward.comm -= _tensor_gathers(ops, returned)
        else:
            backward.comm += (_tensor_gathers(ops, 1 - returned)
                              - ops.sequence_parallel_linear_backward_exposed(mlp_up))
    if recompute == "full":
        backward.add("recompute", moe.recompute - dense.recompute)
        backward.add(EXPERT_DISPATCH, moe.dispatch_recompute)
    weight = None
    if zero_bubble:
        weight = _copy(dense_weight)
        weight.add("backward compute", moe.w - dense.w)
        if ops.sp:
            weight.comm -= _tensor_gathers(ops, 1)   # the MLP input is kept whole
    return forward, backward, weight


def _copy(cost):
    """A copy of a ptdp.perf.pricing.Cost (not imported: pricing's users import this module)."""
    out = type(cost)()
    out += cost
    return out


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
        them), the fp32 copy of the router weight E·h·4 (16-bit only), the top-k indices T·k·8 and their softmax
        T·k·4; balancing: the softmax over all experts T·E·4 and the
        counts E·4; z-loss: the log-sum-exp T·4 (the logits are kept
        already); under a capacity below T, the kept mask T·E (the
        per-expert top-cap's indices are saved by a node that is freed at
        once, its values unused, so they are not held);
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
    Full recomputation keeps none of it; selective keeps all of it."""
    if recompute == "full":
        return 0
    s = model.seq_length // c
    T = b * s
    h, E, k = model.hidden_size, model.num_experts, model.moe_router_topk
    up = 2 if model.swiglu else 1
    load = expert_load(model, t, T, sequence_parallel, ep, etp)
    shared_width = model.moe_shared_expert_intermediate_size or 0
    # The MLP's input as the router keeps it (fp32: the tokens themselves,
    # gathered under sequence parallelism; 16-bit: an fp32 copy, and the
    # tokens only where the shared expert keeps them).
    router = T * h * FP32 + (T * h * e if e != FP32 and shared_width else 0)
    router += T * k * (INT64 + FP32) + T * E * FP32
    if e != FP32:
        router += E * h * FP32
    balancing = model.moe_router_load_balancing_type in ("aux_loss", "seq_aux_loss",
                                                         "global_aux_loss")
    if balancing and model.moe_aux_loss_coeff > 0:
        router += T * E * FP32 + E * FP32
    if model.moe_z_loss_coeff:
        router += T * FP32
    factor = model.moe_expert_capacity_factor
    if factor is not None:
        cap = math.ceil(T * k / E * min(factor, E / k))  # E/k: every token fits
        if cap < T:
            router += T * E
    P, W = load.pairs, load.width
    pairs = P * (2 * INT64 + FP32) + 2 * P * h * e
    experts = P * (up + 2) * W * e
    if model.moe_grouped_gemm:
        experts += load.local_experts * ((up + 1) * W * h * e + FP32)
    S = (model.moe_shared_expert_intermediate_size or 0) // t
    shared = T * (up + 1) * S * e if S else 0
    if S and model.moe_shared_expert_gate:
        shared += T * e + T * h * e
    return router + pairs + experts + shared


def moe_layer_activation_delta(model: ModelConfig, t: int, b: int, e: int, *,
                               sequence_parallel: bool, recompute: str | None, ep: int = 1,
                               etp: int | None = None, c: int = 1) -> int:
    """What an MoE layer saves minus what the dense layer's figure
    (ptdp.perf.memory) counts for its MLP: the MLP input (s/t of the
    positions under sequence parallelism) and the dense activations
    (up + 1)·f/t per token. 0 under full recomputation (both keep the
    layer input only)."""
    if recompute == "full":
        return 0
    T = b * model.seq_length // c
    rows = T // t if sequence_parallel and t > 1 else T
    dense = rows * model.hidden_size * e + (3 if model.swiglu else 2) * T * model.ffn_size // t * e
    return moe_saved_bytes(model, t, b, e, sequence_parallel=sequence_parallel,
                           recompute=recompute, ep=ep, etp=etp, c=c) - dense


def chunk_moe_layers(model: ModelConfig, layout, rank: int, chunk: int) -> int:
    """The MoE layers of (rank, chunk) of `layout` (its virtual stage's)."""
    from ptdp.schedules.kinds import virtual_stage_of

    if not model.is_moe:
        return 0
    stage = virtual_stage_of(layout.schedule_kind, layout.p, layout.v, rank, chunk)
    return stage_moe_layers(model, layout.stage_layers(model.num_layers), stage)
