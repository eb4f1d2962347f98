"""The memory model's held states (ptdp.perf.analytic.counts._held_states),
found with arrays from each rank's op codes, against the walk over every
compute that found them before: the same maximal states, hence the same
`stash_peaks` for any weights."""

from __future__ import annotations

import dataclasses
import random

import pytest

from ptdp.perf.analytic.counts import _held_states, stash_peaks
from ptdp.schedules.kinds import kind_named, register, unregister

# (kind, p, m, v): m below p, equal to it, and not a multiple of it where
# the kind allows; interleaved with two to four chunks; p = 1 where allowed.
CASES = [("gpipe", 1, 3, 1), ("gpipe", 3, 2, 1), ("gpipe", 4, 7, 1),
         ("1f1b", 1, 4, 1), ("1f1b", 4, 3, 1), ("1f1b", 4, 4, 1), ("1f1b", 5, 13, 1),
         ("1f1b", 8, 32, 1),
         ("interleaved", 2, 2, 2), ("interleaved", 4, 4, 2), ("interleaved", 4, 12, 2),
         ("interleaved", 3, 9, 3), ("interleaved", 4, 8, 3), ("interleaved", 8, 24, 2),
         ("interleaved", 3, 6, 4),
         ("zb-h1", 1, 3, 1), ("zb-h1", 4, 4, 1), ("zb-h1", 4, 7, 1), ("zb-h1", 6, 20, 1),
         ("zbv", 2, 4, 2), ("zbv", 3, 7, 2), ("zbv", 4, 8, 2),
         ("zbv", 5, 23, 2), ("zbv", 8, 40, 2)]


def _held_states_by_walking(kind: str, p: int, m: int, v: int, rank: int) -> set[tuple[int, ...]]:
    """The walk _held_states did before it used arrays, over the kind's own
    computes (its `order`): the states before each B or W that follows a
    rising run, and the last, less those another state covers."""
    zero_bubble = kind_named(kind).splits_backward
    held, states, rising = [0] * (2 * v), set(), True
    for compute in kind_named(kind).order(p, m, v, rank):
        op, chunk = compute.op, compute.chunk
        if op == "F":
            held[chunk] += 1
            rising = True
            continue
        if rising:
            states.add(tuple(held))
        if op == "B":
            held[chunk] -= 1
            held[v + chunk] += zero_bubble
            rising = zero_bubble
        else:
            held[v + chunk] -= 1
            rising = False
    states.add(tuple(held))
    kept: list[tuple[int, ...]] = []
    for state in sorted(states, key=sum, reverse=True):
        if not any(all(a >= b for a, b in zip(other, state)) for other in kept):
            kept.append(state)
    return set(kept)


@pytest.mark.parametrize("kind,p,m,v", CASES, ids=[f"{k}-p{p}-m{m}-v{v}" for k, p, m, v in CASES])
def test_held_states_and_stash_peaks_equal_the_walk(kind, p, m, v):
    rng = random.Random(f"{kind}-{p}-{m}-{v}")
    splits = kind_named(kind).splits_backward
    for rank in range(p):
        walked = _held_states_by_walking(kind, p, m, v, rank)
        found = _held_states(kind, p, m, v, rank)
        assert len(found) == len(set(found))
        assert set(found) == walked
        assert all(type(n) is int for state in found for n in state)
        weights = [(1,) * v, tuple(rng.randint(1, 10**12) for _ in range(v))]
        for chunk_weights in weights:
            for deferred in ([None, (0,) * v, tuple(rng.randint(0, 10**12) for _ in range(v))]
                             if splits else [None]):
                both = (*chunk_weights, *(chunk_weights if deferred is None else deferred))
                want = (max(map(sum, walked)),
                        max(sum(n * w for n, w in zip(state, both)) for state in walked))
                assert stash_peaks(kind, p, m, v, rank, chunk_weights, deferred) == want


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved", "zb-h1", "zbv"])
def test_op_codes_equal_the_order_for_every_rank(kind):
    """Each kind's array generator against its `order`, over every rank of
    many (p, m, v) it accepts."""
    record = kind_named(kind)
    for p in range(1, 9):
        for v in ([2, 3] if kind == "interleaved" else [record.chunks or 1]):
            if v > 1 and p < 2:
                continue
            fewest = record.fewest_microbatches(p)
            for m in range(fewest, fewest + 2 * p + 3):
                if record.argument_problem(p, m, v):
                    continue
                for rank in range(p):
                    ops, chunks = record.op_codes(p, m, v, rank)
                    assert list(zip(ops.tolist(), chunks.tolist())) == [
                        ("FBW".index(c.op), c.chunk) for c in record.order(p, m, v, rank)]


def test_a_kind_without_op_codes_is_read_from_its_order():
    record = dataclasses.replace(kind_named("zbv"), name="zbv-read-from-its-order",
                                 op_codes=None, flag=False, searched=False)
    register(record)
    try:
        for rank in range(3):
            assert set(_held_states(record.name, 3, 7, 2, rank)) == \
                _held_states_by_walking("zbv", 3, 7, 2, rank)
    finally:
        unregister(record.name)


@pytest.mark.parametrize("kind", ["zb-h1", "zbv"])
def test_zero_bubble_op_codes_equal_the_steps_below_the_fewest_microbatches(kind):
    """Below the kind's fewest microbatches (which it refuses) the arrays
    are read from the generator's steps: still equal."""
    from ptdp.schedules.zero_bubble import _steps, zero_bubble_op_codes

    for p in range(1, 6):
        for m in range(1, kind_named(kind).fewest_microbatches(p)):
            for rank in range(p):
                ops, chunks = zero_bubble_op_codes(kind, p, m, rank)
                assert list(zip(ops.tolist(), chunks.tolist())) == [
                    ("FBW".index(op), chunk) for op, _, chunk in _steps(kind, p, m, rank)]
