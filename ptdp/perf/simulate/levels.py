"""A schedule's dataflow played level by level in numpy: the planner's
plays without processor sharing (GPU profiles), for schedules it plays
more than once.

Without sharing, an action ends at

    (latest of its predecessor's end and, for an exchange, the other
     ends' postings  +  its work or wait)  +  its collectives (0 for an exchange)

and a posting is the end of the poster's previous action (ptdp.perf.
simulate.codes, `flat_times`). Every action of one level (its longest
chain of predecessors) depends on earlier levels only, so a level is one
vectorised step: gather, maximum, two additions, in the order the loop
takes them, so that every time is bit for bit the loop's (IEEE
arithmetic is the same in numpy; tested). A schedule has a few thousand
levels against hundreds of thousands of actions (p = 64, m = 512). The
levels themselves are found wave by wave (`unit_levels`: the actions
whose predecessors all have a level take the next one, which also finds
a deadlock: what never gets a level), and kept with the schedule's codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Levels:
    """The actions of a schedule sorted by level (position k holds the flat
    action order[k], flat = rank offset + index in its rank), where each
    level starts (`bounds`, and the end), each position's predecessors as
    positions (`waits`: its own rank's previous action, then the other
    ends' previous actions, padded with NEVER; START for a rank's first
    action), where each position's price is in a play's price table
    (`prices`), and each flat action's predecessor position (`before`)."""
    order: np.ndarray
    bounds: list[int]
    waits: np.ndarray
    prices: np.ndarray
    before: np.ndarray
    offsets: list[int]

    @property
    def start(self) -> int:     # a time 0: before a rank's first action
        return len(self.order)

    @property
    def never(self) -> int:     # padding: -inf, below every time
        return len(self.order) + 1


