"""What an MoE layer's MLP costs beyond (or instead of) a dense MLP: its
time per microbatch on one rank (ptdp.model.moe.MoELayer is the work
priced). Its active FLOPs, the load of a rank's experts and the
activations it keeps are counted in ptdp.perf.analytic.moe.

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
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ptdp.perf.analytic.moe import FP32, INT64, ExpertLoad, expert_load
from ptdp.perf.price.operator_bytes import gelu_bytes, swiglu_bytes

EXPERT_DISPATCH = "expert dispatch"   # the time category of the dispatch collectives
GRAD_BYTES = 4
# Operators the MoE layer launches beyond the dense MLP's (ptdp.model.moe,
# eager): routing (linear, cast, top-k, gather, softmax, two scatters), the
# pairs (nonzero, index, index_select, bincount, index_add, add) and, per
# expert run separately, its linear, activation, probability scale, cast,
# linear.
ROUTER_FORWARD_OPS = 14
PER_EXPERT_FORWARD_OPS = 5
GROUPED_FORWARD_OPS = 8


# ---------------------------------------------------------------- layout

def dispatch_group(ep: int, etp: int) -> list[int]:
    """Ranks of the first expert-dispatch group (ETP × EP consecutive ranks
    of a stage: ptdp.parallel.topology's folding)."""
    return list(range(ep * etp))


def expert_group(ep: int, etp: int) -> list[int]:
    """Ranks of the first EP group: ETP apart."""
    return [etp * rank for rank in range(ep)]


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
    gated = ops.w.model.gated_linear_unit
    act = (swiglu_bytes if gated else gelu_bytes)(ops.b * ops.s * ops.f // ops.t, ops.E)
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
    if model.dispatcher == "alltoall":
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
    up = 2 if model.gated_linear_unit else 1
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
    act = (swiglu_bytes if model.gated_linear_unit else gelu_bytes)(P * W, e)
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
        sa = (swiglu_bytes if model.gated_linear_unit else gelu_bytes)(T * S, e)
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
    layer's (ptdp.perf.price.stage_costs: backward includes the recomputation,
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
    elif recompute == "selective":
        backward.add("recompute", _selective_moe_recompute(ops, dense, moe, load))
        if "moe" in ops.w.model.recompute_modules:
            backward.add(EXPERT_DISPATCH, moe.dispatch_forward)
    weight = None
    if zero_bubble:
        weight = _copy(dense_weight)
        weight.add("backward compute", moe.w - dense.w)
        if ops.sp:
            weight.comm -= _tensor_gathers(ops, 1)   # the MLP input is kept whole
    return forward, backward, weight


def _selective_moe_recompute(ops, dense: "MLPPieces", moe: "MLPPieces", load: ExpertLoad
                             ) -> float:
    """What --recompute-modules recomputes of an MoE layer's MLP beyond the
    dense layer's figure (which counts mlp's dense MLP: not an MoE
    layer's): moe its whole forward (the dispatch besides), else moe_act
    the routed experts' activation over their rows and shared_experts the
    shared expert's two products (its gate's too)."""
    model = ops.w.model
    modules = model.recompute_modules
    seconds = -dense.forward if "mlp" in modules else 0.0
    if "moe" in modules:
        return seconds + moe.forward
    if "moe_act" in modules:
        act = (swiglu_bytes if model.gated_linear_unit else gelu_bytes)(load.pairs * load.width,
                                                                        ops.E)
        seconds += ops.memory(act[0], "gelu", "forward")
    shared = (model.moe_shared_expert_intermediate_size or 0) // ops.t
    if "shared_experts" in modules and shared:
        up = 2 if model.gated_linear_unit else 1
        tokens = ops.b * ops.s
        seconds += ops.gemm(tokens, up * shared, ops.h) + ops.gemm(tokens, ops.h, shared)
    return seconds


def _copy(cost):
    """A copy of a ptdp.perf.price.pricing.Cost (not imported: pricing's users
    import this module)."""
    out = type(cost)()
    out += cost
    return out

