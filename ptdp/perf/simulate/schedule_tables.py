"""A schedule's play codes (ptdp.perf.simulate.codes) made from arrays,
without building its actions: what the planner plays.

At p = 64 and m = 512 a schedule is hundreds of thousands of Compute,
Exchange and Transfer objects; building them and reading the codes off
them took most of a large search's time. The same codes come here from
each rank's computes as arrays (op, microbatch, chunk) and one table of
the transfers: rows (rank, slot, kind, microbatch, boundary, op, peer) in
the order the ranks' exchanges hold them, `slot` the compute an exchange
comes before (a rank's number of computes: after its last). The looped
kinds' table follows one_f_one_b.with_exchanges's rule (an exchange before
each step: the previous step's sends, then this step's receives); the
zero-bubble kinds' is zero_bubble.placed_transfers, placed for the
layout's costs as build_zero_bubble places them. A rank's actions are
made only when asked for (a plan's rows need its busiest rank's).
Tested equal to codes_of of the built schedule, field by field.
"""

from __future__ import annotations

import functools

import numpy as np

from ptdp.perf.simulate.codes import Codes
from ptdp.schedules.actions import Compute, Exchange, ScheduleError, Transfer
from ptdp.schedules.kinds import check_arguments, kind_named
from ptdp.schedules.one_f_one_b import (INTERLEAVED, forward_order, looped_steps,
                                        warmup_forwards, with_exchanges)
from ptdp.schedules.zero_bubble import (_order, _steps, chunks_of, costs_from_table,
                                        placed_transfers_for, unit_cost)

OPS = "FBW"
TRANSFER_KINDS = ("activation", "grad")
TRANSFER_OPS = ("recv", "send")
RANK, SLOT, KIND, MICROBATCH, BOUNDARY, OP, PEER = range(7)   # a table's rows


def planned_codes(kind: str, p: int, m: int, v: int, costs: tuple | None = None) -> Codes:
    """codes_of(build_schedule(kind, p, m, v, costs)), without the schedule.
    Zero-bubble costs that place every transfer alike give the same Codes
    object (as build_zero_bubble gives the same schedule)."""
    check_arguments(kind, p, m, v)
    if not kind_named(kind).splits_backward:
        return _looped_codes(kind, p, m, v)
    cost = costs_from_table(dict(costs)) if costs else unit_cost
    rows = placed_transfers_for(kind, p, m, cost)
    key = (kind, p, m, rows[:OP + 1].tobytes())
    codes = _PLACED.get(key)
    if codes is None:
        if len(_PLACED) >= 16:
            _PLACED.clear()
        codes = _PLACED[key] = _zero_bubble_codes(kind, p, m, rows)
    return codes


_PLACED: dict[tuple, Codes] = {}


def _looped_codes(kind: str, p: int, m: int, v: int) -> Codes:
    """gpipe, 1f1b and interleaved: each rank's computes (one_f_one_b's
    warm-up forwards, (forward, backward) pairs, remaining backwards) and
    with_exchanges' transfers, as arrays."""
    forwards = np.asarray(forward_order(kind, p, m, v), dtype=np.int64).reshape(-1, 2)
    backwards = forwards.copy()
    backwards[:, 1] = v - 1 - backwards[:, 1]
    total, last = len(forwards), p * v - 1
    computes, tables = [], []
    for rank in range(p):
        warmup = warmup_forwards(kind, p, m, v, rank)
        steady = total - warmup
        pairs = np.empty((2 * steady, 2), dtype=np.int64)
        pairs[0::2], pairs[1::2] = forwards[warmup:], backwards[:steady]
        microbatch_chunk = np.concatenate((forwards[:warmup], pairs, backwards[steady:]))
        op = np.concatenate((np.zeros(warmup, np.int64), np.tile([0, 1], steady),
                             np.ones(warmup, np.int64)))
        microbatch, chunk = microbatch_chunk[:, 0], microbatch_chunk[:, 1]
        computes.append((op, microbatch, chunk))
        # Each compute's step: its first compute, and the next step's.
        n = len(op)
        first = np.arange(n)
        if kind == INTERLEAVED:   # (forward, backward) pairs in the steady state
            first[warmup + 1:warmup + 2 * steady:2] -= 1
        following = first + 1
        if kind == INTERLEAVED:
            following[warmup:warmup + 2 * steady] += 1
        stage = chunk * p + rank
        before, after = (stage - 1) % p, (stage + 1) % p
        has_before = (stage > 0) & (before != rank)
        has_after = (stage < last) & (after != rank)
        forward = op == 0
        kinds = np.where(forward, 0, 1)
        # A compute's receive in the exchange before its step, its send in
        # the one after; there the sends come first, each part in compute order.
        recv = np.flatnonzero(np.where(forward, has_before, has_after))
        send = np.flatnonzero(np.where(forward, has_after, has_before))
        table = np.concatenate((
            np.stack((first[recv], kinds[recv], microbatch[recv],
                      np.where(forward, stage - 1, stage)[recv], np.zeros_like(recv),
                      np.where(forward, before, after)[recv], np.ones_like(recv), recv)),
            np.stack((following[send], kinds[send], microbatch[send],
                      np.where(forward, stage, stage - 1)[send], np.ones_like(send),
                      np.where(forward, after, before)[send], np.zeros_like(send), send))),
            axis=1)
        table = table[:, np.lexsort((table[7], table[6], table[0]))]
        tables.append(np.concatenate((np.full((1, table.shape[1]), rank), table[:6])))
    rows = np.concatenate(tables, axis=1) if tables else np.zeros((7, 0), np.int64)

    def actions(rank: int) -> tuple:
        return with_exchanges(looped_steps(kind, p, m, v, rank), rank, p, v)

    return _codes_from(f"{kind} p={p} m={m} v={v}", p, False, computes, rows, actions)


