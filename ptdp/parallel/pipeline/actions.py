"""Pipeline schedules as data: the vocabulary every schedule is written in.

A schedule is one list of actions per pipeline rank for one iteration (one
flush). The executor runs these lists, the simulator (simulate.py) prices and
checks them, the plotter draws them; nothing here touches torch. The
generators (one_f_one_b.py: GPipe, 1F1B, interleaved; zero_bubble.py: zb-h1,
zbv) and the layer split (split.py) import this module, never the reverse;
schedules.py picks a generator by kind.

Vocabulary. Rank r holds v model chunks; chunk c of rank r is *virtual
stage* c·p + r of the p·v stages the model is cut into (so with 4 ranks,
16 layers and v = 2, rank 0 holds layers 0-1 and 8-9, as in the paper).
`Compute(F|B, microbatch, chunk)` is a forward or backward pass of one
microbatch through one chunk. Between two computes a rank performs one
`Exchange`: the send that the previous compute produced and the receive the
next compute needs, posted together as one batch so that two neighbours
sending to each other at the same time cannot deadlock. A tensor crossing
the boundary between virtual stages k and k+1 is an activation (forward,
k -> k+1) or a gradient (backward, k+1 -> k).

Under the zero-bubble kinds (ZERO_BUBBLE_KINDS) "B" computes only the
gradient with respect to the chunk's input and "W" the weight gradients;
under the other kinds "B" is the whole backward and there is no "W".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

KINDS = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")
# Kinds whose "B" is the input-gradient half of a backward and that have "W" computes.
ZERO_BUBBLE_KINDS = ("zb-h1", "zbv")


@dataclass(frozen=True)
class Compute:
    op: str          # "F", "B" or "W" (W only under ZERO_BUBBLE_KINDS)
    microbatch: int
    chunk: int

    def __str__(self) -> str:
        return f"{self.op}{self.microbatch}.{self.chunk}"


@dataclass(frozen=True)
class Transfer:
    op: str          # "send" or "recv"
    kind: str        # "activation" or "grad"
    microbatch: int
    boundary: int    # between virtual stages `boundary` and `boundary + 1`
    peer: int        # pipeline rank on the other side (never this rank: see is_local_boundary)

    def matches(self, other: "Transfer") -> bool:
        """`other` is the other end of this transfer."""
        return (self.op != other.op and self.kind == other.kind
                and self.microbatch == other.microbatch and self.boundary == other.boundary)

    @property
    def tag(self) -> tuple[str, int, int]:
        return (self.kind, self.microbatch, self.boundary)

    def __str__(self) -> str:
        arrow = "->" if self.op == "send" else "<-"
        return f"{self.op} {self.kind[0]}{self.microbatch}|{self.boundary} {arrow} {self.peer}"


@dataclass(frozen=True)
class Exchange:
    transfers: tuple[Transfer, ...]

    def __str__(self) -> str:
        return "[" + ", ".join(map(str, self.transfers)) + "]"


Action = Union[Compute, Exchange]


class ScheduleError(ValueError):
    pass


@dataclass(frozen=True)
class Schedule:
    kind: str
    p: int
    m: int
    v: int
    ranks: tuple[tuple[Action, ...], ...]
    # Which kind's placement of virtual stages on ranks (virtual_stage_of);
    # None: this schedule's own kind. Evaluation under zbv is "forward-only"
    # with the V placement.
    placement: str | None = None

    @property
    def num_stages(self) -> int:
        return self.p * self.v

    @property
    def zero_bubble(self) -> bool:
        """B is the input-gradient half of a backward and W computes exist."""
        return self.kind in ZERO_BUBBLE_KINDS

    def virtual_stage(self, rank: int, chunk: int) -> int:
        return virtual_stage_of(self.placement or self.kind, self.p, self.v, rank, chunk)

    def location(self, stage: int) -> tuple[int, int]:
        """(rank, chunk) that holds virtual stage `stage`."""
        return location_of(self.placement or self.kind, self.p, self.v, stage)

    def is_local_boundary(self, boundary: int) -> bool:
        """Stages `boundary` and `boundary + 1` are on the same rank (the
        bottom of zbv's V): the tensor crossing it never leaves the rank, so
        the schedule has no Transfer for it; the consumer takes the producer's
        output (or input gradient) directly."""
        return self.location(boundary)[0] == self.location(boundary + 1)[0]

    def warmup(self, rank: int) -> int:
        if self.zero_bubble:  # read off the data: the orders are not closed-form
            computes = self.computes(rank)
            return next((k for k, c in enumerate(computes) if c.op != "F"), len(computes))
        return warmup_forwards(self.kind, self.p, self.m, self.v, rank)

    def in_flight_bound(self, rank: int) -> int:
        """Most (microbatch, chunk) activations rank holds at once: the warm-up
        forwards plus the one of the first steady-state forward. Under a
        zero-bubble kind an activation is held from its F until its W (W
        needs the stored inputs) and the bound is counted off the data."""
        if self.zero_bubble:
            return peak_stored(self.computes(rank), release_op="W")
        return min(self.warmup(rank) + 1, self.m * self.v)

    def computes(self, rank: int) -> list[Compute]:
        return [a for a in self.ranks[rank] if isinstance(a, Compute)]


def transfer_positions(schedule: "Schedule") -> dict[tuple[str, tuple], tuple[int, int]]:
    """Where each transfer sits, (rank, action index) by (op, tag): to find
    a transfer's other end (the simulator and the performance model's player)."""
    position: dict[tuple[str, tuple], tuple[int, int]] = {}
    for rank, actions in enumerate(schedule.ranks):
        for index, action in enumerate(actions):
            if isinstance(action, Exchange):
                for t in action.transfers:
                    position[(t.op, t.tag)] = (rank, index)
    return position


def peak_stored(computes: list[Compute], release_op: str) -> int:
    """Most (microbatch, chunk) activations held at once when each is stored
    from its F until its `release_op` ("B" or "W")."""
    held = peak = 0
    for c in computes:
        held += (c.op == "F") - (c.op == release_op)
        peak = max(peak, held)
    return peak


def virtual_stage_of(kind: str, p: int, v: int, rank: int, chunk: int) -> int:
    """Virtual stage of (rank, chunk). zbv places its two chunks in a V: rank
    r holds stages r and 2p - 1 - r, so a microbatch goes down the ranks on
    chunk 0 and back up on chunk 1 (rank 0 holds the first and last stage).
    Every other kind loops: chunk c of rank r is stage c·p + r."""
    if kind == "zbv":
        return rank if chunk == 0 else 2 * p - 1 - rank
    return chunk * p + rank


def location_of(kind: str, p: int, v: int, stage: int) -> tuple[int, int]:
    """(rank, chunk) holding virtual stage `stage`: the inverse of virtual_stage_of."""
    if kind == "zbv":
        return (stage, 0) if stage < p else (2 * p - 1 - stage, 1)
    return stage % p, stage // p


def check_arguments(kind: str, p: int, m: int, v: int) -> None:
    if kind not in KINDS:
        raise ScheduleError(f"unknown schedule kind {kind!r}: use one of {', '.join(KINDS)}")
    for name, value in (("p", p), ("m", m), ("v", v)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"{name} = {value!r} must be a positive integer")
    if v > 1 and p < 2:
        raise ScheduleError(f"v = {v} chunks per rank need p >= 2 ranks: with one rank the chunks "
                            f"would pass activations to themselves")
    if kind == "zbv" and v != 2:
        raise ScheduleError(f"the zbv schedule has two chunks per rank in a V (v = 2), not v = {v}")
    if kind == "zb-h1" and m < p:
        raise ScheduleError(f"the zb-h1 schedule needs at least p = {p} microbatches, not m = {m}: "
                            f"use m = {p} (or any m >= {p})")
    if kind == "zbv" and m < 2 * p:
        raise ScheduleError(f"the zbv schedule needs at least 2p = {2 * p} microbatches, not "
                            f"m = {m}: use m = {2 * p} (or any m >= {2 * p})")
    if kind not in ("interleaved", "zbv") and v != 1:
        raise ScheduleError(f"the {kind} schedule has one chunk per rank (v = 1), not v = {v}; "
                            f"use kind 'interleaved' for v > 1")
    if kind == "interleaved" and m % p:
        lower, upper = (m // p) * p, (m // p + 1) * p
        raise ScheduleError(
            f"the interleaved schedule runs microbatches in groups of p = {p}, so m = {m} must be "
            f"a multiple of {p}: use m = " + (f"{lower} or {upper}" if lower else f"{upper}"))


def warmup_forwards(kind: str, p: int, m: int, v: int, rank: int) -> int:
    if kind in ("gpipe", "forward-only"):
        return m * v
    if kind == "1f1b":
        return min(p - rank - 1, m)
    if m == p:
        # One group of p microbatches: the steady phase would stall on every
        # chunk change, so (as Megatron-LM does) run all forwards first.
        return m * v
    return min((p - rank - 1) * 2 + (v - 1) * p, m * v)


def transfers_of(compute: Compute, rank: int, p: int, v: int,
               kind: str = "interleaved") -> tuple[Transfer | None, Transfer | None]:
    """(the receive this compute needs, the send it produces), either may be
    None: at the ends of the model, for W (it sends nothing), and across a
    boundary whose two stages share a rank."""
    if compute.op == "W":
        return None, None
    stage = virtual_stage_of(kind, p, v, rank, compute.chunk)
    last = p * v - 1
    mb = compute.microbatch

    def peer(other_stage: int) -> int | None:
        other = location_of(kind, p, v, other_stage)[0]
        return None if other == rank else other

    recv = send = None
    if compute.op == "F":
        if stage > 0 and peer(stage - 1) is not None:
            recv = Transfer("recv", "activation", mb, stage - 1, peer(stage - 1))
        if stage < last and peer(stage + 1) is not None:
            send = Transfer("send", "activation", mb, stage, peer(stage + 1))
    else:
        if stage < last and peer(stage + 1) is not None:
            recv = Transfer("recv", "grad", mb, stage, peer(stage + 1))
        if stage > 0 and peer(stage - 1) is not None:
            send = Transfer("send", "grad", mb, stage - 1, peer(stage - 1))
    return recv, send
