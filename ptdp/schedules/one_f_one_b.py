"""GPipe, 1F1B and interleaved 1F1B: the looped kinds' orders and exchanges.

All three kinds are one loop (`_one_forward_one_backward`) with a different
number of warm-up forwards (`warmup_forwards`):
- GPipe: all m forwards first, then all m backwards.
- 1F1B (PipeDream-Flush): rank r warms up with min(p - r - 1, m) forwards,
  then alternates one forward and one backward, then drains the backwards.
- Interleaved 1F1B: forwards visit microbatches in groups of p, each group
  through chunk 0, then chunk 1, ...; backwards the same with the chunks
  reversed; rank r warms up with (p - r - 1)·2 + (v - 1)·p chunk-forwards
  (all of them if that reaches m·v, or when m = p). p = 2 is supported
  (Megatron-LM refuses it). m must be a multiple of p: with a partial last
  group these warm-up counts deadlock (the simulator finds it), so such m is
  rejected with the nearest valid values (kinds.check_arguments).
Their records (kinds.py) name these generators.
"""

from __future__ import annotations

import numpy as np

from ptdp.schedules.actions import (FORWARD_ONLY, Action, Compute, Exchange, Schedule, Transfer,
                                    chunk_neighbours)

INTERLEAVED = "interleaved"


def warmup_forwards(kind: str, p: int, m: int, v: int, rank: int) -> int:
    if kind in ("gpipe", FORWARD_ONLY):
        return m * v
    if kind == "1f1b":
        return min(p - rank - 1, m)
    if m == p:
        # One group of p microbatches: the steady phase would stall on every
        # chunk change, so (as Megatron-LM does) run all forwards first.
        return m * v
    return min((p - rank - 1) * 2 + (v - 1) * p, m * v)


def forward_order(kind: str, p: int, m: int, v: int) -> list[tuple[int, int]]:
    """(microbatch, chunk) in the order every rank runs its forwards."""
    if kind != INTERLEAVED:
        return [(i, 0) for i in range(m)]
    order = []
    for first in range(0, m, p):  # microbatches in groups of p (m is a multiple of p)
        order.extend((i, c) for c in range(v) for i in range(first, first + p))
    return order


def backward_order(kind: str, p: int, m: int, v: int) -> list[tuple[int, int]]:
    return [(i, v - 1 - c) for i, c in forward_order(kind, p, m, v)]


def _one_forward_one_backward(forwards: list, backwards: list, warmup: int) -> list[list[Compute]]:
    """The computes in steps: warm-up forwards one by one, then (forward,
    backward) pairs, then the remaining backwards one by one."""
    steps = [[Compute("F", i, c)] for i, c in forwards[:warmup]]
    steady = len(forwards) - warmup
    for k in range(steady):
        steps.append([Compute("F", *forwards[warmup + k]), Compute("B", *backwards[k])])
    steps.extend([Compute("B", i, c)] for i, c in backwards[steady:])
    return steps


def with_exchanges(steps: list[list[Compute]], rank: int, p: int, v: int) -> tuple[Action, ...]:
    """Insert one Exchange between consecutive steps, holding the sends the
    previous step produced and the receives the next step needs.

    GPipe and 1F1B use single computes as steps (Megatron-LM's non-interleaved
    pairing: send_forward_recv_backward, send_backward_recv_forward). The
    interleaved schedule uses (forward, backward) pairs as steady-state steps,
    with all four transfers of a step boundary in one batch, as Megatron-LM
    does; its doubled warm-up covers the receive posted one step early.
    """
    actions: list[Action] = []
    pending_sends: list[Transfer] = []
    sides = chunk_neighbours(rank, p, v)   # (transfers_of's, read once per chunk)
    for step in steps:
        receives, sends = [], []
        for compute in step:
            stage, after, before = sides[compute.chunk]
            mb = compute.microbatch
            if compute.op == "F":
                if before is not None:
                    receives.append(Transfer("recv", "activation", mb, stage - 1, before))
                if after is not None:
                    sends.append(Transfer("send", "activation", mb, stage, after))
            else:
                if after is not None:
                    receives.append(Transfer("recv", "grad", mb, stage, after))
                if before is not None:
                    sends.append(Transfer("send", "grad", mb, stage - 1, before))
        batch = tuple(pending_sends + receives)
        if batch:
            actions.append(Exchange(batch))
        actions.extend(step)
        pending_sends = sends
    if pending_sends:
        actions.append(Exchange(tuple(pending_sends)))
    return tuple(actions)


def looped_steps(kind: str, p: int, m: int, v: int, rank: int) -> list[list[Compute]]:
    """Rank `rank`'s computes in steps: single computes, or under the
    interleaved kind (forward, backward) pairs in the steady state."""
    forwards, backwards = forward_order(kind, p, m, v), backward_order(kind, p, m, v)
    steps = _one_forward_one_backward(forwards, backwards, warmup_forwards(kind, p, m, v, rank))
    if kind != INTERLEAVED:
        steps = [[compute] for step in steps for compute in step]
    return steps


def looped_order(kind: str, p: int, m: int, v: int, rank: int) -> list[Compute]:
    """Rank `rank`'s computes in the order build_looped gives them (without
    the exchanges, which are slow to build for large m)."""
    return [compute for step in looped_steps(kind, p, m, v, rank) for compute in step]


def looped_op_codes(kind: str, p: int, m: int, v: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """looped_order's ops (F 0, B 1) and chunks as arrays, made without the
    computes (a planner's memory model reads thousands of ranks)."""
    if kind == INTERLEAVED:   # forward_order's groups of p microbatches, chunk by chunk
        forwards = np.tile(np.repeat(np.arange(v), p), -(-m // p))
    else:
        forwards = np.zeros(m, np.int64)
    backwards = v - 1 - forwards
    warmup = warmup_forwards(kind, p, m, v, rank)
    steady = len(forwards) - warmup
    ops = np.ones(2 * len(forwards), np.int8)
    ops[:warmup] = 0
    ops[warmup:warmup + 2 * steady:2] = 0
    chunks = np.empty(2 * len(forwards), np.int64)
    chunks[:warmup] = forwards[:warmup]
    chunks[warmup:warmup + 2 * steady:2] = forwards[warmup:]
    chunks[warmup + 1:warmup + 2 * steady:2] = backwards[:steady]
    chunks[warmup + 2 * steady:] = backwards[steady:]
    return ops, chunks


def build_looped(kind: str, p: int, m: int, v: int) -> Schedule:
    """Every rank's actions for one iteration of gpipe, 1f1b or interleaved
    (arguments already checked by kinds.check_arguments)."""
    ranks = tuple(with_exchanges(looped_steps(kind, p, m, v, rank), rank, p, v)
                  for rank in range(p))
    warmups = tuple(warmup_forwards(kind, p, m, v, rank) for rank in range(p))
    return Schedule(kind, p, m, v, ranks, warmups=warmups)


def build_looped_forward_only(p: int, m: int, v: int) -> Schedule:
    """Evaluation under the looped placement: every forward, no backward, in
    training's microbatch order (arguments already checked)."""
    forwards = forward_order(INTERLEAVED if v > 1 else FORWARD_ONLY, p, m, v)
    ranks = tuple(with_exchanges([[Compute("F", i, c)] for i, c in forwards], r, p, v)
                  for r in range(p))
    return Schedule(FORWARD_ONLY, p, m, v, ranks, warmups=(m * v,) * p)
