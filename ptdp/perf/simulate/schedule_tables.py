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

import contextlib
import functools
import gc

import numpy as np

from ptdp.perf.simulate.codes import Codes, RowsOnDemand
from ptdp.schedules.actions import Compute, Exchange, ScheduleError, Transfer
from ptdp.schedules.kinds import check_arguments, kind_named
from ptdp.schedules.one_f_one_b import (INTERLEAVED, forward_order, looped_steps,
                                        warmup_forwards, with_exchanges)
from ptdp.schedules.zero_bubble import _order, chunks_of, order_arrays, placed_transfers_for

OPS = "FBW"
TRANSFER_KINDS = ("activation", "grad")
TRANSFER_OPS = ("recv", "send")
RANK, SLOT, KIND, MICROBATCH, BOUNDARY, OP, PEER = range(7)   # a table's rows


def planned_codes(kind: str, p: int, m: int, v: int, costs: tuple | None = None) -> Codes:
    """codes_of(build_schedule(kind, p, m, v, costs)), without the schedule.
    Zero-bubble costs that place every transfer alike give the same Codes
    object (as build_zero_bubble gives the same schedule)."""
    check_arguments(kind, p, m, v)
    with _collector_paused():
        if not kind_named(kind).splits_backward:
            return _looped_codes(kind, p, m, v)
        return _placed_codes(kind, p, m, costs)


@contextlib.contextmanager
def _collector_paused():
    """The cyclic garbage collector off while the codes' lists are made: a
    large schedule's are ~10^5 lists and tuples (of ints, in no cycle), and
    making them set off collections that scan every object the process
    holds (its earlier codes among them), about half of a p = 64, m = 512
    zbv's codes time. (ptdp plan runs without the collector throughout; a
    simulate() of one layout, a test or a bench does not.)"""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _placed_codes(kind: str, p: int, m: int, costs: tuple | None) -> Codes:
    """zb-h1 and zbv: the codes of the transfers placed for `costs`, one
    Codes for the costs that place them alike."""
    rows, partner = placed_transfers_for(kind, p, m, dict(costs) if costs else None)
    key = (kind, p, m, rows[:OP + 1].tobytes())
    codes = _PLACED.get(key)
    if codes is None:
        if len(_PLACED) >= 16:
            _PLACED.clear()
        codes = _PLACED[key] = _zero_bubble_codes(kind, p, m, rows, partner)
    return codes


_PLACED: dict[tuple, Codes] = {}


def _looped_codes(kind: str, p: int, m: int, v: int) -> Codes:
    """gpipe, 1f1b and interleaved: each rank's computes (one_f_one_b's
    warm-up forwards, (forward, backward) pairs, remaining backwards) and
    with_exchanges' transfers, as arrays (a row per rank)."""
    forwards = np.asarray(forward_order(kind, p, m, v), dtype=np.int64).reshape(-1, 2)
    backwards = forwards.copy()
    backwards[:, 1] = v - 1 - backwards[:, 1]
    total, last = len(forwards), p * v - 1
    rank = np.arange(p)[:, None]
    warmup = np.array([warmup_forwards(kind, p, m, v, r) for r in range(p)])[:, None]
    steady = total - warmup
    i = np.arange(2 * total)[None, :]   # (every rank has each microbatch's F and B per chunk)
    paired = (i >= warmup) & (i < warmup + 2 * steady)
    op = np.where(i < warmup, 0, np.where(paired, (i - warmup) % 2, 1))
    forward = op == 0
    # which forward or backward: the warm-up's, the pair's, the rest's
    pair_index = (i - warmup) // 2 + np.where(forward, warmup, 0)
    index = np.where(i < warmup, i, np.where(paired, pair_index, i - warmup - steady))
    microbatch = np.where(forward, forwards[index, 0], backwards[index, 0])
    chunk = np.where(forward, forwards[index, 1], backwards[index, 1])
    # Each compute's step: its first compute, and the next step's.
    first = np.repeat(i, p, axis=0)
    if kind == INTERLEAVED:   # (forward, backward) pairs in the steady state
        first -= paired & ((i - warmup) % 2 == 1)
    following = first + 1
    if kind == INTERLEAVED:
        following += paired
    stage = chunk * p + rank
    before, after = (stage - 1) % p, (stage + 1) % p
    has_before = (stage > 0) & (before != rank)
    has_after = (stage < last) & (after != rank)
    # A compute's receive in the exchange before its step, its send in
    # the one after; there the sends come first, each part in compute order.
    recv = np.nonzero(np.where(forward, has_before, has_after))
    send = np.nonzero(np.where(forward, has_after, has_before))
    kinds, ranks = np.where(forward, 0, 1), np.broadcast_to(rank, op.shape)
    # the table's columns (RANK ... PEER): the receives' values, then the sends'
    columns = [np.concatenate((at_receive[recv], at_send[send])) for at_receive, at_send in (
        (ranks, ranks), (first, following), (kinds, kinds), (microbatch, microbatch),
        (np.where(forward, stage - 1, stage), np.where(forward, stage, stage - 1)),
        (np.zeros_like(op), np.ones_like(op)),
        (np.where(forward, before, after), np.where(forward, after, before)))]
    compute = np.concatenate((recv[1], send[1]))
    width = 2 * total + 2
    order = np.argsort(((columns[RANK] * width + columns[SLOT]) * 2 + 1 - columns[OP]) * width
                       + compute)
    rows = np.take(np.stack(columns), order, axis=1)

    def actions(rank: int) -> tuple:
        return with_exchanges(looped_steps(kind, p, m, v, rank), rank, p, v)

    return _codes_from(f"{kind} p={p} m={m} v={v}", p, False,
                       [(op[r], microbatch[r], chunk[r]) for r in range(p)], rows, actions)


