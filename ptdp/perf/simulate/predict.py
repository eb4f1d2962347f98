"""Price a training iteration: the schedule-pricing simulator.

`simulate(workload, layout, profile)` builds the pipeline schedule with the
same generator the executor runs (`build_schedule`), gives every action a
cost in seconds from an operator model of ptdp's GPT, and plays the action
lists against each other in an event simulation that respects every send /
receive dependency (an Exchange completes only once the peers have posted
its other ends, as in `ptdp.schedules.simulate`; without processor
sharing, on GPU profiles, the same times come from `_play_unshared`, the
schedule's dataflow in flat lists, shared by layouts with the same prices
and tested equal to the player's records). The gradient
reductions run bucket by bucket under each chunk's last backward (all
after it where the profile says the run reduced after the backward), the
tied embedding's sum after both ends have finished, then the optimizer
step; its weight all-gather may hide under the next iteration's first
forwards (`overlap_param_gather`). The "data-parallel reduction" category
is what of them is exposed: what outlasts the backward.

The pieces: operator prices (ptdp.perf.price.pricing, summed per stage in
ptdp.perf.price.stage_costs), the ranks' links (ptdp.perf.price.machine), the event
simulation (ptdp.schedules.player) and what follows the flush
(ptdp.perf.price.after_flush).

Zero-bubble schedules (ZB-H1, ZB-V): the schedule has no transfer across
ZB-V's bottom (stages p−1 and p, both on rank p−1), so none is priced, and
with both ends of the model on rank 0 the tied embedding needs no sum over
an embedding group. The schedule is built with its exchanges placed for
these predicted F, B and W costs (build_schedule's `costs`), as the trainer
places them for the costs it measures, and sends do not wait for their
receivers (the executor's rule under these schedules; only the receiver
pays for the transfer), so ranks wait only where the data dependencies make
them.

Communication between pipeline stages: an activation or gradient of
b·s·h·E bytes; with scatter/gather each tensor rank sends 1/t of it and the
receiving tensor group all-gathers it; under sequence parallelism each rank
sends its own 1/t and nothing is gathered. The link is inter-server when the two
stages' ranks sit on different servers (rank = tp + t·(dp + d·pp), so for
t·d ≥ devices_per_server every pipeline neighbour is on another server),
intra-server otherwise. A batched Exchange costs the slowest of its
transfers (links are full duplex) plus the all-gathers of what it receives.

CPU profiles (from `ptdp calibrate`): a local job runs t·p·d processes with
`threads_per_process` threads each; while k pipeline ranks compute at once,
k·t·d processes compete for the cores and each computes at
min(1, cores / (k·t·d·threads)) of its speed (processor sharing, simulated
exactly: a rank's remaining work drains at the current share). The
optimizer runs on all processes at once. Communication is not slowed by
sharing: its measured times (collective_seconds) already include waking
the waiting process. With `threads` > 1 (one process alone) each operator
class runs at its measured multi-thread speed-up. GPU profiles have no
contention.

Bubble fraction (from the priced timeline): the time from the start of the
iteration to the pipeline flush, minus the compute time of the busiest
pipeline rank, over that compute time: the paper's bubble time over ideal
time. With uniform costs and free transfers it is exactly (p−1)/m, or
(p−1)/(m·v) interleaved, (p−1)/(3m) ZB-H1 and (p−1)/(6m) ZB-V under
F = B = W (tested); exposed point-to-point time counts as
bubble. `seconds_by_category` breaks the iteration down on that busiest
rank and sums to `iteration_seconds`.
"""

from __future__ import annotations

import functools
import itertools
import operator
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Callable

import numpy as np

