"""Optimizer construction and the global gradient norm.

The norm is over the logical model: a parameter replicated across the tensor
group is counted once (on tensor rank 0), a sharded one by all its shards,
and the last pipeline stage's copy of the tied embedding not at all.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ptdp.config import TrainConfig
from ptdp.parallel.sharding import COPY_ATTR, SHARD_ATTR
from ptdp.parallel.topology import ParallelContext


def build_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW with weight decay on weight matrices only (not biases or norms)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps)


def counts_in_norm(param: nn.Parameter, ctx: ParallelContext) -> bool:
    if getattr(param, COPY_ATTR, False):
        return False
    return hasattr(param, SHARD_ATTR) or ctx.tp_rank == 0


def global_grad_norm(model: nn.Module, ctx: ParallelContext) -> torch.Tensor:
    grads = [p.grad for p in model.parameters() if p.grad is not None and counts_in_norm(p, ctx)]
    device = next(model.parameters()).device
    total = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        total += torch.linalg.vector_norm(g.float()) ** 2
    if ctx.mp_group is not None:
        dist.all_reduce(total, group=ctx.mp_group)
    return total.sqrt()


def clip_gradients(model: nn.Module, norm: torch.Tensor, max_norm: float) -> None:
    """Scale all gradients so that the global norm is at most `max_norm`."""
    if max_norm <= 0:
        return
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(scale)
