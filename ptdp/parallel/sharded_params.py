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

Under LoRA the frozen base is sharded too (it is most of the model): each
unit's frozen parameters have a bucket of their own per kind (dense,
routed experts), gathered and let go with the unit's adapters, with no
gradient and no optimizer state; a rank keeps 1/d of it (`frozen_shards`).
A unit whose parameters are all frozen is let go after its forward and
kept from its backward to the iteration's end (no gradient of it marks
its backward done).

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
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from ptdp.parallel.collectives import all_gather_flat
from ptdp.parallel.data_parallel import Bucket, Replicas
from ptdp.parallel.sharded_grads import ShardedGradBuffer
from ptdp.parallel.sharding import is_expert


@dataclass
class FrozenBucket:
    """A unit's frozen parameters of one kind (LoRA's base): `full` holds
    them whole (they are views into it; padded to a multiple of the
    replicas), `shard` is this rank's part of it (a view of frozen_shards)."""
    full: torch.Tensor
    replicas: Replicas
    shard: torch.Tensor


class _CallInBackward(torch.autograd.Function):
    """Identity whose backward calls `call` when the gradient reaches it: on
    a unit's output, the first of its backward (gather the unit); on its
    input, once every node of the unit's backward that feeds the input's
    gradient has run."""

    @staticmethod
    def forward(ctx, x, call):
        ctx.call = call
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.call()
        return grad, None


