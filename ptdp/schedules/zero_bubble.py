"""Zero-bubble schedules (Qi et al., ICLR 2024): zb-h1 and zbv, as data.

A backward is split into B (the input gradient, which the previous stage
waits for) and W (the weight gradients, which nobody waits for). W can then
be put where a rank would otherwise idle. A (microbatch, chunk) activation is
stored from its F until its W: W needs the inputs the forward saved.

Orders (per rank r, microbatches in order within each chunk):
- zb-h1 (one chunk per rank): 1F1B's warm-up, min(p - r, m) forwards; then
  for every microbatch i: B of i, W of i - r (rank r defers its W by r
  microbatches, filling what 1F1B leaves idle), the next F; then the W
  still to do. A rank holds p - r activations between F and B (1F1B's
  count) and p between F and W (1F1B's peak, rank 0's; the last rank holds
  its deferred W's). Under F = B = W the makespan is 3m + p - 1 and the
  bubble (p - 1)/(3m), against 1F1B's (p - 1)/m.
- zbv (two chunks per rank in a V: rank r holds stages r and 2p - 1 - r;
  the paper's ZB-V pattern): warm-up 2(p - r) - 1 forwards on chunk 0, then
  r pairs (F chunk 1, F chunk 0), then p - r rounds (F, B, W on chunk 1);
  steady rounds of F0 B0 W0 F1 B1 W1 while chunk-0 forwards remain or
  chunk 1 lags; cool-down: r pairs (B0, B1), then p - r rounds (B0, W0),
  then the W's left (chunk 1 first). A rank holds at most 2p chunk
  activations between F and W: p whole ranks' worth, 1F1B's peak. Under
  F = B = W (a chunk's compute one half-unit) rank r can start no earlier
  than r half-units and is never idle after, so the makespan is
  (6m + p - 1)/2 units and the bubble (p - 1)/(6m): half of zb-h1's.

The plan (plan_timed) times every compute as soon as its rank and its
inputs allow, each taking cost(rank, compute): by default one step (F = B
= W, transfers free); given measured or predicted costs, those.

Transfers. The plan's times also place the exchanges: a tensor produced at
time T is sent in the exchange right after its producer and received in the
receiver's exchange that is open at T (the one before its first compute that
starts at or after T). Both ends are then posted by T and neither side waits
when the computes take the costs the plan assumed, so the simulator
reproduces the plan; with other costs the order is unchanged and only the
waiting differs, which is why the trainer re-places the exchanges for the
costs it measures (ptdp.train.loop) and the planner for the costs it
predicts (ptdp.perf.simulate.predict). Transfers in one exchange are sorted by (T, tag),
the same order on both sides of every pair of ranks.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Callable, Mapping

from ptdp.schedules.actions import (
    FORWARD_ONLY,
    LOOPED,
    V_SHAPE,
    Action,
    Compute,
    Exchange,
    Placement,
    Schedule,
    ScheduleError,
    Transfer,
    transfers_of,
)

ZB_H1, ZBV = "zb-h1", "zbv"


def _placement(kind: str) -> Placement:
    return V_SHAPE if kind == ZBV else LOOPED


def chunks_of(kind: str) -> int:
    return 2 if kind == ZBV else 1


def zb_h1_order(p: int, m: int, rank: int) -> list[Compute]:
    order = [Compute("F", i, 0) for i in range(min(p - rank, m))]
    forwards = len(order)
    weights = 0
    for i in range(m):
        order.append(Compute("B", i, 0))
        if i >= rank:
            order.append(Compute("W", weights, 0))
            weights += 1
        if forwards < m:
            order.append(Compute("F", forwards, 0))
            forwards += 1
    order += [Compute("W", i, 0) for i in range(weights, m)]
    return order


def zbv_order(p: int, m: int, rank: int) -> list[Compute]:
    order: list[Compute] = []
    count = {(op, c): 0 for op in "FBW" for c in (0, 1)}  # computes issued so far

    def add(op: str, chunk: int) -> None:
        order.append(Compute(op, count[(op, chunk)], chunk))
        count[(op, chunk)] += 1

    for _ in range(2 * (p - rank) - 1):
        add("F", 0)
    for _ in range(rank):
        add("F", 1)
        add("F", 0)
    for _ in range(p - rank):
        for op in "FBW":
            add(op, 1)
    while count[("F", 1)] < count[("F", 0)] or count[("F", 0)] < m:
        if count[("F", 0)] < m:
            add("F", 0)
        for op, chunk in (("B", 0), ("W", 0), ("F", 1), ("B", 1), ("W", 1)):
            add(op, chunk)
    for _ in range(rank):
        add("B", 0)
        add("B", 1)
    for _ in range(p - rank):
        add("B", 0)
        add("W", 0)
    for chunk in (1, 0):
        while count[("W", chunk)] < count[("B", chunk)]:
            add("W", chunk)
    return order


def zero_bubble_order(kind: str, p: int, m: int, rank: int) -> list[Compute]:
    """Rank `rank`'s computes under zb-h1 or zbv, in schedule order."""
    return (zbv_order if kind == ZBV else zb_h1_order)(p, m, rank)


