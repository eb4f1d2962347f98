"""Property tests of the pipeline schedules as pure data (no torch, no processes).

Checks the action lists from `build_schedule` / `build_forward_only` directly
(completeness, order, warm-up, transfers) and through the unit-time simulator
(no deadlock, exact bubble fractions, in-flight peaks, makespans), the layer
assignment `layers_of`, argument errors, and that the simulator rejects
hand-broken schedules.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from contextlib import contextmanager
from fractions import Fraction

import pytest

from ptdp.schedules.actions import Compute, Exchange, Schedule, ScheduleError, Transfer
from ptdp.schedules.build import build_forward_only, build_schedule, layers_of
from ptdp.schedules.one_f_one_b import backward_order, forward_order, warmup_forwards, with_exchanges
from ptdp.schedules.simulate import check_complete, check_transfer_order, simulate

# --------------------------------------------------------------------------- configurations

P_RANGE = range(1, 9)
V_RANGE = range(1, 5)
M_FLAT = range(1, 25)  # gpipe / 1f1b


def kind_groups():
    """(kind, p, v): every schedule kind over p in 1..8 (v in 1..4 for
    interleaved, v > 1 only with p >= 2). Each test sweeps m_values(...)."""
    return ([(kind, p, 1) for kind in ("gpipe", "1f1b") for p in P_RANGE]
            + [("interleaved", p, v) for p in P_RANGE for v in V_RANGE if v == 1 or p >= 2])


def m_values(kind, p):
    """1..24 for gpipe/1f1b; p, 2p, 3p, 4p for interleaved."""
    return list(M_FLAT) if kind != "interleaved" else list(range(p, 4 * p + 1, p))


GROUPS = kind_groups()


def _id(cfg):
    return "-".join(str(x) for x in cfg)


@contextmanager
def case(**kw):
    """Name the configuration in a failing assertion of a swept test."""
    try:
        yield
    except AssertionError as e:
        raise AssertionError(f"{kw}: {e}") from e


# --------------------------------------------------------------------------- helpers


def expected_forward_sequence(kind, p, m, v):
    """Independent restatement of the issue: microbatches in groups of p, each
    group through chunk 0, then chunk 1, ... (one chunk for gpipe/1f1b)."""
    if kind != "interleaved":
        return [(i, 0) for i in range(m)]
    seq = []
    for g in range(m // p):
        for c in range(v):
            for i in range(g * p, (g + 1) * p):
                seq.append((i, c))
    return seq


def expected_backward_sequence(kind, p, m, v):
    if kind != "interleaved":
        return [(i, 0) for i in range(m)]
    seq = []
    for g in range(m // p):
        for c in reversed(range(v)):
            for i in range(g * p, (g + 1) * p):
                seq.append((i, c))
    return seq


def expected_warmup(kind, p, m, v, r):
    if kind == "gpipe":
        return m
    if kind == "1f1b":
        return min(p - r - 1, m)
    if m == p:
        return m * v
    return min((p - r - 1) * 2 + (v - 1) * p, m * v)


def leading_forwards(schedule, rank):
    n = 0
    for c in schedule.computes(rank):
        if c.op != "F":
            break
        n += 1
    return n


def replace_rank(schedule, rank, actions):
    ranks = list(schedule.ranks)
    ranks[rank] = tuple(actions)
    return dataclasses.replace(schedule, ranks=tuple(ranks))


def index_of(actions, pred):
    hits = [k for k, a in enumerate(actions) if pred(a)]
    assert len(hits) == 1, hits
    return hits[0]


def is_compute(op, mb, chunk=0):
    return lambda a: isinstance(a, Compute) and (a.op, a.microbatch, a.chunk) == (op, mb, chunk)


def has_transfer(op, kind, mb, boundary=None):
    return lambda a: isinstance(a, Exchange) and any(
        (t.op, t.kind, t.microbatch) == (op, kind, mb) and boundary in (None, t.boundary)
        for t in a.transfers)


def check_timeline_dependencies(result, transfer_cost=Fraction(0)):
    """Check from the simulator's timelines, independently of its own checks,
    that every compute starts after the computes it depends on ended."""
    s = result.schedule
    end, start = {}, {}
    for rank, timeline in enumerate(result.timelines):
        assert [iv.action for iv in timeline] == s.computes(rank)
        prev_end = Fraction(0)
        for iv in timeline:
            assert iv.start >= prev_end and iv.end > iv.start  # sequential per rank
            prev_end = iv.end
            key = (iv.action.op, iv.action.microbatch, s.virtual_stage(rank, iv.action.chunk))
            start[key], end[key] = iv.start, iv.end
        assert prev_end <= result.makespan
    last = s.num_stages - 1
    for (op, mb, stage), t0 in start.items():
        if op == "F" and stage > 0:
            assert t0 >= end[("F", mb, stage - 1)] + transfer_cost
        if op == "B":
            assert t0 >= end[("F", mb, stage)]
            if stage < last:
                assert t0 >= end[("B", mb, stage + 1)] + transfer_cost


# --------------------------------------------------------------------------- completeness


@pytest.mark.parametrize("kind,p,v", GROUPS)
def test_every_action_exactly_once_per_rank(kind, p, v):
    for m in m_values(kind, p):
        with case(kind=kind, p=p, m=m, v=v):
            _every_action_exactly_once_per_rank(kind, p, m, v)


def _every_action_exactly_once_per_rank(kind, p, m, v):
    s = build_schedule(kind, p, m, v)
    assert (s.kind, s.p, s.m, s.v, len(s.ranks)) == (kind, p, m, v, p)
    expected = Counter((op, i, c) for op in "FB" for i in range(m) for c in range(v))
    for r in range(p):
        got = Counter((a.op, a.microbatch, a.chunk) for a in s.computes(r))
        assert got == expected, f"rank {r}"
        # actions are only Computes and non-empty Exchanges, never two Exchanges in a row
        kinds = [type(a) for a in s.ranks[r]]
        assert set(kinds) <= {Compute, Exchange}
        assert all(a.transfers for a in s.ranks[r] if isinstance(a, Exchange))
        assert all(not (x is Exchange and y is Exchange) for x, y in zip(kinds, kinds[1:]))


@pytest.mark.parametrize("kind,p,v", GROUPS)
def test_forward_and_backward_order(kind, p, v):
    for m in m_values(kind, p):
        with case(kind=kind, p=p, m=m, v=v):
            _forward_and_backward_order(kind, p, m, v)


def _forward_and_backward_order(kind, p, m, v):
    s = build_schedule(kind, p, m, v)
    fwd = expected_forward_sequence(kind, p, m, v)
    bwd = expected_backward_sequence(kind, p, m, v)
    assert forward_order(kind, p, m, v) == fwd
    assert backward_order(kind, p, m, v) == bwd
    for r in range(p):
        computes = s.computes(r)
        assert [(c.microbatch, c.chunk) for c in computes if c.op == "F"] == fwd
        assert [(c.microbatch, c.chunk) for c in computes if c.op == "B"] == bwd


@pytest.mark.parametrize("kind,p,v", GROUPS)
def test_transfers_pair_up_between_adjacent_virtual_stages(kind, p, v):
    for m in m_values(kind, p):
        with case(kind=kind, p=p, m=m, v=v):
            _transfers_pair_up_between_adjacent_virtual_stages(kind, p, m, v)


def _transfers_pair_up_between_adjacent_virtual_stages(kind, p, m, v):
    s = build_schedule(kind, p, m, v)
    check_transfer_order(s)  # directly, not only via simulate
    sends, recvs = Counter(), Counter()
    for r in range(p):
        for a in s.ranks[r]:
            if not isinstance(a, Exchange):
                continue
            for t in a.transfers:
                assert 0 <= t.boundary < s.num_stages - 1
                lo, hi = t.boundary % p, (t.boundary + 1) % p  # ranks of stages k, k+1
                # activations flow k -> k+1, grads k+1 -> k
                src, dst = (lo, hi) if t.kind == "activation" else (hi, lo)
                me, other = (src, dst) if t.op == "send" else (dst, src)
                assert (r, t.peer) == (me, other), str(t)
                (sends if t.op == "send" else recvs)[(t.kind, t.microbatch, t.boundary)] += 1
    expected = Counter({(k, i, b): 1 for k in ("activation", "grad") for i in range(m)
                        for b in range(s.num_stages - 1)})
    assert sends == expected
    assert recvs == expected


# --------------------------------------------------------------------------- simulation


@pytest.mark.parametrize("kind,p,v", GROUPS)
def test_simulation_completes_with_exact_bubble_and_in_flight(kind, p, v):
    for m in m_values(kind, p):
        with case(kind=kind, p=p, m=m, v=v):
            _simulation_completes_with_exact_bubble_and_in_flight(kind, p, m, v)


def _simulation_completes_with_exact_bubble_and_in_flight(kind, p, m, v):
    s = build_schedule(kind, p, m, v)
    result = simulate(s)
    check_timeline_dependencies(result)

    assert isinstance(result.bubble_fraction, Fraction)
    assert result.ideal == 3 * m
    if kind == "interleaved":
        assert result.bubble_fraction == Fraction(p - 1, m * v)
    else:
        assert result.bubble_fraction == Fraction(p - 1, m)

    assert len(result.peak_in_flight) == p
    for r in range(p):
        assert result.peak_in_flight[r] == s.in_flight_bound(r)
        if kind == "gpipe":
            assert result.peak_in_flight[r] == m
        elif kind == "1f1b":
            assert result.peak_in_flight[r] <= p - r
            assert result.peak_in_flight[r] == min(p - r, m)
        else:
            assert result.peak_in_flight[r] == min(expected_warmup(kind, p, m, v, r) + 1, m * v)


@pytest.mark.parametrize("kind,p,v", GROUPS)
def test_warmup_from_action_list(kind, p, v):
    """Warm-up = forwards before the first one-forward-one-backward step. In the
    steady state every step is a forward then a backward, so the action list
    shows warm-up + 1 forwards before the first backward (all m·v if there is no
    steady state)."""
    for m in m_values(kind, p):
        with case(kind=kind, p=p, m=m, v=v):
            _warmup_from_action_list(kind, p, m, v)


def _warmup_from_action_list(kind, p, m, v):
    s = build_schedule(kind, p, m, v)
    for r in range(p):
        w = expected_warmup(kind, p, m, v, r)
        assert warmup_forwards(kind, p, m, v, r) == w
        assert s.warmup(r) == w
        assert leading_forwards(s, r) == min(w + 1, m * v)
        if kind == "interleaved":
            # Steady steps are (F, B) pairs with no Exchange between them; the
            # warm-up is the single forwards before the first such pair.
            actions = s.ranks[r]
            first_b = next((k for k, a in enumerate(actions)
                            if isinstance(a, Compute) and a.op == "B"), None)
            paired = isinstance(actions[first_b - 1], Compute) and actions[first_b - 1].op == "F"
            leading = leading_forwards(s, r)
            if leading < m * v:
                assert paired and leading - 1 == w
            else:  # all forwards lead; with F and B adjacent the last one may be a pair
                assert w >= m * v - 1 and (paired or w == m * v)


@pytest.mark.parametrize("p,v", [(p, v) for p in range(2, 9) for v in range(2, 5)])
def test_interleaved_one_group_runs_all_forwards_first(p, v):
    s = build_schedule("interleaved", p, p, v)
    for r in range(p):
        ops = [c.op for c in s.computes(r)]
        assert ops == ["F"] * (p * v) + ["B"] * (p * v)


def test_interleaved_warmup_formula_examples():
    # p = 4, v = 2, m = 8: rank r warms up with (4 - r - 1)·2 + 4 forwards
    s = build_schedule("interleaved", 4, 8, 2)
    assert [s.warmup(r) for r in range(4)] == [10, 8, 6, 4]
    assert [leading_forwards(s, r) for r in range(4)] == [11, 9, 7, 5]
    # capped at m·v
    s = build_schedule("interleaved", 8, 16, 2)
    assert s.warmup(0) == min(7 * 2 + 8, 32) == 22
    s = build_schedule("interleaved", 4, 8, 4)
    assert s.warmup(0) == min(3 * 2 + 12, 32) == 18


@pytest.mark.parametrize("m", [2, 4, 6, 8])
@pytest.mark.parametrize("v", [2, 3, 4])
def test_p2_interleaving_works(m, v):
    s = build_schedule("interleaved", 2, m, v)
    result = simulate(s)
    assert result.bubble_fraction == Fraction(1, m * v)
    assert result.peak_in_flight == [s.in_flight_bound(r) for r in range(2)]


# --------------------------------------------------------------------------- costs


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 7, 12])
@pytest.mark.parametrize("cost", [Fraction(1), Fraction(3, 2), Fraction(5)])
def test_equal_costs_makespan(kind, p, m, cost):
    """Forward = backward = c, GPipe: the last stage starts forward 0 at
    (p-1)·c and runs its m forwards and m backwards back to back, ending at
    (p-1+2m)·c; backward m-1 then needs (p-1)·c more to reach stage 0:
    makespan = 2·(m + p - 1)·c. 1F1B reorders work without changing the
    critical path, so it has the same makespan."""
    result = simulate(build_schedule(kind, p, m), forward_cost=cost, backward_cost=cost)
    assert result.makespan == 2 * (m + p - 1) * cost
    assert result.ideal == 2 * m * cost
    assert result.bubble_fraction == Fraction(p - 1, m)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("f,b", [(1, 3), (2, 1), (Fraction(1, 3), Fraction(7, 5))])
@pytest.mark.parametrize("p,m", [(1, 3), (2, 5), (4, 4), (6, 9)])
def test_general_costs_makespan(kind, f, b, p, m):
    result = simulate(build_schedule(kind, p, m), forward_cost=f, backward_cost=b)
    assert result.makespan == (m + p - 1) * (Fraction(f) + Fraction(b))
    check_timeline_dependencies(result)


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (3, 6, 3), (4, 8, 2), (4, 12, 4)])
@pytest.mark.parametrize("f,b", [(1, 1), (1, 3)])
def test_interleaved_costs_makespan(p, m, v, f, b):
    """A chunk costs 1/v of the stage: makespan = (m + (p-1)/v)·(f + b)."""
    result = simulate(build_schedule("interleaved", p, m, v), forward_cost=f, backward_cost=b)
    assert result.makespan == (m + Fraction(p - 1, v)) * (f + b)
    assert result.bubble_fraction == Fraction(p - 1, m * v)


def test_transfer_cost_exact_small_case():
    # gpipe p=2 m=1: F(1) | t | F(1) B(2) | t | B(2)
    t = Fraction(1, 2)
    result = simulate(build_schedule("gpipe", 2, 1), transfer_cost=t)
    assert result.makespan == 6 + 2 * t
    check_timeline_dependencies(result, transfer_cost=t)


@pytest.mark.parametrize("kind,p,m,v", [("gpipe", 3, 4, 1), ("1f1b", 4, 6, 1), ("1f1b", 2, 1, 1),
                                         ("interleaved", 2, 4, 2), ("interleaved", 4, 8, 3)])
def test_transfer_cost_grows_makespan(kind, p, m, v):
    s = build_schedule(kind, p, m, v)
    base = simulate(s).makespan
    spans = [simulate(s, transfer_cost=t).makespan for t in (Fraction(1, 10), Fraction(1, 2), 1)]
    assert base < spans[0] < spans[1] < spans[2]
    # microbatch 0 alone crosses p·v - 1 boundaries forward and back, after 3p of compute
    for t, span in zip((Fraction(1, 10), Fraction(1, 2), 1), spans):
        assert span >= 3 * p + 2 * (p * v - 1) * t
    check_timeline_dependencies(simulate(s, transfer_cost=1), transfer_cost=Fraction(1))


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_transfer_cost_is_free_without_transfers(kind):
    s = build_schedule(kind, 1, 5)
    assert simulate(s, transfer_cost=7).makespan == simulate(s).makespan == 15


# --------------------------------------------------------------------------- forward only


FORWARD_ONLY = ([(p, m, 1) for p in P_RANGE for m in (1, 2, 3, 5, 8, 13)]
                + [(p, m, v) for p in range(2, 9) for v in range(2, 5) for m in (p, 2 * p, 3 * p)])


@pytest.mark.parametrize("cfg", FORWARD_ONLY, ids=_id)
def test_forward_only(cfg):
    p, m, v = cfg
    s = build_forward_only(p, m, v)
    assert s.kind == "forward-only"
    kind = "interleaved" if v > 1 else "gpipe"
    for r in range(p):
        computes = s.computes(r)
        assert all(c.op == "F" for c in computes)
        assert [(c.microbatch, c.chunk) for c in computes] == expected_forward_sequence(kind, p, m, v)
        for a in s.ranks[r]:
            if isinstance(a, Exchange):
                assert all(t.kind == "activation" for t in a.transfers)
    result = simulate(s)
    check_timeline_dependencies(result)
    assert result.peak_in_flight == [m * v] * p
    assert result.peak_in_flight == [s.in_flight_bound(r) for r in range(p)]
    assert result.ideal == m
    assert result.makespan == m + Fraction(p - 1, v)


def test_forward_only_arguments_checked():
    with pytest.raises(ScheduleError, match="multiple of 4"):
        build_forward_only(4, 6, 2)
    with pytest.raises(ScheduleError, match="p >= 2"):
        build_forward_only(1, 4, 2)
    with pytest.raises(ScheduleError):
        build_forward_only(0, 4)


# --------------------------------------------------------------------------- layers


def test_layers_of_paper_example():
    # 4 ranks, 16 layers, v = 2: rank 0 holds layers 1,2,9,10 and rank 1 3,4,11,12 (1-based)
    assert layers_of(0, 0, 4, 2, 16) + layers_of(0, 1, 4, 2, 16) == [0, 1, 8, 9]
    assert layers_of(1, 0, 4, 2, 16) + layers_of(1, 1, 4, 2, 16) == [2, 3, 10, 11]
    assert layers_of(3, 1, 4, 2, 16) == [14, 15]


@pytest.mark.parametrize("p,v", [(p, v) for p in (1, 2, 3, 4, 8) for v in (1, 2, 3, 4)
                                 if v == 1 or p >= 2])
@pytest.mark.parametrize("per_chunk", [1, 2, 3])
def test_layers_of_properties(p, v, per_chunk):
    l = p * v * per_chunk
    seen = Counter()
    for r in range(p):
        for c in range(v):
            layers = layers_of(r, c, p, v, l)
            assert len(layers) == l // (p * v)
            assert layers[0] == c * (l // v) + r * (l // (p * v))
            assert layers == list(range(layers[0], layers[0] + len(layers)))
            seen.update(layers)
    assert seen == Counter(range(l))  # every layer exactly once
    # virtual stage k = c·p + r: stages in order hold consecutive layers
    in_stage_order = []
    for k in range(p * v):
        in_stage_order += layers_of(k % p, k // p, p, v, l)
    assert in_stage_order == list(range(l))


def test_layers_of_rejects_uneven_split():
    with pytest.raises(ScheduleError):
        layers_of(0, 0, 4, 2, 12)
    with pytest.raises(ScheduleError):
        layers_of(0, 0, 3, 1, 10)


# --------------------------------------------------------------------------- argument errors


def test_unknown_kind():
    with pytest.raises(ScheduleError, match="unknown schedule kind 'zero-bubble'"):
        build_schedule("zero-bubble", 2, 4)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_chunks_need_interleaved(kind):
    with pytest.raises(ScheduleError, match="interleaved"):
        build_schedule(kind, 4, 8, 2)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved"])
def test_chunks_need_two_ranks(kind):
    with pytest.raises(ScheduleError):
        build_schedule(kind, 1, 4, 2)


def test_chunks_need_two_ranks_message():
    with pytest.raises(ScheduleError, match="p >= 2"):
        build_schedule("interleaved", 1, 4, 2)


@pytest.mark.parametrize("p,m,suggestion", [(4, 6, "4 or 8"), (4, 3, "4"), (2, 5, "4 or 6"),
                                            (8, 1, "8"), (3, 10, "9 or 12")])
def test_interleaved_m_multiple_of_p(p, m, suggestion):
    with pytest.raises(ScheduleError, match="multiple of") as info:
        build_schedule("interleaved", p, m, 2)
    assert str(info.value).endswith(f"use m = {suggestion}")


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved"])
@pytest.mark.parametrize("name,args", [
    ("p", (0, 4, 1)), ("p", (-2, 4, 1)), ("m", (2, 0, 1)), ("m", (2, -4, 1)),
    ("v", (2, 4, 0)), ("v", (2, 4, -1)), ("p", (2.0, 4, 1)), ("m", (2, "4", 1)),
])
def test_non_positive_or_non_int_arguments(kind, name, args):
    with pytest.raises(ScheduleError, match=f"^{name} = "):
        build_schedule(kind, *args)


def test_schedule_error_is_value_error():
    assert issubclass(ScheduleError, ValueError)


# --------------------------------------------------------------------------- broken schedules


def _act(mb, boundary=0):
    return Transfer("send", "activation", mb, boundary, 1), Transfer("recv", "activation", mb, boundary, 0)


def _grad(mb, boundary=0):
    return Transfer("send", "grad", mb, boundary, 0), Transfer("recv", "grad", mb, boundary, 1)


def test_valid_hand_schedule_simulates():
    """The hand-built reference for the broken variants below is itself valid."""
    send_a, recv_a = _act(0)
    send_g, recv_g = _grad(0)
    s = Schedule("gpipe", 2, 1, 1, (
        (Compute("F", 0, 0), Exchange((send_a,)), Exchange((recv_g,)), Compute("B", 0, 0)),
        (Exchange((recv_a,)), Compute("F", 0, 0), Compute("B", 0, 0), Exchange((send_g,))),
    ))
    assert simulate(s).makespan == 6


def test_detects_deadlock_hand_built():
    """Rank 0 waits for the gradient before sending the activation that rank 1
    needs to produce it. Per-pair transfer order is still consistent."""
    send_a, recv_a = _act(0)
    send_g, recv_g = _grad(0)
    s = Schedule("gpipe", 2, 1, 1, (
        (Compute("F", 0, 0), Exchange((recv_g,)), Exchange((send_a,)), Compute("B", 0, 0)),
        (Exchange((recv_a,)), Compute("F", 0, 0), Compute("B", 0, 0), Exchange((send_g,))),
    ))
    check_complete(s)
    check_transfer_order(s)
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(s)


@pytest.mark.parametrize("kind,p,m", [("gpipe", 2, 1), ("gpipe", 3, 4), ("1f1b", 2, 2),
                                      ("1f1b", 4, 6)])
def test_detects_deadlock_mutated(kind, p, m):
    """Rank 0 receives the gradient of microbatch 0 before it sends any
    activation: rank 1 cannot run the forward that gradient depends on. The
    per-pair transfer order is unchanged, so only the simulation can see it."""
    s = build_schedule(kind, p, m)
    r0 = list(s.ranks[0])
    first_b = index_of(r0, is_compute("B", 0))
    before = [a for a in r0[:first_b] if isinstance(a, Exchange)]
    assert before, "rank 0 exchanges something before its first backward"
    recvs = tuple(t for ex in before for t in ex.transfers if t.op == "recv")
    sends = tuple(t for ex in before for t in ex.transfers if t.op == "send")
    assert [t.tag for t in recvs] == [("grad", 0, 0)]
    assert [t.tag for t in sends] == [("activation", i, 0) for i in range(len(sends))]
    r0 = ([a for a in r0[:first_b] if isinstance(a, Compute)]
          + [Exchange(recvs), Exchange(sends)] + r0[first_b:])
    broken = replace_rank(s, 0, r0)
    check_complete(broken)
    check_transfer_order(broken)
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(broken)


def _steps(forwards, backwards, warmup):
    steps = [[Compute("F", i, c)] for i, c in forwards[:warmup]]
    steady = len(forwards) - warmup
    for k in range(steady):
        steps.append([Compute("F", *forwards[warmup + k]), Compute("B", *backwards[k])])
    steps.extend([Compute("B", i, c)] for i, c in backwards[steady:])
    return steps


@pytest.mark.parametrize("p,m,v", [(4, 6, 2), (3, 4, 2), (4, 10, 3)])
def test_detects_deadlock_of_interleaved_partial_group(p, m, v):
    """Why m must be a multiple of p: building the interleaved schedule anyway
    (with a partial last group) gives consistent transfers that deadlock."""
    with pytest.raises(ScheduleError):
        build_schedule("interleaved", p, m, v)
    groups = [list(range(g, min(g + p, m))) for g in range(0, m, p)]
    fwd = [(i, c) for g in groups for c in range(v) for i in g]
    bwd = [(i, v - 1 - c) for i, c in fwd]
    ranks = []
    for r in range(p):
        w = min((p - r - 1) * 2 + (v - 1) * p, m * v)
        ranks.append(with_exchanges(_steps(fwd, bwd, w), r, p, v))
    s = Schedule("interleaved", p, m, v, tuple(ranks))
    check_complete(s)
    check_transfer_order(s)
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(s)


@pytest.mark.parametrize("kind,p,m,v", [("gpipe", 3, 4, 1), ("1f1b", 4, 5, 1), ("interleaved", 2, 4, 2)])
def test_detects_missing_action(kind, p, m, v):
    s = build_schedule(kind, p, m, v)
    r = p - 1
    actions = list(s.ranks[r])
    k = index_of(actions, is_compute("B", 1, 0))
    del actions[k]
    broken = replace_rank(s, r, actions)
    with pytest.raises(ScheduleError, match=r"missing \[\('B', 1, 0\)\]"):
        check_complete(broken)
    with pytest.raises(ScheduleError, match="missing"):
        simulate(broken)


@pytest.mark.parametrize("kind,p,m,v", [("gpipe", 3, 4, 1), ("1f1b", 4, 5, 1), ("interleaved", 2, 4, 2)])
def test_detects_repeated_action(kind, p, m, v):
    s = build_schedule(kind, p, m, v)
    actions = list(s.ranks[0])
    k = index_of(actions, is_compute("F", 0, 0))
    actions.insert(k + 1, actions[k])
    broken = replace_rank(s, 0, actions)
    with pytest.raises(ScheduleError, match=r"repeated \[\('F', 0, 0\)\]"):
        simulate(broken)


def test_detects_action_replaced_by_another():
    """Same length, one action swapped for a duplicate of another."""
    s = build_schedule("1f1b", 2, 3)
    actions = list(s.ranks[1])
    actions[index_of(actions, is_compute("F", 2))] = Compute("F", 1, 0)
    with pytest.raises(ScheduleError, match="missing.*repeated"):
        simulate(replace_rank(s, 1, actions))


def test_detects_wrong_chunk():
    s = build_schedule("gpipe", 2, 2)
    actions = list(s.ranks[0])
    k = index_of(actions, is_compute("B", 1))
    actions[k] = Compute("B", 1, 1)
    with pytest.raises(ScheduleError, match="missing"):
        simulate(replace_rank(s, 0, actions))


def test_detects_backward_before_forward():
    # 1F1B p=2 m=2, last rank: [recv a0] F0 B0 [send g0, recv a1] F1 B1 [send g1]
    s = build_schedule("1f1b", 2, 2)
    actions = list(s.ranks[1])
    f, b = index_of(actions, is_compute("F", 0)), index_of(actions, is_compute("B", 0))
    assert b == f + 1
    actions[f], actions[b] = actions[b], actions[f]
    broken = replace_rank(s, 1, actions)
    check_complete(broken)
    check_transfer_order(broken)
    with pytest.raises(ScheduleError, match="B0.0 runs before its forward"):
        simulate(broken)


def test_detects_backward_before_its_gradient_arrived():
    # rank 0 of gpipe p=2 m=2: move B0 before the Exchange that receives g0
    s = build_schedule("gpipe", 2, 2)
    actions = list(s.ranks[0])
    k = index_of(actions, has_transfer("recv", "grad", 0))
    b = index_of(actions, is_compute("B", 0))
    assert b == k + 1
    actions[k], actions[b] = actions[b], actions[k]
    with pytest.raises(ScheduleError, match="B0.0 runs before its output gradient arrived"):
        simulate(replace_rank(s, 0, actions))


def test_detects_forward_without_received_input():
    """Drop both ends of activation 0's transfer: transfer order stays
    consistent, but rank 1's forward of microbatch 0 has no input."""
    s = build_schedule("gpipe", 2, 2)
    r0, r1 = list(s.ranks[0]), list(s.ranks[1])
    del r0[index_of(r0, has_transfer("send", "activation", 0))]  # [send a0] alone
    del r1[index_of(r1, has_transfer("recv", "activation", 0))]  # [recv a0] alone
    broken = dataclasses.replace(s, ranks=(tuple(r0), tuple(r1)))
    check_complete(broken)
    check_transfer_order(broken)
    with pytest.raises(ScheduleError, match="F0.0 runs before its input activation arrived"):
        simulate(broken)


