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

The planner places them without building the actions (placed_transfers_for):
the orders as numpy arrays (order_arrays), timed level by level of their
dataflow (_levels, _timed_levels) and the transfers placed by sorting one
table; bit for bit what the loops above give (tested).
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


def placed_transfers(kind: str, p: int, m: int, starts, ends) -> np.ndarray:
    """Where _with_timed_exchanges puts every transfer for these times (the
    flat `_timed` of the kind's orders): columns of rows (rank, slot (the
    exchange before the rank's compute `slot`; its number of computes:
    after the last), kind (activation 0, grad 1), microbatch, boundary, op
    (recv 0, send 1), peer), in the order the ranks' exchanges hold them,
    each exchange sorted by (time, kind, microbatch, boundary, op) as there."""
    return _placed(kind, p, m, np.asarray(starts, dtype=np.float64),
                   np.asarray(ends, dtype=np.float64))[0]


def placed_transfers_for(kind: str, p: int, m: int,
                         table: Mapping[tuple[int, int, str], float] | None = None
                         ) -> tuple[np.ndarray, np.ndarray]:
    """`placed_transfers` for computes that take table[(rank, chunk, op)]
    (None: one step each): where build_zero_bubble's schedule for those
    costs has its transfers, without building it; and each row's other
    end (the row of the same transfer's other op)."""
    durations = _durations(kind, p, m, table)
    if durations is None:   # costs the arrays may not add as Python does: its loop
        flat = _timed(_dataflow(kind, p, m), p, costs_from_table(table))
        starts, ends = (np.asarray(times, dtype=np.float64) for times in flat)
    else:
        starts, ends = _timed_levels(_levels(kind, p, m), durations)
    return _placed(kind, p, m, starts, ends)


def _durations(kind: str, p: int, m: int, table: Mapping | None) -> np.ndarray | None:
    """table[(rank, chunk, op)] at index (rank * v + chunk) * 3 + op (F 0, B
    1, W 2); None where float64 sums might not be the loop's (durations
    not Python floats or small ints, or negative: _levels drops the waits
    a rank's own order already implies, which needs ends that never fall)."""
    v = chunks_of(kind)
    if table is None:
        return np.ones(p * v * 3)
    values = [table[(rank, chunk, op)] for rank in range(p) for chunk in range(v) for op in "FBW"]
    exact = all(type(value) is float or type(value) is int for value in values)
    if not exact or not all(value >= 0 for value in values):
        return None
    if any(type(value) is int for value in values) and max(values) * 6 * p * m >= 2 ** 53:
        return None
    return np.array(values, dtype=np.float64)


def _placed(kind: str, p: int, m: int, starts: np.ndarray, ends: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray]:
    """placed_transfers' rows for flat start and end arrays, and each row's
    other end."""
    sends = _send_table(kind, p, m)
    offsets, count = _offsets(kind, p, m), len(sends.compute)
    produced = ends[sends.compute]
    # The receiver's exchange before its first compute starting at or after `produced`.
    received = np.empty(count, dtype=np.int64)
    for r in range(p):
        mine = sends.by_receiver[sends.receiver_bounds[r]:sends.receiver_bounds[r + 1]]
        received[mine] = np.searchsorted(starts[offsets[r]:offsets[r + 1]], produced[mine],
                                         side="left")
    # sender entries (op send = 1) in slot k + 1, receiver entries (op recv = 0)
    slot = np.concatenate((sends.rows[1, :count], received))
    rank = sends.rows[0]
    # sorted by (rank, slot, time, tag): one integer per row, the time as
    # its rank among the times (tags, and so the keys, are distinct)
    times, time_rank = np.unique(produced, return_inverse=True)
    slots = int(np.diff(offsets).max()) + 2   # (a slot is 0 ... a rank's number of computes)
    if p * slots * max(len(times), 1) * max(2 * count, 1) < 2 ** 62:
        time_rank = np.tile(time_rank.ravel(), 2)
        order = np.argsort(((rank * slots + slot) * len(times) + time_rank) * (2 * count)
                           + sends.tag)
    else:
        order = np.lexsort((sends.tag, np.tile(produced, 2), slot, rank))
    rows = np.take(sends.rows, order, axis=1)   # (several times rows[:, order]'s speed)
    rows[1] = slot[order]
    position = np.empty(2 * count, dtype=np.int64)
    position[order] = np.arange(2 * count)
    return rows, position[(order + count) % (2 * count)] if count else position


@dataclass(frozen=True)
class _Sends:
    """Every send of the kind's orders (_sends' in order): its compute's
    flat index, and the sends by receiver (where receiver r's start at
    receiver_bounds[r]); `rows`: placed_transfers' columns for the senders'
    entries, then the receivers' (slot: the sender's k + 1, the receiver's
    left to fill); `tag`: each entry's rank by (kind, microbatch, boundary,
    op)."""
    compute: np.ndarray
    by_receiver: np.ndarray
    receiver_bounds: np.ndarray
    rows: np.ndarray
    tag: np.ndarray


