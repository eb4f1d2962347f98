"""Schedule kinds as records: one frozen ScheduleKind per kind, and the registry.

Every rule that depends on the kind lives in its record: how many chunks a
rank holds (a fixed v, or any), where the virtual stages sit (placement),
how few stages and microbatches it needs, whether m must be a multiple of p,
whether it splits the backward into B and W, its title and bubble formula,
and its generator. The configuration's checks, the planner, the timeline,
the performance model and the executor ask the record, never the name:
adding a schedule is adding a generator and its record (`register`).

The `--pipeline-schedule` values are the records with `flag` set; one of
them with chunks (--num-layers-per-virtual-pipeline-stage) runs as the kind
its `with_chunks` names (1f1b with chunks is the interleaved kind, which is
no flag value of its own).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Iterator

import numpy as np

from ptdp.schedules.actions import (FORWARD_ONLY, LOOPED, V_SHAPE, Compute, Placement, Schedule,
                                    ScheduleError)
from ptdp.schedules.one_f_one_b import (INTERLEAVED, build_looped, build_looped_forward_only,
                                        looped_op_codes, looped_order)
from ptdp.schedules.zero_bubble import (ZB_H1, ZBV, build_zbv_forward_only, build_zero_bubble,
                                        costs_from_table, unit_cost, zero_bubble_op_codes,
                                        zero_bubble_order)

# ((rank, chunk, op), duration) pairs: build_schedule's `costs` (a tuple, so cacheable).
Costs = tuple[tuple[tuple[int, int, str], float], ...]
_NUMBERS = {1: "one", 2: "two", 3: "three", 4: "four"}


def _pipeline_bubble(p: int, m: int, v: int) -> Fraction:
    return Fraction(p - 1, m)


def looped_forward_only(p: int, m: int, v: int) -> Schedule:
    check_arguments(INTERLEAVED if v > 1 else GPIPE, p, m, v)
    return build_looped_forward_only(p, m, v)


@dataclass(frozen=True)
class ScheduleKind:
    name: str
    title: str                      # the timeline's title
    # (p, m, v, costs) -> the schedule (arguments already checked). `costs`:
    # ((rank, chunk, op), duration) pairs the exchanges are placed for, or None.
    generate: Callable[[int, int, int, Costs | None], Schedule]
    # (p, m, v, rank) -> that rank's computes in schedule order (no exchanges).
    order: Callable[[int, int, int, int], list[Compute]]
    chunks: int | None = 1          # chunks per rank v; None: any v
    placement: Placement = LOOPED
    microbatches_per_rank: int = 0  # fewest microbatches: this × p (at least 1)
    microbatches_multiple_of_p: bool = False
    splits_backward: bool = False   # B (input gradient) and W (weight gradients) apart
    bubble: Callable[[int, int, int], Fraction] = _pipeline_bubble   # (p, m, v), unit costs
    bubble_formula: str = "(p-1)/m"
    # (p, m, v) -> evaluation's schedule under this kind's placement (arguments unchecked).
    forward_only: Callable[[int, int, int], Schedule] = looped_forward_only
    # (p, m, v, rank) -> `order`'s ops (F 0, B 1, W 2) and chunks alone, as
    # arrays made without its computes (a planner's memory model reads
    # thousands of ranks); None: read from `order`.
    op_codes: Callable[[int, int, int, int], tuple[np.ndarray, np.ndarray]] | None = None
    flag: bool = True               # a --pipeline-schedule value
    with_chunks: str | None = None  # the kind this flag value runs as with v > 1 chunks
    searched: bool = True           # `ptdp plan` tries it when --pipeline-schedule is free
    # The kind to offer where m is too small for this one, and the kind with
    # the other chunk count (each a name, or None).
    fewer_microbatches: str | None = None
    other_chunks: str | None = None
    help: str = ""                  # its part of --pipeline-schedule's help

    @property
    def fewest_stages(self) -> int:
        """Two chunks per rank passing activations to each other need two ranks."""
        return 2 if (self.chunks or 1) > 1 else 1

    def fewest_microbatches(self, p: int) -> int:
        return max(1, self.microbatches_per_rank * p)

    @property
    def fewest_text(self) -> str:
        """The fewest microbatches as a formula: "p", "2p"."""
        k = self.microbatches_per_rank
        return "p" if k == 1 else f"{k}p"

    @property
    def in_a_v(self) -> str:
        return " in a V" if self.placement is V_SHAPE else ""

    @property
    def chunks_word(self) -> str:
        """Its chunks per rank in words: 'one', 'two'."""
        n = self.chunks or 1
        return str(_NUMBERS.get(n, n))

    @property
    def chunks_words(self) -> str:
        """'one chunk per rank', 'two chunks per rank in a V'."""
        n = self.chunks or 1
        return f"{self.chunks_word} chunk{'s' * (n > 1)} per rank{self.in_a_v}"

    @property
    def fixed_chunks(self) -> int | None:
        """v when it keeps a fixed v > 1 of its own (None otherwise)."""
        return self.chunks if self.keeps_its_chunks and (self.chunks or 1) > 1 else None

    @property
    def keeps_its_chunks(self) -> bool:
        """As a --pipeline-schedule value it keeps its own chunks per rank:
        --num-layers-per-virtual-pipeline-stage never makes it interleaved
        (the kinds that split the backward; gpipe with the flag is refused)."""
        return self.splits_backward

    @property
    def takes_layers_per_chunk(self) -> bool:
        """--num-layers-per-virtual-pipeline-stage means something under it:
        it interleaves (or takes any v), or it has a fixed v > 1 (and the flag
        must agree)."""
        return self.with_chunks is not None or self.chunks != 1

    def schedule(self, p: int, m: int, v: int, costs: Costs | None = None) -> Schedule:
        check_arguments(self.name, p, m, v)
        return self.generate(p, m, v, costs)

    def argument_problem(self, p: int, m: int, v: int) -> str | None:
        """Why this kind cannot run p ranks, m microbatches, v chunks (None: it can)."""
        if self.chunks is not None and self.chunks > 1 and v != self.chunks:
            return (f"the {self.name} schedule has {self.chunks_words} (v = {self.chunks}), "
                    f"not v = {v}")
        fewest = self.fewest_microbatches(p)
        if m < fewest:
            return (f"the {self.name} schedule needs at least {self.fewest_text} = {fewest} "
                    f"microbatches, not m = {m}: use m = {fewest} (or any m >= {fewest})")
        if self.chunks == 1 and v != 1:
            any_v = any_chunks_kind().name
            return (f"the {self.name} schedule has one chunk per rank (v = 1), not v = {v}; "
                    f"use kind '{any_v}' for v > 1")
        if self.microbatches_multiple_of_p and m % p:
            lower, upper = (m // p) * p, (m // p + 1) * p
            return (f"the {self.name} schedule runs microbatches in groups of p = {p}, so m = {m} "
                    f"must be a multiple of {p}: use m = "
                    + (f"{lower} or {upper}" if lower else f"{upper}"))
        return None


def _zero_bubble_costs(costs: Costs | None):
    return costs_from_table(dict(costs)) if costs else unit_cost


def _zbv_forward_only(p: int, m: int, v: int) -> Schedule:
    check_arguments(ZBV, p, max(m, 2 * p), v)  # any m: no backward to overlap
    return build_zbv_forward_only(p, m)


def _looped(name: str, **fields) -> ScheduleKind:
    return ScheduleKind(
        name, generate=lambda p, m, v, costs: build_looped(name, p, m, v),
        order=lambda p, m, v, rank: looped_order(name, p, m, v, rank),
        op_codes=lambda p, m, v, rank: looped_op_codes(name, p, m, v, rank), **fields)


def _zero_bubble(name: str, **fields) -> ScheduleKind:
    return ScheduleKind(
        name, generate=lambda p, m, v, costs: build_zero_bubble(name, p, m,
                                                                _zero_bubble_costs(costs)),
        order=lambda p, m, v, rank: zero_bubble_order(name, p, m, rank), splits_backward=True,
        op_codes=lambda p, m, v, rank: zero_bubble_op_codes(name, p, m, rank),
        **fields)


GPIPE = "gpipe"
DEFAULT_SCHEDULE = "1f1b"   # --pipeline-schedule's default
KINDS: dict[str, ScheduleKind] = {k.name: k for k in (
    _looped(GPIPE, title="GPipe", searched=False,
            help="gpipe (all forwards, then all backwards)"),
    _looped(DEFAULT_SCHEDULE, title="1F1B (PipeDream-Flush)", with_chunks=INTERLEAVED,
            help=DEFAULT_SCHEDULE),
    _looped(INTERLEAVED, title="Interleaved 1F1B", chunks=None, microbatches_multiple_of_p=True,
            bubble=lambda p, m, v: Fraction(p - 1, m * v), bubble_formula="(p-1)/(m·v)",
            flag=False),
    _zero_bubble(ZB_H1, title="ZB-H1 (zero bubble)", microbatches_per_rank=1,
                 bubble=lambda p, m, v: Fraction(p - 1, 3 * m),
                 bubble_formula="(p-1)/(3m) at F = B = W", fewer_microbatches=DEFAULT_SCHEDULE,
                 other_chunks=ZBV,
                 help=f"{ZB_H1} (one chunk per rank, 1F1B's memory, needs m >= p microbatches)"),
    _zero_bubble(ZBV, title="ZB-V (zero bubble, V placement)", chunks=2, placement=V_SHAPE,
                 microbatches_per_rank=2, bubble=lambda p, m, v: Fraction(p - 1, 6 * m),
                 bubble_formula="(p-1)/(6m) at F = B = W", forward_only=_zbv_forward_only,
                 fewer_microbatches=ZB_H1, other_chunks=ZB_H1,
                 help=f"{ZBV} (two chunks per rank in a V, needs m >= 2p)"),
)}


def or_list(names) -> str:
    """'a, b or c'."""
    names = list(names)
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def any_chunks_kind() -> ScheduleKind:
    """The kind that takes any v (the interleaved one)."""
    return next(k for k in KINDS.values() if k.chunks is None)


def register(kind: ScheduleKind) -> ScheduleKind:
    """Add a kind: from then on every consumer accepts it by name."""
    if kind.name in KINDS or kind.name == FORWARD_ONLY:
        raise ScheduleError(f"schedule kind {kind.name!r} is already registered")
    KINDS[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    del KINDS[name]


def kind_named(name: str) -> ScheduleKind:
    if name not in KINDS:
        raise ScheduleError(f"unknown schedule kind {name!r}: use one of {', '.join(KINDS)}")
    return KINDS[name]


class _Names:
    """The names of the records `keep` selects, read at each use (a kind
    registered later is in them): argparse's and the config's choices."""

    def __init__(self, keep: Callable[[ScheduleKind], bool], default_first: bool = False):
        self._keep, self._default_first = keep, default_first

    def __iter__(self) -> Iterator[str]:
        names = [k.name for k in KINDS.values() if self._keep(k)]
        if self._default_first:
            names.sort(key=lambda name: name != DEFAULT_SCHEDULE)
        return iter(names)

    def __contains__(self, name) -> bool:
        return name in KINDS and self._keep(KINDS[name])

    def __len__(self) -> int:
        return len(list(iter(self)))

    def __repr__(self) -> str:
        return repr(tuple(self))


KIND_NAMES = _Names(lambda k: True)            # `ptdp schedule --kind`
FLAG_CHOICES = _Names(lambda k: k.flag)       # `--pipeline-schedule`
PLAN_CHOICES = _Names(lambda k: k.flag, default_first=True)   # `ptdp plan --pipeline-schedule`
SEARCHED = _Names(lambda k: k.flag and k.searched)
SPLIT_BACKWARD = _Names(lambda k: k.splits_backward)


def flag_help() -> str:
    """--pipeline-schedule's help, from the records."""
    plain = [k.help or k.name for k in KINDS.values() if k.flag and not k.splits_backward]
    split = [k.help or k.name for k in KINDS.values() if k.flag and k.splits_backward]
    chunked = [k for k in KINDS.values() if k.with_chunks]
    return (", ".join(plain) + ", or a zero-bubble schedule (backward split into input and weight "
            "gradients, the weight gradients filling the bubbles): " + " or ".join(split)
            + "".join(f"; --num-layers-per-virtual-pipeline-stage with {k.name} selects the "
                      f"{lower_first(KINDS[k.with_chunks].title)} schedule" for k in chunked))