# Seconds (or units) of one compute on a rank: cost(rank, compute).
ComputeCost = Callable[[int, Compute], float]


def unit_cost(rank: int, compute: Compute) -> float:
    return 1


def costs_from_table(table: Mapping[tuple[int, int, str], float]) -> ComputeCost:
    """cost(rank, compute) from {(rank, chunk, op): duration}."""
    return lambda rank, compute: table[(rank, compute.chunk, compute.op)]


def plan_timed(kind: str, p: int, m: int, orders: list[list[Compute]] | None = None,
               cost: ComputeCost = unit_cost) -> list[list[tuple[Compute, float, float]]]:
    """Per rank, (compute, start, end) in order: every compute as early as
    its rank and its inputs allow, taking cost(rank, compute). `orders`:
    each rank's computes (default: the kind's training orders)."""
    v, placement = chunks_of(kind), _placement(kind)
    last = p * v - 1
    if orders is None:
        orders = [zero_bubble_order(kind, p, m, rank) for rank in range(p)]
    end: dict[tuple[str, int, int], float] = {}   # (op, microbatch, stage) -> end time
    plan: list[list[tuple[Compute, float, float]]] = [[] for _ in range(p)]
    free = [0] * p
    while any(len(plan[r]) < len(orders[r]) for r in range(p)):
        moved = False
        for rank in range(p):
            while len(plan[rank]) < len(orders[rank]):
                compute = orders[rank][len(plan[rank])]
                i, stage = compute.microbatch, placement.stage(p, v, rank, compute.chunk)
                needs = {"F": [("F", i, stage - 1)] if stage > 0 else [],
                         "B": [("F", i, stage)] + ([("B", i, stage + 1)] if stage < last else []),
                         "W": [("B", i, stage)]}[compute.op]
                if any(n not in end for n in needs):
                    break
                start = max([free[rank]] + [end[n] for n in needs])
                end[(compute.op, i, stage)] = free[rank] = start + cost(rank, compute)
                plan[rank].append((compute, start, free[rank]))
                moved = True
        if not moved:
            raise ScheduleError(f"{kind} p={p} m={m}: the orders deadlock")
    return plan


def _with_timed_exchanges(kind: str, p: int, v: int,
                          plan: list[list[tuple[Compute, float, float]]]
                          ) -> tuple[tuple[Action, ...], ...]:
    # slots[rank][k]: transfers of the exchange before compute k (k = len: after the last).
    slots: list[list[list[tuple[float, Transfer]]]] = [[[] for _ in range(len(row) + 1)]
                                                      for row in plan]
    starts = [[start for _, start, _ in row] for row in plan]
    for rank, row in enumerate(plan):
        for k, (compute, _, produced) in enumerate(row):
            _, send = transfers_of(compute, rank, p, v, _placement(kind))
            if send is None:
                continue
            slots[rank][k + 1].append((produced, send))
            # The receiver's exchange before its first compute starting at or after `produced`.
            slot = bisect_left(starts[send.peer], produced)
            recv = Transfer("recv", send.kind, send.microbatch, send.boundary, rank)
            slots[send.peer][slot].append((produced, recv))
    ranks = []
    for rank, row in enumerate(plan):
        actions: list[Action] = []
        for k in range(len(row) + 1):
            if slots[rank][k]:
                ordered = sorted(slots[rank][k], key=lambda e: (e[0], e[1].kind, e[1].microbatch,
                                                                e[1].boundary, e[1].op))
                actions.append(Exchange(tuple(t for _, t in ordered)))
            if k < len(row):
                actions.append(row[k][0])
        ranks.append(tuple(actions))
    return tuple(ranks)


def build_zbv_forward_only(p: int, m: int) -> Schedule:
    """Evaluation under the V placement: every rank runs its chunk-0
    forwards, then its chunk-1 forwards, microbatches in order."""
    orders = [[Compute("F", i, c) for c in (0, 1) for i in range(m)] for _ in range(p)]
    plan = plan_timed(ZBV, p, m, orders)
    return Schedule(FORWARD_ONLY, p, m, 2, _with_timed_exchanges(ZBV, p, 2, plan),
                    placement=V_SHAPE, warmups=(2 * m,) * p)


def build_zero_bubble(kind: str, p: int, m: int, cost: ComputeCost = unit_cost) -> Schedule:
    """Every rank's actions for one iteration of zb-h1 or zbv (arguments
    already checked by kinds.check_arguments), the exchanges placed for
    computes that take cost(rank, compute)."""
    v = chunks_of(kind)
    plan = plan_timed(kind, p, m, cost=cost)
    return Schedule(kind, p, m, v, _with_timed_exchanges(kind, p, v, plan),
                    placement=_placement(kind), splits_backward=True)