def _zero_bubble_codes(kind: str, p: int, m: int, rows: np.ndarray, partner: np.ndarray
                       ) -> Codes:
    """zb-h1 and zbv: their orders (zero_bubble.order_arrays) and the
    transfers placed for a layout's costs (`rows` and each row's other end,
    `partner`: placed_transfers_for's)."""
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
                       list(order_arrays(kind, p, m)), rows, actions, partner)


def _codes_from(label: str, p: int, splits_backward: bool, computes: list, rows: np.ndarray,
                actions, partner: np.ndarray | None = None) -> Codes:
    """The Codes of each rank's computes ((op, microbatch, chunk) arrays)
    and the transfer table `rows` (columns RANK ... PEER, sorted by rank,
    then in the order of each rank's exchanges, an exchange's rows together),
    with the flat arrays level_times reads (`flat_slot`, `flat_ends`).
    `partner`: each row's other end, where the table's maker knows it.
    Every rank at once: each list is one slice of a list made for all."""
    op, microbatch, chunk = (np.concatenate(column) for column in zip(*computes))
    places = _Places(rows, [len(column) for column, _, _ in computes])
    offsets, compute_rank = places.offsets, places.compute_rank
    compute_action = places.compute_action
    exchange_codes, kept = _exchange_codes(rows, places.firsts, places.exchange_bounds, p)
    flat_slot = np.empty(int(offsets[-1]), dtype=np.int64)
    compute_at = offsets[compute_rank] + compute_action
    exchange_at = offsets[places.exchange_rank] + places.exchange_action
    # computes: slots by (chunk, op, whether it is the first forward), first seen first
    kinds = (int(chunk.max()) + 1 if len(chunk) else 1) * 6
    compute_key = compute_rank * kinds + (chunk * 3 + op) * 2 + ((op == 0) & (microbatch == 0))
    seen, seen_bounds, compute_slot = _first_seen(compute_key, compute_rank, p)
    flat_slot[compute_at], flat_slot[exchange_at] = compute_slot, exchange_codes
    codes = Codes(p, label, splits_backward, actions, [], [], [], [], [], [])
    codes.flat_slot = flat_slot
    codes.flat_ends, waited_ends = _ends(rows, places, splits_backward, partner)
    kept_bounds = np.searchsorted(places.exchange_rank[kept], np.arange(p + 1)).tolist()
    row_bounds = np.append(places.firsts, rows.shape[1])
    kept_rows = np.stack((row_bounds[kept], row_bounds[kept + 1]), axis=1).tolist()
    slots = flat_slot.tolist()
    # computes by (rank, op), in order (small keys: np.argsort's radix sort)
    rank_op = (compute_rank * 3 + op).astype(np.int16 if 3 * p < 2 ** 15 else np.int64)
    by_op = np.argsort(rank_op, kind="stable")
    op_bounds = np.searchsorted(rank_op[by_op], np.arange(3 * p + 1)).tolist()
    of_op = compute_action[by_op].tolist()
    actions_of = compute_action.tolist()
    # each rank's first forward of each chunk, in the order they come
    forwards = np.flatnonzero(op == 0)
    _, first_of_chunk = np.unique(compute_rank[forwards] * kinds + chunk[forwards],
                                  return_index=True)
    firsts = np.sort(forwards[first_of_chunk])
    first_bounds = np.searchsorted(compute_rank[firsts], np.arange(p + 1)).tolist()
    firsts = compute_action[firsts].tolist()
    released = np.flatnonzero(op == (2 if splits_backward else 1))
    released_bounds = np.searchsorted(compute_rank[released], np.arange(p + 1)).tolist()
    released = chunk[released].tolist()
    compute_bounds = places.compute_bounds.tolist()
    offsets = offsets.tolist()
    seen_computes = [Compute(OPS[k], i, c) for k, i, c in
                     zip(op[seen].tolist(), microbatch[seen].tolist(), chunk[seen].tolist())]
    for rank in range(p):
        a, b = offsets[rank], offsets[rank + 1]
        codes.slots.append(slots[a:b])
        kept_here = kept_rows[kept_bounds[rank]:kept_bounds[rank + 1]]
        codes.computes.append(actions_of[compute_bounds[rank]:compute_bounds[rank + 1]])
        codes.of_op.append({name: of_op[op_bounds[3 * rank + k]:op_bounds[3 * rank + k + 1]]
                            for k, name in enumerate(OPS)})
        codes.compute_slots.append(seen_computes[seen_bounds[rank]:seen_bounds[rank + 1]])
        codes.exchange_slots.append([_exchange(rows, lo, hi) for lo, hi in kept_here])
        codes.first_forwards.append(firsts[first_bounds[rank]:first_bounds[rank + 1]])
        codes.released_chunks.append(released[released_bounds[rank]:released_bounds[rank + 1]])
    # Each action's other ends and peers (a compute's None), per rank when
    # first read: a large schedule's plays read the flat arrays only.
    exchange_bounds = places.exchange_bounds.tolist()

    def ends_of(rank: int) -> list:
        row: list = [None] * (offsets[rank + 1] - offsets[rank])
        first, last = exchange_bounds[rank], exchange_bounds[rank + 1]
        taken, other_rank, other_action = waited_ends
        cuts = (taken[first:last + 1] - taken[first]).tolist()
        lo, hi = int(taken[first]), int(taken[last])
        pairs = list(zip(other_rank[lo:hi].tolist(), other_action[lo:hi].tolist()))
        for k, action in enumerate(places.exchange_action[first:last].tolist()):
            row[action] = pairs[cuts[k]:cuts[k + 1]]
        return row

    def peers_of(rank: int) -> list:
        # by its slot: None for a compute's (0 ...), the k-th exchange
        # code's peers at -1 - k
        kept_here = kept_rows[kept_bounds[rank]:kept_bounds[rank + 1]]
        of_slot = [None] * (seen_bounds[rank + 1] - seen_bounds[rank]) + [
            tuple(rows[PEER, lo:hi].tolist()) for lo, hi in reversed(kept_here)]
        return list(map(of_slot.__getitem__, codes.slots[rank]))

    codes.ends = RowsOnDemand([functools.partial(ends_of, rank) for rank in range(p)])
    codes.peers = RowsOnDemand([functools.partial(peers_of, rank) for rank in range(p)])
    return codes