@functools.lru_cache(maxsize=8)
def _zero_bubble_computes(kind: str, p: int, m: int) -> tuple:
    """Each rank's zero-bubble computes as (op, microbatch, chunk) arrays."""
    computes = []
    for rank in range(p):
        steps = _steps(kind, p, m, rank)
        op = np.fromiter((OPS.index(step[0]) for step in steps), np.int64, len(steps))
        rest = np.asarray([step[1:] for step in steps], dtype=np.int64).reshape(-1, 2)
        computes.append((op, rest[:, 0], rest[:, 1]))
    return tuple(computes)


def _zero_bubble_codes(kind: str, p: int, m: int, rows: np.ndarray) -> Codes:
    """zb-h1 and zbv: their orders (zero_bubble._steps) and the transfers
    placed for a layout's costs."""
    # placed_transfers' columns are (rank, slot, kind, microbatch, boundary, op, peer)
    table = rows[[0, 1, 2, 3, 4, 5, 6]]
    starts = np.searchsorted(table[RANK], np.arange(p + 1))
    v = chunks_of(kind)

    def actions(rank: int) -> tuple:
        own = table[:, starts[rank]:starts[rank + 1]]
        exchanges: dict[int, list[Transfer]] = {}
        for slot, *rest in zip(own[SLOT].tolist(), own[KIND].tolist(), own[MICROBATCH].tolist(),
                               own[BOUNDARY].tolist(), own[OP].tolist(), own[PEER].tolist()):
            kind_, microbatch, boundary, op, peer = rest
            exchanges.setdefault(slot, []).append(Transfer(
                TRANSFER_OPS[op], TRANSFER_KINDS[kind_], microbatch, boundary, peer))
        out: list = []
        order = _order(kind, p, m, rank)
        for k in range(len(order) + 1):
            if k in exchanges:
                out.append(Exchange(tuple(exchanges[k])))
            if k < len(order):
                out.append(order[k])
        return tuple(out)

    return _codes_from(f"{kind} p={p} m={m} v={v}", p, True, list(_zero_bubble_computes(kind, p, m)),
                       table, actions)