from ptdp.schedules.actions import Compute, Exchange
from ptdp.schedules.build import build_schedule
from ptdp.schedules.simulate import compute_costs
from ptdp.perf.price.after_flush import after_flush
from ptdp.perf.analytic.flops import model_flops_per_iteration
from ptdp.perf.layout import Layout, Workload
from ptdp.perf.price.machine import Machine
from ptdp.schedules.player import Record, play
from ptdp.perf.price.profiles import HardwareProfile
from ptdp.perf.price.stage_costs import layout_chunk_costs, operator_model
from ptdp.perf.simulate.codes import Codes, RowsOnDemand, flat_index, flat_times, level_times
from ptdp.perf.simulate.schedule_tables import planned_codes
from ptdp.perf.simulate.timeline import Box, draw_timeline

CATEGORIES = ("forward compute", "backward compute", "recompute", "tensor all-reduce",
              "pipeline transfer", "data-parallel reduction", "optimizer", "bubble/idle")
# ZeRO-3 only (Layout.shards_parameters): what of the units' all-gathers the
# computation does not hide.
GATHER_CATEGORY = "parameter all-gather"

# Schedules are immutable data; a planner prices many layouts sharing (kind, p, m, v).
_schedule = functools.lru_cache(maxsize=32)(build_schedule)


@dataclass
class Prediction:
    workload: Workload
    layout: Layout
    profile: HardwareProfile
    iteration_seconds: float
    tflops_per_device: float
    bubble_fraction: float
    pipeline_seconds: float                   # start of the iteration to the flush
    microbatches: int
    critical_rank: int                        # the busiest pipeline rank
    flops_per_iteration: float
    # () -> (categories_by_rank, timelines): walked from the played actions
    # only when asked for (a search ranks by the iteration alone);
    # rank_details(r): rank r's alone (a plan's rows need the busiest rank's categories only).
    details: Callable[[], tuple[list[dict[str, float]], list[list[Box]]]] = field(repr=False)
    rank_details: Callable[[int], tuple[dict[str, float], list[Box]]] | None = field(
        default=None, repr=False)

    @functools.cached_property
    def _details(self) -> tuple[list[dict[str, float]], list[list[Box]]]:
        return self.details()

    @functools.cached_property
    def _critical_categories(self) -> dict[str, float]:
        if "_details" in self.__dict__ or self.rank_details is None:
            return self._details[0][self.critical_rank]
        return self.rank_details(self.critical_rank)[0]

    @property
    def categories_by_rank(self) -> list[dict[str, float]]:
        """`seconds_by_category` of every pipeline rank."""
        return self._details[0]

    @property
    def seconds_by_category(self) -> dict[str, float]:
        """On the busiest pipeline rank; sums to the iteration."""
        return self._critical_categories

    @property
    def timelines(self) -> list[list[Box]]:
        """Per pipeline rank (tensor 0, data 0), seconds."""
        return self._details[1]

    def rank_categories(self, rank: int) -> dict[str, float]:
        """`seconds_by_category` of pipeline rank `rank` (sums to the iteration)."""
        return self.categories_by_rank[rank]

    def draw(self, path: str | Path, *, time_unit: str = "ms") -> Path:
        """The priced timeline as a picture (ptdp.perf.simulate.timeline.draw_timeline)."""
        scale = {"s": 1.0, "ms": 1e3, "us": 1e6}[time_unit]
        rows = [[Box(b.op, b.microbatch, b.chunk, b.start * scale, b.end * scale) for b in row]
                for row in self.timelines]
        lay = self.layout
        title = (f"predicted {lay.schedule_kind} on {self.profile.name}: t={lay.t} p={lay.p} "
                 f"d={lay.d} b={lay.b} m={self.microbatches}" + (f" v={lay.v}" if lay.v > 1 else "")
                 + f", {self.iteration_seconds * scale:.4g} {time_unit}/iteration")
        draw_timeline(rows, path, v=lay.v, title=title, time_unit=time_unit,
                      bubble_fraction=self.bubble_fraction, first_microbatch=1)
        return Path(path)

    def summary(self) -> str:
        lines = [f"{self.iteration_seconds * 1e3:.4g} ms/iteration, "
                 f"{self.tflops_per_device:.4g} TFLOP/s per device, bubble {self.bubble_fraction:.3f}"]
        for category, seconds in self.seconds_by_category.items():
            lines.append(f"  {category:<24} {seconds * 1e3:10.4g} ms")
        return "\n".join(lines)


