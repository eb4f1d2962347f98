"""The one schedule player: a schedule's action lists played against each
other in simulated time.

Each rank runs its actions in order; a Compute takes its priced processor
work and then its collectives; an Exchange is posted as one batch and
completes once every peer has posted its other ends (the receives it needs
and, unless the schedule splits the backward, the sends it pairs with: under
those schedules a send does not wait for its receiver, the executor's rule).
With a `speed` function the ranks computing at once share the processor (CPU
profiles: processor sharing, simulated exactly: a rank's remaining work
drains at the current share).

The prices are the caller's: the invariant checker (simulate.py) plays with
unit costs, the performance model (ptdp.perf.simulate.predict) with predicted seconds.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from ptdp.schedules.actions import Compute, Exchange, Schedule, ScheduleError

# (rank, compute) -> (processor work, collective seconds) of a Compute.
ComputePrice = Callable[[int, Compute], tuple[Any, Any]]
# (rank, exchange) -> seconds an Exchange takes once every other end is posted.
ExchangePrice = Callable[[int, Exchange], Any]


@dataclass(slots=True)
class Record:
    """One action of a rank as played. Computes: start, work_end (the
    processor part, stretched by contention), end (after collectives).
    Exchanges: start (posted), ready (every other end posted), end. `cost`:
    the caller's price breakdown, if it keeps one (ptdp.perf.simulate.predict)."""
    action: Compute | Exchange
    start: Any
    end: Any = 0.0
    work_end: Any = 0.0
    ready: Any = 0.0
    cost: Any = None


def other_ends(schedule: Schedule) -> list[list[list[tuple[int, int]] | None]]:
    """For every Exchange, where the other ends it waits for are, (rank,
    action index); None for a Compute. Under a schedule that splits the
    backward a send waits for nobody. ScheduleError for a transfer with no
    other end."""
    # Where each transfer sits, (rank, action index) by (op, kind, microbatch,
    # boundary): transfer_positions' table, keyed flat (it is built for
    # every schedule a planner prices).
    position: dict[tuple, tuple[int, int]] = {}
    for rank, actions in enumerate(schedule.ranks):
        for index, action in enumerate(actions):
            if isinstance(action, Exchange):
                for t in action.transfers:
                    position[(t.op, t.kind, t.microbatch, t.boundary)] = (rank, index)
    waits_for_sends = not schedule.zero_bubble
    ends_of: list[list[list[tuple[int, int]] | None]] = []
    for rank, actions in enumerate(schedule.ranks):
        row: list[list[tuple[int, int]] | None] = []
        for action in actions:
            if isinstance(action, Exchange):
                ends = []
                for t in action.transfers:
                    receives = t.op == "recv"
                    end = position.get(("send" if receives else "recv", t.kind, t.microbatch,
                                        t.boundary))
                    if end is None:
                        raise ScheduleError(f"rank {rank}: {t} has no other end in the schedule")
                    if receives or waits_for_sends:
                        ends.append(end)
                row.append(ends)
            else:
                row.append(None)
        ends_of.append(row)
    return ends_of


def play(schedule: Schedule, compute: ComputePrice, exchange: ExchangePrice,
         speed: Callable[[int], float] | None = None) -> list[list[Record]]:
    """Run every rank's action list in simulated time.

    `compute(rank, action)` -> (processor work, collective seconds) of a
    Compute; `exchange(rank, action)` -> seconds an Exchange takes once every
    other end is posted; `speed(k)`, when given, -> the rate at which each of
    k ranks computing at once does its processor work (processor sharing;
    None: every rank at full speed). Exact numbers (ints, Fractions) stay
    exact without `speed`. Raises ScheduleError on a deadlock.
    """
    return _Play(schedule, compute, exchange, speed).run()


