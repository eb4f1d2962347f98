"""Property tests of the zero-bubble schedules (zb-h1, zbv) as pure data.

Every (F|B|W, microbatch, chunk) once per rank, no deadlock, the
dependencies (F after the previous stage's F, B after its F and the next
stage's B, W after its own B), transfers between the right ranks (the V
placement of zbv included), peak stored activations counted from F until W,
the bubble under F = B = W — (p - 1)/(3m) for zb-h1 and (p - 1)/(6m) for
zbv, derived in zero_bubble.py and docs/pipeline-schedules.md — and the
refusal of invalid m.
"""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

import pytest

from ptdp.schedules.actions import Exchange, ScheduleError
from ptdp.schedules.kinds import location_of, virtual_stage_of
from ptdp.schedules.build import build_schedule, layers_of
from ptdp.schedules.simulate import simulate


def m_values(kind, p):
    least = p if kind == "zb-h1" else 2 * p
    return sorted({least, least + 1, least + p // 2 + 1, 2 * least, 2 * least + 3, 3 * least})


CASES = ([("zb-h1", p, m) for p in range(1, 9) for m in m_values("zb-h1", p)]
         + [("zbv", p, m) for p in range(2, 9) for m in m_values("zbv", p)])
V = {"zb-h1": 1, "zbv": 2}


def one_f_one_b_peak(p, rank):
    return p - rank


@pytest.mark.parametrize("kind,p,m", CASES, ids=lambda x: str(x))
def test_zero_bubble_schedule_is_complete_ordered_and_exact(kind, p, m):
    v = V[kind]
    s = build_schedule(kind, p, m, v)
    assert (s.kind, s.p, s.m, s.v, s.zero_bubble) == (kind, p, m, v, True)
    expected = Counter((op, i, c) for op in "FBW" for i in range(m) for c in range(v))
    for r in range(p):
        assert Counter((c.op, c.microbatch, c.chunk) for c in s.computes(r)) == expected
        kinds = [type(a) for a in s.ranks[r]]
        assert all(not (x is Exchange and y is Exchange) for x, y in zip(kinds, kinds[1:]))

    result = simulate(s)  # raises on deadlock, missing inputs, W before B, transfer order
    end, start = {}, {}
    for r, timeline in enumerate(result.timelines):
        for iv in timeline:
            key = (iv.action.op, iv.action.microbatch, s.virtual_stage(r, iv.action.chunk))
            start[key], end[key] = iv.start, iv.end
    last = s.num_stages - 1
    for (op, i, stage), t0 in start.items():
        if op == "F" and stage > 0:
            assert t0 >= end[("F", i, stage - 1)]
        if op == "B":
            assert t0 >= end[("F", i, stage)]
            if stage < last:
                assert t0 >= end[("B", i, stage + 1)]
        if op == "W":
            assert t0 >= end[("B", i, stage)]

    # Bubble under F = B = W (the simulator's default split of backward 2).
    assert result.ideal == 3 * m
    assert result.bubble_fraction == Fraction(p - 1, 3 * m * v)
    assert result.makespan == Fraction(3 * m * v + p - 1, v)

    for r in range(p):
        if kind == "zb-h1":
            # From F until B: 1F1B's count on every rank; from F until W: 1F1B's peak (rank 0's).
            assert result.peak_before_backward[r] == one_f_one_b_peak(p, r)
            assert result.peak_in_flight[r] == p
        else:
            # Chunk activations, each half a rank's: at most 1F1B's peak of p whole ranks.
            assert result.peak_in_flight[r] <= 2 * p
        assert s.in_flight_bound(r) == result.peak_in_flight[r]


@pytest.mark.parametrize("kind,p,m", [("zb-h1", 4, 8), ("zbv", 4, 8), ("zbv", 3, 10)])
def test_other_costs_keep_the_schedule_valid(kind, p, m):
    s = build_schedule(kind, p, m, V[kind])
    for forward, backward, weight, transfer in ((1, 2, Fraction(1, 2), 0), (1, 3, 2, 0),
                                                (2, 3, 1, Fraction(1, 4)), (1, 2, None, 1)):
        result = simulate(s, forward, backward, transfer, weight)
        assert result.ideal == m * (forward + backward)
        assert result.makespan >= result.ideal


def test_zbv_places_the_chunks_in_a_v():
    p = 4
    assert [virtual_stage_of("zbv", p, 2, r, c) for c in (0, 1) for r in range(p)] == \
        [0, 1, 2, 3, 7, 6, 5, 4]
    for stage in range(2 * p):
        assert virtual_stage_of("zbv", p, 2, *location_of("zbv", p, 2, stage)) == stage
    # The looped kinds are unchanged.
    assert [virtual_stage_of("interleaved", p, 2, r, c) for c in (0, 1) for r in range(p)] == \
        list(range(8))
    assert layers_of(0, 1, p, 2, 16, kind="zbv") == [14, 15]
    assert layers_of(3, 1, p, 2, 16, kind="zbv") == [8, 9]
    assert layers_of(0, 1, p, 2, 16) == [8, 9]
    assert sorted(l for r in range(p) for c in (0, 1) for l in layers_of(r, c, p, 2, 16, kind="zbv")) \
        == list(range(16))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (5, 13)])