def simulate(workload: Workload, layout: Layout, profile: HardwareProfile) -> Prediction:
    """Predict one training iteration of `workload` under `layout` on `profile`."""
    problems = layout.valid_for(workload.model, workload.global_batch)
    if problems:
        raise ValueError("invalid layout: " + "; ".join(problems))
    p, v, t, d = layout.p, layout.v, layout.t, layout.d
    m = layout.microbatches(workload.global_batch)
    machine = Machine(layout, profile)
    threads = profile.threads_per_process(layout.devices)
    ops = operator_model(workload, layout, profile)
    chunks = layout_chunk_costs(ops, layout)
    # Zero-bubble: the exchanges placed for these costs, as the trainer
    # places them for the costs it measures.
    costs = (tuple(((r, c, op), chunks[(r, c)].of(op).total_work + chunks[(r, c)].of(op).comm)
                   for r in range(p) for c in range(v) for op in "FBW")
             if layout.zero_bubble else None)

    # Contention (CPU profiles): t·d processes per computing pipeline rank.
    contended = profile.kind == "cpu" and profile.cores > 0

    def speed(working: int) -> float:
        return profile.share(working * t * layout.c * d, threads)

    ops_priced = ("F", "B", "W") if layout.zero_bubble else ("F", "B")
    priced = {(r, c, op): (costs.of(op).total_work, costs.of(op).comm)
              for (r, c), costs in chunks.items() for op in ops_priced}

    after = after_flush(workload, layout, profile, ops)
    gathered = _exposed_gathers(layout, after, priced)

    def compute(rank: int, action: Compute) -> tuple[float, float]:
        work, comm = priced[(rank, action.chunk, action.op)]
        return work, comm + gathered(rank, action)

    exchange = _exchange_price(layout, ops, machine, profile)
    if contended:
        schedule = _schedule(layout.schedule_kind, p, m, v, costs)
        played = _played_from_records(play(schedule, compute, exchange, speed),
                                      layout.zero_bubble)
    else:   # no processor sharing: the dataflow of the actions alone decides their times
        played = _play_unshared((layout.schedule_kind, p, m, v, costs), compute, exchange)

    # The gradient reductions, overlapping each chunk's last backward (every
    # backward under ZeRO-2/3); the tied embedding's sum; then the optimizer
    # (all ranks together).
    pipeline_end, flush = played.pipeline_end, max(played.pipeline_end)
    optimizer_seconds = [after.optimizer[r] - min(after.hideable_gather[r],
                                                  played.first_forwards[r])
                         for r in range(p)]
    buckets_done = [_buckets_done(played, r, pipeline_end[r], after) for r in range(p)]
    # What of each rank's reduction follows its last computation.
    exposed = [max(0.0, float(buckets_done[r] - pipeline_end[r])) for r in range(p)]
    reduced = [max(pipeline_end[r], buckets_done[r]) for r in range(p)]
    ends = after.ends
    embedding_start = None
    if after.embedding:   # the first and the last stage sum the tied embedding together
        embedding_start = max(reduced[ends[0]], reduced[ends[1]])
        for r in ends:
            reduced[r] = embedding_start + after.embedding
    sync = max(reduced)
    iteration = sync + max(optimizer_seconds)

    busy = played.busy   # the busiest rank: most compute
    critical = max(range(p), key=lambda r: busy[r])
    bubble = (flush - busy[critical]) / busy[critical] if busy[critical] else 0.0

    def rank_details(r: int) -> tuple[dict[str, float], list[Box]]:
        """Rank r's seconds by category and its timeline boxes."""
        embedding = after.embedding if embedding_start is not None and r in ends else 0.0
        boxes, categories = _rank_boxes(played.row(r), r, chunks, priced, exposed[r],
                                        pipeline_end[r], embedding_start, embedding, gathered)
        if not layout.shards_parameters:
            del categories[GATHER_CATEGORY]
        # The exposed part, split as the bucketed work is (the sequence-
        # parallel partial sums travel with their buckets).
        partial = (after.partial_sums[r] / after.bucketed[r] * exposed[r]
                   if after.bucketed[r] else 0.0)
        categories["data-parallel reduction"] = exposed[r] - partial + embedding
        categories["tensor all-reduce"] += partial
        categories["optimizer"] = optimizer_seconds[r]
        categories["bubble/idle"] += float(iteration) - sum(categories.values())
        return categories, boxes

    def details() -> tuple[list[dict[str, float]], list[list[Box]]]:
        """Each rank's seconds by category and its timeline boxes."""
        ranks = [rank_details(r) for r in range(p)]
        return [categories for categories, _ in ranks], [boxes for _, boxes in ranks]

    flops = model_flops_per_iteration(
        workload.model, workload.global_batch, recompute=layout.recompute,
        recomputed_layers=workload.model.num_layers if layout.recompute == "full" else None,
        lora=workload.lora)
    iteration = float(iteration)
    return Prediction(
        workload=workload, layout=layout, profile=profile, iteration_seconds=iteration,
        tflops_per_device=flops / (layout.devices * iteration) / 1e12,
        bubble_fraction=float(bubble), pipeline_seconds=float(flush), microbatches=m,
        critical_rank=critical, flops_per_iteration=flops, details=details,
        rank_details=rank_details)