class _Play:
    """The state of one play: each rank's position and mode (start | work |
    delay | wait | done), the clock, and the ranks to move on next."""

    def __init__(self, schedule: Schedule, compute: ComputePrice, exchange: ExchangePrice,
                 speed: Callable[[int], float] | None):
        p = schedule.p
        self.schedule, self.compute, self.exchange, self.speed = schedule, compute, exchange, speed
        self.ends_of = other_ends(schedule)
        self.now: Any = 0
        self.index = [0] * p
        self.mode = ["start"] * p
        self.remaining: list = [0] * p      # processor work left (work mode, with `speed`)
        self.delay: list = [0] * p          # collective seconds after the work
        self.until: list = [0] * p          # end of the delay
        self.posted: list[list] = [[None] * len(actions) for actions in schedule.ranks]
        self.records: list[list[Record]] = [[] for _ in range(p)]
        self.current: list[Record | None] = [None] * p
        self.timers: list = []              # (until, rank) of delays, without `speed`
        self.pending = deque(range(p))
        self.finished = 0

    def run(self) -> list[list[Record]]:
        p = self.schedule.p
        while True:
            while self.pending:
                self.advance(self.pending.popleft())
            if self.finished == p:
                return self.records
            if self.speed is None:
                if self.timers:
                    self.now, r = heapq.heappop(self.timers)
                    self.pending.append(r)
                    continue
            elif self.share_time():
                continue
            waiting = [f"rank {r} at {self.schedule.ranks[r][self.index[r]]}" for r in range(p)
                       if self.mode[r] == "wait"]
            s = self.schedule
            raise ScheduleError(f"{s.kind} p={p} m={s.m} v={s.v} deadlocks: " + "; ".join(waiting))

    def share_time(self) -> bool:
        """Processor sharing: move the clock to the next rank's end of work or
        delay (False: nothing is under way)."""
        mode, remaining = self.mode, self.remaining
        working = [r for r in range(self.schedule.p) if mode[r] == "work"]
        rate = self.speed(len(working)) if working else 1.0
        steps = [(remaining[r] / rate, r) for r in working]
        steps += [(self.until[r] - self.now, r) for r in range(self.schedule.p) if mode[r] == "delay"]
        if not steps:
            return False
        dt = min(step for step, _ in steps)
        for step, r in steps:
            if mode[r] == "work":
                remaining[r] = 0 if step == dt else remaining[r] - dt * rate
            if step == dt:
                self.pending.append(r)
        self.now = self.now + dt
        return True

    def enter_delay(self, r: int, end) -> None:
        self.until[r] = end
        self.mode[r] = "delay"
        if self.speed is None and end > self.now:
            heapq.heappush(self.timers, (end, r))

    def start(self, r: int) -> None:
        """Rank r begins its next action (or is done)."""
        actions, i = self.schedule.ranks[r], self.index[r]
        if i >= len(actions):
            self.mode[r] = "done"
            self.finished += 1
            return
        action, now = actions[i], self.now
        self.current[r] = Record(action, now)
        if self.ends_of[r][i] is None:
            work, collective = self.compute(r, action)
            if self.speed is None:
                self.current[r].work_end = now + work
                self.enter_delay(r, now + work + collective)
            else:
                self.remaining[r], self.delay[r] = work, collective
                self.mode[r] = "work"
        else:
            self.posted[r][i] = now
            self.mode[r] = "wait"
            # Wake every peer: also those whose receive waits for a send posted here.
            self.pending.extend(t.peer for t in action.transfers)

    def advance(self, r: int) -> None:
        """Move rank r on as far as it can at the current time."""
        while True:
            state = self.mode[r]
            if state == "start":
                self.start(r)
            elif state == "wait":
                i = self.index[r]
                ready = self.posted[r][i]
                for peer, j in self.ends_of[r][i]:
                    when = self.posted[peer][j]
                    if when is None:
                        return
                    if when > ready:
                        ready = when
                self.current[r].ready = ready
                self.enter_delay(r, ready + self.exchange(r, self.schedule.ranks[r][i]))
            elif state == "work":
                if self.remaining[r] > 0:
                    return
                self.current[r].work_end = self.now
                self.enter_delay(r, self.now + self.delay[r])
            elif state == "delay":
                if self.until[r] > self.now:
                    return
                self.current[r].end = self.now
                self.records[r].append(self.current[r])
                self.index[r] += 1
                self.mode[r] = "start"
            else:
                return
