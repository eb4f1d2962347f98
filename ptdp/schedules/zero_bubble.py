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

import functools
from bisect import bisect_left
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

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
    chunk_neighbours,
)

ZB_H1, ZBV = "zb-h1", "zbv"


def _placement(kind: str) -> Placement:
    return V_SHAPE if kind == ZBV else LOOPED


def chunks_of(kind: str) -> int:
    return 2 if kind == ZBV else 1


def zb_h1_order(p: int, m: int, rank: int) -> list[Compute]:
    return [Compute(*step) for step in _zb_h1_steps(p, m, rank)]


def _zb_h1_steps(p: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """zb_h1_order as (op, microbatch, chunk)."""
    order = [("F", i, 0) for i in range(min(p - rank, m))]
    forwards = len(order)
    weights = 0
    for i in range(m):
        order.append(("B", i, 0))
        if i >= rank:
            order.append(("W", weights, 0))
            weights += 1
        if forwards < m:
            order.append(("F", forwards, 0))
            forwards += 1
    order += [("W", i, 0) for i in range(weights, m)]
    return order


def zbv_order(p: int, m: int, rank: int) -> list[Compute]:
    return [Compute(*step) for step in _zbv_steps(p, m, rank)]


def _zbv_steps(p: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """zbv_order as (op, microbatch, chunk)."""
    order: list[tuple[str, int, int]] = []
    count = {(op, c): 0 for op in "FBW" for c in (0, 1)}  # computes issued so far

    def add(op: str, chunk: int) -> None:
        order.append((op, count[(op, chunk)], chunk))
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
    return list(_order(kind, p, m, rank))


def zero_bubble_op_codes(kind: str, p: int, m: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """zero_bubble_order's ops (F 0, B 1, W 2) and chunks as arrays, made
    without the computes (a planner's memory model reads thousands of ranks)."""
    r = rank
    if kind == ZBV and m >= 2 * p:
        # _zbv_steps' loop, its counts known: the steady rounds with a chunk-0
        # forward run until chunk 0 has all m, those without it until chunk 1
        # catches up; r W's of each chunk are left.
        return _runs([("F0", 2 * (p - r) - 1), ("F1 F0", r), ("F1 B1 W1", p - r),
                      ("F0 B0 W0 F1 B1 W1", m - 2 * p + r + 1), ("B0 W0 F1 B1 W1", p - r - 1),
                      ("B0 B1", r), ("B0 W0", p - r), ("W1", r), ("W0", r)])
    if kind != ZBV and m >= p:
        # _zb_h1_steps: after the warm-up, microbatch i's B, its W once i
        # reaches r, the next F while forwards remain; then r W's.
        return _runs([("F0", p - r), ("B0 F0", r), ("B0 W0 F0", m - p), ("B0 W0", p - r),
                      ("W0", r)])
    # (below the kinds' fewest microbatches: read from the steps)
    steps = _steps(kind, p, m, rank)
    return (np.array(["FBW".index(op) for op, _, _ in steps], np.int8),
            np.array([chunk for _, _, chunk in steps], np.int64))


def _runs(runs: list[tuple[str, int]]) -> tuple[np.ndarray, np.ndarray]:
    """(op, chunk) arrays of `runs`: each a pattern of computes ("F0 B1":
    op and chunk) repeated that many times, one run after another."""
    patterns = [run.split() for run, _ in runs]
    steps = [step for pattern in patterns for step in pattern]
    lengths = np.array([len(pattern) for pattern in patterns])
    sizes = lengths * np.array([times for _, times in runs])
    run = np.repeat(np.arange(len(runs)), sizes)   # each compute's run
    position = np.arange(sizes.sum()) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    step = (np.cumsum(lengths) - lengths)[run] + position % lengths[run]
    return (np.array(["FBW".index(op) for op, _ in steps], np.int8)[step],
            np.array([int(chunk) for _, chunk in steps], np.int64)[step])


def _steps(kind: str, p: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    return (_zbv_steps if kind == ZBV else _zb_h1_steps)(p, m, rank)


@functools.lru_cache(maxsize=4096)
def _order(kind: str, p: int, m: int, rank: int) -> tuple[Compute, ...]:
    # (a planner asks for the same orders for its schedules)
    return tuple(Compute(*step) for step in _steps(kind, p, m, rank))


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
    flow = _dataflow(kind, p, m) if orders is None else _dataflow_of(kind, p, m, orders)
    return _plan_rows(flow, *_timed(flow, p, cost))


def _timed(flow: "_Dataflow", p: int, cost: ComputeCost) -> tuple[list, list]:
    """(starts, ends) of the flow's computes, flat."""
    computes, ranks, needs = flow.computes, flow.ranks, flow.needs
    starts, ends = [0.0] * len(computes), [0.0] * len(computes)
    free = [0] * p
    # flow.sequence: every compute after its inputs, so one pass times them all
    # (the times are the dataflow's own, whatever order it is walked in).
    for flat in flow.sequence:
        rank = ranks[flat]
        start = free[rank]
        for need in needs[flat]:
            if ends[need] > start:
                start = ends[need]
        starts[flat] = start
        ends[flat] = free[rank] = start + cost(rank, computes[flat])
    return starts, ends


def _plan_rows(flow: "_Dataflow", starts: list, ends: list
               ) -> list[list[tuple[Compute, float, float]]]:
    computes = flow.computes
    return [[(computes[flat], starts[flat], ends[flat]) for flat in range(first, last)]
            for first, last in zip(flow.offsets, flow.offsets[1:])]


@dataclass(frozen=True)
class _Dataflow:
    """The computes of a zero-bubble iteration as a flat dataflow: every
    rank's computes one after the other (rank r's from offsets[r]), each
    one's rank, the computes it waits for besides its rank's previous one
    (needs) and an order in which every compute follows its inputs
    (sequence). It depends on the orders alone, not on the costs."""
    computes: list[Compute]
    ranks: list[int]
    offsets: list[int]
    needs: list[tuple[int, ...]]
    sequence: list[int]


@functools.lru_cache(maxsize=8)
def _dataflow(kind: str, p: int, m: int) -> _Dataflow:
    return _dataflow_of(kind, p, m, [zero_bubble_order(kind, p, m, rank) for rank in range(p)])


def _dataflow_of(kind: str, p: int, m: int, orders: list[list[Compute]]) -> _Dataflow:
    v, placement = chunks_of(kind), _placement(kind)
    last = p * v - 1
    offsets = [0]
    for order in orders:
        offsets.append(offsets[-1] + len(order))
    computes = [compute for order in orders for compute in order]
    ranks = [rank for rank, order in enumerate(orders) for _ in order]
    position: dict[tuple[str, int, int], int] = {}   # (op, microbatch, stage) -> flat index
    needs: list[tuple[int, ...]] = [()] * len(computes)
    sequence: list[int] = []
    done = [0] * p
    stages = [[placement.stage(p, v, rank, chunk) for chunk in range(v)] for rank in range(p)]
    while any(done[r] < len(orders[r]) for r in range(p)):
        moved = False
        for rank in range(p):
            k, n, first, stage_of = done[rank], len(orders[rank]), offsets[rank], stages[rank]
            while k < n:
                flat = first + k
                compute = computes[flat]
                op, i, stage = compute.op, compute.microbatch, stage_of[compute.chunk]
                # what it waits for: the forward before it; its own forward and the
                # backward after it; its backward
                try:
                    if op == "F":
                        wanted = (position[("F", i, stage - 1)],) if stage > 0 else ()
                    elif op == "B":
                        wanted = ((position[("F", i, stage)], position[("B", i, stage + 1)])
                                  if stage < last else (position[("F", i, stage)],))
                    else:
                        wanted = (position[("B", i, stage)],)
                except KeyError:   # not computed yet: the rank waits
                    break
                needs[flat] = wanted
                position[(op, i, stage)] = flat
                sequence.append(flat)
                k += 1
            if k > done[rank]:
                done[rank] = k
                moved = True
        if not moved:
            raise ScheduleError(f"{kind} p={p} m={m}: the orders deadlock")
    return _Dataflow(computes, ranks, offsets, needs, sequence)


@functools.lru_cache(maxsize=8)
def _sends(kind: str, p: int, m: int) -> list[list[tuple[Transfer, Transfer] | None]]:
    orders = [zero_bubble_order(kind, p, m, rank) for rank in range(p)]
    return _sends_of(kind, p, orders)


def _sends_of(kind: str, p: int, orders) -> list[list[tuple[Transfer, Transfer] | None]]:
    """Per rank, per compute: (the send it produces, its receiver's end), or
    None (transfers_of's send, read per (rank, chunk) once)."""
    v, placement = chunks_of(kind), _placement(kind)
    rows = []
    for rank, order in enumerate(orders):
        sides = chunk_neighbours(rank, p, v, placement)
        row = []
        for compute in order:
            op = compute.op
            stage, after, before = sides[compute.chunk]
            if op == "F" and after is not None:
                row.append((Transfer("send", "activation", compute.microbatch, stage, after),
                            Transfer("recv", "activation", compute.microbatch, stage, rank)))
            elif op == "B" and before is not None:
                row.append((Transfer("send", "grad", compute.microbatch, stage - 1, before),
                            Transfer("recv", "grad", compute.microbatch, stage - 1, rank)))
            else:
                row.append(None)
        rows.append(row)
    return rows


def _transfer_order(entry: tuple[float, Transfer]):
    time, transfer = entry
    return (time, transfer.kind, transfer.microbatch, transfer.boundary, transfer.op)


def _with_timed_exchanges(kind: str, p: int, v: int,
                          plan: list[list[tuple[Compute, float, float]]],
                          sends: list[list[tuple[Transfer, Transfer] | None]] | None = None
                          ) -> tuple[tuple[Action, ...], ...]:
    """`sends`: _sends_of for the plan's orders (computed here when not given)."""
    if sends is None:
        sends = _sends_of(kind, p, [[compute for compute, _, _ in row] for row in plan])
    # slots[rank][k]: transfers of the exchange before compute k (k = len: after
    # the last), only where there is one.
    slots: list[dict[int, list[tuple[float, Transfer]]]] = [{} for _ in plan]
    starts = [[start for _, start, _ in row] for row in plan]
    for rank, row in enumerate(plan):
        mine = slots[rank]
        for k, pair in enumerate(sends[rank]):
            if pair is None:
                continue
            send, recv = pair
            produced = row[k][2]
            mine.setdefault(k + 1, []).append((produced, send))
            # The receiver's exchange before its first compute starting at or after `produced`.
            slot = bisect_left(starts[send.peer], produced)
            slots[send.peer].setdefault(slot, []).append((produced, recv))
    ranks = []
    for rank, row in enumerate(plan):
        mine, actions = slots[rank], []
        for k in range(len(row) + 1):
            slot = mine.get(k)
            if slot is not None:
                if len(slot) == 1:
                    actions.append(Exchange((slot[0][1],)))
                else:
                    slot.sort(key=_transfer_order)
                    actions.append(Exchange(tuple([t for _, t in slot])))
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
    computes that take cost(rank, compute). Costs that place every
    exchange where earlier ones did give that schedule again, the same
    object (a planner builds one per layout's costs; most place alike)."""
    v = chunks_of(kind)
    flow = _dataflow(kind, p, m)
    starts, ends = _timed(flow, p, cost)
    key = (kind, p, m, _placement_signature(kind, p, m, starts, ends))
    schedule = _PLACED.get(key)
    if schedule is None:
        plan = _plan_rows(flow, starts, ends)
        schedule = Schedule(kind, p, m, v, _with_timed_exchanges(kind, p, v, plan,
                                                                 _sends(kind, p, m)),
                            placement=_placement(kind), splits_backward=True)
        if len(_PLACED) >= 16:
            _PLACED.clear()
        _PLACED[key] = schedule
    return schedule


_PLACED: dict[tuple, Schedule] = {}


def _placement_signature(kind: str, p: int, m: int, starts: list, ends: list) -> bytes:
    """Where _with_timed_exchanges puts every transfer for these times, as
    bytes: `placed_transfers`' rows without their peers (which the rest
    implies). Equal bytes, equal actions."""
    return placed_transfers(kind, p, m, starts, ends)[:6].tobytes()


def placed_transfers(kind: str, p: int, m: int, starts: list, ends: list) -> np.ndarray:
    """Where _with_timed_exchanges puts every transfer for these times (the
    flat `_timed` of the kind's orders): columns of rows (rank, slot (the
    exchange before the rank's compute `slot`; its number of computes:
    after the last), kind (activation 0, grad 1), microbatch, boundary, op
    (recv 0, send 1), peer), in the order the ranks' exchanges hold them,
    each exchange sorted by (time, kind, microbatch, boundary, op) as there."""
    table, by_receiver, receiver_bounds = _send_table(kind, p, m)
    flow = _dataflow(kind, p, m)
    starts, ends = np.asarray(starts, dtype=np.float64), np.asarray(ends, dtype=np.float64)
    produced = ends[table[:, 1]]
    # The receiver's exchange before its first compute starting at or after `produced`.
    received = np.empty(len(table), dtype=np.int64)
    for r in range(p):
        sends = by_receiver[receiver_bounds[r]:receiver_bounds[r + 1]]
        received[sends] = np.searchsorted(starts[flow.offsets[r]:flow.offsets[r + 1]],
                                          produced[sends], side="left")
    # sender entries (op send = 1) in slot k + 1, receiver entries (op recv = 0)
    rank = np.concatenate((table[:, 0], table[:, 3]))
    slot = np.concatenate((table[:, 2] + 1, received))
    time = np.concatenate((produced, produced))
    kind_, microbatch, boundary = (np.tile(table[:, column], 2) for column in (4, 5, 6))
    op = np.repeat([1, 0], len(table))
    peer = np.concatenate((table[:, 3], table[:, 0]))
    order = np.lexsort((op, boundary, microbatch, kind_, time, slot, rank))
    return np.stack((rank, slot, kind_, microbatch, boundary, op, peer))[:, order]


def placed_transfers_for(kind: str, p: int, m: int, cost: ComputeCost = unit_cost
                         ) -> np.ndarray:
    """`placed_transfers` for computes that take cost(rank, compute): where
    build_zero_bubble's schedule for `cost` has its transfers, without
    building it."""
    starts, ends = _timed(_dataflow(kind, p, m), p, cost)
    return placed_transfers(kind, p, m, starts, ends)


@functools.lru_cache(maxsize=8)
def order_arrays(kind: str, p: int, m: int) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]:
    """Each rank's computes in schedule order as (op (F 0, B 1, W 2),
    microbatch, chunk) arrays."""
    arrays = []
    for rank in range(p):
        computes = _order(kind, p, m, rank)   # (the dataflow's, made once)
        op = np.fromiter(("FBW".index(c.op) for c in computes), np.int64, len(computes))
        microbatch = np.fromiter((c.microbatch for c in computes), np.int64, len(computes))
        chunk = np.fromiter((c.chunk for c in computes), np.int64, len(computes))
        arrays.append((op, microbatch, chunk))
    return tuple(arrays)


@functools.lru_cache(maxsize=8)
def _send_table(kind: str, p: int, m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every send of the kind's orders as a row (sender, its compute's flat
    index, its index on the sender, receiver, kind (activation 0, grad 1),
    microbatch, boundary), _sends' in order; the rows by receiver, and
    where each receiver's start."""
    flow, v, placement = _dataflow(kind, p, m), chunks_of(kind), _placement(kind)
    tables = []
    for rank, (op, microbatch, chunk) in enumerate(order_arrays(kind, p, m)):
        # per chunk: its stage, the rank after it and before it (-1: none or this rank)
        sides = np.array([(stage, -1 if after is None else after, -1 if before is None else before)
                          for stage, after, before in chunk_neighbours(rank, p, v, placement)],
                         dtype=np.int64).reshape(-1, 3)
        stage, after, before = sides[chunk].T
        forward = op == 0
        # a forward sends its activation on, a backward its input gradient back
        receiver = np.where(forward, after, np.where(op == 1, before, -1))
        k = np.flatnonzero(receiver >= 0)
        tables.append(np.stack((np.full(len(k), rank), flow.offsets[rank] + k, k, receiver[k],
                                1 - forward[k], microbatch[k],
                                np.where(forward, stage, stage - 1)[k]), axis=1))
    table = np.concatenate(tables).astype(np.int64).reshape(-1, 7)
    by_receiver = np.argsort(table[:, 3], kind="stable")
    bounds = np.searchsorted(table[by_receiver, 3], np.arange(p + 1), side="left")
    return table, by_receiver, bounds
