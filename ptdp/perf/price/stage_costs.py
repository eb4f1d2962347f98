"""F, B (and W) of every (rank, chunk) of a layout: the operator prices of
ptdp.perf.price.pricing summed over a virtual stage's layers, its embedding and
its output layer.

Every layer of a shape costs the same, so a stage is one layer's costs
times its layers. Costs are keyed by (rank, chunk); whether a chunk has the
embedding or the output layer follows its virtual stage
(`virtual_stage_of`: under ZB-V rank 0 holds stage 0 and stage 2p−1). What
one microbatch costs on one tensor rank depends only on t, b, sequence
parallelism and the threads each process gets, so a search shares one
OperatorModel (`operator_model`) among every layout that has them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ptdp.schedules.actions import ScheduleError
from ptdp.schedules.kinds import virtual_stage_of
from ptdp.perf.analytic import counts as analytic
from ptdp.perf.layout import ByIdentity, ByValue, Layout, Workload
from ptdp.perf.price.machine import Machine
from ptdp.perf.analytic.moe import stage_moe_layers
from ptdp.perf.price.moe import moe_layer_costs
from ptdp.perf.price.pricing import Cost, OperatorModel
from ptdp.perf.price.profiles import HardwareProfile


@dataclass
class ChunkCosts:
    forward: Cost
    backward: Cost          # includes recomputation; zero-bubble kinds: B only
    parameters: int
    weight: Cost | None = None   # zero-bubble kinds: W (the weight gradients)

    def of(self, op: str) -> Cost:
        """The cost of a Compute's op: "F", "B" or "W"."""
        cost = {"F": self.forward, "B": self.backward, "W": self.weight}[op]
        if cost is None:
            raise ScheduleError("a W compute under a schedule whose backward is not split")
        return cost


def chunk_costs(ops: OperatorModel, layout: Layout, rank: int, chunk: int) -> ChunkCosts:
    """The costs of (rank, chunk): its virtual stage under the layout's
    schedule (ZB-V's V places rank 0's chunk 1 at the last stage) decides
    whether it has the embedding or the output layer. Zero-bubble kinds
    split the backward into B and W (OperatorModel.layer_backward_parts)."""
    return layout_chunk_costs(ops, layout)[(rank, chunk)]


def layout_chunk_costs(ops: OperatorModel, layout: Layout) -> dict[tuple[int, int], ChunkCosts]:
    """`chunk_costs` of every (rank, chunk) of `layout`."""
    p, v, kind = layout.p, layout.v, layout.schedule_kind
    stages = layout.stage_layers(ops.l)
    parameters = parameter_counts(ops.model_key, analytic.placement_of_parameters(layout))
    costs = {}
    for rank in range(p):
        for chunk in range(v):
            stage = virtual_stage_of(kind, p, v, rank, chunk)
            priced = stage_costs(ops, layout.recompute, layout.zero_bubble, stage == 0,
                                 stage == p * v - 1, stages[stage],
                                 stage_moe_layers(ops.w.model, stages, stage),
                                 (layout.ep, layout.etp))
            costs[(rank, chunk)] = ChunkCosts(priced.forward, priced.backward,
                                              parameters[rank][chunk], priced.weight)
    return costs


def stage_costs(ops: OperatorModel, recompute: str | None, zero_bubble: bool, first: bool,
                last: bool, layers: int, moe_layers: int = 0,
                experts: tuple[int, int | None] = (1, None)) -> ChunkCosts:
    """F, B (and W) of a virtual stage of `layers` transformer layers, with
    the embedding (`first`) and the output layer (`last`), priced once per
    OperatorModel: one layer's costs times `layers` (the parameters are
    left 0; chunk_costs fills them in). `moe_layers` of them are MoE layers
    under the expert layout `experts` = (EP, ETP) (ptdp.perf.price.moe)."""
    key = (recompute, zero_bubble, first, last, layers) + ((moe_layers, experts) if moe_layers
                                                          else ())
    if key in ops.memo:
        return ops.memo[key]
    layer = ops.memo.get((recompute, zero_bubble))
    if layer is None:
        recomputed = ops.layer_recompute(recompute)
        if zero_bubble:
            b, w = ops.layer_backward_parts()
        else:
            b, w = ops.layer_backward(), None
        backward = Cost()
        backward += recomputed
        backward += b
        layer = ops.memo[(recompute, zero_bubble)] = ChunkCosts(ops.layer_forward(), backward, 0,
                                                                 w)
    forward, backward = layer.forward.scaled(layers), layer.backward.scaled(layers)
    weight = layer.weight.scaled(layers) if zero_bubble else None
    if moe_layers:   # each MoE layer: the dense layer with its MLP replaced
        moe = moe_layer_costs(ops, layer.forward, layer.backward, layer.weight, recompute,
                              *experts)
        forward = _plus(layer.forward.scaled(layers - moe_layers), moe[0].scaled(moe_layers))
        backward = _plus(layer.backward.scaled(layers - moe_layers), moe[1].scaled(moe_layers))
        weight = (_plus(layer.weight.scaled(layers - moe_layers), moe[2].scaled(moe_layers))
                  if zero_bubble else None)
    if first:
        forward = _plus(_piece(ops, "embedding_forward"), forward)
    if last:
        forward += _piece(ops, "head_forward")
        backward += _piece(ops, "head_backward")  # also under zero-bubble: see the module docstring
        if ops.w.model.mtp_depth:
            mtp = _mtp_costs(ops, layer, recompute, experts)
            forward, backward = _plus(forward, mtp.forward), _plus(backward, mtp.backward)
            if zero_bubble:
                weight = _plus(weight, mtp.weight)
    if first:
        backward += _piece(ops, "embedding_backward")
    costs = ops.memo[key] = ChunkCosts(forward, backward, 0, weight)
    return costs