def test_zbv_transfers_follow_the_v(p, m):
    s = build_schedule("zbv", p, m, 2)
    assert s.is_local_boundary(p - 1)
    assert not any(s.is_local_boundary(k) for k in range(2 * p - 1) if k != p - 1)
    seen = Counter()
    for r in range(p):
        for a in s.ranks[r]:
            if not isinstance(a, Exchange):
                continue
            for t in a.transfers:
                low, high = s.location(t.boundary)[0], s.location(t.boundary + 1)[0]
                source, target = (low, high) if t.kind == "activation" else (high, low)
                assert (r, t.peer) == ((source, target) if t.op == "send" else (target, source))
                assert abs(r - t.peer) == 1
                seen[(t.op, t.kind, t.boundary)] += 1
    for op in ("send", "recv"):
        for kind in ("activation", "grad"):
            for k in range(2 * p - 1):
                assert seen[(op, kind, k)] == (0 if k == p - 1 else m)


@pytest.mark.parametrize("kind,p,m,v,nearest", [
    ("zb-h1", 4, 3, 1, "use m = 4"),
    ("zb-h1", 8, 1, 1, "use m = 8"),
    ("zbv", 4, 7, 2, "use m = 8"),
    ("zbv", 3, 2, 2, "use m = 6"),
])
def test_too_few_microbatches_are_refused_with_the_nearest_valid_m(kind, p, m, v, nearest):
    with pytest.raises(ValueError, match=nearest):
        build_schedule(kind, p, m, v)


def test_zbv_needs_two_chunks_and_two_ranks():
    with pytest.raises(ScheduleError, match="v = 2"):
        build_schedule("zbv", 4, 8, 3)
    with pytest.raises(ScheduleError, match="p >= 2"):
        build_schedule("zbv", 1, 4, 2)
    with pytest.raises(ScheduleError, match="one chunk"):
        build_schedule("zb-h1", 4, 8, 2)


def test_weight_cost_only_for_zero_bubble_kinds():
    with pytest.raises(ScheduleError, match="weight cost"):
        simulate(build_schedule("1f1b", 2, 4), weight_cost=1)
    with pytest.raises(ScheduleError, match="strictly between"):
        simulate(build_schedule("zb-h1", 2, 4), backward_cost=2, weight_cost=2)


def test_fused_kinds_report_the_same_peak_both_ways():
    result = simulate(build_schedule("1f1b", 4, 8))
    assert result.peak_in_flight == result.peak_before_backward == [4, 3, 2, 1]


def test_schedule_command_prints_and_draws_zero_bubble(tmp_path, capsys):
    import argparse
    import json

    from ptdp.commands.schedule import add_schedule_parser, run_schedule_command

    parser = argparse.ArgumentParser()
    add_schedule_parser(parser.add_subparsers())
    out = tmp_path / "zbv.png"
    assert run_schedule_command(parser.parse_args(
        ["schedule", "--kind", "zbv", "-p", "2", "-m", "4", "--out", str(out), "--json"])) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["v"], data["weight_cost"], data["bubble_fraction_exact"]) == (2, 1, "1/24")
    assert out.stat().st_size > 0
    assert any(a.startswith("W") for a in data["actions"][0])
    assert run_schedule_command(parser.parse_args(
        ["schedule", "--kind", "zb-h1", "-p", "4", "-m", "8", "--weight-cost", "1/2"])) == 0
    assert "B 3/2 + W 1/2" in capsys.readouterr().out
    assert run_schedule_command(parser.parse_args(
        ["schedule", "--kind", "1f1b", "-p", "4", "-m", "8", "--weight-cost", "1"])) == 2
    assert run_schedule_command(parser.parse_args(
        ["schedule", "--kind", "zbv", "-p", "4", "-m", "6"])) == 2
    assert "use m = 8" in capsys.readouterr().err


