"""ZeRO-2 (`--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads`):
gradients sharded over the data-parallel replicas as well as the optimizer
state.

The distributed optimizer (ZeRO-1, ptdp.parallel.data_parallel) keeps a
full fp32 gradient buffer on every rank and reduce-scatters each bucket once,
after the iteration's last microbatch. Here no full gradient buffer lives
across the backward: a bucket's fp32 gradients are allocated when its first
gradient of a microbatch arrives, and as soon as every parameter of the
bucket has its gradient of that microbatch they are reduce-scattered into
this rank's shard (`grad_shard`, where they accumulate over the
microbatches) and the bucket's storage is let go. A bucket holds one
unit's parameters (a layer's: the trainer passes `unit_of`, and
--ddp-bucket-size may cut a unit further) and at most IN_FLIGHT reductions
wait at a time, so the full gradients in memory at once are a few layers',
whatever the model's size; the price is one reduce-scatter per bucket per
microbatch instead of per iteration (Megatron-FSDP pays the same).

Summing per microbatch and then over them is the same sum as reducing the
accumulated gradient once, in another order: the numbers agree to fp32
rounding. A bucket whose parameters receive gradients at different times
(zero-bubble's W after B) is reduced whenever every one of its parameters
has had its next microbatch's, and whatever arrived early for the following
one waits in the next round's storage: each gradient is reduced exactly once.

The tied word embedding's bucket (summed over the embedding group first,
then over the replicas, once the backward has finished) keeps its gradient
for the whole iteration, as under ZeRO-1: it is one matrix.

With --main-grads-dtype bf16 the buckets and the shard are bf16 (the
gradients reduced in bf16 and added into the shard in bf16, as
Megatron-FSDP's main_grads_dtype bf16 does).
"""

from __future__ import annotations

from collections import deque

import torch
from torch import nn

from ptdp.parallel.collectives import reduce_scatter_flat
from ptdp.parallel.data_parallel import Bucket, GradBuffer
from ptdp.parallel.tensor import sum_partial_grads

# Reductions launched and not yet added into the shard, at most: each holds
# its bucket's main gradients (and their bf16 copy, if those are fp32) until it completes.
IN_FLIGHT = 2


class ShardedGradBuffer(GradBuffer):
    """GradBuffer with the distributed optimizer's shards, whose gradients
    are sharded too (ZeRO-2). Same constructor arguments (`shard` is implied)."""

    def __init__(self, params: list[nn.Parameter], ctx, **options):
        options["shard"] = True
        super().__init__(params, ctx, **options)
        self._segment_of = {id(segment.param): segment for segment in self.segments}
        self.alias_grads = False  # autograd's gradient is added into the bucket, then dropped
        for bucket in self.buckets:
            bucket.grads = bucket.grads.clone() if bucket.tied else None
        for segment in self.segments:
            bucket = self._bucket_of[segment.param]
            segment.param.grad = None
            segment.param.main_grad = (self._view(bucket, segment.param) if bucket.tied else None)
        self.grad_data = None  # no full gradient buffer
        self._in_flight: deque = deque()
        self._rounds: dict[int, int] = {}
        self.peak_full_grad_bytes = 0  # the most full_grad_bytes has been (the memory's measure)

    def _view(self, bucket: Bucket, param: nn.Parameter) -> torch.Tensor:
        segment = self._segment_of[id(param)]
        return bucket.grads[segment.start - bucket.start:segment.end - bucket.start].view_as(param)

    # One iteration ----------------------------------------------------------------

    def start_iteration(self, num_microbatches: int) -> None:
        self.grad_shard.zero_()
        self._expected = {segment.param: num_microbatches * self._accumulations.get(segment.param, 1)
                          for segment in self.segments}
        self._counts = {segment.param: 0 for segment in self.segments}
        for bucket in self.buckets:
            if bucket.tied:
                bucket.grads.zero_()
            else:
                self._release(bucket)
            bucket.pending = len(bucket.params)
            bucket.handles, bucket.unpack, bucket.launched = [], [], False
        self._rounds = {id(bucket): 0 for bucket in self.buckets}
        self._in_flight.clear()

    def _on_grad(self, param: nn.Parameter) -> None:
        bucket = self._bucket_of[param]
        if bucket.tied:
            super()._on_grad(param)
            return
        if bucket.grads is None:
            self._allocate(bucket)
        param.main_grad.add_(param.grad)
        param.grad = None
        self._counts[param] += 1
        # The microbatches every parameter of the bucket has had in full.
        done = min(self._counts[p] // self._accumulations.get(p, 1) for p in bucket.params)
        if done > self._rounds[id(bucket)]:
            self._rounds[id(bucket)] = done
            self._launch_round(bucket)

    def _allocate(self, bucket: Bucket) -> None:
        bucket.grads = torch.zeros(bucket.size, dtype=self.grad_dtype, device=self.grad_shard.device)
        for param in bucket.params:
            param.main_grad = self._view(bucket, param)
        self.peak_full_grad_bytes = max(self.peak_full_grad_bytes, self.full_grad_bytes)

    def _release(self, bucket: Bucket) -> None:
        bucket.grads = None
        for param in bucket.params:
            param.main_grad = None

    def _launch_round(self, bucket: Bucket) -> None:
        """Reduce-scatter the bucket's gradients gathered so far into the
        shard (asynchronously), and start a new storage for the next ones."""
        sum_partial_grads([p.main_grad for p in bucket.partial], self.ctx.tp_group)
        grads = bucket.grads
        self._release(bucket)
        if self.average and self.ctx.dp_size > 1:
            grads.div_(self.ctx.dp_size)
        if bucket.replicas.group is None:
            self._shard_view(bucket).add_(grads)
            return
        sent = grads if self.reduce_dtype == grads.dtype else grads.to(self.reduce_dtype)
        received = torch.empty(bucket.size // bucket.replicas.size, dtype=sent.dtype,
                               device=sent.device)
        handle = reduce_scatter_flat(received, sent, bucket.replicas.group, async_op=True)
        self._in_flight.append((bucket, handle, received, sent))
        self.peak_full_grad_bytes = max(self.peak_full_grad_bytes, self.full_grad_bytes)
        while len(self._in_flight) > IN_FLIGHT:
            self._complete(*self._in_flight.popleft())

    def _complete(self, bucket: Bucket, handle, received: torch.Tensor, sent: torch.Tensor) -> None:
        if handle is not None:
            handle.wait()
        self._shard_view(bucket).add_(received.to(self.grad_dtype))

    def finish(self) -> None:
        """Reduce what every bucket still holds (a parameter given fewer
        gradients than microbatches leaves some), wait for every reduction,
        and finish the tied bucket as ZeRO-1 does."""
        for bucket in self.buckets:
            if not bucket.tied and bucket.grads is not None:
                self._launch_round(bucket)
        while self._in_flight:
            self._complete(*self._in_flight.popleft())
        tied = [bucket for bucket in self.buckets if bucket.tied]
        for bucket in tied:
            if not bucket.launched:
                self._launch(bucket)
        for bucket in tied:
            for handle in bucket.handles:
                handle.wait()
            bucket.handles = []
            self._unpack(bucket)
            if self.ctx.embedding_group is not None:
                self._reduce_over_replicas(bucket, async_op=False)

    @property
    def full_grad_bytes(self) -> int:
        """The full gradients held now (the buckets between reductions)."""
        return sum(b.grads.nbytes for b in self.buckets if b.grads is not None) + \
            sum(sent.nbytes for _, _, _, sent in self._in_flight)
