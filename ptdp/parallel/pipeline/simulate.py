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

Zero-bubble kinds (actions.ZERO_BUBBLE_KINDS) split the backward into B
(input gradient) and W (weight gradients): `weight_cost` is W's share of
`backward_cost` (default: half of it, so F = B = W = 1 by default), B costs
the rest. Their extra rules: W after its own B on the same rank and chunk;
B of stage k after B of stage k + 1 (as every backward); an activation is
stored from its F until its W, and `peak_in_flight` counts it so. Across
the bottom of zbv's V (two stages on one rank) no tensor is transferred:
the consumer reads what the producer left on the rank. Their sends do not
wait for the receiver (the executor waits for them at the end of the run):
an Exchange waits only for its receives' sends to be posted. With blocking
sends a schedule whose W's fill the gaps could not avoid waiting once the
computes take unequal times: two busy ranks rarely reach an exchange at the
same moment.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from fractions import Fraction

from ptdp.parallel.pipeline.actions import (Compute, Exchange, Schedule, ScheduleError,
                                            transfer_positions)


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
    peak_in_flight: list[int] = field(default_factory=list)      # F until W (fused kinds: B)
    peak_before_backward: list[int] = field(default_factory=list)  # F until B

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
    ops = "FBW" if schedule.zero_bubble else "FB"
    expected = sorted((op, i, c) for op in ops for i in range(schedule.m) for c in range(schedule.v))
    if schedule.kind == "forward-only":
        expected = [e for e in expected if e[0] == "F"]
    for rank in range(schedule.p):
        got = sorted((a.op, a.microbatch, a.chunk) for a in schedule.computes(rank))
        if got != expected:
            missing = sorted(set(expected) - set(got))
            repeated = sorted({g for g in got if got.count(g) > 1})
            raise ScheduleError(f"rank {rank}: missing {missing[:5]}, repeated {repeated[:5]}")


def compute_costs(schedule: Schedule, forward_cost, backward_cost,
                  weight_cost=None) -> dict[str, Fraction]:
    """Cost of one chunk's F, B (and W) under `schedule`'s kind."""
    v = schedule.v
    forward_cost, backward_cost = Fraction(forward_cost), Fraction(backward_cost)
    if not schedule.zero_bubble:
        if weight_cost is not None:
            raise ScheduleError(f"a weight cost applies only to the zero-bubble schedules "
                                f"(zb-h1, zbv), not to {schedule.kind}, whose backward is one compute")
        return {"F": forward_cost / v, "B": backward_cost / v}
    weight = backward_cost / 2 if weight_cost is None else Fraction(weight_cost)
    if not 0 < weight < backward_cost:
        raise ScheduleError(f"weight cost {weight} must lie strictly between 0 and the backward cost "
                            f"{backward_cost}: it is the weight-gradient share of the backward")
    return {"F": forward_cost / v, "B": (backward_cost - weight) / v, "W": weight / v}


def simulate(schedule: Schedule, forward_cost: Fraction | int = 1, backward_cost: Fraction | int = 2,
             transfer_cost: Fraction | int = 0, weight_cost: Fraction | int | None = None
             ) -> SimulationResult:
    check_complete(schedule)
    check_transfer_order(schedule)
    p, v = schedule.p, schedule.v
    cost = compute_costs(schedule, forward_cost, backward_cost, weight_cost)
    transfer_cost = Fraction(transfer_cost)
    last_stage = schedule.num_stages - 1

    # Where each transfer sits: (rank, action index), to find the other end.
    position = transfer_positions(schedule)

    pointer = [0] * p
    clock = [Fraction(0)] * p
    arrived: dict[tuple[int, int], Fraction] = {}       # (rank, index) -> when the rank posted it
    have: list[set] = [set() for _ in range(p)]          # tensors a rank holds: (kind, mb, boundary)
    forwarded: list[set] = [set() for _ in range(p)]     # (mb, chunk) forwards done, not yet backward
    awaiting_w: list[set] = [set() for _ in range(p)]    # (mb, chunk) B done, W not yet (zero-bubble)
    peak = [0] * p                                       # stored: F until W (fused: until B)
    peak_before_backward = [0] * p                       # stored: F until B
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
                    mb = action.microbatch
                    if action.op == "F":
                        # Across a boundary inside the rank the input is the producer's output.
                        arrived_as = "output" if stage > 0 and schedule.is_local_boundary(stage - 1) \
                            else "activation"
                        if stage > 0 and (arrived_as, mb, stage - 1) not in have[rank]:
                            fail(rank, f"{action} runs before its input activation arrived")
                        forwarded[rank].add(key)
                        peak_before_backward[rank] = max(peak_before_backward[rank],
                                                         len(forwarded[rank]))
                        peak[rank] = max(peak[rank], len(forwarded[rank]) + len(awaiting_w[rank]))
                        if stage < last_stage:
                            have[rank].add(("output", mb, stage))
                    elif action.op == "B":
                        if key not in forwarded[rank]:
                            fail(rank, f"{action} runs before its forward")
                        arrived_as = ("input-grad" if stage < last_stage
                                      and schedule.is_local_boundary(stage) else "grad")
                        if stage < last_stage and (arrived_as, mb, stage) not in have[rank]:
                            fail(rank, f"{action} runs before its output gradient arrived")
                        forwarded[rank].discard(key)
                        if schedule.zero_bubble:
                            awaiting_w[rank].add(key)
                        if stage > 0:
                            have[rank].add(("input-grad", mb, stage - 1))
                    else:
                        if key not in awaiting_w[rank]:
                            fail(rank, f"{action} runs before its B")
                        awaiting_w[rank].discard(key)
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
                    if schedule.zero_bubble:  # sends do not wait for their receiver
                        ends = [e for e, t in zip(ends, action.transfers) if t.op == "recv"]
                    if not all(pointer[peer] >= index for peer, index in ends):
                        break  # a peer has not posted the other end yet
                    done = (max([clock[rank]] + [arrived.get((peer, index), clock[peer])
                                                 for peer, index in ends]) + transfer_cost
                            if ends else clock[rank])
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
    return SimulationResult(schedule, timelines, makespan, schedule.m * per_stage, peak,
                            peak_before_backward)