# Exchanges placed for the costs the computes really take --------------------------------

from ptdp.schedules.build import uniform_costs  # noqa: E402
from ptdp.schedules.simulate import compute_costs  # noqa: E402
from ptdp.schedules.zero_bubble import costs_from_table, plan_timed  # noqa: E402


@pytest.mark.parametrize("kind,p,m", [("zb-h1", 4, 16), ("zbv", 4, 16), ("zb-h1", 2, 6), ("zbv", 3, 9)])
@pytest.mark.parametrize("backward,weight", [(Fraction(18, 10), Fraction(7, 10)),
                                             (Fraction(3), Fraction(1, 2))])
def test_exchanges_placed_for_unequal_costs_wait_for_nothing(kind, p, m, backward, weight):
    """F = 1, B + W = `backward`: the schedule built for these costs plays in
    the makespan its plan promises (nobody waits at an exchange), which is
    no more than the one placed for F = B = W played with the same costs."""
    v = 2 if kind == "zbv" else 1
    per_op = compute_costs(build_schedule(kind, p, m, v), 1, backward, weight)
    costs = uniform_costs(p, v, per_op)
    placed = simulate(build_schedule(kind, p, m, v, costs), 1, backward, 0, weight)
    plan = plan_timed(kind, p, m, cost=costs_from_table(dict(costs)))
    assert placed.makespan == max(end for row in plan for _, _, end in row)
    unit_placed = simulate(build_schedule(kind, p, m, v), 1, backward, 0, weight)
    assert placed.makespan <= unit_placed.makespan


# The plan's times from its cached flat dataflow --------------------------------------

import random  # noqa: E402

from ptdp.schedules.actions import Compute, Transfer, transfers_of  # noqa: E402
from ptdp.schedules.kinds import KINDS  # noqa: E402
from ptdp.schedules.zero_bubble import zero_bubble_order  # noqa: E402


def _plan_round_robin(kind, p, m, cost):
    """plan_timed's definition, walked the plain way: move every rank as far
    as its inputs' end times are known, round after round."""
    v = 2 if kind == "zbv" else 1
    placement, last = KINDS[kind].placement, 2 * p - 1 if kind == "zbv" else p - 1
    orders = [zero_bubble_order(kind, p, m, r) for r in range(p)]
    end, plan, free = {}, [[] for _ in range(p)], [0] * p
    while any(len(plan[r]) < len(orders[r]) for r in range(p)):
        for r in range(p):
            while len(plan[r]) < len(orders[r]):
                c = orders[r][len(plan[r])]
                stage = placement.stage(p, v, r, c.chunk)
                needs = {"F": [("F", c.microbatch, stage - 1)] if stage > 0 else [],
                         "B": [("F", c.microbatch, stage)]
                         + ([("B", c.microbatch, stage + 1)] if stage < last else []),
                         "W": [("B", c.microbatch, stage)]}[c.op]
                if any(n not in end for n in needs):
                    break
                start = max([free[r]] + [end[n] for n in needs])
                end[(c.op, c.microbatch, stage)] = free[r] = start + cost(r, c)
                plan[r].append((c, start, free[r]))
    return plan


@pytest.mark.parametrize("kind,p,m", [("zb-h1", 4, 9), ("zbv", 4, 11), ("zbv", 6, 24),
                                      ("zb-h1", 8, 20)])
def test_cached_dataflow_times_and_exchanges_equal_the_plain_walk(kind, p, m):
    """Random float costs (ties between ranks' inputs included): the cached
    flat dataflow gives the round-robin walk's times, and every send sits
    right after its producer and its receive in the exchange before the
    receiver's first compute starting at or after the producer's end."""
    rng = random.Random(p * m)
    table = {(r, c, op): rng.choice([0.5, 1.0, 1.25, rng.random()])
             for r in range(p) for c in range(2) for op in "FBW"}
    cost = costs_from_table(table)
    plan = plan_timed(kind, p, m, cost=cost)
    assert plan == _plan_round_robin(kind, p, m, cost)
    v = 2 if kind == "zbv" else 1
    schedule = build_schedule(kind, p, m, v, tuple(table.items()) if v == 2 else
                              tuple((key, d) for key, d in table.items() if key[1] == 0))
    assert [a for row in schedule.ranks for a in row if isinstance(a, Compute)] == \
        [c for row in plan for c, _, _ in row]
    for r, actions in enumerate(schedule.ranks):
        k = -1   # index of the last compute so far
        for action in actions:
            if isinstance(action, Compute):
                k += 1
                continue
            for t in action.transfers:
                if t.op == "send":
                    _, send = transfers_of(plan[r][k][0], r, p, v, KINDS[kind].placement)
                    assert send == t
                else:
                    producer = next(row for row in plan[t.peer]
                                    if transfers_of(row[0], t.peer, p, v, KINDS[kind].placement)[1]
                                    == Transfer("send", t.kind, t.microbatch, t.boundary, r))
                    starts = [start for _, start, _ in plan[r]]
                    assert all(s < producer[2] for s in starts[:k + 1])
                    assert k + 1 == len(starts) or starts[k + 1] >= producer[2]


