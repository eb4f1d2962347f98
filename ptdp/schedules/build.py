"""Pipeline schedules: a kind's action lists, built by its record's generator.

A schedule is a pure function (kind, p, m, v) -> one list of actions per
pipeline rank (the vocabulary, Compute/Exchange/Transfer/Schedule, and the
placements of virtual stages on ranks are in actions.py). Each kind's record
(kinds.py) checks the arguments and names its generator:
- the looped kinds: one_f_one_b.py (one loop, different warm-ups);
- the kinds that split the backward (Qi et al., "Zero Bubble Pipeline
  Parallelism", ICLR 2024): zero_bubble.py, where "B" computes only the
  gradient with respect to the chunk's input (what the previous stage waits
  for) and "W" the weight gradients (what nobody waits for), so W can fill
  what would be bubbles; see there for their orders and the V placement.
`layers_of` maps (rank, chunk) to its layers through split.py.
"""

from __future__ import annotations

from ptdp.schedules.actions import Schedule, ScheduleError
from ptdp.schedules.kinds import Costs, kind_named, looped_forward_only, virtual_stage_of
from ptdp.schedules.split import EVEN, split_problems, stage_layer_counts


def build_schedule(kind: str, p: int, m: int, v: int = 1, costs: Costs | None = None) -> Schedule:
    """Every pipeline rank's action list for one iteration (one flush).
    `costs` ((rank, chunk, op), duration) pairs: under the kinds that split
    the backward the exchanges are placed for computes of those durations
    (default: all equal); the order of the computes never depends on them.
    A tuple, so that schedules can be cached by their arguments."""
    return kind_named(kind).schedule(p, m, v, costs)


def uniform_costs(p: int, v: int, per_op: dict) -> tuple:
    """build_schedule's `costs` when every rank's chunk takes the same time per op."""
    return tuple(((rank, chunk, op), cost) for rank in range(p) for chunk in range(v)
                 for op, cost in per_op.items())


def build_forward_only(p: int, m: int, v: int = 1, placement: str | None = None) -> Schedule:
    """Evaluation: every forward, no backward (same microbatch order as
    training). `placement`: the training schedule's kind, for its placement
    (None: looped)."""
    if placement is None:
        return looped_forward_only(p, m, v)
    return kind_named(placement).forward_only(p, m, v)


def layers_of(rank: int, chunk: int, p: int, v: int, num_layers: int,
              kind: str | None = None, split=None) -> list[int]:
    """Global indices of the layers of (rank, chunk): those of its virtual
    stage k = virtual_stage_of(kind, ...). Evenly split, stage k holds
    l/(p·v) layers from k·(l/(p·v)); for the looped kinds c·(l/v) +
    r·(l/(p·v)). `kind` gives the placement (None: looped); a LayerSplit
    (ptdp.schedules.split) an uneven split."""
    split = EVEN if split is None else split
    if split.even and num_layers % (p * v):
        raise ScheduleError(f"{num_layers} layers do not split into p·v = {p * v} equal chunks")
    problems = split_problems(num_layers, p, v, kind, split)
    if problems:
        raise ScheduleError("; ".join(problems))
    counts = stage_layer_counts(num_layers, p, v, kind, split)
    stage = virtual_stage_of(kind, p, v, rank, chunk)
    first = sum(counts[:stage])
    return list(range(first, first + counts[stage]))
