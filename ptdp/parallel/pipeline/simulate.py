"""A unit-time simulator that checks and prices a schedule.

It runs every rank's action list the way the executor does: computes in
order; an Exchange is posted as one batch and the rank waits until every
transfer in it has met its other end, i.e. until the peer has reached the
Exchange that holds the matching transfer. It raises ScheduleError on

- a deadlock (no rank can move; the message lists what each waits for),
- a dependency violation (a compute whose input was never received, a send
  of a tensor not yet produced, a backward before its forward),
- an action missing or repeated,
- transfers between two ranks whose order differs on the two sides (NCCL
  matches point-to-point messages between a pair of ranks in order).

Costs are per pipeline stage: by default a forward through all of a rank's
layers costs 1 and a backward 2; a chunk holds 1/v of the rank's layers, so
one chunk-forward costs 1/v (the paper's assumption). Exact fractions keep
the bubble figures exact.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from fractions import Fraction

from ptdp.parallel.pipeline.schedules import Compute, Exchange, Schedule, ScheduleError


@dataclass
class Interval:
    action: Compute
    start: Fraction
    end: Fraction


@dataclass
class SimulationResult:
    schedule: Schedule
    timelines: list[list[Interval]]
    makespan: Fraction
    ideal: Fraction                      # m·(t_f + t_b): one rank's compute time
    peak_in_flight: list[int] = field(default_factory=list)

    @property
    def bubble_fraction(self) -> Fraction:
        """Pipeline bubble time over ideal time, as the paper defines it."""
        return (self.makespan - self.ideal) / self.ideal

    def idle_fraction(self, rank: int) -> Fraction:
        busy = sum((i.end - i.start for i in self.timelines[rank]), Fraction(0))
        return (self.makespan - busy) / self.makespan


def check_transfer_order(schedule: Schedule) -> None:
    """Sends from a to b must appear on a in the order b receives them."""
    sent: dict[tuple[int, int], list] = defaultdict(list)
    received: dict[tuple[int, int], list] = defaultdict(list)
    for rank, actions in enumerate(schedule.ranks):
        for action in actions:
            if isinstance(action, Exchange):
                for t in action.transfers:
                    if t.op == "send":
                        sent[(rank, t.peer)].append(t.tag)
                    else:
                        received[(t.peer, rank)].append(t.tag)
    for pair in set(sent) | set(received):
        if sent[pair] != received[pair]:
            raise ScheduleError(
                f"rank {pair[0]} sends to rank {pair[1]} in the order {sent[pair]} but rank "
                f"{pair[1]} receives in the order {received[pair]}")


def check_complete(schedule: Schedule) -> None:
    """Every (op, microbatch, chunk) exactly once on every rank."""
    expected = sorted((op, i, c) for op in "FB" for i in range(schedule.m) for c in range(schedule.v))
    if schedule.kind == "forward-only":
        expected = [e for e in expected if e[0] == "F"]
    for rank in range(schedule.p):
        got = sorted((a.op, a.microbatch, a.chunk) for a in schedule.computes(rank))
        if got != expected:
            missing = sorted(set(expected) - set(got))
            repeated = sorted({g for g in got if got.count(g) > 1})
            raise ScheduleError(f"rank {rank}: missing {missing[:5]}, repeated {repeated[:5]}")


def simulate(schedule: Schedule, forward_cost: Fraction | int = 1, backward_cost: Fraction | int = 2,
             transfer_cost: Fraction | int = 0) -> SimulationResult:
    check_complete(schedule)
    check_transfer_order(schedule)
    p, v = schedule.p, schedule.v
    cost = {"F": Fraction(forward_cost) / v, "B": Fraction(backward_cost) / v}
    transfer_cost = Fraction(transfer_cost)
    last_stage = schedule.num_stages - 1

    # Where each transfer sits: (rank, action index), to find the other end.
    position: dict[tuple[str, tuple], tuple[int, int]] = {}
    for rank, actions in enumerate(schedule.ranks):
        for index, action in enumerate(actions):
            if isinstance(action, Exchange):
                for t in action.transfers:
                    position[(t.op, t.tag)] = (rank, index)

    pointer = [0] * p
    clock = [Fraction(0)] * p
    arrived: dict[tuple[int, int], Fraction] = {}       # (rank, index) -> when the rank posted it
    have: list[set] = [set() for _ in range(p)]          # tensors a rank holds: (kind, mb, boundary)
    forwarded: list[set] = [set() for _ in range(p)]     # (mb, chunk) forwards done, not yet backward
    peak = [0] * p
    timelines: list[list[Interval]] = [[] for _ in range(p)]

    def fail(rank: int, message: str) -> None:
        raise ScheduleError(f"{schedule.kind} p={p} m={schedule.m} v={v}, rank {rank}: {message}")

    while any(pointer[r] < len(schedule.ranks[r]) for r in range(p)):
        moved = False
        for rank in range(p):
            actions = schedule.ranks[rank]
            while pointer[rank] < len(actions):
                action = actions[pointer[rank]]
                if isinstance(action, Compute):
                    stage = schedule.virtual_stage(rank, action.chunk)
                    key = (action.microbatch, action.chunk)
                    if action.op == "F":
                        if stage > 0 and ("activation", action.microbatch, stage - 1) not in have[rank]:
                            fail(rank, f"{action} runs before its input activation arrived")
                        forwarded[rank].add(key)
                        peak[rank] = max(peak[rank], len(forwarded[rank]))
                        if stage < last_stage:
                            have[rank].add(("output", action.microbatch, stage))
                    else:
                        if key not in forwarded[rank]:
                            fail(rank, f"{action} runs before its forward")
                        if stage < last_stage and ("grad", action.microbatch, stage) not in have[rank]:
                            fail(rank, f"{action} runs before its output gradient arrived")
                        forwarded[rank].discard(key)
                        if stage > 0:
                            have[rank].add(("input-grad", action.microbatch, stage - 1))
                    start = clock[rank]
                    clock[rank] = start + cost[action.op]
                    timelines[rank].append(Interval(action, start, clock[rank]))
                else:
                    here = (rank, pointer[rank])
                    arrived.setdefault(here, clock[rank])
                    for t in action.transfers:
                        produced = ("output" if t.kind == "activation" else "input-grad",
                                    t.microbatch, t.boundary)
                        if t.op == "send" and produced not in have[rank]:
                            fail(rank, f"sends {t} before producing it")
                    ends = [position.get(("recv" if t.op == "send" else "send", t.tag))
                            for t in action.transfers]
                    if any(e is None for e in ends):
                        fail(rank, f"{action}: a transfer has no other end in the schedule")
                    if not all(pointer[peer] >= index for peer, index in ends):
                        break  # a peer has not posted the other end yet
                    done = max([clock[rank]] + [arrived.get((peer, index), clock[peer])
                                                for peer, index in ends]) + transfer_cost
                    for t in action.transfers:
                        if t.op == "recv":
                            have[rank].add((t.kind, t.microbatch, t.boundary))
                    clock[rank] = done
                pointer[rank] += 1
                moved = True
        if not moved:
            waiting = [f"rank {r} at {schedule.ranks[r][pointer[r]]}" for r in range(p)
                       if pointer[r] < len(schedule.ranks[r])]
            raise ScheduleError(f"{schedule.kind} p={p} m={schedule.m} v={v} deadlocks: "
                                + "; ".join(waiting))

    makespan = max(clock)
    per_stage = Fraction(forward_cost) + (Fraction(backward_cost)
                                          if schedule.kind != "forward-only" else 0)
    return SimulationResult(schedule, timelines, makespan, schedule.m * per_stage, peak)