def _piece(ops: OperatorModel, name: str) -> Cost:
    """ops.NAME() (the embedding's or the output layer's F or B), priced
    once per OperatorModel: a search prices thousands of stages with the
    same first and last pieces. (Read only: every use adds it to a Cost of
    its own.)"""
    key = ("piece", name)
    if key not in ops.memo:
        ops.memo[key] = getattr(ops, name)()
    return ops.memo[key]


def _mtp_costs(ops: OperatorModel, layer: ChunkCosts, recompute: str | None,
               experts: tuple[int, int | None]) -> ChunkCosts:
    """What the D MTP modules (--mtp-num-layers) add to the last stage, per
    microbatch: each module's embedding lookup of the tokens ahead, its
    2h -> h projection (column-parallel: [b·s, 2h]×[2h, h/t]; the model
    FLOPs' term), a transformer layer of the last layer's kind (dense or
    MoE, priced as the model's; recomputed as they are, and under full
    recomputation the projection too) and the output layer with its loss
    again (its logits over the vocabulary). The norms are the layer's
    norms' price (three more per module, priced as one layer's two)."""
    model = ops.w.model
    module = layer
    if model.is_moe and model.moe_layer_pattern[-1]:
        forward, backward, weight = moe_layer_costs(ops, layer.forward, layer.backward,
                                                    layer.weight, recompute, *experts)
        module = ChunkCosts(forward, backward, 0, weight)
    m, n, k = ops.b * ops.s, ops.h // ops.t, 2 * ops.h
    projection = ops.gemm(m, n, k)
    forward = _plus(_plus(module.forward, ops.head_forward()), ops.embedding_forward())
    forward.add("forward compute", projection)
    backward = _plus(_plus(module.backward, ops.head_backward()), ops.embedding_backward())
    backward.add("backward compute", ops.gemm_backward(m, n, k))
    if recompute == "full":
        backward.add("recompute", projection)
    weight = module.weight
    depth = model.mtp_depth
    return ChunkCosts(forward.scaled(depth), backward.scaled(depth), 0,
                      None if weight is None else weight.scaled(depth))


def _plus(a: Cost, b: Cost) -> Cost:
    total = Cost()
    total += a
    total += b
    return total


@functools.lru_cache(maxsize=16384)
def parameter_counts(model: ByValue, placement: Layout) -> tuple[tuple[int, ...], ...]:
    """Parameters of each (rank, chunk) on one tensor rank, [rank][chunk]."""
    return tuple(tuple(analytic.placed_chunk_parameter_count(model, placement, rank, chunk)
                       for chunk in range(placement.v))
                 for rank in range(placement.p))


@functools.lru_cache(maxsize=1024)
def _operator_model(workload: ByValue, t: int, b: int, sequence_parallel: bool,
                    profile: ByIdentity, threads: int, c: int = 1,
                    cp_comm: str = "p2p") -> OperatorModel:
    layout = Layout(t=t, b=b, sequence_parallel=sequence_parallel, c=c, cp_comm=cp_comm)
    return OperatorModel(workload.copy(), layout, profile.value, Machine(layout, profile.value),
                         threads)


def operator_model(workload: Workload, layout: Layout, profile: HardwareProfile,
                   workload_key: ByValue | None = None) -> OperatorModel:
    """The OperatorModel of `layout` (what one microbatch costs on one
    tensor rank depends only on t, b, sequence parallelism, c and its comm
    type, and the threads each process gets), shared by every layout of a
    search that has them. `workload_key`: ByValue(workload), made once by
    a caller that asks for many layouts of one workload."""
    key = ByValue(workload) if workload_key is None else workload_key
    return _operator_model(key, layout.t, layout.b, layout.splits_sequence,
                           ByIdentity(profile), profile.threads_per_process(layout.devices),
                           layout.c, layout.cp_comm)