class ShardedParamBuffer(ShardedGradBuffer):
    """ShardedGradBuffer whose parameters are sharded too (ZeRO-3).
    `units`: (module, its trained parameters) in forward order, of which
    `ends` (their indices) stay gathered through an iteration; `frozen`:
    each unit's frozen parameters (LoRA's base), sharded without gradients."""

    def __init__(self, params: list[nn.Parameter], ctx, *, units: list[tuple[nn.Module, list]],
                 ends: set[int], reshard_after_forward: bool = True,
                 frozen: list[list[nn.Parameter]] | None = None, **options):
        unit_of = {param: i for i, (_, unit) in enumerate(units) for param in unit}
        super().__init__(params, ctx, unit_of=unit_of, **options)
        self.reshard_after_forward = reshard_after_forward
        self.ends = set(ends)
        self._unit_buckets: list[list[Bucket | FrozenBucket]] = [[] for _ in units]
        self._unit_of_bucket: dict[int, int] = {}
        for bucket in self.buckets:
            self._unit_buckets[unit_of[bucket.params[0]]].append(bucket)
            self._unit_of_bucket[id(bucket)] = unit_of[bucket.params[0]]
        # Per unit, this iteration: backwards begun, forwards whose input
        # wants a gradient, and those gradients come (_backward_done).
        self._backwards = [0] * len(units)
        self._inputs_expected = [0] * len(units)
        self._inputs_done = [0] * len(units)
        self.frozen_shards = self._shard_frozen(frozen or [[] for _ in units], ctx)
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

    def _shard_frozen(self, frozen: list[list[nn.Parameter]], ctx) -> torch.Tensor:
        """A FrozenBucket per unit and kind, its parameters made views of its
        full tensor; returns this rank's parts of them all, one tensor."""
        planned = []
        for unit, unit_params in enumerate(frozen):
            for expert in (False, True):
                kind = [p for p in unit_params if is_expert(p) == expert]
                if kind:
                    replicas = Replicas.of(ctx, expert)
                    numel = sum(p.numel() for p in kind)
                    planned.append((unit, kind, replicas, -(-numel // replicas.size)))
        shards = torch.zeros(sum(part for *_, part in planned), dtype=self.param_data.dtype,
                             device=self.param_data.device)
        start = 0
        for unit, kind, replicas, part in planned:
            full = torch.zeros(part * replicas.size, dtype=shards.dtype, device=shards.device)
            offset = 0
            for param in kind:
                full[offset:offset + param.numel()].copy_(param.data.reshape(-1))
                param.data = full[offset:offset + param.numel()].view_as(param)
                offset += param.numel()
            shard = shards[start:start + part]
            shard.copy_(full[replicas.rank * part:(replicas.rank + 1) * part])
            self._unit_buckets[unit].append(FrozenBucket(full, replicas, shard))
            start += part
        return shards

    def _shard_of(self, bucket: Bucket | FrozenBucket) -> torch.Tensor:
        """This rank's part of a bucket's parameters, where it is kept."""
        if isinstance(bucket, FrozenBucket):
            return bucket.shard
        part = bucket.size // bucket.replicas.size
        return self.param_shards[bucket.shard_start:bucket.shard_start + part]

    # Gathering and letting go --------------------------------------------------

    def _install(self, units: list[tuple[nn.Module, list]]) -> None:
        for i, (module, _) in enumerate(units):
            module.register_forward_pre_hook(lambda _m, args, i=i: self._before_forward(i, args))
            module.register_forward_hook(lambda _m, _a, out, i=i: self._after_forward(i, out))

    def _before_forward(self, unit: int, args: tuple) -> tuple | None:
        self.gather(unit)
        if unit + 1 < len(self._unit_buckets):
            self._start_gather(unit + 1)  # the next unit's, during this one's compute
        in_backward = torch._C._current_graph_task_id() != -1  # (a recomputation)
        if args and isinstance(args[0], torch.Tensor) and args[0].requires_grad and \
                torch.is_grad_enabled() and not in_backward:
            self._inputs_expected[unit] += 1
            return (_CallInBackward.apply(args[0], lambda: self._input_grad_done(unit)), *args[1:])
        return None

    def _after_forward(self, unit: int, output: Any) -> Any:
        in_backward = torch._C._current_graph_task_id() != -1  # (a recomputation)
        if isinstance(output, torch.Tensor) and output.requires_grad and not in_backward:
            output = _CallInBackward.apply(output, lambda: self._before_backward(unit))
        if unit not in self.ends and not in_backward and \
                (self.reshard_after_forward or not torch.is_grad_enabled()):
            self._release_unit(unit)
        return output

    def _before_backward(self, unit: int) -> None:
        self._backwards[unit] += 1
        self.gather(unit)
        if unit > 0:
            self._start_gather(unit - 1)

    def _input_grad_done(self, unit: int) -> None:
        self._inputs_done[unit] += 1
        self._release_if_backward_done(unit)

    def _release_if_backward_done(self, unit: int) -> None:
        """With reshard-after-forward, a unit is let go once each backward
        begun on it is over: its trained gradients reduced for as many
        microbatches (under zero bubble: after the W's), and its input's
        gradient come where it wants one. Either alone is not enough: under
        LoRA the adapters' gradients can be complete while the frozen base's
        input gradients still need its weights, and a weight gradient comes
        after the input's in zero bubble's W."""
        started = self._backwards[unit]
        if not self.reshard_after_forward or unit in self.ends or not started or \
                unit not in self._gathered:
            return
        trained = all(self._rounds[id(b)] >= started for b in self._unit_buckets[unit]
                      if not isinstance(b, FrozenBucket))
        if trained and self._inputs_done[unit] >= min(started, self._inputs_expected[unit]):
            self._release_unit(unit)

    def _start_gather(self, unit: int) -> None:
        if unit in self._gathered or unit in self._pending:
            return
        handles = []
        for bucket in self._unit_buckets[unit]:
            full = bucket.full
            full.untyped_storage().resize_(full.numel() * full.element_size())
            mine = self._shard_of(bucket)
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
                    self._shard_of(bucket).copy_(bucket.full[start - bucket.start:
                                                             end - bucket.start])
                for bucket in self._frozen_buckets():
                    part = bucket.shard.numel()
                    rank = bucket.replicas.rank
                    bucket.shard.copy_(bucket.full[rank * part:(rank + 1) * part])
            self.release_all()

    def _frozen_buckets(self) -> Iterator[FrozenBucket]:
        return (b for unit in self._unit_buckets for b in unit if isinstance(b, FrozenBucket))

    # One iteration ----------------------------------------------------------------

    def _launch_round(self, bucket: Bucket) -> None:
        super()._launch_round(bucket)
        self._release_if_backward_done(self._unit_of_bucket[id(bucket)])

    def start_iteration(self, num_microbatches: int) -> None:
        super().start_iteration(num_microbatches)
        for counts in (self._backwards, self._inputs_expected, self._inputs_done):
            counts[:] = [0] * len(counts)

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
        return sum(b.full.untyped_storage().nbytes() for unit in self._unit_buckets for b in unit)
