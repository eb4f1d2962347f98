"""ZeRO-3 (`--use-megatron-fsdp --data-parallel-sharding-strategy
optim_grads_params`, the default of --use-megatron-fsdp): parameters
sharded over the data-parallel replicas too.

A rank keeps 1/d of every bucket of its parameters (`param_shards`, the
training dtype) beside ZeRO-2's gradient shards and the optimizer's fp32
shards. The model is cut into units: each transformer layer, and a chunk's
ends (the embeddings; the final norm and output layer), and a bucket holds
one unit's parameters. Each bucket has a full-size tensor whose parameters
are views into it; its storage exists only while the unit is gathered:

- before a unit's forward (a module pre-hook) its buckets are all-gathered
  from the shards (the next unit's gather is started then, so it runs
  during this unit's compute), and after it they are let go
  (`reshard_after_forward`, Megatron-LM's and FSDP2's default), unless the
  forward is a recomputation inside the backward, which uses them at once;
- before a unit's backward (the backward of an identity on its output) they
  are gathered again, the previous unit's gather started; after the
  unit's last gradient of the microbatch (its bucket reduce-scattered, as
  ZeRO-2 does) they are let go;
- without `reshard_after_forward` a unit stays gathered from its first use
  to the iteration's end: a pipeline stage gathers each of its units once
  per iteration, not per microbatch, and holds its whole parameters while
  it runs (the trade `--fsdp-reshard-after-forward` chooses).

A chunk's ends stay gathered through the iteration in either case: the
word embedding is used at both ends of the chunk (tied) and the ends are
a small share of a large model's parameters.

Letting go resizes the storage to zero bytes and gathering resizes it back
and fills it in place, so every view (the parameters, and the tensors
autograd saved for the backward) stays valid; the fill keeps the version
counter, since the values are the ones saved.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from ptdp.parallel.collectives import all_gather_flat
from ptdp.parallel.data_parallel import Bucket
from ptdp.parallel.sharded_grads import ShardedGradBuffer


class _GatherBeforeBackward(torch.autograd.Function):
    """Identity; its backward, the first of a unit's, gathers the unit."""

    @staticmethod
    def forward(ctx, x, gather):
        ctx.gather = gather
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.gather()
        return grad, None


