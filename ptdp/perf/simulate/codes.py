"""Play codes: a schedule's actions as slots of their prices, and their
plays from those prices (ptdp.perf.simulate.predict's `_play_unshared`).

Per rank, each action is one slot: a compute's (chunk, op, whether it is
the first forward), priced alike; an exchange's transfers' ops and peers.
A play at given prices runs each rank as far as its exchanges let it (the
loop, `flat_times`: a small schedule), or, for a large schedule, level by
level in numpy (`level_times`, ptdp.perf.simulate.levels), bit for bit the
loop's times.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ptdp.perf.simulate.levels import ends_table, levels_of, play_levels, unit_levels
from ptdp.schedules.actions import Compute, Exchange, ScheduleError
from ptdp.schedules.player import other_ends


@dataclass
class Codes:
    """A schedule's actions as slots of their prices (predict's
    `_play_unshared`): per rank, each action's slot (>= 0: a compute's (chunk, op, whether it
    is the first forward), priced alike; < 0: -1 - an exchange's slot, by
    its transfers' ops and peers, as predict's _exchange_price caches them), one
    action of each slot, the other ends each exchange waits for
    (player.other_ends), and where the computes and each op's computes are.
    `actions(rank)`: that rank's actions (made on demand where the codes
    come from tables, ptdp.perf.simulate.schedule_tables); `label`: the
    schedule in words, for a deadlock's error."""
    p: int
    label: str
    splits_backward: bool
    actions: Callable[[int], tuple]
    slots: list[list[int]]
    compute_slots: list[list[Compute]]
    exchange_slots: list[list[Exchange]]
    ends: list[list]
    computes: list[list[int]]
    of_op: list[dict[str, list[int]]]
    # Per rank: where its first forward of each chunk is (in the order they
    # come), the chunk of each backward that releases buckets (its Ws under
    # the zero-bubble kinds, its Bs otherwise) and each exchange's peers.
    first_forwards: list[list[int]] = field(default_factory=list)
    released_chunks: list[list[int]] = field(default_factory=list)
    peers: list[list[tuple[int, ...] | None]] = field(default_factory=list)
    # Plays so far, and the dataflow's levels (levels.py) once found
    plays: int = 0
    levels: Any = None
    # `slots` flat, rank after rank, and `ends` as levels.ends_table's
    # arrays (made from the lists when not given)
    flat_slot: Any = None
    flat_ends: Any = None
    flat: dict | None = None   # flat_index's


class RowsOnDemand:
    """A list of rows, each made the first time it is read: a play's
    backwards as tuples, a large schedule's ends and peers (most searches
    read only their arrays)."""

    def __init__(self, makers: list[Callable[[], list]]):
        self._makers, self._rows = makers, [None] * len(makers)

    def __len__(self) -> int:
        return len(self._makers)

    def __getitem__(self, r: int) -> list:
        if self._rows[r] is None:
            self._rows[r] = self._makers[r]()
        return self._rows[r]

    def __iter__(self):
        return (self[r] for r in range(len(self)))

    def __eq__(self, other) -> bool:   # (as the list of its rows)
        return list(self) == list(other)

    __hash__ = None


def codes_of(schedule) -> Codes:
    slots, compute_slots, exchange_slots, computes, of_op = [], [], [], [], []
    for actions in schedule.ranks:
        seen: dict[tuple, int] = {}
        row, kept_computes, kept_exchanges, positions = [], [], [], []
        by_op: dict[str, list[int]] = {"F": [], "B": [], "W": []}
        for i, action in enumerate(actions):
            if isinstance(action, Compute):
                slot = (action.chunk, action.op, action.op == "F" and action.microbatch == 0)
                if slot not in seen:
                    seen[slot] = len(kept_computes)
                    kept_computes.append(action)
                row.append(seen[slot])
                positions.append(i)
                by_op[action.op].append(i)
            else:
                slot = tuple([(transfer.op, transfer.peer) for transfer in action.transfers])
                if slot not in seen:
                    seen[slot] = -1 - len(kept_exchanges)
                    kept_exchanges.append(action)
                row.append(seen[slot])
        slots.append(row)
        compute_slots.append(kept_computes)
        exchange_slots.append(kept_exchanges)
        computes.append(positions)
        of_op.append(by_op)
    released = "W" if schedule.splits_backward else "B"
    first_forwards = []
    for actions, by_op in zip(schedule.ranks, of_op):
        first: dict[int, int] = {}
        for i in by_op["F"]:
            first.setdefault(actions[i].chunk, i)
        first_forwards.append(list(first.values()))
    label = f"{schedule.kind} p={schedule.p} m={schedule.m} v={schedule.v}"
    return Codes(schedule.p, label, schedule.splits_backward, schedule.ranks.__getitem__,
                 slots, compute_slots, exchange_slots, other_ends(schedule), computes,
                  of_op, first_forwards,
                  [[actions[i].chunk for i in by_op[released]]
                   for actions, by_op in zip(schedule.ranks, of_op)],
                  [[None if isinstance(action, Compute) else
                    tuple([transfer.peer for transfer in action.transfers]) for action in actions]
                   for actions in schedule.ranks])


