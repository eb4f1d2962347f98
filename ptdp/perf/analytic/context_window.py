"""What a sliding window leaves of context parallelism's attention, per
context rank and ring step, for the performance model (ptdp.perf.price.
context_exchange and pricing.OperatorModel).

ptdp.parallel.context_attention plans a window from absolute positions:
rank r holds chunks r and 2c − 1 − r of the 2c chunks of s/(2c) positions;
each query chunk is cut in WINDOW_BLOCK positions, and each query block
[a, b) meets only the keys of a key chunk its rows' windows reach: those
every row sees as one unmasked rectangle, the window's edge as masked
rectangles, the block's own square causal where the window holds all of
it. So with a short window most ring steps compute nothing (their K/V block
still travels on), and a rank's work is no longer the same at every step.

Work is counted as the kernel runs it, in (query, key) score entries: a
rectangle, masked or not, at its whole area; a causal square of n at n²/2.
A full causal ring step (no window) is (s/c)²/2 of them on every rank and
step (the own block causal, the others half a block by the layout), and a
rank's whole causal attention c of those; that is the unit of the shares
below. Counting is closed form per query block (no tensors), the sums of
context_attention's `_window_plan` over the same spans (a test checks they
agree).

Nothing here imports torch."""

from __future__ import annotations

import functools
from dataclasses import dataclass

WINDOW_BLOCK = 128  # ptdp.parallel.context_attention.WINDOW_BLOCK (a test checks they agree)

# A span of natural positions: (first, count).
Span = tuple[int, int]


@dataclass(frozen=True)
class ContextWindowWork:
    """The windowed attention's work under context parallelism.

    `steps[r][k]` (p2p): what context rank r computes at ring step k (keys
    of rank (r − k) mod c) as a share of a full causal step; () for the
    other comm types. `busiest`: the busiest rank's whole attention as a
    share of a rank's full causal attention (p2p and all_gather: its
    queries against every key; a2a: every rank holds whole sequences for
    heads/c of the heads, so the whole sequence's share)."""
    steps: tuple[tuple[float, ...], ...]
    busiest: float


def _query_block_work(a: int, b: int, keys: Span, left: int) -> float:
    """Score entries of query positions [a, b) against the key span
    `keys`, as context_attention._window_query_block cuts them."""
    k_start, k_end = keys[0], keys[0] + keys[1]
    lo, hi = max(k_start, a - left), min(k_end, b)
    if lo >= hi:
        return 0.0   # every key lies outside (or after) the rows' windows
    inner = (max(lo, b - 1 - left), min(hi, a))   # keys every row sees
    if inner[0] >= inner[1]:
        work, parts = 0.0, [(lo, hi)]
    else:
        work, parts = float((b - a) * (inner[1] - inner[0])), [(lo, inner[0]), (inner[1], hi)]
    for x, y in parts:
        if x >= y:
            continue
        if (x, y) == (a, b) and b - 1 - a <= left:
            work += (b - a) * (b - a) / 2   # the own square, causal
        else:
            work += (b - a) * (y - x)       # masked: computed whole
    return work


def span_work(queries: Span, keys: Span, left: int) -> float:
    """Score entries of the query span against the key span under a window
    of left side `left`, the queries cut in WINDOW_BLOCK positions from
    their first."""
    (q_start, q_len), (k_start, k_len) = queries, keys
    q_end, k_end = q_start + q_len, k_start + k_len
    if k_start >= q_end or k_end <= q_start - left:
        return 0.0   # keys after every query, or before every window
    if k_end <= q_start and k_start >= q_end - 1 - left:
        return float(q_len * k_len)   # every row sees every key: one rectangle per block
    return sum(_query_block_work(a, min(a + WINDOW_BLOCK, q_end), keys, left)
               for a in range(q_start, q_end, WINDOW_BLOCK))


def _chunk_spans(rank: int, size: int, half: int) -> list[Span]:
    """Context rank `rank`'s two chunks (context_layout)."""
    return [(rank * half, half), ((2 * size - 1 - rank) * half, half)]


@functools.lru_cache(maxsize=256)
def context_window_work(seq: int, c: int, left: int, comm: str) -> ContextWindowWork:
    """The work of a layer with a causal window of left side `left` (−1:
    none) over sequences of `seq` positions split over `c` context ranks
    with --cp-comm-type `comm` (see ContextWindowWork). A window that holds
    every earlier key runs as plain causal attention: every share 1."""
    half = seq // (2 * c)
    full_step = (2 * half) ** 2 / 2
    unbounded = left < 0 or left >= seq - 1
    if comm == "p2p":
        if unbounded:
            steps = tuple((1.0,) * c for _ in range(c))
        else:
            steps = tuple(tuple(sum(span_work(q, k, left) for q in _chunk_spans(rank, c, half)
                                    for k in _chunk_spans((rank - step) % c, c, half)) / full_step
                                for step in range(c))
                          for rank in range(c))
        return ContextWindowWork(steps, max(sum(row) for row in steps) / c)
    if unbounded:
        return ContextWindowWork((), 1.0)
    whole = (0, 2 * c * half)
    if comm == "all_gather":
        busiest = max(sum(span_work(q, whole, left) for q in _chunk_spans(rank, c, half))
                      for rank in range(c))
        return ContextWindowWork((), busiest / (c * full_step))
    if comm == "a2a":   # the 2c chunks of the whole sequence, each against all of it
        work = sum(span_work((start, half), whole, left) for start in range(0, 2 * c * half, half))
        return ContextWindowWork((), work / (c * c * full_step))
    raise ValueError(f"unknown --cp-comm-type {comm!r}: use p2p, all_gather or a2a")
