"""Data parallelism: averaging gradients over the d model replicas.

One reduction per iteration, after all microbatches (gradient accumulation
happens locally). The gradients are flattened into one buffer per dtype so
that d replicas exchange a few large messages instead of one per parameter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ptdp.parallel.topology import ParallelContext


def average_gradients(model: nn.Module, ctx: ParallelContext) -> None:
    if ctx.dp_group is None:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in model.parameters():
        if param.grad is not None:
            by_dtype.setdefault(param.grad.dtype, []).append(param.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        flat.div_(ctx.dp_size)
        dist.all_reduce(flat, group=ctx.dp_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