class _Places:
    """Where a table's exchanges and the ranks' computes fall among the
    ranks' actions: each exchange's first row (`firsts`), each row's
    exchange, each rank's first exchange (`exchange_bounds`) and first
    compute (`compute_bounds`), each exchange's and each compute's rank and
    index among its rank's actions, and where each rank's actions start
    in the flat order (`offsets`)."""

    def __init__(self, rows: np.ndarray, compute_counts: list[int]):
        p = len(compute_counts)
        opens = np.ones(rows.shape[1], dtype=bool)
        opens[1:] = (rows[RANK, 1:] != rows[RANK, :-1]) | (rows[SLOT, 1:] != rows[SLOT, :-1])
        self.firsts = np.flatnonzero(opens)
        self.exchange_of_row = np.cumsum(opens) - 1
        self.exchange_rank = rows[RANK, self.firsts]
        self.exchange_bounds = np.searchsorted(self.exchange_rank, np.arange(p + 1))
        exchange_slot = rows[SLOT, self.firsts]
        self.exchange_action = (exchange_slot + np.arange(len(self.firsts))
                                - self.exchange_bounds[self.exchange_rank])
        self.compute_bounds = np.concatenate(([0], np.cumsum(compute_counts))).astype(np.int64)
        self.compute_rank = np.repeat(np.arange(p), compute_counts)
        index = np.arange(int(self.compute_bounds[-1])) - self.compute_bounds[self.compute_rank]
        # a compute's index: its own, plus its rank's exchanges before it
        # (slot <= its index; (rank, slot) increase along the table)
        width = max(compute_counts, default=0) + 2
        before = np.searchsorted(self.exchange_rank * width + exchange_slot,
                                 self.compute_rank * width + index, side="right")
        self.compute_action = index + before - self.exchange_bounds[self.compute_rank]
        lengths = np.asarray(compute_counts, dtype=np.int64) + np.diff(self.exchange_bounds)
        self.offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)