@functools.lru_cache(maxsize=8)
def _send_table(kind: str, p: int, m: int) -> _Sends:
    v, placement, offsets = chunks_of(kind), _placement(kind), _offsets(kind, p, m)
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
        tables.append(np.stack((np.full(len(k), rank), offsets[rank] + k, k, receiver[k],
                                1 - forward[k], microbatch[k],
                                np.where(forward, stage, stage - 1)[k])))
    # (sender, flat index, index on the sender, receiver, kind, microbatch, boundary)
    table = np.concatenate(tables, axis=1).astype(np.int64).reshape(7, -1)
    sender, compute, index, receiver, kind_, microbatch, boundary = table
    by_receiver = np.argsort(receiver, kind="stable")
    bounds = np.searchsorted(receiver[by_receiver], np.arange(p + 1), side="left")
    tags = np.empty(len(compute), dtype=np.int64)
    tags[np.lexsort((boundary, microbatch, kind_))] = np.arange(len(compute))
    op = np.repeat([1, 0], len(compute))
    rows = np.stack((np.concatenate((sender, receiver)),
                     np.concatenate((index + 1, np.zeros_like(index))),
                     np.tile(kind_, 2), np.tile(microbatch, 2), np.tile(boundary, 2), op,
                     np.concatenate((receiver, sender))))
    return _Sends(compute, by_receiver, bounds, rows, 2 * np.tile(tags, 2) + op)