def _exchange_price(layout: Layout, ops, machine: Machine, profile: HardwareProfile):
    """exchange(rank, action) -> seconds of an Exchange once its other ends
    are posted: the slowest of its transfers, the receivers' all-gather
    under scatter/gather, a launch per transfer (cached by its shape)."""
    t = layout.t
    activation = layout.b * ops.s * ops.h * ops.E   # ops.s: s/c positions per context rank
    # Each tensor rank sends 1/t: scatter/gather (then the receivers
    # all-gather it) or sequence parallelism (its own s/t positions, kept).
    split = layout.sends_slices and activation % t == 0
    gather = split and layout.gathers_received
    # (one function, with its caches, for the layouts that price exchanges alike)
    shape = (activation, t, layout.c, layout.d, split, gather, layout.zero_bubble)
    known = _EXCHANGES.get(shape)
    if known is not None and known[0] is profile:
        return known[1]
    exchange_costs: dict[tuple, float] = {}

    def exchange(rank: int, action: Exchange) -> float:
        key = (rank, *[(transfer.op, transfer.peer) for transfer in action.transfers])
        if key not in exchange_costs:
            slowest, gathers = 0.0, 0.0
            for transfer in action.transfers:
                if transfer.op == "send" and layout.zero_bubble:
                    continue  # travels while the sender goes on; its receiver pays for it
                nbytes = activation / t if split else activation
                slowest = max(slowest, machine.p2p(nbytes, rank, transfer.peer))
                if transfer.op == "recv" and gather:
                    gathers += machine.tensor_allgather(activation)
            exchange_costs[key] = slowest + gathers + profile.launch_overhead * len(action.transfers)
        return exchange_costs[key]

    exchange.of_codes = {}   # a schedule's exchange prices (_play_unshared), by its key
    if len(_EXCHANGES) >= 256:
        _EXCHANGES.clear()
    _EXCHANGES[shape] = (profile, exchange)
    return exchange


_EXCHANGES: dict[tuple, tuple] = {}   # _exchange_price's functions, by what prices alike


