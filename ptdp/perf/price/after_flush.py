"""What follows the pipeline flush: the gradient reductions and the
optimizer step, per pipeline rank.

A pipeline rank reduces its gradients (fp32, as ptdp keeps them) over the
d replicas with a hierarchical ring (reduce-scatter inside the server,
all-reduce between servers, all-gather inside); a reduce-scatter only with
the distributed optimizer. Its buckets start as soon as their gradients are
final, during each chunk's last backward (ptdp.parallel.data_parallel.GradBuffer),
so the reduction overlaps that backward: simulate/predict.py plays it against the
timeline from these per-chunk amounts (`chunk_shares`), and at least the
last bucket's reduction (`last_bucket`) follows the flush. The tied
embedding is summed over the embedding group (the first and the last
stage, once both have finished; not with an untied output layer) after the
buckets. Then every rank meets in the gradient-norm
all-reduces and steps its optimizer: ptdp's element-wise AdamW, about 112
bytes moved per parameter it owns (32 for a run with fused multi-tensor
kernels, HardwareProfile.fused_optimizer; 1/d of them with the distributed
optimizer, followed by the all-gather of the updated weights; a run that
overlaps that gather with the next iteration's forward, as Megatron-LM's
--overlap-param-gather does, exposes only what its first forwards do not
cover, `hideable_gather` and simulate/predict.py).

Sharded gradients (ZeRO-2 and 3, Layout.shards_gradients;
ptdp.parallel.sharded_grads): every bucket is reduce-scattered once per
microbatch, as it completes in that microbatch's backward, instead of once
per iteration: `bucketed` is then one microbatch's reductions
(`per_microbatch`), which simulate/predict.py releases under every backward
of each chunk, m times ZeRO-1's volume in all. The zeroing counts the shard
and one allocation of every bucket. ZeRO-3 (Layout.shards_parameters) gathers no updated
weights after the step; instead each unit is all-gathered before its
forward and before its backward, but a chunk's ends, gathered once an
iteration (`chunk_gathers`; see simulate/predict.py for how they overlap
the computation).

Sequence parallelism: each gradient bucket holding partial gradients
(norms, row-parallel biases, the position table) all-reduces them over the
tensor group (fp32) before the data-parallel reduction. None of it depends
on the microbatch size or the recomputation, so a search prices it once for
all of them.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable

from ptdp.config.train import TrainConfig
from ptdp.schedules.kinds import virtual_stage_of
from ptdp.perf.analytic import counts as analytic
from ptdp.perf.analytic.lora import chunk_adapter_parameters, cut_adapter_buckets
from ptdp.perf.layout import ByIdentity, ByValue, Layout, Workload
from ptdp.perf.price.machine import Machine
from ptdp.perf.price.operator_bytes import optimizer_bytes_per_parameter
from ptdp.perf.price.pricing import GRAD_BYTES, OperatorModel
from ptdp.perf.price.profiles import HardwareProfile
from ptdp.perf.price.stage_costs import parameter_counts



@functools.lru_cache(maxsize=4096)
def _stage_location(kind: str, p: int, v: int, stage: int) -> tuple[int, int]:
    """(rank, chunk) holding virtual stage `stage`."""
    for rank in range(p):
        for chunk in range(v):
            if virtual_stage_of(kind, p, v, rank, chunk) == stage:
                return rank, chunk
    raise ValueError(f"{kind} p={p} v={v} has no stage {stage}")


@dataclass
class AfterFlush:
    """What follows the pipeline flush on each pipeline rank: its gradient
    reductions (the tied embedding's sum between the ranks in `ends`, the
    sequence-parallel partial sums `partial_sums`, the data-parallel
    reduction) and its optimizer step."""
    partial_sums: list[float]
    optimizer: list[float]
    ends: tuple[int, int]          # ranks of the first and the last stage
    embedding: float               # seconds of the tied embedding's sum (0: none)
    # The bucketed part of each rank's reduction (data-parallel and partial
    # sums, not the embedding's), each chunk's share of it, and what its
    # last bucket takes: it starts only once the backward has finished.
    bucketed: list[float]
    chunk_shares: list[tuple[float, ...]]
    last_bucket: list[float]
    # Of each rank's optimizer step, the all-gather of the updated weights
    # that may run under the next iteration's first forwards
    # (HardwareProfile.overlap_param_gather; 0 otherwise): all of it but
    # the first bucket, which the first forward waits for.
    hideable_gather: list[float]
    overlapped: bool               # buckets reduced during the backward (else after the flush)
    # ZeRO-2/3: `bucketed` is one microbatch's reductions, run under each backward.
    per_microbatch: bool = False
    # ZeRO-3: () -> chunk_gathers, priced when first read (a search's bounds never read them).
    gathers: Callable[[], tuple] = tuple

    @functools.cached_property
    def chunk_gathers(self) -> tuple[tuple[tuple[float, float, int], ...], ...]:
        """ZeRO-3, [rank][chunk]: (seconds to all-gather its layers once, to
        gather its ends once, its layers) (ptdp.perf.analytic.sharding.rank_units)."""
        return self.gathers()

    def optimizer_at_least(self, rank: int) -> float:
        """The least of rank `rank`'s optimizer step any schedule leaves exposed."""
        return self.optimizer[rank] - self.hideable_gather[rank]

    def exposed_at_least(self, rank: int) -> float:
        """Reduction seconds rank `rank` spends after its last backward in
        any schedule: its last bucket (all of them when nothing overlaps),
        and the tied embedding's sum."""
        buckets = self.last_bucket[rank] if self.overlapped else self.bucketed[rank]
        return buckets + (self.embedding if rank in self.ends else 0.0)


