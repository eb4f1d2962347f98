"""Data parallelism: contiguous gradient buckets reduced while backward runs.

All parameters of a rank live in one flat buffer (`param_data`, the model's
dtype) and their gradients in another (`grad_data`, fp32 unless
--main-grads-dtype bf16, so microbatch gradients accumulate in fp32 whatever
the model's precision). The buffers
are cut into buckets of about `bucket_size` elements, in reverse parameter
order (roughly the order backward finishes them). A parameter's gradient is
final once it has been accumulated for every microbatch of the iteration
(under the zero-bubble schedules, by the microbatch's W: ptdp.parallel.weight_grad);
when all of a bucket's gradients are final its reduction over the d replicas
starts at once (asynchronously), overlapping the rest of the backward pass.
Gradients are averaged over d; summed under --calculate-per-token-loss,
whose loss is already divided by the tokens of the whole global batch
(Megatron-LM's DDP likewise leaves out its 1/d there).

With --grad-reduce-in-bf16 the reduction over the replicas sends bf16 copies
of the fp32 gradients (half the bytes) and the reduced values are written
back into the fp32 buffer; accumulation over microbatches stays fp32.

With --main-grads-dtype bf16 the gradient buffers themselves are bf16
(`grad_dtype`; the distributed optimizer's shard too): a bf16 model's
gradients are added into them in bf16 (autograd accumulates straight into
the buffer, as for fp32 models) and reduced in bf16, as Megatron-LM's
buffers are when it does not accumulate in fp32. The optimizer reads them
as fp32 (ptdp.train.optimizer).

With the distributed optimizer each bucket is padded to a multiple of d and
reduce-scattered: data-parallel rank r receives the summed r-th 1/d of every
bucket (`grad_shard`), the part whose fp32 weights and Adam states it owns.

After the distributed optimizer's step every replica all-gathers the
updated weights (`gather_params`). With --overlap-param-gather
(`overlap_param_gather`) the gathers are only started, in forward order,
and each bucket's is waited for by a forward pre-hook of the first module
whose parameters it holds, so the gathers run during the next forward
(Megatron-LM's meaning); whatever reads the weights otherwise between the
step and that forward (a checkpoint, through `gathered`) waits for all of
them first (`finish_param_gather`).

The tied word embedding of the first and last pipeline stage has a bucket of
its own: its gradient is first summed over the embedding group, then reduced
over the replicas, when the iteration's backward has finished.

Routed experts' parameters (expert parallelism) sit in buckets of their
own, reduced over the expert-data-parallel group (the replicas of the same
expert shard; sharded over it by the distributed optimizer) and divided by
d like the rest: an expert's gradient on one rank already sums the tokens
that several data-parallel replicas dispatched to it.

Under sequence parallelism the norms' weights and the row-parallel biases see
only s/t positions on each tensor rank: when their bucket is ready, their
gradients are first summed over the tensor group (one all-reduce of the
bucket's such gradients, once per iteration), then reduced like the rest.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from ptdp.parallel.collectives import all_gather_flat, reduce_scatter_flat
from ptdp.parallel.sharding import PARTIAL_GRAD_ATTR, is_expert
from ptdp.parallel.tensor import sum_partial_grads
from ptdp.parallel.topology import ParallelContext


@dataclass(frozen=True)
class Replicas:
    """The ranks holding the same values as this one, over which a bucket's
    gradients are reduced: the data × context group (the data-parallel group
    when c = 1), or for routed experts the expert-data-parallel one."""
    group: Any       # None: one rank
    size: int
    rank: int

    @classmethod
    def of(cls, ctx: ParallelContext, expert: bool) -> "Replicas":
        if expert:
            return cls(ctx.expert_data_group, ctx.edp_size, ctx.edp_rank)
        return cls(ctx.grad_reduce_group, ctx.grad_reduce_size, ctx.grad_reduce_rank)


@dataclass
class Bucket:
    start: int                      # range in the flat buffers; length divisible by the replicas when sharded
    end: int
    params: list[nn.Parameter]
    replicas: Replicas
    shard_start: int = 0            # where this rank's part begins in grad_shard (sharded)
    tied: bool = False              # the tied word embedding: summed over the embedding group first
    # Gradients computed from s/t positions per tensor rank: summed over the tensor group first.
    partial: list[nn.Parameter] = field(default_factory=list)
    pending: int = 0                # parameters whose gradient is not final yet this iteration
    launched: bool = False
    handles: list[Any] = field(default_factory=list)
    # --grad-reduce-in-bf16: (reduced bf16 copy, its fp32 destination), copied when the handles are.
    unpack: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # Its main gradients (grad_dtype): a view of grad_data (None while a ZeRO-2
    # bucket holds none: sharded_grads.py).
    grads: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Segment:
    """Where one parameter sits in the flat buffers."""
    param: nn.Parameter
    start: int
    end: int


class GradBuffer:
    def __init__(self, params: list[nn.Parameter], ctx: ParallelContext, *, param_dtype: torch.dtype,
                 bucket_size: int, shard: bool, tied: set[nn.Parameter] = frozenset(),
                 accumulations: dict[nn.Parameter, int] | None = None, average: bool = True,
                 reduce_dtype: torch.dtype = torch.float32, grad_dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None, unit_of: dict[nn.Parameter, int] | None = None):
        """`accumulations`: for a parameter that autograd accumulates into
        more than once per microbatch (separate backward passes, e.g. zbv's
        shared word embedding: the lookup's gradient in one chunk's backward,
        the output layer's in another's), how many times; 1 otherwise.
        `average`: divide the reduced gradients by d (else sum them).
        `reduce_dtype`: what the data-parallel reduction sends (fp32 or bf16);
        `grad_dtype`: the main gradients' (fp32, or bf16: --main-grads-dtype).
        `device`: where the buffers live (default: the parameters'; needed
        where a rank has no trainable parameter, as a LoRA stage without
        adapters). `unit_of`: a bucket holds parameters of one unit only
        (ZeRO-3 gathers a unit's buckets together: sharded_params.py)."""
        self.ctx, self.shard = ctx, shard
        self.average, self.reduce_dtype, self.grad_dtype = average, reduce_dtype, grad_dtype
        self._accumulations = dict(accumulations or {})
        device = device if device is not None else params[0].device
        ordered = list(reversed(params))  # backward finishes the last layers first

        # Cut into buckets; tied parameters each in a bucket of their own,
        # routed experts' in buckets of their own (reduced over other ranks).
        groups: list[tuple[list[nn.Parameter], bool]] = []
        current: list[nn.Parameter] = []
        for param in ordered:
            if param in tied:
                groups.append(([param], True))
                continue
            if current and (is_expert(param) != is_expert(current[0]) or unit_of is not None
                            and unit_of[param] != unit_of[current[0]]):
                groups.append((current, False))
                current = []
            current.append(param)
            if sum(p.numel() for p in current) >= bucket_size:
                groups.append((current, False))
                current = []
        if current:
            groups.append((current, False))

        self.buckets: list[Bucket] = []
        self.segments: list[Segment] = []
        offset = shard_offset = 0
        for group_params, is_tied in groups:
            start = offset
            replicas = Replicas.of(ctx, is_expert(group_params[0]))
            for param in group_params:
                self.segments.append(Segment(param, offset, offset + param.numel()))
                offset += param.numel()
            if shard:
                offset += (-(offset - start)) % replicas.size  # pad to a multiple of the replicas
            partial = [p for p in group_params if getattr(p, PARTIAL_GRAD_ATTR, False)]
            bucket = Bucket(start, offset, group_params, replicas, tied=is_tied, partial=partial,
                            shard_start=shard_offset if shard else start)
            shard_offset += bucket.size // replicas.size if shard else bucket.size
            self.buckets.append(bucket)
        self.numel, self.shard_numel = offset, shard_offset

        # Move the parameters into the flat buffer (their fp32 values are kept
        # for the optimizer's main weights) and give each its main_grad view.
        self.initial_fp32 = torch.zeros(self.numel, dtype=torch.float32, device=device)
        self.param_data = torch.zeros(self.numel, dtype=param_dtype, device=device)
        self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=device)
        self.alias_grads = param_dtype == grad_dtype
        self._bucket_of: dict[nn.Parameter, Bucket] = {}
        # The hook reaches the buffer through a weak reference: a parameter's
        # hooks are held where Python's garbage collector does not look, so a
        # strong one would keep this buffer (and every gradient and weight in
        # it) alive after its trainer is gone, in any process that builds a
        # second one (a benchmark, a notebook, the tests).
        on_grad_of = weakref.WeakMethod(self._on_grad)

        def on_grad(param: nn.Parameter) -> None:
            method = on_grad_of()
            if method is not None:
                method(param)

        for bucket in self.buckets:
            bucket.grads = self.grad_data[bucket.start:bucket.end]
            for param in bucket.params:
                self._bucket_of[param] = bucket
        for segment in self.segments:
            param = segment.param
            with torch.no_grad():
                self.initial_fp32[segment.start:segment.end].copy_(param.detach().reshape(-1))
                view = self.param_data[segment.start:segment.end].view_as(param)
                view.copy_(param.detach())
            param.data = view
            param.main_grad = self.grad_data[segment.start:segment.end].view_as(param)
            if self.alias_grads:
                # The model's dtype: autograd accumulates straight into the buffer.
                param.grad = param.main_grad
            param.register_post_accumulate_grad_hook(on_grad)
        self.grad_shard = (torch.zeros(self.shard_numel, dtype=grad_dtype, device=device)
                           if shard else None)
        self._counts: dict[nn.Parameter, int] = {}
        self._expected: dict[nn.Parameter, int] = {}
        # --overlap-param-gather: gathers in flight, id(bucket) -> (handle, the shard it sends).
        self.overlaps_param_gather, self._gathering = False, {}

    # One iteration ----------------------------------------------------------------

    def start_iteration(self, num_microbatches: int) -> None:
        self.grad_data.zero_()
        self._expected = {segment.param: num_microbatches * self._accumulations.get(segment.param, 1)
                          for segment in self.segments}
        self._counts = {segment.param: 0 for segment in self.segments}
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
            bucket.handles = []
            bucket.unpack = []
            bucket.launched = False

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self.alias_grads:
            param.main_grad.add_(param.grad)
            param.grad = None
        count = self._counts[param] = self._counts[param] + 1
        if count == self._expected[param]:
            bucket = self._bucket_of[param]
            bucket.pending -= 1
            if bucket.pending == 0:
                self._launch(bucket)

    def _shard_view(self, bucket: Bucket) -> torch.Tensor:
        return self.grad_shard[bucket.shard_start:bucket.shard_start + bucket.size // bucket.replicas.size]

    def _launch(self, bucket: Bucket) -> None:
        """Start this bucket's reduction (asynchronously)."""
        bucket.launched = True
        sum_partial_grads([p.main_grad for p in bucket.partial], self.ctx.tp_group)
        view = bucket.grads
        if bucket.tied and self.ctx.embedding_group is not None:
            # Sum the two copies first; the replica reduction follows in finish().
            bucket.handles.append(dist.all_reduce(view, group=self.ctx.embedding_group,
                                                  async_op=True))
            return
        self._reduce_over_replicas(bucket, async_op=True)

    def _reduce_over_replicas(self, bucket: Bucket, async_op: bool) -> None:
        view = bucket.grads
        group = bucket.replicas.group
        # The mean over the d data-parallel replicas' losses: an expert's
        # bucket too, whose gradient holds several replicas' tokens.
        if self.average and self.ctx.dp_size > 1:
            view.div_(self.ctx.dp_size)
        if group is None:
            if self.shard:
                self._shard_view(bucket).copy_(view)
            return
        sent, received = view, (self._shard_view(bucket) if self.shard else view)
        if self.reduce_dtype != view.dtype:
            sent = view.to(self.reduce_dtype)
            received = torch.empty(received.numel(), dtype=self.reduce_dtype, device=view.device) \
                if self.shard else sent
            bucket.unpack.append((received, self._shard_view(bucket) if self.shard else view))
        if self.shard:
            handle = reduce_scatter_flat(received, sent, group, async_op)
        else:
            handle = dist.all_reduce(sent, group=group, async_op=async_op)
        if handle is not None and async_op:
            bucket.handles.append(handle)
        else:
            self._unpack(bucket)

    @staticmethod
    def _unpack(bucket: Bucket) -> None:
        """Copy reduced low-precision gradients back into the main gradients."""
        for reduced, destination in bucket.unpack:
            destination.copy_(reduced)
        bucket.unpack = []

    def finish(self) -> None:
        """Wait for every reduction of the iteration (launching any bucket whose
        parameters got fewer gradients than microbatches, in bucket order on
        every rank so the collectives match)."""
        for bucket in self.buckets:
            if not bucket.launched:
                self._launch(bucket)
        for bucket in self.buckets:
            for handle in bucket.handles:
                handle.wait()
            bucket.handles = []
            self._unpack(bucket)
            if bucket.tied and self.ctx.embedding_group is not None:
                self._reduce_over_replicas(bucket, async_op=False)

    @contextlib.contextmanager
    def gathered(self, write_back: bool = False) -> Iterator[None]:
        """Every parameter whole and up to date inside: here once any
        gather of the updated weights in flight has finished (ZeRO-3's
        gathers them: sharded_params.py)."""
        self.finish_param_gather()
        yield

    @property
    def reduced_grads(self) -> torch.Tensor:
        """The gradients this rank's optimizer steps: all of them, or its shard."""
        return self.grad_shard if self.shard else self.grad_data

    def owned_range(self, bucket: Bucket) -> tuple[int, int]:
        """The part of `bucket` (flat-buffer offsets) whose weights this rank steps."""
        if not self.shard:
            return bucket.start, bucket.end
        part = bucket.size // bucket.replicas.size
        start = bucket.start + bucket.replicas.rank * part
        return start, start + part

    def gather_params(self, updated_shard: torch.Tensor) -> None:
        """Distributed optimizer: every replica gets every updated weight,
        at once, or with --overlap-param-gather by the next forward (each
        bucket's gather started here, in forward order: the first layers'
        buckets, the last in `buckets`, first, the same order on every rank)."""
        self.finish_param_gather()
        with torch.no_grad():
            for bucket in reversed(self.buckets):
                part = self.param_data[bucket.start:bucket.end]
                size = bucket.size // bucket.replicas.size
                mine = updated_shard[bucket.shard_start:bucket.shard_start + size].to(part.dtype)
                if bucket.replicas.group is None:
                    part.copy_(mine)
                elif self.overlaps_param_gather:
                    handle = all_gather_flat(part, mine, bucket.replicas.group, async_op=True)
                    self._gathering[id(bucket)] = (handle, mine)
                else:
                    all_gather_flat(part, mine, bucket.replicas.group)

    def overlap_param_gather(self, units: list[tuple[nn.Module, list[nn.Parameter]]]) -> None:
        """--overlap-param-gather: from now on `gather_params` only starts
        the gathers, and before each of `units`' modules runs its forward
        (a forward pre-hook) the gathers of every bucket holding any of its
        parameters are waited for. `units`: (module, the parameters its
        forward uses first), covering every parameter a forward uses (those
        outside this buffer, as LoRA's frozen base, are left out)."""
        self.overlaps_param_gather = True
        owner = weakref.ref(self)  # (not kept alive by its modules' hooks: see __init__)
        waits = [list({id(self._bucket_of[p]): self._bucket_of[p]
                       for p in params if p in self._bucket_of}.values()) for _, params in units]
        # A bucket of parameters no unit names (none in ptdp's models) before the first forward.
        named = {id(bucket) for buckets in waits for bucket in buckets}
        if units:
            waits[0] += [bucket for bucket in self.buckets if id(bucket) not in named]
        for (module, _), buckets in zip(units, waits):
            if not buckets:
                continue

            def before_forward(_module, _args, buckets=buckets) -> None:
                buffer = owner()
                if buffer is not None:
                    buffer._wait_for_gathers(buckets)

            module.register_forward_pre_hook(before_forward)

    def _wait_for_gathers(self, buckets: list[Bucket]) -> None:
        for bucket in buckets:
            started = self._gathering.pop(id(bucket), None)
            if started is not None and started[0] is not None:
                started[0].wait()

    def finish_param_gather(self) -> None:
        """Wait for every gather of the updated weights still in flight
        (--overlap-param-gather): before anything but the next forward reads
        the weights, or the optimizer changes the shards they come from."""
        if self._gathering:
            self._wait_for_gathers(self.buckets)
