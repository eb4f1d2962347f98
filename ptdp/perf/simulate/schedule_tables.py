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

import numpy as np

from ptdp.perf.simulate.codes import Codes
from ptdp.schedules.actions import Compute, Exchange, ScheduleError, Transfer
from ptdp.schedules.kinds import check_arguments, kind_named
from ptdp.schedules.one_f_one_b import (INTERLEAVED, forward_order, looped_steps,
                                        warmup_forwards, with_exchanges)
from ptdp.schedules.zero_bubble import (_order, chunks_of, costs_from_table, order_arrays,
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


def _zero_bubble_codes(kind: str, p: int, m: int, rows: np.ndarray) -> Codes:
    """zb-h1 and zbv: their orders (zero_bubble.order_arrays) and the
    transfers placed for a layout's costs (`rows`: placed_transfers')."""
    starts = np.searchsorted(rows[RANK], np.arange(p + 1))

    def actions(rank: int) -> tuple:
        a, b = starts[rank], starts[rank + 1]
        # (each exchange's first row: where the slot changes; slots are >= 0)
        opens = (a + np.flatnonzero(np.diff(rows[SLOT, a:b], prepend=-1))).tolist()
        exchanges = {int(rows[SLOT, lo]): _exchange(rows, lo, hi)
                     for lo, hi in zip(opens, opens[1:] + [b])}
        out: list = []
        order = _order(kind, p, m, rank)
        for k in range(len(order) + 1):
            if k in exchanges:
                out.append(exchanges[k])
            if k < len(order):
                out.append(order[k])
        return tuple(out)

    return _codes_from(f"{kind} p={p} m={m} v={chunks_of(kind)}", p, True,
                       list(order_arrays(kind, p, m)), rows, actions)


def _codes_from(label: str, p: int, splits_backward: bool, computes: list, rows: np.ndarray,
                actions) -> Codes:
    """The Codes of each rank's computes ((op, microbatch, chunk) arrays)
    and the transfer table `rows` (columns RANK ... PEER, sorted by rank,
    then in the order of each rank's exchanges, an exchange's rows together),
    with the flat arrays level_times reads (`flat_slot`, `flat_ends`)."""
    starts = np.searchsorted(rows[RANK], np.arange(p + 1))
    # Each row's exchange: where a (rank, slot) begins; each exchange's and
    # each compute's index among its rank's actions.
    opens = np.ones(rows.shape[1], dtype=bool)
    opens[1:] = (rows[RANK, 1:] != rows[RANK, :-1]) | (rows[SLOT, 1:] != rows[SLOT, :-1])
    firsts = np.flatnonzero(opens)                  # each exchange's first row
    exchange_of_row = np.cumsum(opens) - 1
    exchange_action = np.empty(len(firsts), dtype=np.int64)
    exchange_bounds = np.searchsorted(firsts, starts)   # each rank's exchanges
    compute_actions, lengths = [], []
    for rank, (op, _, _) in enumerate(computes):
        e0, e1 = exchange_bounds[rank], exchange_bounds[rank + 1]
        slots = rows[SLOT, firsts[e0:e1]]
        exchange_action[e0:e1] = slots + np.arange(e1 - e0)
        compute_actions.append(np.arange(len(op)) + np.searchsorted(slots, np.arange(len(op)),
                                                                    side="right"))
        lengths.append(len(op) + e1 - e0)
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    row_action = exchange_action[exchange_of_row]
    exchange_codes = _exchange_codes(rows, firsts, exchange_bounds, p)
    # The other ends each exchange waits for (its receives' senders; under
    # the kinds that do not split the backward its sends' receivers too).
    partner = _other_ends(rows)
    waited = np.flatnonzero((rows[OP] == 0) | (not splits_backward))
    other_rank, other_action = rows[RANK, partner[waited]], row_action[partner[waited]]
    taken = np.concatenate(([0], np.cumsum(np.bincount(exchange_of_row[waited],
                                                       minlength=len(firsts)))))
    column = np.arange(len(waited)) - taken[exchange_of_row[waited]] + 1
    flat_ends = (offsets[rows[RANK, waited]] + row_action[waited], column,
                 np.where(other_action > 0, offsets[other_rank] + other_action - 1, -1))
    other = list(zip(other_rank.tolist(), other_action.tolist()))
    taken, peers_of_rows = taken.tolist(), rows[PEER].tolist()
    row_bounds = firsts.tolist() + [rows.shape[1]]
    codes = Codes(p, label, splits_backward, actions, [], [], [], [], [], [])
    flat_slot = np.empty(int(offsets[-1]), dtype=np.int64)
    for rank, (op, microbatch, chunk) in enumerate(computes):
        compute_action = compute_actions[rank]
        e0, e1 = exchange_bounds[rank], exchange_bounds[rank + 1]
        positions = exchange_action[e0:e1].tolist()
        slots = flat_slot[offsets[rank]:offsets[rank + 1]]
        # computes: slots by (chunk, op, whether it is the first forward), first seen first
        first_forward = (op == 0) & (microbatch == 0)
        _, seen_at, inverse = np.unique((chunk * 3 + op) * 2 + first_forward,
                                        return_index=True, return_inverse=True)
        slots[compute_action] = np.argsort(np.argsort(seen_at))[inverse.ravel()]
        slots[exchange_action[e0:e1]] = exchange_codes[e0:e1]
        codes.compute_slots.append([Compute(OPS[op[i]], int(microbatch[i]), int(chunk[i]))
                                    for i in np.sort(seen_at).tolist()])
        kept = np.flatnonzero(np.concatenate(([True], exchange_codes[e0 + 1:e1] <
                                              np.minimum.accumulate(exchange_codes[e0:e1 - 1])))
                              ) if e1 > e0 else []
        codes.exchange_slots.append([_exchange(rows, row_bounds[e0 + e], row_bounds[e0 + e + 1])
                                     for e in kept])
        ends: list = [None] * lengths[rank]
        peers: list = [None] * lengths[rank]
        for e, position in zip(range(e0, e1), positions):
            ends[position] = other[taken[e]:taken[e + 1]]
            peers[position] = tuple(peers_of_rows[row_bounds[e]:row_bounds[e + 1]])
        codes.slots.append(slots.tolist())
        codes.ends.append(ends)
        codes.peers.append(peers)
        codes.computes.append(compute_action.tolist())
        codes.of_op.append({name: compute_action[op == k].tolist() for k, name in enumerate(OPS)})
        forwards = np.flatnonzero(op == 0)
        _, first_of_chunk = np.unique(chunk[forwards], return_index=True)
        codes.first_forwards.append(compute_action[forwards[np.sort(first_of_chunk)]].tolist())
        codes.released_chunks.append(chunk[op == (2 if splits_backward else 1)].tolist())
    codes.flat_slot, codes.flat_ends = flat_slot, flat_ends
    return codes


def _exchange_codes(rows: np.ndarray, firsts: np.ndarray, exchange_bounds: np.ndarray,
                    p: int) -> np.ndarray:
    """Each exchange's slot code: -1 - k for the k-th distinct sequence of
    its transfers' (op, peer) among its rank's exchanges, first seen first."""
    count = len(firsts)
    if not count:
        return np.zeros(0, dtype=np.int64)
    sizes = np.diff(np.append(firsts, rows.shape[1]))
    keys = np.zeros((count, 1 + int(sizes.max())), dtype=np.int64)
    keys[:, 0] = rows[RANK, firsts]
    exchange_of_row = np.repeat(np.arange(count), sizes)
    keys[exchange_of_row, 1 + np.arange(rows.shape[1]) - firsts[exchange_of_row]] = (
        1 + rows[OP] * p + rows[PEER])
    base = 2 * p + 1   # (a transfer's code is 1 ... 2p, 0 pads)
    if (p + 1) * float(base) ** (keys.shape[1] - 1) < 2.0 ** 62:   # one integer per key
        packed = keys[:, 0]
        for column in range(1, keys.shape[1]):
            packed = packed * base + keys[:, column]
        _, seen_at, inverse = np.unique(packed, return_index=True, return_inverse=True)
    else:
        _, seen_at, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    # the distinct keys in order of appearance; a rank's first is its code -1
    appearance = np.sort(seen_at)
    ordinal = np.arange(len(appearance)) - np.searchsorted(
        appearance, exchange_bounds[np.searchsorted(exchange_bounds, appearance, side="right") - 1])
    code_of_key = np.empty(len(seen_at), dtype=np.int64)
    code_of_key[np.argsort(seen_at)] = -1 - ordinal
    return code_of_key[inverse.ravel()]


def _exchange(rows: np.ndarray, lo: int, hi: int) -> Exchange:
    """The Exchange of table rows lo..hi."""
    return Exchange(tuple(Transfer(TRANSFER_OPS[rows[OP, i]], TRANSFER_KINDS[rows[KIND, i]],
                                   int(rows[MICROBATCH, i]), int(rows[BOUNDARY, i]),
                                   int(rows[PEER, i])) for i in range(lo, hi)))


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