def _first_seen(key: np.ndarray, rank: np.ndarray, p: int) -> tuple[np.ndarray, list, np.ndarray]:
    """Per distinct key (rank-major keys, `rank` each one's rank): its
    first index, in order of first appearance (so rank after rank); where
    each rank's start among them; and each element's key's ordinal among its
    rank's keys, first seen first."""
    if len(key) and 0 <= key.min() and key.max() < 2 ** 15:   # (np.unique's sort: radix)
        key = key.astype(np.int16)
    _, seen_at, inverse = np.unique(key, return_index=True, return_inverse=True)
    by_appearance = np.argsort(seen_at)
    seen = seen_at[by_appearance]
    bounds = np.searchsorted(rank[seen], np.arange(p + 1))
    ordinal = np.empty(len(seen_at), dtype=np.int64)
    ordinal[by_appearance] = np.arange(len(seen)) - bounds[rank[seen]]
    return seen, bounds.tolist(), ordinal[inverse.ravel()]


def _ends(rows: np.ndarray, places: _Places, splits_backward: bool,
          partner: np.ndarray | None) -> tuple[tuple, tuple]:
    """The other ends each exchange waits for (its receives' senders; under
    the kinds that do not split the backward its sends' receivers too): as
    levels.ends_table's arrays, and as (where each exchange's ends start,
    in exchange order, then their ranks and actions), from which a rank's
    lists of (rank, action) are made."""
    if partner is None:
        partner = _other_ends(rows)
    offsets, exchange_of_row = places.offsets, places.exchange_of_row
    row_action = places.exchange_action[exchange_of_row]
    waited = np.flatnonzero((rows[OP] == 0) | (not splits_backward))
    other_rank, other_action = rows[RANK, partner[waited]], row_action[partner[waited]]
    taken = np.concatenate(([0], np.cumsum(np.bincount(exchange_of_row[waited],
                                                       minlength=len(places.firsts)))))
    column = np.arange(len(waited)) - taken[exchange_of_row[waited]] + 1
    flat_ends = (offsets[rows[RANK, waited]] + row_action[waited], column,
                 np.where(other_action > 0, offsets[other_rank] + other_action - 1, -1))
    return flat_ends, (taken, other_rank, other_action)


def _exchange_codes(rows: np.ndarray, firsts: np.ndarray, exchange_bounds: np.ndarray,
                    p: int) -> tuple[np.ndarray, np.ndarray]:
    """Each exchange's slot code: -1 - k for the k-th distinct sequence of
    its transfers' (op, peer) among its rank's exchanges, first seen first;
    and the first exchange of each code, rank after rank, by k."""
    count = len(firsts)
    if not count:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
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
    return code_of_key[inverse.ravel()], appearance


def _exchange(rows: np.ndarray, lo: int, hi: int) -> Exchange:
    """The Exchange of table rows lo..hi."""
    return Exchange(tuple(Transfer(TRANSFER_OPS[op], TRANSFER_KINDS[kind], microbatch, boundary,
                                   peer) for _, _, kind, microbatch, boundary, op, peer
                          in rows[:, lo:hi].T.tolist()))


def _other_ends(rows: np.ndarray) -> np.ndarray:
    """Each row's other end: the row of the same (kind, microbatch,
    boundary) and the other op. ScheduleError for a transfer without one."""
    tags = rows[[KIND, MICROBATCH, BOUNDARY]]
    sizes = tags.max(axis=1) + 1 if len(rows[OP]) else None
    if sizes is not None and tags.min() >= 0 and 2.0 * float(np.prod(sizes)) < 2.0 ** 62:
        # one integer per row, sorted once
        key = ((tags[0] * sizes[1] + tags[1]) * sizes[2] + tags[2]) * 2 + rows[OP]
        order = np.argsort(key)
        # (a pair: a tag's receive, key 2k, then its send, 2k + 1)
        keys = key[order]
        paired = (len(order) % 2 == 0 and bool(np.all(keys[0::2] % 2 == 0))
                  and bool(np.all(keys[1::2] == keys[0::2] + 1)))
    else:
        order = np.lexsort((rows[OP], rows[BOUNDARY], rows[MICROBATCH], rows[KIND]))
        tags, ops = tags[:, order], rows[OP][order]
        paired = (len(order) % 2 == 0 and bool(np.all(tags[:, 0::2] == tags[:, 1::2]))
                  and bool(np.all(ops[0::2] == 0)) and bool(np.all(ops[1::2] == 1)))
    if not paired:
        raise ScheduleError("a transfer has no other end in the schedule")
    partner = np.empty(len(order), dtype=np.int64)
    partner[order[0::2]], partner[order[1::2]] = order[1::2], order[0::2]
    return partner
