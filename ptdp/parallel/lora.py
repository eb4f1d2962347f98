"""Low-rank adapters (LoRA; Hu et al., 2021) on the tensor-parallel linear layers.

An adapted layer computes y = x Wᵀ + (α/r) · dropout(x) Aᵀ Bᵀ, with A [r, in]
and B [out, r], B starting at zero so that the adapted model starts as the
base model (peft's LoraLayer, whose default scale is lora_alpha / r).

Sharding follows the base layer, so that the adapter adds no collective
where the base needs none (torchtitan's rule):

- column-parallel base (W split by output rows): A whole on every tensor
  rank, B split by rows as W is (block by block: q, k, v; gate, up). The
  input x is the one the base multiplies (after f), so the input gradient
  of the adapter joins the base's in f's all-reduce. Each rank's gradient
  of A covers its own output rows: partial over the tensor group, summed
  as the norms' are (mark_partial_grad).
  Under sequence parallelism the base gathers x inside its product; the
  adapter projects its own s/t positions down to r first and gathers that
  (an all-gather of r columns per position against the base's h: the one
  collective the adapter adds, r/h of the base's), whose backward
  reduce-scatters the partial gradient as the base's does.
- row-parallel base (W split by input columns): A split by columns as W
  is, B whole. x_t Aᵀ_t is partial over the tensor ranks, and so is its
  product with B: it is added to the base's partial output before the
  base's all-reduce (or reduce-scatter), which sums both. B's gradient is
  partial (each rank's uses its own partial x_t Aᵀ_t) and summed.

Dropout draws from the default stream where x is the same on every tensor
rank (column-parallel without sequence parallelism), else from the rank's
own (ptdp.parallel.tensor.RNGStreams), as the model's dropouts do.

A's initial values are drawn from N(0, 1/(3·in)): the variance of peft's
default kaiming_uniform_(a=√5), whose bound is 1/√in; the draw is of the
logical tensor (ptdp.parallel.sharding), so every layout starts equal.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ptdp.parallel.sharding import SHARD_ATTR, TensorShard, set_init
from ptdp.parallel.tensor import gather_from_sequence_region, mark_partial_grad


class LoRA(nn.Module):
    """The adapter of one column- or row-parallel layer (`attach` builds it)."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float, *,
                 column: bool, tp_size: int, tp_rank: int, rng: Any = None):
        super().__init__()
        if rank < 1:
            raise ValueError(f"a LoRA rank must be at least 1, not {rank}")
        out_local, in_local = base.weight.shape
        in_features = in_local if column else in_local * tp_size
        out_features = out_local * tp_size if column else out_local
        if rank > min(in_features, out_features):
            raise ValueError(f"a LoRA rank of {rank} is larger than the layer it adapts "
                             f"({out_features} × {in_features}); use at most "
                             f"{min(in_features, out_features)}")
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        self.column, self.rng = column, rng
        self.dropout = nn.Dropout(dropout) if dropout > 0 else None
        self.sequence_parallel = getattr(base, "sequence_parallel", False)
        self.group = base.group
        self.lora_A = nn.Parameter(torch.empty(rank, in_local))
        self.lora_B = nn.Parameter(torch.empty(out_local, rank))
        set_init(self.lora_A, "normal", 1.0 / math.sqrt(3 * in_features))
        set_init(self.lora_B, "zeros")
        if column:
            # B split as the base's rows are (its blocks too); A whole, partial gradients.
            setattr(self.lora_B, SHARD_ATTR, getattr(base.weight, SHARD_ATTR))
            if self.group is not None:
                mark_partial_grad(self.lora_A)
        else:
            setattr(self.lora_A, SHARD_ATTR, TensorShard(dim=1, parts=tp_size, index=tp_rank))
            if self.group is not None:
                mark_partial_grad(self.lora_B)

    def _dropped(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout is None or not self.training:
            return x
        if self.column and not self.sequence_parallel or self.rng is None:
            return self.dropout(x)           # the same x on every tensor rank
        with self.rng.fork("tensor"):
            return self.dropout(x)

    def column_delta(self, x: torch.Tensor) -> torch.Tensor:
        """A column-parallel base's adapter term, [.., out/t]: `x` is the
        base's input after f, or under sequence parallelism its own s/t
        positions (the down projection gathered, not x)."""
        down = F.linear(self._dropped(x), self.lora_A)
        if self.sequence_parallel:
            down = gather_from_sequence_region(down, self.group)
        return F.linear(down, self.lora_B) * self.scale

    def row_delta(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel base's adapter term, partial over the tensor ranks
        like the base's own product, [.., out]: added before its reduction."""
        return F.linear(F.linear(self._dropped(x), self.lora_A), self.lora_B) * self.scale

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}, {'column' if self.column else 'row'}-parallel"


def attach(layer: nn.Module, rank: int, alpha: float, dropout: float = 0.0, *,
           tp_size: int = 1, tp_rank: int = 0, rng: Any = None) -> LoRA:
    """Give a ColumnParallelLinear or RowParallelLinear an adapter (its
    `lora`), which its forward adds; returns it."""
    from ptdp.parallel.tensor import ColumnParallelLinear, RowParallelLinear

    if not isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
        raise TypeError(f"LoRA adapts column- and row-parallel linear layers, not "
                        f"{type(layer).__name__}")
    layer.lora = LoRA(layer, rank, alpha, dropout, column=isinstance(layer, ColumnParallelLinear),
                      tp_size=tp_size, tp_rank=tp_rank, rng=rng)
    return layer.lora