def after_flush(workload: Workload, layout: Layout, profile: HardwareProfile,
                 ops: OperatorModel) -> AfterFlush:
    # The microbatch size and the recomputation change none of it: a search
    # prices it once for all of them.
    key = (ops.model_key, workload.lora, workload.precision, ByIdentity(profile), ops.threads, layout.t,
           layout.p, layout.d, layout.c, layout.v, layout.schedule, layout.sharding,
           layout.reshard_after_forward, layout.sequence_parallel, layout.split, layout.ep,
           layout.etp)
    after = _AFTER_FLUSH.get(key)
    if after is None:
        if len(_AFTER_FLUSH) > 65536:
            _AFTER_FLUSH.clear()
        after = _AFTER_FLUSH[key] = _price_after_flush(workload, layout, profile, ops)
    return after


_AFTER_FLUSH: dict[tuple, AfterFlush] = {}


def _price_after_flush(workload: Workload, layout: Layout, profile: HardwareProfile,
                       ops: OperatorModel) -> AfterFlush:
    p, v, t, d = layout.p, layout.v, layout.t, layout.d
    machine = Machine(layout, profile)
    threads = profile.threads_per_process(layout.devices)
    contended = profile.kind == "cpu" and profile.cores > 0
    kind = layout.schedule_kind
    ends = (_stage_location(kind, p, v, 0)[0], _stage_location(kind, p, v, p * v - 1)[0])
    embedding = 0.0
    lora = workload.lora   # adapters: their buffer only is reduced and stepped
    if ends[0] != ends[1] and workload.model.tied_output and not lora:
        # The tied embedding's gradient: the first and the last stage sum it together.
        embedding = machine.allreduce(ops.V // t * ops.h * GRAD_BYTES,
                                      [machine.rank(0, 0, ends[0]), machine.rank(0, 0, ends[1])])
    # Sequence parallelism: each bucket holding partial gradients (norms,
    # row-parallel biases, positions) all-reduces them over the tensor group first.
    tensor_allreduce = functools.cache(machine.tensor_allreduce)   # buckets repeat sizes
    placement = analytic.placement_of_parameters(layout)
    bucket_size = TrainConfig().ddp_bucket_size
    if lora:
        partial = [tuple(bucket.partial for bucket in cut_adapter_buckets(
            ops.model_key, lora, placement, r, bucket_size) if bucket.partial) for r in range(p)]
        parameters = tuple(tuple(sum(param.numel for param in chunk_adapter_parameters(
            workload.model, lora, placement, r, chunk)) for chunk in range(v)) for r in range(p))
    else:
        partial = [_partial_gradient_buckets(ops.model_key, placement, r) for r in range(p)]
        parameters = parameter_counts(ops.model_key, placement)
    partial_sums = [sum(tensor_allreduce(n * GRAD_BYTES) for n in partial[r]) for r in range(p)]
    optimizer, bucketed, shares, last_bucket, hideable = [], [], [], [], []
    step_per_parameter = optimizer_bytes_per_parameter(profile.fused_optimizer, workload.precision)
    world_latency = machine.world_latency()   # (the same for every rank)
    for r in range(p):
        params = sum(parameters[r])
        # (ZeRO-2/3: one microbatch's reduce-scatters; see per_microbatch)
        seconds = machine.data_parallel(params * GRAD_BYTES, r,
                                        reduce_scatter_only=layout.distributed_optimizer)
        bucketed.append(seconds + partial_sums[r])
        shares.append(tuple(n / params if params else 0.0 for n in parameters[r]))
        # A bucket's share of the rank's parameters (its chunks' smallest
        # holds at most one): the last reduced, the first gathered.
        smallest_chunk = min((n for n in parameters[r] if n), default=0)
        one_bucket = min(bucket_size, smallest_chunk) / params if params else 0.0
        last_bucket.append(bucketed[-1] * one_bucket)
        # The distributed optimizer shards over the d·c ranks holding the same parameters.
        owned = params / (d * layout.c) if layout.distributed_optimizer else params
        # Zeroed: the gradient buffer; under ZeRO-2/3 the shard, and each
        # bucket's storage as it is allocated (once per microbatch: the m − 1
        # further fills, under the backward, are left out).
        zeroed = params + (owned if layout.shards_gradients else 0)
        step_bytes = zeroed * GRAD_BYTES + owned * step_per_parameter  # zero + step
        if ops.E != 4:
            step_bytes += owned * (4 + ops.E)                 # main weights -> model weights
        work = ops.memory(step_bytes, "optimizer") + profile.launch_overhead * 30
        work /= profile.share(layout.devices, threads) if contended else 1
        comm = 2 * world_latency                               # inf check, gradient norm
        gather = 0.0
        if layout.distributed_optimizer and not layout.shards_parameters:
            gather = machine.data_parallel(params * ops.E, r, reduce_scatter_only=True)
        optimizer.append(work + comm + gather)
        hideable.append(gather * (1 - one_bucket) if profile.overlap_param_gather else 0.0)
    # (kept with a copy of the model: the cached result outlives the caller's object)
    gathers = (functools.partial(_parameter_gathers, dataclasses.replace(
        workload, model=ops.model_key.copy()), layout, machine, ops)
        if layout.shards_parameters else tuple)
    return AfterFlush(partial_sums, optimizer, ends, embedding, bucketed, shares, last_bucket,
                      hideable, profile.overlap_grad_reduce, layout.shards_gradients, gathers)


