"""Pipeline schedules: which generator builds a kind's action lists.

A schedule is a pure function (kind, p, m, v) -> one list of actions per
pipeline rank (the vocabulary, Compute/Exchange/Transfer/Schedule, and the
placement of virtual stages on ranks are in actions.py). This module only
dispatches, and so sits above the generators, which never import it:
- gpipe, 1f1b and interleaved: one_f_one_b.py (one loop, different warm-ups);
- zb-h1 and zbv (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024):
  zero_bubble.py, which splits each backward in two: "B" computes only the
  gradient with respect to the chunk's input (what the previous stage waits
  for) and "W" the weight gradients (what nobody waits for), so W can fill
  what would be bubbles; see there for zb-h1 and zbv and the V placement.
`layers_of` maps (rank, chunk) to its layers through split.py.
"""

from __future__ import annotations

from ptdp.parallel.pipeline.actions import (ZERO_BUBBLE_KINDS, Schedule, ScheduleError,
                                            check_arguments, virtual_stage_of)
from ptdp.parallel.pipeline.one_f_one_b import build_looped, build_looped_forward_only
from ptdp.parallel.pipeline.split import EVEN, split_problems, stage_layer_counts
from ptdp.parallel.pipeline.zero_bubble import (build_zbv_forward_only, build_zero_bubble,
                                                costs_from_table, unit_cost)


def build_schedule(kind: str, p: int, m: int, v: int = 1,
                   costs: tuple[tuple[tuple[int, int, str], float], ...] | None = None) -> Schedule:
    """Every pipeline rank's action list for one iteration (one flush).
    `costs` ((rank, chunk, op), duration) pairs: under the zero-bubble kinds
    the exchanges are placed for computes of those durations (default: all
    equal); the order of the computes never depends on them. A tuple, so
    that schedules can be cached by their arguments."""
    check_arguments(kind, p, m, v)
    if kind in ZERO_BUBBLE_KINDS:
        return build_zero_bubble(kind, p, m, costs_from_table(dict(costs)) if costs else unit_cost)
    return build_looped(kind, p, m, v)


def uniform_costs(p: int, v: int, per_op: dict) -> tuple:
    """build_schedule's `costs` when every rank's chunk takes the same time per op."""
    return tuple(((rank, chunk, op), cost) for rank in range(p) for chunk in range(v)
                 for op, cost in per_op.items())


def build_forward_only(p: int, m: int, v: int = 1, placement: str = "interleaved") -> Schedule:
    """Evaluation: every forward, no backward (same microbatch order as
    training). `placement`: the training schedule's kind, for zbv's V."""
    if placement == "zbv":
        check_arguments("zbv", p, max(m, 2 * p), v)  # any m: no backward to overlap
        return build_zbv_forward_only(p, m)
    check_arguments("interleaved" if v > 1 else "gpipe", p, m, v)
    return build_looped_forward_only(p, m, v)


def layers_of(rank: int, chunk: int, p: int, v: int, num_layers: int,
              kind: str = "interleaved", split=None) -> list[int]:
    """Global indices of the layers of (rank, chunk): those of its virtual
    stage k = virtual_stage_of(kind, ...). Evenly split, stage k holds
    l/(p·v) layers from k·(l/(p·v)); for the looped kinds c·(l/v) +
    r·(l/(p·v)). Pass kind="zbv" for the V placement, and a LayerSplit
    (ptdp.parallel.pipeline.split) for an uneven one."""
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