def lower_first(title: str) -> str:
    """'Interleaved 1F1B' -> 'interleaved 1F1B', as it reads inside a sentence."""
    return title[:1].lower() + title[1:]


def check_arguments(kind: str, p: int, m: int, v: int) -> None:
    record = kind_named(kind)
    for name, value in (("p", p), ("m", m), ("v", v)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"{name} = {value!r} must be a positive integer")
    if v > 1 and p < 2:
        raise ScheduleError(f"v = {v} chunks per rank need p >= 2 ranks: with one rank the chunks "
                            f"would pass activations to themselves")
    problem = record.argument_problem(p, m, v)
    if problem:
        raise ScheduleError(problem)


def running_kind(schedule: str, v: int) -> str:
    """The kind a --pipeline-schedule value runs as with v chunks per rank:
    a kind with a fixed v > 1 is itself; any other interleaves when v > 1."""
    record = KINDS.get(schedule)
    if record is not None and (record.chunks or 1) > 1:
        return schedule
    if v > 1:
        return any_chunks_kind().name
    return schedule


def placement_of(kind: str | None) -> Placement:
    """Where `kind` places the virtual stages (None: looped)."""
    return LOOPED if kind in (None, FORWARD_ONLY) else kind_named(kind).placement


def virtual_stage_of(kind: str | None, p: int, v: int, rank: int, chunk: int) -> int:
    """Virtual stage of (rank, chunk) under `kind`'s placement (actions.Placement)."""
    return placement_of(kind).stage(p, v, rank, chunk)


def location_of(kind: str | None, p: int, v: int, stage: int) -> tuple[int, int]:
    """(rank, chunk) holding virtual stage `stage`: the inverse of virtual_stage_of."""
    return placement_of(kind).location(p, v, stage)