def unit_levels(counts: list[int], ends: tuple) -> np.ndarray:
    """Each action's level, flat (rank after rank): 1 + the most of its
    predecessors' (its own rank's previous action and, for an exchange,
    the action before each other end), 1 where it has none, which is its
    end in a play where every action takes 1; 0 for an action that never
    gets one (a deadlock). `ends`: ends_table's arrays. Found wave by wave
    (a wave: the actions whose predecessors all have a level), a few
    numpy calls per level instead of a Python step per action."""
    offsets = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    n = int(offsets[-1])
    rows, columns, targets = ends
    width = 1 + (int(columns.max()) if len(columns) else 0)
    done = n   # a column that always has a level: no predecessor there
    first = np.zeros(n, dtype=bool)
    first[offsets[:-1][np.asarray(counts) > 0]] = True
    # predecessors (column 0: the own rank's; then the other ends')
    before = np.full((n, width), done, dtype=np.int64)
    before[:, 0] = np.where(first, done, np.arange(n) - 1)
    external = targets >= 0
    before[rows[external], columns[external]] = targets[external]
    # successors, the same way round (the next action on the rank; the
    # exchanges that wait on it), padded with n
    taken = [np.where(np.append(first[1:], True), n, np.arange(n) + 1)]
    sources, sinks = targets[external], rows[external]
    by_source = np.argsort(sources, kind="stable")
    sources, sinks = sources[by_source], sinks[by_source]
    rank_in_source = np.arange(len(sources)) - np.searchsorted(sources, sources)
    for k in range(int(rank_in_source.max()) + 1 if len(sources) else 0):
        column = np.full(n, n, dtype=np.int64)
        chosen = rank_in_source == k
        column[sources[chosen]] = sinks[chosen]
        taken.append(column)
    after = np.stack(taken, axis=1)
    after = np.concatenate((after, np.full((1, after.shape[1]), n, dtype=np.int64)))
    # Each action's predecessors without a level yet (the padding n: never
    # ready); a wave takes one off each follower per predecessor in it.
    remaining = np.append((before != done).sum(axis=1), np.iinfo(np.int64).max // 2)
    level = np.zeros(n + 1, dtype=np.int64)
    latest = np.zeros(n + 1, dtype=np.int64)   # where an action last came in the wave
    wave = np.flatnonzero(remaining == 0)
    number = 0
    while len(wave):
        number += 1
        level[wave] = number
        following = after[wave].ravel()
        np.subtract.at(remaining, following, 1)
        wave = following[remaining[following] == 0]
        # once each (it follows each of its predecessors in the wave)
        places = np.arange(len(wave))
        latest[wave] = places
        wave = wave[latest[wave] == places]
    return level[:n]


def levels_of(flat_slot: np.ndarray, counts: list[int], ends: tuple, flat_level: np.ndarray,
              compute_counts: list[int], exchange_counts: list[int]) -> Levels:
    """`flat_slot`: each action's price slot (codes.Codes' `slots`, rank
    after rank), `counts` each rank's actions; `ends`: each exchange's other
    ends as flat arrays (`ends_table`); `flat_level`: each action's level
    (`unit_levels`, rank after rank); `compute_counts`,
    `exchange_counts`: each rank's compute and exchange slots (a play's
    table holds rank 0's computes, then its exchanges, then rank 1's ...)."""
    offsets = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    n = int(offsets[-1])
    order = np.argsort(flat_level, kind="stable")
    position = np.empty(n, dtype=np.int64)
    position[order] = np.arange(n)
    start, never = n, n + 1
    rank_of = np.repeat(np.arange(len(counts)), counts)
    first = offsets[:-1][rank_of] == np.arange(n)
    before = np.where(first, start, np.concatenate(([start], position[:-1])))
    rows, columns, targets = ends
    width = 1 + (int(columns.max()) if len(columns) else 0)
    waits = np.full((n, width), never, dtype=np.int64)
    waits[position, 0] = before
    # the other ends' previous actions (START before a rank's first action)
    if len(rows):
        waits[position[rows], columns] = np.where(targets < 0, start,
                                                  position[np.maximum(targets, 0)])
    table_base = np.concatenate(([0], np.cumsum(np.add(compute_counts, exchange_counts))))
    computes = np.asarray(compute_counts, dtype=np.int64)[rank_of]
    prices = (table_base[:-1][rank_of] + np.where(flat_slot >= 0, flat_slot,
                                                  computes - 1 - flat_slot))[order]
    sorted_levels = flat_level[order]
    bounds = np.flatnonzero(np.diff(sorted_levels)) + 1
    return Levels(order, [0, *bounds.tolist(), n], waits, prices, before, offsets.tolist())


def ends_table(ends: list[list]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """codes.Codes' `ends` as flat arrays: for each other end (rank q,
    index j) of each exchange, in order, the exchange's flat index, its
    column (1, 2, ... in the exchange), and the flat index of the action
    before (q, j) (-1 where j is q's first action)."""
    offsets = [0]
    for row in ends:
        offsets.append(offsets[-1] + len(row))
    rows, columns, targets = [], [], []
    for r, ends_r in enumerate(ends):
        base = offsets[r]
        for i, others in enumerate(ends_r):
            for column, (peer, j) in enumerate(others or (), 1):
                rows.append(base + i)
                columns.append(column)
                targets.append(offsets[peer] + j - 1 if j else -1)
    return tuple(np.asarray(values, dtype=np.int64) for values in (rows, columns, targets))


def play_levels(levels: Levels, table_work: list[float], table_after: list[float]
                ) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of every action, flat (rank after rank), priced by
    the table: position k takes table_work[prices[k]] then
    table_after[prices[k]] (a compute's work and collectives, an
    exchange's wait and 0.0). An action starts when its predecessor ends
    (an exchange: when it is posted), as in predict's loop."""
    n = len(levels.order)
    work = np.asarray(table_work, dtype=np.float64)[levels.prices]
    after = np.asarray(table_after, dtype=np.float64)[levels.prices]
    times = np.empty(n + 2)
    times[levels.start], times[levels.never] = 0.0, -np.inf
    waits, bounds = levels.waits, levels.bounds
    for a, b in zip(bounds, bounds[1:]):
        times[a:b] = (times[waits[a:b]].max(axis=1) + work[a:b]) + after[a:b]
    ends = np.empty(n)
    ends[levels.order] = times[:n]
    return times[levels.before], ends
