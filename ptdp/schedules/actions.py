"""Pipeline schedules as data: the vocabulary every schedule is written in.

A schedule is one list of actions per pipeline rank for one iteration (one
flush). The executor runs these lists, the player (player.py) times them,
the invariant checker (simulate.py) checks them, the plotter draws them;
nothing in this package touches torch. The generators (one_f_one_b.py: the
looped kinds; zero_bubble.py: the kinds that split the backward) import this
module, never the reverse; kinds.py holds one record per kind (its rules,
its generator, its placement) and build.py builds a kind's schedule.

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

Under the kinds that split the backward (ScheduleKind.splits_backward) "B"
computes only the gradient with respect to the chunk's input and "W" the
weight gradients; under the other kinds "B" is the whole backward and there
is no "W".

Placement. Where the virtual stages sit on the ranks is a Placement: LOOPED
(chunk c of rank r is stage c·p + r) or V_SHAPE (rank r holds stages r and
2p - 1 - r, so a microbatch goes down the ranks on chunk 0 and back up on
chunk 1, and rank 0 holds the first and the last stage).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

# Schedule.kind of an evaluation schedule: every forward, no backward.
FORWARD_ONLY = "forward-only"


@dataclass(frozen=True)
class Compute:
    op: str          # "F", "B" or "W" (W only under kinds that split the backward)
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
class Placement:
    """Where the virtual stages sit on the ranks: `stage(p, v, rank, chunk)`
    and its inverse `location(p, v, stage)` -> (rank, chunk)."""
    name: str
    stage: Callable[[int, int, int, int], int]
    location: Callable[[int, int, int], tuple[int, int]]


def _looped_stage(p: int, v: int, rank: int, chunk: int) -> int:
    return chunk * p + rank


def _looped_location(p: int, v: int, stage: int) -> tuple[int, int]:
    return stage % p, stage // p


def _v_stage(p: int, v: int, rank: int, chunk: int) -> int:
    return rank if chunk == 0 else 2 * p - 1 - rank


def _v_location(p: int, v: int, stage: int) -> tuple[int, int]:
    return (stage, 0) if stage < p else (2 * p - 1 - stage, 1)


# Module-level functions, so that a Schedule pickles (it crosses process pools).
LOOPED = Placement("looped", _looped_stage, _looped_location)
V_SHAPE = Placement("V", _v_stage, _v_location)


@dataclass(frozen=True)
class Schedule:
    kind: str
    p: int
    m: int
    v: int
    ranks: tuple[tuple[Action, ...], ...]
    # Where the virtual stages sit on the ranks (an evaluation schedule:
    # its training kind's placement).
    placement: Placement = LOOPED
    # B is the input-gradient half of a backward and W computes exist.
    splits_backward: bool = False
    # Each rank's warm-up forwards where the generator counts them (the
    # looped kinds); None: read off the data (the orders are not closed-form).
    warmups: tuple[int, ...] | None = None

    @property
    def num_stages(self) -> int:
        return self.p * self.v

    @property
    def zero_bubble(self) -> bool:
        """B is the input-gradient half of a backward and W computes exist."""
        return self.splits_backward

    def virtual_stage(self, rank: int, chunk: int) -> int:
        return self.placement.stage(self.p, self.v, rank, chunk)

    def location(self, stage: int) -> tuple[int, int]:
        """(rank, chunk) that holds virtual stage `stage`."""
        return self.placement.location(self.p, self.v, stage)

    def is_local_boundary(self, boundary: int) -> bool:
        """Stages `boundary` and `boundary + 1` are on the same rank (the
        bottom of a V): the tensor crossing it never leaves the rank, so the
        schedule has no Transfer for it; the consumer takes the producer's
        output (or input gradient) directly."""
        return self.location(boundary)[0] == self.location(boundary + 1)[0]

    def warmup(self, rank: int) -> int:
        if self.warmups is None:
            computes = self.computes(rank)
            return next((k for k, c in enumerate(computes) if c.op != "F"), len(computes))
        return self.warmups[rank]

    def in_flight_bound(self, rank: int) -> int:
        """Most (microbatch, chunk) activations rank holds at once: the warm-up
        forwards plus the one of the first steady-state forward. When the
        backward is split an activation is held from its F until its W (W
        needs the stored inputs) and the bound is counted off the data."""
        if self.zero_bubble:
            return peak_stored(self.computes(rank), release_op="W")
        if self.warmups is None:  # built by hand: count it off the data
            return peak_stored(self.computes(rank), release_op="B")
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


def chunk_neighbours(rank: int, p: int, v: int, placement: Placement = LOOPED
                     ) -> list[tuple[int, int | None, int | None]]:
    """Per chunk of rank `rank`: (its virtual stage, the rank of the stage
    after it, of the stage before it), None where there is none or it is
    on this rank: what transfers_of reads, for callers that place many
    computes."""
    last = p * v - 1
    sides = []
    for chunk in range(v):
        stage = placement.stage(p, v, rank, chunk)
        after = placement.location(p, v, stage + 1)[0] if stage < last else rank
        before = placement.location(p, v, stage - 1)[0] if stage > 0 else rank
        sides.append((stage, None if after == rank else after, None if before == rank else before))
    return sides


def transfers_of(compute: Compute, rank: int, p: int, v: int,
                 placement: Placement = LOOPED) -> tuple[Transfer | None, Transfer | None]:
    """(the receive this compute needs, the send it produces), either may be
    None: at the ends of the model, for W (it sends nothing), and across a
    boundary whose two stages share a rank."""
    if compute.op == "W":
        return None, None
    stage = placement.stage(p, v, rank, compute.chunk)
    last = p * v - 1
    mb = compute.microbatch

    def peer(other_stage: int) -> int | None:
        other = placement.location(p, v, other_stage)[0]
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