# The planner's array forms of the orders, the times and the placement ------------------

import numpy as np  # noqa: E402

from ptdp.schedules import zero_bubble as zb  # noqa: E402


@pytest.mark.parametrize("kind", ["zb-h1", "zbv"])
def test_order_arrays_are_the_orders(kind):
    """order_arrays, made phase by phase in numpy, are the step loops'
    orders for every rank, at m below, at and above the kind's minimum."""
    for p in range(1, 7):
        for m in range(1, 4 * p + 3):
            for rank, (op, microbatch, chunk) in enumerate(zb.order_arrays(kind, p, m)):
                assert list(zip(["FBW"[k] for k in op.tolist()], microbatch.tolist(),
                                chunk.tolist())) == zb._steps(kind, p, m, rank), (p, m, rank)


@pytest.mark.parametrize("kind,p,m", [("zb-h1", 4, 9), ("zbv", 4, 11), ("zbv", 8, 24),
                                      ("zb-h1", 8, 20), ("zb-h1", 1, 3), ("zbv", 2, 4)])
def test_level_times_and_placement_are_the_loops_bit_for_bit(kind, p, m):
    """The times found level by level in numpy are _timed's loop's, bit for
    bit (random floats, ties, zero costs), and so is the placement made
    from them; costs numpy might add otherwise (float32, negative) take
    the loop. Each row's other end is the same transfer's other op."""
    rng = random.Random(f"{kind}{p}{m}")
    v = zb.chunks_of(kind)
    tables = [None] + [{(r, c, op): pick() for r in range(p) for c in range(v) for op in "FBW"}
                       for pick in (lambda: rng.uniform(0.5, 2.0),
                                    lambda: rng.choice([0.0, 0.5, 1.0, 1.25, rng.random()]),
                                    lambda: rng.choice([1, 2, 3]),
                                    lambda: np.float32(rng.uniform(0.5, 2.0)),
                                    lambda: rng.choice([1.0, -0.5]))]
    for table in tables:
        cost = zb.costs_from_table(table) if table else zb.unit_cost
        starts, ends = zb._timed(zb._dataflow(kind, p, m), p, cost)
        durations = zb._durations(kind, p, m, table)
        assert (durations is None) == (table is not None and any(
            type(d) is not float and type(d) is not int or d < 0 for d in table.values()))
        if durations is not None:
            level_starts, level_ends = zb._timed_levels(zb._levels(kind, p, m), durations)
            assert level_starts.tolist() == starts and level_ends.tolist() == ends
        rows, partner = zb.placed_transfers_for(kind, p, m, table)
        assert np.array_equal(rows, zb.placed_transfers(kind, p, m, starts, ends))
        assert np.array_equal(partner[partner], np.arange(rows.shape[1]))
        assert np.array_equal(rows[2:5, partner], rows[2:5])
        assert np.array_equal(rows[5, partner], 1 - rows[5])


def test_orders_that_deadlock_are_refused_by_the_levels():
    """_levels refuses orders whose computes wait for each other."""
    orders = zb.order_arrays("zb-h1", 3, 6)
    broken = list(orders)
    op, microbatch, chunk = broken[1]
    broken[1] = (op[::-1].copy(), microbatch[::-1].copy(), chunk)   # W before its B
    zb._levels.cache_clear()
    zb._offsets.cache_clear()
    original = zb.order_arrays
    try:
        zb.order_arrays = lambda kind, p, m: tuple(broken)
        with pytest.raises(zb.ScheduleError, match="deadlock"):
            zb._levels("zb-h1", 3, 6)
    finally:
        zb.order_arrays = original
        zb._levels.cache_clear()
        zb._offsets.cache_clear()