def _exposed_gathers(layout: Layout, after, priced):
    """gathered(rank, action) -> the seconds a compute waits for ZeRO-3's
    all-gathers (0 for other strategies). Each layer is gathered one ahead,
    under the previous layer's computation: the first layer's gather is
    exposed, and each other's by what it outlasts its predecessor's
    computation (layers taken as equal: g = G/L, c = C/L, exposed
    g + (L − 1)·max(0, g − c)). With reshard-after-forward every forward
    and backward gathers the chunk's layers; without, only its first
    forward of the iteration. A chunk's ends are gathered once an iteration,
    before its first forward (exposed)."""
    if not layout.shards_parameters:
        return lambda rank, action: 0.0
    exposed: dict[tuple[int, int, str], float] = {}
    for (rank, chunk, op), (work, _) in priced.items():
        layers_seconds, _, layers = after.chunk_gathers[rank][chunk]
        if op == "W" or not layers:   # W needs no weight
            continue
        g, c = layers_seconds / layers, work / layers
        exposed[(rank, chunk, op)] = g + (layers - 1) * max(0.0, g - c)

    def gathered(rank: int, action: Compute) -> float:
        first = action.op == "F" and action.microbatch == 0
        if not layout.reshard_after_forward and not first:
            return 0.0
        ends = after.chunk_gathers[rank][action.chunk][1] if first else 0.0
        return ends + exposed.get((rank, action.chunk, action.op), 0.0)
    return gathered


def _rank_boxes(row, r: int, chunks, priced, exposed: float, pipeline_end, embedding_start,
                embedding: float, gathered) -> tuple[list[Box], dict[str, float]]:
    """One rank's timeline boxes and its seconds by category (before the
    reductions' and the optimizer's shares)."""
    boxes: list[Box] = []
    categories = {name: 0.0 for name in CATEGORIES + (GATHER_CATEGORY,)}
    # Per (chunk, op, whether it is the first forward): its work's categories,
    # its priced work and the seconds it waits for gathers, looked up once
    # (a rank's computes number 3·m·v, its kinds a few).
    per_kind: dict[tuple, tuple] = {}
    for rec in row:
        action = rec.action
        if isinstance(action, Compute):
            op, chunk = action.op, action.chunk
            boxes.append(Box(op, action.microbatch, chunk, float(rec.start), float(rec.end)))
            kind = (chunk, op, op == "F" and action.microbatch == 0)
            known = per_kind.get(kind)
            if known is None:
                known = per_kind[kind] = (tuple(chunks[(r, chunk)].of(op).work.items()),
                                          priced[(r, chunk, op)][0] or 1.0, gathered(r, action))
            shares, total, waits = known
            stretched = float(rec.work_end - rec.start)
            for category, seconds in shares:
                # (.get: "context exchange" appears only with c > 1)
                categories[category] = (categories.get(category, 0.0)
                                        + stretched * seconds / total)
            collectives = float(rec.end - rec.work_end)
            gather = min(collectives, waits)
            categories[GATHER_CATEGORY] += gather
            categories["tensor all-reduce"] += collectives - gather
        else:
            if rec.ready > rec.start:
                boxes.append(Box("wait", -1, -1, float(rec.start), float(rec.ready)))
            if rec.end > rec.ready:
                boxes.append(Box("comm", -1, -1, float(rec.ready), float(rec.end)))
            categories["bubble/idle"] += float(rec.ready - rec.start)
            categories["pipeline transfer"] += float(rec.end - rec.ready)
    if exposed > 0:
        boxes.append(Box("comm", -1, -1, float(pipeline_end), float(pipeline_end) + exposed))
    if embedding:   # (waiting for the other end is idle time)
        boxes.append(Box("comm", -1, -1, float(embedding_start),
                         float(embedding_start) + embedding))
    return boxes, categories