def _parameter_gathers(workload: Workload, layout: Layout, machine: Machine, ops: OperatorModel
                       ) -> tuple[tuple[tuple[float, float, int], ...], ...]:
    """ZeRO-3: per (rank, chunk), the seconds to all-gather its layers once
    in the model dtype over its replicas, the seconds to gather its ends
    (kept gathered through the iteration), and its layers (units)."""
    from ptdp.perf.analytic.sharding import rank_units

    def seconds(units, r: int) -> float:
        return machine.data_parallel(sum(unit.elements(layout) for unit in units) * ops.E, r,
                                     reduce_scatter_only=True)

    if workload.lora:   # only the adapters are sharded (the frozen base stays whole): tiny
        return tuple(tuple((0.0, 0.0, 0) for _ in range(layout.v)) for _ in range(layout.p))
    bucket_size = TrainConfig().ddp_bucket_size
    return tuple(tuple((seconds([u for u in chunk if not u.end], r),
                        seconds([u for u in chunk if u.end], r),
                        sum(not u.end for u in chunk))
                       for chunk in rank_units(workload.model, layout, r, bucket_size))
                 for r in range(layout.p))


@functools.lru_cache(maxsize=65536)
def _partial_gradient_buckets(model: ByValue, layout: Layout, rank: int) -> tuple[int, ...]:
    # (analytic.partial_gradient_buckets, from the key the search holds: no
    # second snapshot of the model)
    return tuple(bucket.partial for bucket in analytic.cut_placed_buckets(
        model, layout, rank, TrainConfig().ddp_bucket_size) if bucket.partial)
