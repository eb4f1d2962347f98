"""A lower bound on a layout's iteration time, priced without building its
schedule: what the planner sorts layouts by before it plays any of them.
"""

from __future__ import annotations

import functools

import numpy as np

from ptdp.schedules.kinds import virtual_stage_of
from ptdp.perf.price.after_flush import after_flush
from ptdp.perf.layout import ByValue, Layout, Workload
from ptdp.perf.analytic.moe import stage_moe_layers
from ptdp.perf.price.pricing import OperatorModel
from ptdp.perf.price.profiles import HardwareProfile
from ptdp.perf.price.stage_costs import operator_model, stage_costs


def compute_lower_bound(workload: Workload, layout: Layout, profile: HardwareProfile,
                        workload_key: ByValue | None = None, *, reductions: bool = True) -> float:
    """Seconds no iteration of this layout can beat, without building its
    schedule (`simulate` never predicts less; tested):

      max over pipeline ranks r of  head_r + compute_r + max(tail_r, reduction_r)
      + the slowest rank's optimizer step

    compute_r is the work and collectives of r's computes (m times each of
    its chunks' F and B, and W); head_r the forwards of the stages before
    r's first stage, which the first microbatch passes through before r
    can start; tail_r, under the schedules whose every rank ends with the
    backward of its first stage (GPipe, 1F1B, interleaved), the backwards
    of the stages before it, which the last microbatch still passes
    through (zero-bubble ranks may end with a W: no tail); reduction_r is
    what of the gradient reductions follows r's last backward in any
    schedule (its last bucket, the tied embedding's sum) and the optimizer
    what `simulate` adds after the flush. Transfers,
    waits and contention (CPU profiles) only add to this. With uniform
    costs and free transfers it is 1F1B's makespan itself. The planner
    sorts layouts by it and prices only those that can reach its top rows
    (`workload_key`: ByValue(workload), made once for a search's layouts).
    `reductions=False`: without the reductions and the optimizer (nothing
    after the flush is priced), a bound no larger than the whole one: what
    rules a layout out before its reductions are priced."""
    p, v = layout.p, layout.v
    m = layout.microbatches(workload.global_batch)
    kind = layout.schedule_kind
    ops = operator_model(workload, layout, profile, workload_key)
    zero_bubble = layout.zero_bubble
    # The stages' seconds and each rank's sum of them: the same for every
    # sharding strategy, microbatch count and d (a search's many layouts
    # share them). (The split, with p, v and the kind, decides the layers.)
    key = ("bound totals", layout.recompute, zero_bubble, kind, p, v, layout.split, layout.ep,
           layout.etp)
    if key not in ops.memo:
        layers = layout.stage_layers(ops.l)
        stage_of = _stage_table(kind, p, v)
        alike: dict[tuple, tuple[float, ...]] = {}   # (most stages are priced alike)
        totals = []
        for stage in range(p * v):
            shape = (stage == 0, stage == p * v - 1, layers[stage],
                     stage_moe_layers(ops.w.model, layers, stage))
            if shape not in alike:
                alike[shape] = _stage_seconds(ops, layout.recompute, zero_bubble, *shape,
                                              (layout.ep, layout.etp))
            totals.append(alike[shape])
        per_rank = [sum(sum(totals[stage]) for stage in stage_of[r]) for r in range(p)]
        heads, tails = [], []   # over the stages before rank r's first stage (stage r)
        head = tail = 0.0
        for r in range(p):
            heads.append(head)
            tails.append(tail)
            head += totals[r][0]
            if not zero_bubble:
                tail += totals[r][1]
        ops.memo[key] = (totals, per_rank, np.array(heads), np.array(per_rank),
                         np.array(tails))
    totals, per_rank, heads, computes, tails = ops.memo[key]
    if not reductions:   # (the largest of head + m · compute + tail, as the loop below adds)
        return max(0.0, float(((heads + m * computes) + tails).max()))
    bound = 0.0
    head = tail = 0.0
    after = after_flush(workload, layout, profile, ops)
    for r in range(p):
        compute = m * per_rank[r]
        # The flush comes after the tail; r's own reductions after its last backward.
        bound = max(bound, head + compute + max(tail, after.exposed_at_least(r)))
        head += totals[r][0]
        if not zero_bubble:
            tail += totals[r][1]
    return bound + max(after.optimizer_at_least(r) for r in range(p))


def partial_bound_shape(layout: Layout) -> tuple:
    """What of a layout `compute_lower_bound(..., reductions=False)` reads
    (with the workload and the profile): every field but the sharding
    strategy, its reshard policy and scatter/gather, which change only what
    follows the flush and the transfers (tested on a search's layouts)."""
    return (layout.t, layout.p, layout.d, layout.b, layout.v, layout.recompute,
            layout.schedule, layout.sequence_parallel, layout.split, layout.ep, layout.etp,
            layout.c, layout.cp_comm)


@functools.lru_cache(maxsize=4096)
def _stage_table(kind: str, p: int, v: int) -> tuple[tuple[int, ...], ...]:
    """The virtual stage of each (rank, chunk), [rank][chunk]."""
    return tuple(tuple(virtual_stage_of(kind, p, v, rank, chunk) for chunk in range(v))
                 for rank in range(p))


def _stage_seconds(ops: OperatorModel, recompute: str | None, zero_bubble: bool, first: bool,
                   last: bool, layers: int, moe_layers: int = 0,
                   experts: tuple[int, int | None] = (1, None)) -> tuple[float, ...]:
    """Seconds (work and collectives) of a stage's F, B (and W): `stage_costs`
    summed, its MoE layers priced as such (as simulate prices them)."""
    key = ("seconds", recompute, zero_bubble, first, last, layers) + (
        (moe_layers, experts) if moe_layers else ())
    if key not in ops.memo:
        costs = stage_costs(ops, recompute, zero_bubble, first, last, layers, moe_layers, experts)
        ops.memo[key] = tuple(costs.of(op).total_work + costs.of(op).comm
                              for op in (("F", "B", "W") if zero_bubble else ("F", "B")))
    return ops.memo[key]
