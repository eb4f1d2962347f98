"""Flat-tensor collectives under the names each torch version prefers.

torch 2.5 calls them all_gather_into_tensor / reduce_scatter_tensor; newer
releases add all_gather_single / reduce_scatter_single and deprecate the old
names.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_flat(output: torch.Tensor, tensor: torch.Tensor, group: Any,
                    async_op: bool = False):
    """output (size·n) <- every rank's tensor (n), in rank order (a handle to
    wait on with `async_op`)."""
    return _all_gather(output, tensor, group=group, async_op=async_op)


def reduce_scatter_flat(output: torch.Tensor, tensor: torch.Tensor, group: Any,
                        async_op: bool = False):
    """output (n) <- this rank's n-slice of the sum over ranks of tensor (size·n)."""
    try:
        return _reduce_scatter(output, tensor, group=group, async_op=async_op)
    except (RuntimeError, NotImplementedError, ValueError):
        # Backends without reduce-scatter (older gloo): all-reduce, keep own part.
        dist.all_reduce(tensor, group=group)
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        output.copy_(tensor.view(size, -1)[rank])
        return None