def level_times(codes: Codes, compute_prices: tuple, exchange_prices: tuple):
    """flat_times' starts and ends, flat (rank after rank; an exchange is
    posted when it starts), from the dataflow's levels (levels.py), found
    on the first call and kept with the codes."""
    if codes.levels is None:
        if codes.flat_slot is None:
            codes.flat_slot = np.fromiter(itertools.chain.from_iterable(codes.slots), np.int64,
                                          sum(map(len, codes.slots)))
            codes.flat_ends = ends_table(codes.ends)
        counts = [len(row) for row in codes.slots]
        level = unit_levels(counts, codes.flat_ends)
        if not level.all():
            rank_of = np.repeat(np.arange(codes.p), counts)
            stuck = np.unique(rank_of[level == 0]).tolist()
            raise ScheduleError(f"{codes.label} deadlocks at ranks {stuck}")
        codes.levels = levels_of(codes.flat_slot, counts, codes.flat_ends, level,
                                 [len(row) for row in codes.compute_slots],
                                 [len(row) for row in codes.exchange_slots])
    work, after = [], []
    for computes, exchanges in zip(compute_prices, exchange_prices):
        work += [price[0] for price in computes] + list(exchanges)
        after += [price[1] for price in computes] + [0.0] * len(exchanges)
    return play_levels(codes.levels, work, after)


def flat_index(codes: Codes) -> dict[str, Any]:
    """Where each rank's actions start in a flat play (`offsets`), and per
    rank the flat positions of its computes, of its backwards that release
    buckets (its Ws under the zero-bubble kinds, its Bs otherwise) and of
    its first forward of each chunk (made once per codes)."""
    if codes.flat is None:
        offsets = [0]
        for row in codes.slots:
            offsets.append(offsets[-1] + len(row))
        released = "W" if codes.splits_backward else "B"

        def flat(positions: list[list[int]]) -> list[np.ndarray]:
            return [np.asarray(row, dtype=np.int64) + base for row, base in zip(positions, offsets)]

        codes.flat = {"offsets": offsets, "computes": flat(codes.computes),
                      "released": flat([of_op[released] for of_op in codes.of_op]),
                      "first_forwards": flat(codes.first_forwards),
                      "released_chunks": [np.asarray(row, dtype=np.int64)
                                          for row in codes.released_chunks]}
    return codes.flat


def flat_times(codes: Codes, compute_prices: tuple, exchange_prices: tuple):
    """Per rank, each action's start and end, and each exchange's posting
    (None for a compute): each rank run as far as its exchanges let it."""
    slots, ends_of, peers, p = codes.slots, codes.ends, codes.peers, codes.p
    starts: list[list] = [[] for _ in range(p)]
    finishes: list[list] = [[] for _ in range(p)]
    posted = [[None] * len(row) for row in slots]
    clock: list = [0] * p
    queued, pending = [True] * p, deque(range(p))
    while pending:
        r = pending.popleft()
        queued[r] = False
        row, ends_r, mine, begun, done = slots[r], ends_of[r], posted[r], starts[r], finishes[r]
        peers_r = peers[r]
        works, waits = compute_prices[r], exchange_prices[r]
        now, i, n = clock[r], len(done), len(row)
        while i < n:
            slot = row[i]
            if slot >= 0:
                work, collective = works[slot]
                begun.append(now)
                now = now + work + collective
                done.append(now)
                i += 1
                continue
            if mine[i] is None:   # posted: wake its peers
                mine[i] = now
                for peer in peers_r[i]:
                    if not queued[peer]:
                        queued[peer] = True
                        pending.append(peer)
            ready = now
            for peer, j in ends_r[i]:
                when = posted[peer][j]
                if when is None:
                    break
                if when > ready:
                    ready = when
            else:
                begun.append(now)
                now = ready + waits[-1 - slot]
                done.append(now)
                i += 1
                continue
            break
        clock[r] = now
    stuck = [r for r in range(p) if len(finishes[r]) < len(slots[r])]
    if stuck:
        raise ScheduleError(f"{codes.label} deadlocks at ranks {stuck}")
    return starts, finishes, posted
