"""Play a schedule's action lists against each other in simulated time.

Each rank runs its actions in order; a Compute takes its priced processor
work and then its collectives, an Exchange completes only once the peers
have posted its other ends (the rule of ptdp.parallel.pipeline.simulate),
and under zero-bubble schedules a send does not wait for its receiver (the
executor's rule). With a `speed` function the ranks computing at once share
the processor (CPU profiles: processor sharing, simulated exactly: a rank's
remaining work drains at the current share).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Callable

from ptdp.parallel.pipeline.actions import (Compute, Exchange, Schedule, ScheduleError,
                                            transfer_positions)
from ptdp.perf.pricing import Cost


@dataclass(slots=True)
class Record:
    """One action of a rank as simulated. Computes: start, work_end (the
    processor part, stretched by contention), end (after collectives).
    Exchanges: start (posted), ready (every other end posted), end."""
    action: Compute | Exchange
    start: float
    end: float = 0.0
    work_end: float = 0.0
    ready: float = 0.0
    cost: Cost | None = None


def play(schedule: Schedule, compute: Callable[[int, Compute], tuple[float, float]],
         exchange: Callable[[int, Exchange], float],
         speed: Callable[[int], float] | None = None) -> list[list[Record]]:
    """Run every rank's action list in simulated time.

    `compute(rank, action)` -> (processor work, collective seconds) of a
    Compute; `exchange(rank, action)` -> seconds an Exchange takes once every
    other end is posted (the rule of ptdp.parallel.pipeline.simulate);
    `speed(k)`, when given, -> the rate at which each of k ranks computing at
    once does its processor work (processor sharing; None: every rank at full
    speed). Exact numbers (ints, Fractions) stay exact without `speed`.
    Raises ScheduleError on a deadlock.
    """
    p = schedule.p
    position = transfer_positions(schedule)
    # For every Exchange, where its other ends are; None for a Compute.
    ends_of: list[list[list[tuple[int, int]] | None]] = []
    for rank, actions in enumerate(schedule.ranks):
        row: list[list[tuple[int, int]] | None] = []
        for action in actions:
            if isinstance(action, Exchange):
                ends = []
                for t in action.transfers:
                    end = position.get(("recv" if t.op == "send" else "send", t.tag))
                    if end is None:
                        raise ScheduleError(f"rank {rank}: {t} has no other end in the schedule")
                    # Zero-bubble: a send does not wait for its receiver (the executor's rule).
                    if t.op == "recv" or not schedule.zero_bubble:
                        ends.append(end)
                row.append(ends)
            else:
                row.append(None)
        ends_of.append(row)

    now = 0
    index = [0] * p
    mode = ["start"] * p           # start | work | delay | wait | done
    remaining: list = [0] * p      # processor work left (work mode, with `speed`)
    delay: list = [0] * p          # collective seconds after the work
    until: list = [0] * p          # end of the delay
    posted: list[list] = [[None] * len(actions) for actions in schedule.ranks]
    records: list[list[Record]] = [[] for _ in range(p)]
    current: list[Record | None] = [None] * p
    timers: list = []              # (until, rank) of delays, without `speed`
    pending = deque(range(p))
    finished = 0

    def enter_delay(r: int, end) -> None:
        until[r] = end
        mode[r] = "delay"
        if speed is None and end > now:
            heapq.heappush(timers, (end, r))

    def advance(r: int) -> None:
        """Move rank r on as far as it can at the current time."""
        nonlocal finished
        actions, ends_row, posted_row = schedule.ranks[r], ends_of[r], posted[r]
        while True:
            state = mode[r]
            if state == "start":
                i = index[r]
                if i >= len(actions):
                    mode[r] = "done"
                    finished += 1
                    return
                action = actions[i]
                current[r] = Record(action, now)
                ends = ends_row[i]
                if ends is None:
                    work, collective = compute(r, action)
                    if speed is None:
                        current[r].work_end = now + work
                        enter_delay(r, now + work + collective)
                    else:
                        remaining[r], delay[r] = work, collective
                        mode[r] = "work"
                else:
                    posted_row[i] = now
                    mode[r] = "wait"
                    # Wake every peer: also those whose receive waits for a send posted here.
                    pending.extend(t.peer for t in action.transfers)
            elif state == "wait":
                i = index[r]
                ready = posted_row[i]
                for peer, j in ends_row[i]:
                    when = posted[peer][j]
                    if when is None:
                        return
                    if when > ready:
                        ready = when
                current[r].ready = ready
                enter_delay(r, ready + exchange(r, actions[i]))
            elif state == "work":
                if remaining[r] > 0:
                    return
                current[r].work_end = now
                enter_delay(r, now + delay[r])
            elif state == "delay":
                if until[r] > now:
                    return
                current[r].end = now
                records[r].append(current[r])
                index[r] += 1
                mode[r] = "start"
            else:
                return

    while True:
        while pending:
            advance(pending.popleft())
        if finished == p:
            return records
        if speed is None:
            if timers:
                now, r = heapq.heappop(timers)
                pending.append(r)
                continue
        else:
            working = [r for r in range(p) if mode[r] == "work"]
            rate = speed(len(working)) if working else 1.0
            steps = [(remaining[r] / rate, r) for r in working]
            steps += [(until[r] - now, r) for r in range(p) if mode[r] == "delay"]
            if steps:
                dt = min(step for step, _ in steps)
                for step, r in steps:
                    if mode[r] == "work":
                        remaining[r] = 0 if step == dt else remaining[r] - dt * rate
                    if step == dt:
                        pending.append(r)
                now = now + dt
                continue
        waiting = [f"rank {r} at {schedule.ranks[r][index[r]]}" for r in range(p)
                   if mode[r] == "wait"]
        raise ScheduleError(f"{schedule.kind} p={p} m={schedule.m} v={schedule.v} deadlocks: "
                            + "; ".join(waiting))
