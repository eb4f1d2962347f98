"""The layouts a `ptdp plan` search considers: every one `ptdp train` would
accept for a workload on N devices, over every dimension (t, c, p, d, b, v,
the schedule, the layer split, recomputation, sequence parallelism, the
distributed optimizer and, for a mixture of experts, EP and ETP), with any
subset of them fixed.

A dimension left free is searched over the values that can win (microbatches
up to MAX_MICROBATCH, chunks up to MAX_CHUNKS, c while a rank keeps at least
MIN_CONTEXT_POSITIONS positions, ETP dividing t); a fixed one takes exactly
its value, beyond those limits too. Validity is Layout.valid_for: the rules
`ptdp train` enforces.
"""

from __future__ import annotations

import dataclasses
import functools
from itertools import product
from typing import Iterable

from ptdp.config import ModelConfig, ParallelConfig
from ptdp.config.base import divisors
from ptdp.config.context import context_parallel_problems
from ptdp.schedules.kinds import DEFAULT_SCHEDULE, KINDS, SEARCHED
from ptdp.schedules.split import LayerSplit, split_problems
from ptdp.perf.layout import (RECOMPUTE_KINDS, SHARDING_STRATEGIES, Layout, Workload,
                              sequence_parallel_problems, tensor_size_problems, trained_strategies)

MAX_MICROBATCH = 32        # larger microbatches only add memory at these sizes
MAX_CHUNKS = 8             # interleaving beyond this only adds transfers
MIN_CONTEXT_POSITIONS = 1024   # the search's smallest s/c (see context_sizes_to_search)
# The schedules searched: the --pipeline-schedule values whose records are
# `searched` (1F1B, interleaved with v > 1, and the two zero-bubble ones).
# GPipe is never better than 1F1B here (same bubble, more memory): it is
# priced only when --pipeline-schedule fixes it (ScheduleKind.searched).
SCHEDULES = SEARCHED


def candidate_layouts(workload: Workload, devices: int, *, tensor_sizes=None,
                      pipeline_sizes=None, data_sizes=None, microbatch_sizes=None,
                      chunk_counts=None, layers_per_chunk: int | None = None,
                      recompute=(None, "selective", "full"),
                      distributed_optimizer=None, sharding=None,
                      reshard_after_forward=(True, False),
                      sequence_parallel=(False, True), schedules=SCHEDULES,
                      layer_splits: bool = True, splits=None, context_sizes=None,
                      cp_comm: str = "p2p", expert_sizes=None, expert_tensor_sizes=None,
                      scatter_gather: bool = True) -> Iterable[Layout]:
    """Every layout `ptdp train` would accept for this workload on `devices`,
    restricted to the given values of each dimension (None: searched):
    `tensor_sizes`, `pipeline_sizes`, `data_sizes`, `microbatch_sizes`,
    `chunk_counts` (v), `layers_per_chunk` (--num-layers-per-virtual-
    pipeline-stage: v = l/(p·k), a schedule that interleaves or one whose
    fixed v it is), `recompute`, `sharding` (strategies; default: those
    `ptdp train` runs; `distributed_optimizer`, of before the strategies:
    False is no_shard, True optim), `reshard_after_forward` (ZeRO-3's),
    `sequence_parallel` (only where t > 1 divides s), `schedules`
    (--pipeline-schedule values; each runs at the v of its record: one that
    interleaves at any v, the others at their own, each only where its
    microbatch and layer rules hold), `context_sizes` (default: each that
    `context_sizes_to_search` keeps) with the comm type `cp_comm`, and for a
    mixture of experts `expert_sizes` (EP) and `expert_tensor_sizes` (ETP; an
    entry None is ptdp train's default, ETP = t). `layer_splits`: also the
    uneven splits of `split_candidates`; `splits`: exactly these splits
    instead. The t·p·d ranks are devices/c."""
    model = workload.model
    if sharding is None:
        sharding = (trained_strategies() if distributed_optimizer is None else
                    tuple("optim" if on else "no_shard" for on in distributed_optimizer))
    for c in (context_sizes_to_search(model, devices, cp_comm) if context_sizes is None
              else [c for c in context_sizes if c >= 1 and devices % c == 0]):
        yield from _candidates_of_context(
            workload, devices, c, cp_comm if c > 1 else "p2p", dict(
                tensor_sizes=tensor_sizes, pipeline_sizes=pipeline_sizes, data_sizes=data_sizes,
                microbatch_sizes=microbatch_sizes, chunk_counts=chunk_counts,
                layers_per_chunk=layers_per_chunk, recompute=recompute,
                sharding=tuple(sharding), reshard_after_forward=tuple(reshard_after_forward),
                sequence_parallel=sequence_parallel,
                schedules=schedules, layer_splits=layer_splits, splits=splits,
                expert_sizes=expert_sizes, expert_tensor_sizes=expert_tensor_sizes,
                scatter_gather=scatter_gather))


