"""The invariant checker, and the unit-time simulation that prices a schedule.

It checks each rank's action list for what the executor needs (completeness,
dependencies, the order of transfers between two ranks), then plays the
lists against each other in unit time with the one player (player.py):
computes in order; an Exchange is posted as one batch and the rank waits
until every transfer in it has met its other end, i.e. until the peer has
reached the Exchange that holds the matching transfer. It raises
ScheduleError on

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

Zero-bubble kinds (ScheduleKind.splits_backward) split the backward into B
(input gradient) and W (weight gradients): `weight_cost` is W's share of
`backward_cost` (default: half of it, so F = B = W = 1 by default), B costs
the rest. Their extra rules: W after its own B on the same rank and chunk;
B of stage k after B of stage k + 1 (as every backward); an activation is
stored from its F until its W, and `peak_in_flight` counts it so. Across
the bottom of a V (two stages on one rank) no tensor is transferred:
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

from ptdp.schedules.actions import (FORWARD_ONLY, Compute, Exchange, Schedule, ScheduleError,
                                    transfer_positions)
from ptdp.schedules.kinds import SPLIT_BACKWARD
from ptdp.schedules.player import play


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
    if schedule.kind == FORWARD_ONLY:
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
                                f"({', '.join(SPLIT_BACKWARD)}), not to {schedule.kind}, whose "
                                f"backward is one compute")
        return {"F": forward_cost / v, "B": backward_cost / v}
    weight = backward_cost / 2 if weight_cost is None else Fraction(weight_cost)
    if not 0 < weight < backward_cost:
        raise ScheduleError(f"weight cost {weight} must lie strictly between 0 and the backward cost "
                            f"{backward_cost}: it is the weight-gradient share of the backward")
    return {"F": forward_cost / v, "B": (backward_cost - weight) / v, "W": weight / v}


def check_dependencies(schedule: Schedule) -> tuple[list[int], list[int]]:
    """Walk every rank's actions in order: each compute has its input (a
    forward its activation, a backward its forward and its output gradient,
    a W its B), each send what it sends, each transfer its other end.
    Returns each rank's peak activations held from F until W (fused kinds:
    until B) and from F until B."""
    position = transfer_positions(schedule)
    peaks: list[int] = []
    peaks_before_backward: list[int] = []
    for rank in range(schedule.p):
        peak, before = _check_rank(schedule, rank, position)
        peaks.append(peak)
        peaks_before_backward.append(before)
    return peaks, peaks_before_backward


def _check_rank(schedule: Schedule, rank: int, position: dict) -> tuple[int, int]:
    last_stage = schedule.num_stages - 1
    have: set = set()             # tensors the rank holds: (kind, mb, boundary)
    forwarded: set = set()        # (mb, chunk) forwards done, not yet backward
    awaiting_w: set = set()       # (mb, chunk) B done, W not yet (split backward)
    peak = peak_before_backward = 0

    def fail(message: str) -> None:
        raise ScheduleError(f"{schedule.kind} p={schedule.p} m={schedule.m} v={schedule.v}, "
                            f"rank {rank}: {message}")

    for action in schedule.ranks[rank]:
        if isinstance(action, Exchange):
            for t in action.transfers:
                produced = ("output" if t.kind == "activation" else "input-grad",
                            t.microbatch, t.boundary)
                if t.op == "send" and produced not in have:
                    fail(f"sends {t} before producing it")
            if any(position.get(("recv" if t.op == "send" else "send", t.tag)) is None
                   for t in action.transfers):
                fail(f"{action}: a transfer has no other end in the schedule")
            have.update((t.kind, t.microbatch, t.boundary) for t in action.transfers
                        if t.op == "recv")
            continue
        stage = schedule.virtual_stage(rank, action.chunk)
        key, mb = (action.microbatch, action.chunk), action.microbatch
        if action.op == "F":
            # Across a boundary inside the rank the input is the producer's output.
            arrived_as = "output" if stage > 0 and schedule.is_local_boundary(stage - 1) \
                else "activation"
            if stage > 0 and (arrived_as, mb, stage - 1) not in have:
                fail(f"{action} runs before its input activation arrived")
            forwarded.add(key)
            peak_before_backward = max(peak_before_backward, len(forwarded))
            peak = max(peak, len(forwarded) + len(awaiting_w))
            if stage < last_stage:
                have.add(("output", mb, stage))
        elif action.op == "B":
            if key not in forwarded:
                fail(f"{action} runs before its forward")
            arrived_as = ("input-grad" if stage < last_stage
                          and schedule.is_local_boundary(stage) else "grad")
            if stage < last_stage and (arrived_as, mb, stage) not in have:
                fail(f"{action} runs before its output gradient arrived")
            forwarded.discard(key)
            if schedule.zero_bubble:
                awaiting_w.add(key)
            if stage > 0:
                have.add(("input-grad", mb, stage - 1))
        else:
            if key not in awaiting_w:
                fail(f"{action} runs before its B")
            awaiting_w.discard(key)
    return peak, peak_before_backward


def simulate(schedule: Schedule, forward_cost: Fraction | int = 1, backward_cost: Fraction | int = 2,
             transfer_cost: Fraction | int = 0, weight_cost: Fraction | int | None = None
             ) -> SimulationResult:
    """Check the schedule's invariants (completeness, transfer order,
    dependencies), then play it (player.py) with unit costs: `cost` per
    chunk compute (compute_costs), `transfer_cost` per exchange that waits
    for another end. ScheduleError on a broken invariant or a deadlock."""
    check_complete(schedule)
    check_transfer_order(schedule)
    peak, peak_before_backward = check_dependencies(schedule)
    cost = compute_costs(schedule, forward_cost, backward_cost, weight_cost)
    transfer_cost = Fraction(transfer_cost)
    zero_bubble = schedule.zero_bubble

    def exchange(rank: int, action: Exchange) -> Fraction | int:
        # Only an exchange that waits for another end costs a transfer: under
        # a split backward one that only sends waits for nobody.
        waits = not zero_bubble or any(t.op == "recv" for t in action.transfers)
        return transfer_cost if waits else 0

    records = play(schedule, lambda rank, action: (cost[action.op], 0), exchange)
    timelines = [[Interval(r.action, r.start, r.end) for r in row if isinstance(r.action, Compute)]
                 for row in records]
    makespan = max((row[-1].end for row in records if row), default=Fraction(0))
    per_stage = Fraction(forward_cost) + (Fraction(backward_cost)
                                          if schedule.kind != FORWARD_ONLY else 0)
    return SimulationResult(schedule, timelines, makespan, schedule.m * per_stage, peak,
                            peak_before_backward)
