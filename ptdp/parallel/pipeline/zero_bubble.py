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

The plan (plan_unit_time) times every compute as soon as its rank and its
inputs allow, every compute one step (F = B = W, transfers free).

Transfers. The plan's times also place the exchanges: a tensor produced at
time T is sent in the exchange right after its producer and received in the
receiver's exchange that is open at T (the one before its first compute that
starts at or after T). Both ends are then posted by T and neither side waits
under equal costs, so the simulator reproduces the plan; with other costs the
order is unchanged and only the waiting differs. Transfers in one exchange
are sorted by (T, tag), the same order on both sides of every pair of ranks.
"""

from __future__ import annotations

from ptdp.parallel.pipeline.schedules import (
    Action,
    Compute,
    Exchange,
    Schedule,
    ScheduleError,
    Transfer,
    _transfers,
    virtual_stage_of,
)


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


def plan_unit_time(kind: str, p: int, m: int,
                   orders: list[list[Compute]] | None = None) -> list[list[tuple[Compute, int]]]:
    """Per rank, (compute, start step) in order: every compute one step, as
    early as its rank and its inputs allow. `orders`: each rank's computes
    (default: the kind's training orders)."""
    v = 2 if kind == "zbv" else 1
    last = p * v - 1
    if orders is None:
        orders = [(zbv_order if kind == "zbv" else zb_h1_order)(p, m, rank) for rank in range(p)]
    end: dict[tuple[str, int, int], int] = {}   # (op, microbatch, stage) -> end step
    plan: list[list[tuple[Compute, int]]] = [[] for _ in range(p)]
    free = [0] * p
    while any(len(plan[r]) < len(orders[r]) for r in range(p)):
        moved = False
        for rank in range(p):
            while len(plan[rank]) < len(orders[rank]):
                compute = orders[rank][len(plan[rank])]
                i, stage = compute.microbatch, virtual_stage_of(kind, p, v, rank, compute.chunk)
                needs = {"F": [("F", i, stage - 1)] if stage > 0 else [],
                         "B": [("F", i, stage)] + ([("B", i, stage + 1)] if stage < last else []),
                         "W": [("B", i, stage)]}[compute.op]
                if any(n not in end for n in needs):
                    break
                start = max([free[rank]] + [end[n] for n in needs])
                end[(compute.op, i, stage)] = free[rank] = start + 1
                plan[rank].append((compute, start))
                moved = True
        if not moved:
            raise ScheduleError(f"{kind} p={p} m={m}: the orders deadlock")
    return plan


def _with_timed_exchanges(kind: str, p: int, v: int,
                          plan: list[list[tuple[Compute, int]]]) -> tuple[tuple[Action, ...], ...]:
    # slots[rank][k]: transfers of the exchange before compute k (k = len: after the last).
    slots: list[list[list[tuple[int, Transfer]]]] = [[[] for _ in range(len(row) + 1)] for row in plan]
    for rank, row in enumerate(plan):
        for k, (compute, start) in enumerate(row):
            _, send = _transfers(compute, rank, p, v, kind)
            if send is None:
                continue
            produced = start + 1
            slots[rank][k + 1].append((produced, send))
            receiver_starts = [s for _, s in plan[send.peer]]
            slot = next((j for j, s in enumerate(receiver_starts) if s >= produced),
                        len(receiver_starts))
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
    plan = plan_unit_time("zbv", p, m, orders)
    return Schedule("forward-only", p, m, 2, _with_timed_exchanges("zbv", p, 2, plan),
                    placement="zbv")


def build_zero_bubble(kind: str, p: int, m: int) -> Schedule:
    """Every rank's actions for one iteration of zb-h1 or zbv (arguments
    already checked by schedules.check_arguments)."""
    v = 2 if kind == "zbv" else 1
    plan = plan_unit_time(kind, p, m)
    return Schedule(kind, p, m, v, _with_timed_exchanges(kind, p, v, plan))