@dataclass
class _Played:
    """What a priced iteration needs of a played schedule, per pipeline
    rank: when its last action ends, its compute time, its first forward
    of each chunk (_first_forwards), the (chunk, start, end) of each of its
    backwards (its Ws under the zero-bubble kinds: what releases gradient
    buckets), and its records (built on demand)."""
    pipeline_end: list
    busy: list
    first_forwards: list[float]
    backwards: list[list[tuple]]
    records: Callable[[], list[list[Record]]]
    row: Callable[[int], list[Record]] | None = None   # one rank's records
    # per rank, backwards as (chunks, starts, ends) arrays (made from
    # `backwards` when not given)
    backward_arrays: list | None = None
    # per rank, found once for the layouts sharing this play: its backwards
    # by their end, and each chunk's last
    _by_end: dict = field(default_factory=dict)
    _last: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.row is None:
            self.row = lambda r: self.records()[r]

    def backwards_by_end(self, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rank r's backwards as (chunks, starts, ends) arrays, by their end
        (ties in their order)."""
        if r not in self._by_end:
            if self.backward_arrays is None:
                rows = np.asarray(self.backwards[r], dtype=np.float64).reshape(-1, 3)
                chunks, starts, ends = rows[:, 0].astype(np.int64), rows[:, 1], rows[:, 2]
            else:
                chunks, starts, ends = self.backward_arrays[r]
            order = np.argsort(ends, kind="stable")
            self._by_end[r] = (chunks[order], starts[order], ends[order])
        return self._by_end[r]

    def last_backwards(self, r: int) -> dict[int, tuple]:
        """Rank r's last backward of each chunk, by chunk (in the order the
        chunks first come)."""
        if r not in self._last:
            if self.backward_arrays is None:
                self._last[r] = dict(zip(map(_FIRST, self.backwards[r]), self.backwards[r]))
            else:
                chunks, starts, ends = self.backward_arrays[r]
                values, first = np.unique(chunks, return_index=True)
                last = len(chunks) - 1 - np.unique(chunks[::-1], return_index=True)[1]
                self._last[r] = {int(values[k]): (int(values[k]), float(starts[last[k]]),
                                                  float(ends[last[k]]))
                                 for k in np.argsort(first).tolist()}
        return self._last[r]


def _played_from_records(records: list[list[Record]], zero_bubble: bool) -> _Played:
    op = "W" if zero_bubble else "B"
    return _Played(
        [max((rec.end for rec in row), default=0.0) for row in records],
        [sum(rec.end - rec.start for rec in row if isinstance(rec.action, Compute))
         for row in records],
        [_first_forwards([(rec.action, rec.start, rec.end) for rec in row]) for row in records],
        [[(rec.action.chunk, rec.start, rec.end) for rec in row
          if isinstance(rec.action, Compute) and rec.action.op == op] for row in records],
        lambda: records)


def _first_forwards(row) -> float:
    """Seconds of a rank's first forward of each of its chunks (row: its
    (action, start, end) in order): what a weight all-gather overlapped
    with the next iteration's forward can hide under, each chunk's buckets
    arriving before its first forward needs them."""
    first: dict[int, float] = {}
    for action, start, end in row:
        if isinstance(action, Compute) and action.op == "F":
            first.setdefault(action.chunk, float(end - start))
    return sum(first.values())


def _buckets_done(played: _Played, rank: int, row_end, after):
    """When rank `rank`'s gradient buckets have all been reduced: each
    chunk's share of the bucketed work is released evenly over the chunk's
    last backward (played.backwards[rank]: (chunk, start, end) of its Bs,
    or its Ws under the zero-bubble schedules, which compute the weight
    gradients; every one of them under ZeRO-2/3, which reduce each
    microbatch's gradients as they complete), the link works through it
    in that order, and a chunk's last bucket can start only once its
    backward has ended (`row_end`: when the rank's last action ends)."""
    total = after.bucketed[rank]
    if total <= 0:
        return 0.0
    last = played.last_backwards(rank)   # by chunk (read once per play)
    if not after.overlapped:     # every bucket after the rank's last computation
        rounds = (len(played.backward_arrays[rank][0]) if played.backward_arrays is not None
                  else len(played.backwards[rank])) / max(1, len(last)) if after.per_microbatch else 1
        return row_end + total * rounds
    # Each chunk's bucketed work and its last bucket's, as the loop used them.
    shares, last_bucket = after.chunk_shares[rank], after.last_bucket[rank]
    works = {chunk: total * shares[chunk] for chunk in last}
    tails = {chunk: min(work, last_bucket) for chunk, work in works.items()}
    if after.per_microbatch:   # every backward releases its buckets
        chunks, starts, ends = played.backwards_by_end(rank)
        work_of = np.zeros(max(works) + 1)
        tail_of = np.zeros(max(works) + 1)
        for chunk, work in works.items():
            work_of[chunk], tail_of[chunk] = work, tails[chunk]
        kept = work_of[chunks] > 0
        return _link_free(starts[kept], ends[kept], work_of[chunks][kept],
                          tail_of[chunks][kept])
    free = 0.0
    for chunk, start, end in sorted(last.values(), key=_THIRD):
        work = works[chunk]
        if work <= 0:
            continue
        free = max(max(free, start) + work, end + tails[chunk])
    return free


def _link_free(starts: np.ndarray, ends: np.ndarray, works: np.ndarray, tails: np.ndarray,
               switches: int = 16) -> float:
    """The link's free time after x = max(max(x, start) + work, end + tail)
    over the arrays in order, from x = 0.0, bit for bit that loop. Rounding
    is monotonic, so max(x, s) + w = max(x + w, s + w): x_k = max(x_{k-1}
    + w_k, c_k) with c_k = max(s_k + w_k, e_k + t_k). Where the link idles
    between backwards each x_k is c_k (checked at once: c_{k-1} + w_k <=
    c_k); where it is busy x runs on as a sum (np.cumsum adds in order,
    as the loop does) until some c_k passes it. After `switches` changes
    between the two the loop does the rest."""
    n = len(starts)
    if not n:
        return 0.0
    c = np.maximum(starts + works, ends + tails)
    k = 0   # x_k = c_k here (so at the first backward: times are >= 0)
    for _ in range(switches):
        carried = np.flatnonzero(c[k:-1] + works[k + 1:] > c[k + 1:])
        if not len(carried):
            return float(c[-1])
        j = k + 1 + int(carried[0])       # x_j = c_{j-1} + w_j: the link is busy
        chain = np.cumsum(np.concatenate(([c[j - 1]], works[j:])))[1:]
        passed = np.flatnonzero(c[j:] > chain)
        if not len(passed):
            return float(chain[-1])
        k = j + int(passed[0])            # x_k = c_k again
    free = float(c[k])
    for start, end, work, tail in zip(starts[k + 1:].tolist(), ends[k + 1:].tolist(),
                                      works[k + 1:].tolist(), tails[k + 1:].tolist()):
        free = max(max(free, start) + work, end + tail)
    return free


_FIRST, _THIRD = operator.itemgetter(0), operator.itemgetter(2)


@functools.lru_cache(maxsize=32)
def _codes(key: tuple) -> Codes:
    # From arrays, without the schedule's actions (schedule_tables); zero-
    # bubble costs that place the exchanges alike give one set of codes,
    # and of levels, for all of them.
    return planned_codes(*key)


def _play_unshared(key: tuple, compute, exchange) -> _Played:
    """`play` without processor sharing (GPU profiles), from the same
    prices: then an action's times follow from its predecessor on its rank
    and, for an exchange, its other ends' posting alone, whatever order
    the ranks are moved in, so each rank runs as far as its exchanges let
    it, its start and end times kept in flat lists; the records are the
    ones `play` makes (tested), built only when asked for. Plays are shared
    by the layouts whose prices they have in common (the sharding
    strategies that change only what follows the flush)."""
    codes = _codes(key)
    compute_prices = tuple(tuple(compute(r, action) for action in row)
                           for r, row in enumerate(codes.compute_slots))
    known = getattr(exchange, "of_codes", {})
    exchange_prices = known.get(key)
    if exchange_prices is None:
        exchange_prices = known[key] = tuple(tuple(exchange(r, action) for action in row)
                                             for r, row in enumerate(codes.exchange_slots))
    memo = (key, compute_prices, exchange_prices)
    played = _PLAYS.get(memo)
    if played is None:
        if len(_PLAYS) >= 64:
            _PLAYS.clear()
        codes.plays += 1
        # (a small schedule: the loop, faster than numpy's calls on a few
        # actions a level)
        if sum(map(len, codes.slots)) < LEVELS_FROM:
            starts, ends, _ = flat_times(codes, compute_prices, exchange_prices)
            count = sum(map(len, starts))
            starts = np.fromiter(itertools.chain.from_iterable(starts), np.float64, count)
            ends = np.fromiter(itertools.chain.from_iterable(ends), np.float64, count)
        else:
            starts, ends = level_times(codes, compute_prices, exchange_prices)
        played = _PLAYS[memo] = _played_of(codes, compute_prices, starts, ends)
    return played


_PLAYS: dict[tuple, _Played] = {}
LEVELS_FROM = 20_000   # actions in a schedule for its plays to go level by level


def _played_of(codes: Codes, compute_prices: tuple, starts: np.ndarray, ends: np.ndarray
               ) -> _Played:
    """The _Played of a play's times, flat (rank after rank; an exchange
    is posted when it starts). Sums run in the actions' order, as over
    the records."""
    slots, ends_of, p = codes.slots, codes.ends, codes.p
    flat = flat_index(codes)
    offsets = flat["offsets"]

    def row_of(r: int) -> list[Record]:
        row, slots_r, ends_r, works = [], slots[r], ends_of[r], compute_prices[r]
        begun, done = starts[offsets[r]:offsets[r + 1]].tolist(), ends[offsets[r]:offsets[r + 1]].tolist()
        for i, action in enumerate(codes.actions(r)):
            record = Record(action, begun[i], done[i])
            slot = slots_r[i]
            if slot >= 0:
                record.work_end = begun[i] + works[slot][0]
            else:   # the latest of its posting and its other ends'
                ready = begun[i]
                for peer, j in ends_r[i]:
                    posted = float(starts[offsets[peer] + j])
                    if posted > ready:
                        ready = posted
                record.ready = ready
            row.append(record)
        return row

    def records() -> list[list[Record]]:
        return [row_of(r) for r in range(p)]

    busy = []
    for computes in flat["computes"]:   # (cumsum: the sum in order, as Python's)
        spans = ends[computes] - starts[computes]
        busy.append(float(np.cumsum(spans)[-1]) if len(spans) else 0)
    return _Played(
        [float(ends[a:b].max()) if b > a else 0.0 for a, b in zip(offsets, offsets[1:])],
        busy,
        # (_first_forwards of the rank's forwards: only each chunk's first counts)
        [sum((ends[firsts] - starts[firsts]).tolist()) for firsts in flat["first_forwards"]],
        RowsOnDemand([lambda chunks=chunks, released=released: list(zip(
            chunks, starts[released].tolist(), ends[released].tolist()))
            for chunks, released in zip(codes.released_chunks, flat["released"])]),
        records, row_of,
        [(chunks, starts[released], ends[released])
         for chunks, released in zip(flat["released_chunks"], flat["released"])])


def simulate_uniform(kind: str, p: int, m: int, v: int = 1, *, forward: Fraction | int = 1,
                     backward: Fraction | int = 2, weight: Fraction | int | None = None
                     ) -> tuple[Fraction, Fraction]:
    """(makespan, bubble fraction) of a schedule with uniform costs: a
    forward through one rank's layers costs `forward`, a backward `backward`,
    a chunk 1/v of that, transfers are free. The paper's assumption; the
    bubble is (p-1)/m, or (p-1)/(m·v) interleaved. Zero-bubble kinds: W
    costs `weight` of the backward (default half) and B the rest, as in
    ptdp.schedules.simulate (bubble (p-1)/(3m) for ZB-H1 and
    (p-1)/(6m) for ZB-V under F = B = W)."""
    schedule = build_schedule(kind, p, m, v)
    costs = compute_costs(schedule, forward, backward, weight)
    records = play(schedule, lambda r, a: (costs[a.op], 0), lambda r, a: 0)
    makespan = max(rec.end for row in records for rec in row)
    busy = max(sum(rec.end - rec.start for rec in row if isinstance(rec.action, Compute))
               for row in records)
    return makespan, (makespan - busy) / busy