def _codes_from(label: str, p: int, splits_backward: bool, computes: list, rows: np.ndarray,
                actions) -> Codes:
    """The Codes of each rank's computes ((op, microbatch, chunk) arrays)
    and the transfer table `rows` (columns RANK ... PEER, sorted by rank,
    then in the order of each rank's exchanges, an exchange's rows together)."""
    starts = np.searchsorted(rows[RANK], np.arange(p + 1))
    # Each row's exchange: where a (rank, slot) begins; each exchange's and
    # each compute's index among its rank's actions.
    opens = np.ones(rows.shape[1], dtype=bool)
    opens[1:] = (rows[RANK, 1:] != rows[RANK, :-1]) | (rows[SLOT, 1:] != rows[SLOT, :-1])
    row_action = np.empty(rows.shape[1], dtype=np.int64)
    ranks = []
    for rank, (op, microbatch, chunk) in enumerate(computes):
        a, b = starts[rank], starts[rank + 1]
        firsts = np.flatnonzero(opens[a:b])
        exchange_slots = rows[SLOT, a:b][firsts]
        exchange_action = exchange_slots + np.arange(len(firsts))
        row_action[a:b] = exchange_action[np.cumsum(opens[a:b]) - 1]
        compute_action = np.arange(len(op)) + np.searchsorted(exchange_slots, np.arange(len(op)),
                                                              side="right")
        ranks.append((firsts, exchange_action, compute_action))
    partner = _other_ends(rows)
    waited = (rows[OP] == 0) | (not splits_backward)
    other = list(zip(rows[RANK][partner].tolist(), row_action[partner].tolist()))
    waited, peers_of_rows = waited.tolist(), rows[PEER].tolist()
    ops_of_rows = rows[OP].tolist()
    codes = Codes(p, label, splits_backward, actions, [], [], [], [], [], [])
    for rank, (op, microbatch, chunk) in enumerate(computes):
        firsts, exchange_action, compute_action = ranks[rank]
        a, b = starts[rank], starts[rank + 1]
        length = len(op) + len(firsts)
        slots: list = [0] * length
        ends: list = [None] * length
        peers: list = [None] * length
        # computes: slots by (chunk, op, whether it is the first forward), first seen first
        first_forward = (op == 0) & (microbatch == 0)
        kind_key = (chunk * 3 + op) * 2 + first_forward
        _, seen_at, inverse = np.unique(kind_key, return_index=True, return_inverse=True)
        by_appearance = np.argsort(np.argsort(seen_at))
        compute_positions = compute_action.tolist()
        for position, slot in zip(compute_positions, by_appearance[inverse.ravel()].tolist()):
            slots[position] = slot
        kept_computes = [Compute(OPS[op[i]], int(microbatch[i]), int(chunk[i]))
                         for i in np.sort(seen_at).tolist()]
        # exchanges: slots by their transfers' (op, peer), first seen first
        seen: dict[tuple, int] = {}
        kept_exchanges: list[Exchange] = []
        bounds = (a + firsts).tolist() + [b]
        for e, position in enumerate(exchange_action.tolist()):
            lo, hi = bounds[e], bounds[e + 1]
            key = tuple(zip(ops_of_rows[lo:hi], peers_of_rows[lo:hi]))
            code = seen.get(key)
            if code is None:
                code = seen[key] = -1 - len(kept_exchanges)
                kept_exchanges.append(Exchange(tuple(
                    Transfer(TRANSFER_OPS[rows[OP, i]], TRANSFER_KINDS[rows[KIND, i]],
                             int(rows[MICROBATCH, i]), int(rows[BOUNDARY, i]),
                             int(rows[PEER, i])) for i in range(lo, hi))))
            slots[position] = code
            ends[position] = [other[i] for i in range(lo, hi) if waited[i]]
            peers[position] = tuple(peers_of_rows[lo:hi])
        codes.slots.append(slots)
        codes.ends.append(ends)
        codes.peers.append(peers)
        codes.compute_slots.append(kept_computes)
        codes.exchange_slots.append(kept_exchanges)
        codes.computes.append(compute_positions)
        codes.of_op.append({name: compute_action[op == k].tolist() for k, name in enumerate(OPS)})
        forwards = np.flatnonzero(op == 0)
        _, first_of_chunk = np.unique(chunk[forwards], return_index=True)
        codes.first_forwards.append(compute_action[forwards[np.sort(first_of_chunk)]].tolist())
        codes.released_chunks.append(chunk[op == (2 if splits_backward else 1)].tolist())
    return codes


def _other_ends(rows: np.ndarray) -> np.ndarray:
    """Each row's other end: the row of the same (kind, microbatch,
    boundary) and the other op. ScheduleError for a transfer without one."""
    order = np.lexsort((rows[OP], rows[BOUNDARY], rows[MICROBATCH], rows[KIND]))
    tags = rows[[KIND, MICROBATCH, BOUNDARY]][:, order]
    ops = rows[OP][order]
    paired = (len(order) % 2 == 0 and bool(np.all(tags[:, 0::2] == tags[:, 1::2]))
              and bool(np.all(ops[0::2] == 0)) and bool(np.all(ops[1::2] == 1)))
    if not paired:
        raise ScheduleError("a transfer has no other end in the schedule")
    partner = np.empty(len(order), dtype=np.int64)
    partner[order[0::2]], partner[order[1::2]] = order[1::2], order[0::2]
    return partner