def test_detects_dropped_exchange_one_side():
    """Dropping only the receiving Exchange leaves a send without a receive."""
    s = build_schedule("gpipe", 2, 2)
    r1 = list(s.ranks[1])
    del r1[index_of(r1, has_transfer("recv", "activation", 0))]
    with pytest.raises(ScheduleError):
        simulate(replace_rank(s, 1, r1))


def test_detects_forward_before_its_input_exchange():
    """Move the receive after the forward that needs it."""
    s = build_schedule("gpipe", 2, 2)
    r1 = list(s.ranks[1])
    k = index_of(r1, has_transfer("recv", "activation", 0))
    f = index_of(r1, is_compute("F", 0))
    r1[k], r1[f] = r1[f], r1[k]
    broken = replace_rank(s, 1, r1)
    check_transfer_order(broken)
    with pytest.raises(ScheduleError, match="F0.0 runs before its input activation arrived"):
        simulate(broken)


def test_detects_send_before_produced():
    s = build_schedule("gpipe", 2, 2)
    r0 = list(s.ranks[0])
    k = index_of(r0, has_transfer("send", "activation", 0))
    f = index_of(r0, is_compute("F", 0))
    r0[k], r0[f] = r0[f], r0[k]
    with pytest.raises(ScheduleError, match="before producing it"):
        simulate(replace_rank(s, 0, r0))