class ShardedParamBuffer(ShardedGradBuffer):
    """ShardedGradBuffer whose parameters are sharded too (ZeRO-3).
    `units`: (module, its parameters) in forward order, of which `ends`
    (their indices) stay gathered through an iteration."""

    def __init__(self, params: list[nn.Parameter], ctx, *, units: list[tuple[nn.Module, list]],
                 ends: set[int], reshard_after_forward: bool = True, **options):
        unit_of = {param: i for i, (_, unit) in enumerate(units) for param in unit}
        super().__init__(params, ctx, unit_of=unit_of, **options)
        self.reshard_after_forward = reshard_after_forward
        self.ends = set(ends)
        self._unit_buckets: list[list[Bucket]] = [[] for _ in units]
        self._unit_of_bucket: dict[int, int] = {}
        for bucket in self.buckets:
            self._unit_buckets[unit_of[bucket.params[0]]].append(bucket)
            self._unit_of_bucket[id(bucket)] = unit_of[bucket.params[0]]
        self._gathered: set[int] = set()
        self._pending: dict[int, list] = {}   # unit -> its gathers in flight
        # Each bucket's own full tensor (its parameters are views), and the shard.
        self.param_shards = torch.cat([self.param_data[slice(*self.owned_range(b))]
                                       for b in self.buckets]) if self.buckets else \
            torch.zeros(0, dtype=self.param_data.dtype, device=self.param_data.device)
        for bucket in self.buckets:
            bucket.full = self.param_data[bucket.start:bucket.end].clone()
            for param in bucket.params:
                segment = self._segment_of[id(param)]
                param.data = bucket.full[segment.start - bucket.start:
                                         segment.end - bucket.start].view_as(param)
        self.param_data = self.param_shards  # what the optimizer's shard updates
        for i in range(len(units)):
            self._release_unit(i)
        self._install(units)

    # Gathering and letting go --------------------------------------------------

    def _install(self, units: list[tuple[nn.Module, list]]) -> None:
        for i, (module, _) in enumerate(units):
            module.register_forward_pre_hook(lambda _m, _a, i=i: self._before_forward(i))
            module.register_forward_hook(lambda _m, _a, out, i=i: self._after_forward(i, out))

    def _before_forward(self, unit: int) -> None:
        self.gather(unit)
        if unit + 1 < len(self._unit_buckets):
            self._start_gather(unit + 1)  # the next unit's, during this one's compute

    def _after_forward(self, unit: int, output: Any) -> Any:
        in_backward = torch._C._current_graph_task_id() != -1  # (a recomputation)
        if isinstance(output, torch.Tensor) and output.requires_grad and not in_backward:
            output = _GatherBeforeBackward.apply(output, lambda: self._before_backward(unit))
        if unit not in self.ends and not in_backward and \
                (self.reshard_after_forward or not torch.is_grad_enabled()):
            self._release_unit(unit)
        return output

    def _before_backward(self, unit: int) -> None:
        self.gather(unit)
        if unit > 0:
            self._start_gather(unit - 1)

    def _start_gather(self, unit: int) -> None:
        if unit in self._gathered or unit in self._pending:
            return
        handles = []
        for bucket in self._unit_buckets[unit]:
            full = bucket.full
            full.untyped_storage().resize_(full.numel() * full.element_size())
            part = bucket.size // bucket.replicas.size
            mine = self.param_shards[bucket.shard_start:bucket.shard_start + part]
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(full):
                if bucket.replicas.group is None:
                    full.copy_(mine)
                else:
                    handles.append(all_gather_flat(full, mine, bucket.replicas.group,
                                                   async_op=True))
        self._pending[unit] = handles

    def gather(self, unit: int) -> None:
        """The unit's parameters whole (waiting for a gather in flight)."""
        if unit in self._gathered:
            return
        self._start_gather(unit)
        for handle in self._pending.pop(unit):
            if handle is not None:
                handle.wait()
        self._gathered.add(unit)

    def _release_unit(self, unit: int) -> None:
        if unit in self._pending:  # (a prefetch not used: finish it before letting go)
            self.gather(unit)
        for bucket in self._unit_buckets[unit]:
            bucket.full.untyped_storage().resize_(0)
        self._gathered.discard(unit)

    def release_all(self) -> None:
        for unit in range(len(self._unit_buckets)):
            self._release_unit(unit)

    @contextlib.contextmanager
    def gathered(self, write_back: bool = False) -> Iterator[None]:
        """Every parameter whole inside (a save reads them, a load writes
        them: `write_back` copies this rank's part of each into the shards)."""
        for unit in range(len(self._unit_buckets)):
            self.gather(unit)
        try:
            yield
        finally:
            if write_back:
                for bucket in self.buckets:
                    start, end = self.owned_range(bucket)
                    part = bucket.size // bucket.replicas.size
                    self.param_shards[bucket.shard_start:bucket.shard_start + part].copy_(
                        bucket.full[start - bucket.start:end - bucket.start])
            self.release_all()

    # One iteration ----------------------------------------------------------------

    def _launch_round(self, bucket: Bucket) -> None:
        super()._launch_round(bucket)
        unit = self._unit_of_bucket[id(bucket)]
        if self.reshard_after_forward and unit not in self.ends and all(
                self._rounds[id(b)] >= self._rounds[id(bucket)] for b in self._unit_buckets[unit]):
            self._release_unit(unit)  # its backward of this microbatch is done

    def finish(self) -> None:
        super().finish()
        self.release_all()

    def gather_params(self, updated_shard: torch.Tensor) -> None:
        """The optimizer's updated fp32 shard into the parameters' shards
        (gathered before their next use); in fp32 they are the same tensor."""
        if updated_shard.data_ptr() != self.param_shards.data_ptr():
            self.param_shards.copy_(updated_shard)

    @property
    def full_param_bytes(self) -> int:
        return sum(b.full.untyped_storage().nbytes() for b in self.buckets)