def context_sizes_to_search(model: ModelConfig, devices: int, cp_comm: str = "p2p") -> list[int]:
    """The context-parallel sizes a search tries: 1, and each c dividing
    the devices that `ptdp train`'s rules allow at t = 1 (s divisible by 2c,
    a2a's heads and key/value groups by c, no attention dropout) while a
    rank keeps at least MIN_CONTEXT_POSITIONS positions (shorter blocks
    hide no transfer and only add steps; give --context-parallel-size to
    price one anyway)."""
    sizes = [1]
    for c in divisors(devices)[1:]:
        if model.seq_length // c < MIN_CONTEXT_POSITIONS:
            break
        if not context_parallel_problems(model, ParallelConfig(context_parallel_size=c,
                                                               cp_comm_type=cp_comm)):
            sizes.append(c)
    return sizes


def _candidates_of_context(workload: Workload, devices: int, c: int, cp_comm: str,
                           given: dict) -> Iterable[Layout]:
    """`candidate_layouts` of one context-parallel size c."""
    model, batch = workload.model, workload.global_batch
    ranks = devices // c
    for t in _kept(divisors(ranks), given["tensor_sizes"]):
        # (the rules of t alone, checked once: every layout of such a t is refused)
        if tensor_size_problems(model, t):
            continue
        split_choices = [on for on in given["sequence_parallel"]
                         if not on or not sequence_parallel_problems(model, t)]
        for p in _kept(divisors(ranks // t), given["pipeline_sizes"]):
            d = ranks // (t * p)
            if batch % d or (given["data_sizes"] is not None and d not in given["data_sizes"]):
                continue
            if given["microbatch_sizes"] is None:
                sizes = [b for b in divisors(batch // d) if b <= MAX_MICROBATCH]
            else:
                sizes = [b for b in given["microbatch_sizes"] if b >= 1 and (batch // d) % b == 0]
            pipelines = _pipelines(model.num_layers, p, given["schedules"], given["chunk_counts"],
                                   given["layers_per_chunk"])
            # With d·c = 1 there is nothing to shard: one strategy (the first given).
            sharding = _sharding_choices(given, d * c)
            experts = _expert_layouts(model, t, t * c * d, given["expert_sizes"],
                                      given["expert_tensor_sizes"])
            # (b, schedule, v) that no layout of theirs runs, found once, not per layout
            # (the layouts kept are the same, in the same order)
            runnable = [(b, pipeline) for b in sizes for pipeline in pipelines
                        if _may_run(model, batch, given, t, p, d, b, *pipeline, c, cp_comm)]
            # valid_for reads a layout's recomputation and sharding strategy
            # only to check their names: its other rules are checked once per
            # (b, schedule, v, sequence parallelism, EP, ETP), on a probe with
            # the default names (the same layouts kept, in the same order).
            checked: dict[tuple, tuple[bool, tuple[LayerSplit, ...]]] = {}
            for (b, (schedule, v)), kind, (strategy, reshard), split, (ep, etp) in product(
                    runnable, given["recompute"], sharding, split_choices, experts):
                layout = Layout(t=t, p=p, d=d, b=b, v=v, recompute=kind, sharding=strategy,
                                reshard_after_forward=reshard, sequence_parallel=split,
                                schedule=schedule, c=c, cp_comm=cp_comm, ep=ep, etp=etp,
                                scatter_gather=given["scatter_gather"])
                if given["splits"] is not None:
                    if given["layers_per_chunk"] is not None:   # train refuses both
                        return
                    yield from (uneven for uneven in (_with_split(layout, cut)
                                                      for cut in given["splits"])
                                if not uneven.valid_for(model, batch))
                    continue
                shape = (b, schedule, v, split, ep, etp)
                if shape not in checked:
                    probe = Layout(t=t, p=p, d=d, b=b, v=v, sequence_parallel=split,
                                   schedule=schedule, c=c, cp_comm=cp_comm, ep=ep, etp=etp,
                                   scatter_gather=given["scatter_gather"])
                    # (--num-layers-per-virtual-pipeline-stage fixes every chunk's size: even only)
                    checked[shape] = (not probe.valid_for(model, batch),
                                      _valid_uneven_splits(probe, model, batch)
                                      if given["layer_splits"] and given["layers_per_chunk"] is None
                                      else ())
                if kind not in RECOMPUTE_KINDS or strategy not in SHARDING_STRATEGIES:
                    continue
                even, uneven = checked[shape]
                if even:
                    yield layout
                yield from (_with_split(layout, cut) for cut in uneven)


def _may_run(model: ModelConfig, batch: int, given: dict, t: int, p: int, d: int, b: int,
             schedule: str, v: int, c: int, cp_comm: str) -> bool:
    """False where every layout of this (b, schedule, v) is refused: m =
    B/(b·d) breaks the schedule's microbatch rules (whatever the layer
    split), or the even split breaks its layer rules and no other split is
    tried (given none, and none of `_uneven_splits` exists for it)."""
    probe = Layout(t=t, p=p, d=d, b=b, v=v, schedule=schedule, c=c, cp_comm=cp_comm)
    if probe._microbatch_problems(probe.microbatches(batch)):
        return False
    if given["splits"] is not None or not probe._schedule_problems(model):
        return True
    return bool(given["layer_splits"] and given["layers_per_chunk"] is None
                and _uneven_splits(model.num_layers, p, v, schedule))


def _sharding_choices(given: dict, replicas: int) -> list[tuple[str, bool]]:
    """The (strategy, reshard_after_forward) pairs to try where the
    parameters have `replicas` = d·c copies: each strategy given, ZeRO-3
    with each reshard policy given (the others at the field's default, which
    means nothing for them); one strategy
    (the first given) where there is nothing to shard."""
    strategies = given["sharding"] if replicas > 1 else given["sharding"][:1]
    policies = given["reshard_after_forward"]
    return [(strategy, reshard) for strategy in strategies
            for reshard in (policies if strategy == "optim_grads_params" else (True,))]


def _kept(values: list[int], allowed) -> list[int]:
    return values if allowed is None else [x for x in values if x in allowed]


def _pipelines(num_layers: int, p: int, schedules, chunk_counts,
               layers_per_chunk: int | None) -> list[tuple[str, int]]:
    """The (schedule, v) pairs to try at pipeline size p."""
    if layers_per_chunk is not None:   # v follows from k: interleaved, or a fixed v (a V's 2)
        k = layers_per_chunk
        if p < 2 or k < 1 or num_layers % (p * k):
            return []
        v = num_layers // (p * k)
        pairs = [(s, v) for s in schedules if s in KINDS and (KINDS[s].with_chunks is not None
                                                              or KINDS[s].fixed_chunks == v)]
        return [(s, v) for s, v in pairs if chunk_counts is None or v in chunk_counts]
    if chunk_counts is None:
        chunks = [1] + (list(range(2, MAX_CHUNKS + 1)) if p > 1 else [])
    else:
        chunks = [v for v in chunk_counts if v == 1 or (v > 1 and p > 1)]
    return [(s, v) for v in chunks for s in schedules
            if _takes_chunks(s, v)
            # with p = 1 all are one schedule: the default's, unless another is fixed
            and (p > 1 or s == DEFAULT_SCHEDULE or DEFAULT_SCHEDULE not in schedules)]


def _takes_chunks(schedule: str, v: int) -> bool:
    """Whether the --pipeline-schedule value runs with v chunks per rank: its
    own (fixed) v, or any v where it interleaves."""
    record = KINDS.get(schedule)
    if record is None:
        return False
    if record.with_chunks is not None:
        return True
    return v == (record.fixed_chunks or 1)


def _expert_layouts(model: ModelConfig, t: int, ranks: int, expert_sizes,
                    expert_tensor_sizes) -> list[tuple[int, int | None]]:
    """The (EP, ETP) pairs to try where a pipeline stage has `ranks` = t·c·d
    ranks: for a dense model (1, None) unless fixed (valid_for then refuses
    it with ptdp train's message); for an MoE, each EP dividing E and ETP
    (None: t; searched over the divisors of t) with EP·ETP dividing the ranks."""
    if not model.is_moe:
        return [(ep, etp) for ep in (expert_sizes or (1,)) for etp in (expert_tensor_sizes or (None,))]
    eps = expert_sizes or [x for x in divisors(model.num_experts) if ranks % x == 0]
    etps = expert_tensor_sizes or [None] + [x for x in divisors(t) if x != t]
    return [(ep, etp) for ep in eps for etp in etps
            if ep >= 1 and (etp is None or etp >= 1) and ranks % (ep * (t if etp is None else etp)) == 0]


def _valid_uneven_splits(layout: Layout, model: ModelConfig, batch: int
                         ) -> tuple[LayerSplit, ...]:
    """The splits of `layout`'s valid uneven variants, one per distinct cut
    (a split that cuts as the even one does, or as an earlier one, is left
    out)."""
    splits = _uneven_splits(model.num_layers, layout.p, layout.v, layout.schedule)
    # Once the split's own rules hold, every other rule is the same for all splits.
    if splits and not _with_split(layout, splits[0]).valid_for(model, batch):
        return splits
    return ()


def _with_split(layout: Layout, split: LayerSplit) -> Layout:
    """dataclasses.replace(layout, split=split) without running __init__
    again (the split is a field nothing else is derived from; a search
    makes tens of thousands of these)."""
    copied = object.__new__(Layout)
    copied.__dict__.update(layout.__dict__)
    object.__setattr__(copied, "split", split)
    return copied


@functools.lru_cache(maxsize=4096)
def _uneven_splits(num_layers: int, p: int, v: int, schedule: str) -> tuple[LayerSplit, ...]:
    """The splits of `split_candidates` that split_problems accepts, one per
    distinct cut, none cutting as the even split does where that is valid."""
    layout = Layout(p=p, v=v, schedule=schedule)
    kind = layout.schedule_kind
    even = num_layers % (p * v) == 0
    seen = {tuple(layout.stage_layers(num_layers))} if even else set()
    splits = []
    for split in split_candidates(layout, num_layers):
        if KINDS[kind].chunks is None or split_problems(num_layers, p, v, kind, split):
            continue
        counts = tuple(dataclasses.replace(layout, split=split).stage_layers(num_layers))
        if counts not in seen:
            seen.add(counts)
            splits.append(split)
    return tuple(splits)


def split_candidates(layout: Layout, num_layers: int) -> list[LayerSplit]:
    """The uneven splits the search tries for `layout` (not checked: the
    caller keeps the valid ones). Only p >= 2 under a kind of fixed chunks
    (not the interleaved one): the three nontrivial combinations of the accounting
    flags, and for v = 1 first/last-rank layer counts one or two below the
    even share (ceil(l/p)) on the first and/or the last rank."""
    if layout.p < 2 or layout.schedule_kind not in KINDS or KINDS[layout.schedule_kind].chunks is None:
        return []
    splits = [LayerSplit(embedding=True), LayerSplit(loss=True),
              LayerSplit(embedding=True, loss=True)]
    if layout.v == 1:
        share = -(-num_layers // layout.p)
        counts = [None] + [share - k for k in (1, 2) if share - k >= 1]
        splits += [LayerSplit(first=first, last=last) for first in counts for last in counts
                   if (first, last) != (None, None)]
    return splits
