"""Expert parallelism's communication: all-to-all with variable splits and
all-gather of variable row counts, as autograd functions (picotron's style:
the backward of each is the reverse exchange).

The MoE layer (ptdp.model.moe) uses them to send each token to the ranks
holding its experts (--moe-token-dispatcher-type alltoall) and back. A group
of None is one rank: nothing moves.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ptdp.parallel.tensor import gather_from_sequence_region, reduce_scatter_to_sequence_region


def _exchange(x: torch.Tensor, output_splits: list[int], input_splits: list[int],
              group: Any) -> torch.Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Rows [sum(input_splits), ...]: input_splits[r] of them go to rank r of
    the group, output_splits[r] come from it. Backward: the gradients go
    back the same way reversed."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _exchange(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _exchange(grad, input_splits, output_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int],
               group: Any) -> torch.Tensor:
    return x if group is None else _AllToAll.apply(x, output_splits, input_splits, group)


def exchange_counts(counts: torch.Tensor, group: Any) -> torch.Tensor:
    """counts [n, m] (int64): row r is what this rank sends to rank r of the
    group; returns [n, m], row r what rank r sends to this one."""
    if group is None:
        return counts
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received


def gather_rows(x: torch.Tensor, group: Any) -> tuple[torch.Tensor, list[int]]:
    """All-gather rows whose number differs between the group's ranks:
    ([Σ n_r, ...] in rank order, [n_r]). The rows are padded to the largest
    count for an all-gather of equal parts; the backward reduce-scatters
    the gradients (see `scatter_rows`, its conjugate)."""
    if group is None:
        return x, [x.shape[0]]
    counts = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
    gathered = [torch.empty_like(counts) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, counts, group=group)
    sizes = [int(c.item()) for c in gathered]
    largest = max(sizes)
    padded = torch.cat([x, x.new_zeros((largest - x.shape[0], *x.shape[1:]))]) \
        if largest > x.shape[0] else x
    whole = gather_from_sequence_region(padded, group)
    keep = torch.cat([torch.arange(r * largest, r * largest + n, device=x.device)
                      for r, n in enumerate(sizes)])
    return whole.index_select(0, keep), sizes


def scatter_rows(x: torch.Tensor, sizes: list[int], rank: int, group: Any) -> torch.Tensor:
    """The conjugate of `gather_rows`: x [Σ n_r, ...] partial sums on every
    rank of the group; returns this rank's n_rank rows of their sum."""
    if group is None:
        return x
    largest = max(sizes)
    padded = x.new_zeros((largest * len(sizes), *x.shape[1:]))
    place = torch.cat([torch.arange(r * largest, r * largest + n, device=x.device)
                       for r, n in enumerate(sizes)])
    padded = padded.index_copy(0, place, x)
    return reduce_scatter_to_sequence_region(padded, group)[:sizes[rank]]