@functools.lru_cache(maxsize=8)
def order_arrays(kind: str, p: int, m: int
                 ) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]:
    """Each rank's computes in schedule order as (op (F 0, B 1, W 2),
    microbatch, chunk) arrays: _zb_h1_steps' and _zbv_steps' orders, made
    phase by phase (tested equal), without a Compute or tuple per step."""
    arrays = []
    for rank in range(p):
        steps = (_zbv_codes if kind == ZBV else _zb_h1_codes)(p, m, rank)
        # each step's microbatch: how many steps of its (op, chunk) come before it
        by_step = np.argsort(steps, kind="stable")
        sorted_steps = steps[by_step]
        microbatch = np.empty(len(steps), dtype=np.int64)
        microbatch[by_step] = np.arange(len(steps)) - np.searchsorted(sorted_steps, sorted_steps)
        arrays.append((steps // 2, microbatch, steps % 2))
    return tuple(arrays)


# A step in the arrays below: op * 2 + chunk.
_F0, _F1, _B0, _B1, _W0, _W1 = range(6)


def _zb_h1_codes(p: int, m: int, rank: int) -> np.ndarray:
    """_zb_h1_steps' (op, chunk) steps: the warm-up's forwards; per
    microbatch i its B, a W from i = rank on, an F while forwards remain;
    the W's left."""
    warmup, i = min(p - rank, m), np.arange(m)
    kept = np.stack((np.ones(m, dtype=bool), i >= rank, i < m - warmup), axis=1)
    rounds = np.tile(np.array([_B0, _W0, _F0], dtype=np.int64), (m, 1))[kept]
    return np.concatenate((np.full(warmup, _F0), rounds, np.full(min(rank, m), _W0)))


def _zbv_codes(p: int, m: int, rank: int) -> np.ndarray:
    """_zbv_steps' (op, chunk) steps, phase by phase, its loop's rounds
    counted: those with a chunk-0 forward (while one remains), then those
    while chunk 1's forwards lag."""
    forwards_0, forwards_1 = 2 * (p - rank) - 1 + rank, p   # after the warm-up
    with_forward = max(0, m - forwards_0)
    lagging = max(0, forwards_0 - forwards_1)   # (a round adds one forward of each chunk)
    steps = np.concatenate([np.tile(np.array(phase, dtype=np.int64), count) for phase, count in (
        ([_F0], 2 * (p - rank) - 1), ([_F1, _F0], rank), ([_F1, _B1, _W1], p - rank),
        ([_F0, _B0, _W0, _F1, _B1, _W1], with_forward), ([_B0, _W0, _F1, _B1, _W1], lagging),
        ([_B0, _B1], rank), ([_B0, _W0], p - rank))])
    count = np.bincount(steps, minlength=6)
    return np.concatenate((steps, np.full(count[_B1] - count[_W1], _W1),
                           np.full(count[_B0] - count[_W0], _W0)))


@functools.lru_cache(maxsize=8)
def _offsets(kind: str, p: int, m: int) -> np.ndarray:
    """Where each rank's computes start in the flat order (rank after rank)."""
    lengths = [len(op) for op, _, _ in order_arrays(kind, p, m)]
    return np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)


@dataclass(frozen=True)
class _Levels:
    """The kind's orders as levels, for timing them in numpy: a compute's
    level is one more than the highest of the computes it waits for (its
    rank's previous one, and the one on another rank it needs), so a
    level's computes can be timed together once the levels before it are.
    `order`: the flat indices level after level, level k at
    order[bounds[k]:bounds[k + 1]]; `previous` and `waited`: per place in
    `order`, the places of those two computes (len(order): none);
    `duration_of`: each flat compute's (rank * v + chunk) * 3 + op."""
    order: np.ndarray
    bounds: list[int]
    previous: np.ndarray
    waited: np.ndarray
    duration_of: np.ndarray


@functools.lru_cache(maxsize=8)
def _levels(kind: str, p: int, m: int) -> _Levels:
    """The dataflow of _dataflow_of for the kind's orders, as levels. The
    needs on the compute's own rank (B its F, W its B, and across the V's
    turn) come before it in its order, so they end by its previous
    compute's end: only the need on another rank is kept."""
    v, placement, offsets = chunks_of(kind), _placement(kind), _offsets(kind, p, m)
    op, microbatch, chunk = (np.concatenate(column) for column in zip(*order_arrays(kind, p, m)))
    count, last = len(op), p * v - 1
    rank = np.repeat(np.arange(p), np.diff(offsets))
    stages = np.array([[placement.stage(p, v, r, c) for c in range(v)] for r in range(p)])
    stage = stages[rank, chunk]
    position = np.full((3, p * v, m), -1, dtype=np.int64)   # (op, stage, microbatch) -> flat index
    position[op, stage, microbatch] = np.arange(count)
    deadlock = ScheduleError(f"{kind} p={p} m={m}: the orders deadlock")
    # F waits for the forward before it, B for its F and the backward after it, W for its B
    other = op != 2
    other[other] = np.where(op[other] == 0, stage[other] > 0, stage[other] < last)
    needed = np.full(count, count)
    needed[other] = position[op[other], np.where(op[other] == 0, -1, 1) + stage[other],
                             microbatch[other]]
    backward = op > 0
    own = np.full(count, -1)
    own[backward] = position[op[backward] - 1, stage[backward], microbatch[backward]]
    flat = np.arange(count)
    if np.any(needed < 0) or np.any(backward & ((own < 0) | (own >= flat))):
        raise deadlock
    same_rank = other.copy()
    same_rank[other] = rank[needed[other]] == rank[other]
    if np.any(needed[same_rank] >= flat[same_rank]):
        raise deadlock
    needed[same_rank] = count
    order, bounds = _level_order(offsets, needed, deadlock)
    place = np.empty(count + 1, dtype=np.int64)
    place[order], place[count] = np.arange(count), count
    previous = np.where(flat == offsets[rank], count, flat - 1)
    return _Levels(order, bounds, place[previous[order]], place[needed[order]],
                   (rank * v + chunk) * 3 + op)


def _level_order(offsets: np.ndarray, needed: np.ndarray, deadlock: ScheduleError
                 ) -> tuple[np.ndarray, list[int]]:
    """The flat computes level after level, and where each level starts:
    each round takes every rank's next compute whose need (`needed`; its
    length: none) an earlier round took."""
    count = len(needed)
    # (index count: no need, taken before every round; a finished rank's
    # next compute is count + 1, whose need count + 2 is never taken)
    level = np.full(count + 3, count, dtype=np.int64)
    level[count] = -1
    needed = np.concatenate((needed, [count, count + 2]))
    after = np.arange(1, count + 3)
    after[offsets[1:] - 1] = count + 1
    after[count + 1] = count + 1
    following = np.where(offsets[:-1] < offsets[1:], offsets[:-1], count + 1)
    taken, left = [], count
    while left:
        ready = level[needed[following]] < len(taken)
        moved = following[ready]
        if not len(moved):
            raise deadlock
        level[moved] = len(taken)
        taken.append(moved)
        left -= len(moved)
        following = np.where(ready, after[following], following)
    bounds = np.concatenate(([0], np.cumsum([len(level_) for level_ in taken]))).tolist()
    return (np.concatenate(taken) if taken else np.zeros(0, dtype=np.int64)), bounds


def _timed_levels(levels: _Levels, durations: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`_timed`'s starts and ends as flat float64 arrays, level by level:
    each the max of the two ends it waits for (0.0: none) plus its
    duration, the operations the loop does, so bit for bit its times."""
    count = len(levels.order)
    work = durations[levels.duration_of[levels.order]]
    starts, ends = np.empty(count), np.zeros(count + 1)
    previous, waited = levels.previous, levels.waited
    for lo, hi in zip(levels.bounds, levels.bounds[1:]):
        start = np.maximum(ends[previous[lo:hi]], ends[waited[lo:hi]])
        starts[lo:hi] = start
        np.add(start, work[lo:hi], out=ends[lo:hi])
    flat_starts, flat_ends = np.empty(count), np.empty(count)
    flat_starts[levels.order], flat_ends[levels.order] = starts, ends[:count]
    return flat_starts, flat_ends