def test_detects_inconsistent_transfer_order():
    """Rank 0 sends activation 0 then 1; rank 1 now receives 1 then 0."""
    s = build_schedule("gpipe", 2, 2)
    r1 = list(s.ranks[1])
    k0 = index_of(r1, has_transfer("recv", "activation", 0))
    k1 = index_of(r1, has_transfer("recv", "activation", 1))
    r1[k0], r1[k1] = r1[k1], r1[k0]
    broken = replace_rank(s, 1, r1)
    check_complete(broken)
    with pytest.raises(ScheduleError, match="rank 0 sends to rank 1 in the order"):
        check_transfer_order(broken)
    with pytest.raises(ScheduleError, match="order"):
        simulate(broken)


def test_detects_inconsistent_transfer_order_within_one_exchange_sequence():
    """Interleaved p=2: swap two grads inside the exchanges of one rank."""
    s = build_schedule("interleaved", 2, 4, 2)
    r0 = list(s.ranks[0])
    k0 = index_of(r0, has_transfer("recv", "grad", 2, boundary=2))
    k1 = index_of(r0, has_transfer("recv", "grad", 3, boundary=2))

    def swap(ex):
        return Exchange(tuple(
            dataclasses.replace(t, microbatch={2: 3, 3: 2}[t.microbatch])
            if t.op == "recv" and t.kind == "grad" and t.boundary == 2 and t.microbatch in (2, 3)
            else t
            for t in ex.transfers))
    r0[k0], r0[k1] = swap(r0[k0]), swap(r0[k1])
    with pytest.raises(ScheduleError, match="rank 1 sends to rank 0 in the order"):
        simulate(replace_rank(s, 0, r0))
