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

from ptdp.parallel.sharding import EXPERT_ATTR, SHARD_ATTR, TensorShard, set_init
from ptdp.parallel.tensor import gather_from_sequence_region, mark_partial_grad


class LoRA(nn.Module):
    """The adapter of one column- or row-parallel layer, or of an MoE
    expert's matrix (`attach` builds it). Its split follows the base
    weight's (TensorShard): `column` bases split by output rows, the others
    by input columns. `partial_group`: the tensor group over which the
    whole matrix's gradient is partial (None: the adapter is whole here)."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float, *,
                 column: bool, rng: Any = None, partial: bool = False):
        super().__init__()
        if rank < 1:
            raise ValueError(f"a LoRA rank must be at least 1, not {rank}")
        spec = getattr(base.weight, SHARD_ATTR, None)
        parts, index = (spec.parts, spec.index) if spec is not None else (1, 0)
        out_local, in_local = base.weight.shape
        in_features = in_local if column else in_local * parts
        out_features = out_local * parts if column else out_local
        if rank > min(in_features, out_features):
            raise ValueError(f"a LoRA rank of {rank} is larger than the layer it adapts "
                             f"({out_features} × {in_features}); use at most "
                             f"{min(in_features, out_features)}")
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        self.column, self.rng = column, rng
        self.dropout = nn.Dropout(dropout) if dropout > 0 else None
        self.sequence_parallel = getattr(base, "sequence_parallel", False)
        self.group = getattr(base, "group", None)
        dtype = base.weight.dtype
        self.A = nn.Parameter(torch.empty(rank, in_local, dtype=dtype, device=base.weight.device))
        self.B = nn.Parameter(torch.empty(out_local, rank, dtype=dtype, device=base.weight.device))
        set_init(self.A, "normal", 1.0 / math.sqrt(3 * in_features))
        set_init(self.B, "zeros")
        if parts > 1:
            if column:  # B split as the base's rows are (its blocks too); A whole
                setattr(self.B, SHARD_ATTR, spec)
            else:
                setattr(self.A, SHARD_ATTR, TensorShard(dim=1, parts=parts, index=index))
        if partial or (parts > 1 and self.group is not None):
            # column: each rank's A gradient covers its own output rows; row:
            # each rank's B gradient comes from its partial x_t A_tᵀ.
            mark_partial_grad(self.A if column else self.B)
        if getattr(base.weight, EXPERT_ATTR, False):
            for param in (self.A, self.B):
                setattr(param, EXPERT_ATTR, True)

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
        down = F.linear(self._dropped(x), self.A)
        if self.sequence_parallel:
            down = gather_from_sequence_region(down, self.group)
        return F.linear(down, self.B) * self.scale

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """An expert's adapter term (no sequence gather: its rows are whole
        tokens), partial over the tensor ranks where the expert is split."""
        return self.row_delta(x)

    def row_delta(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel base's adapter term, partial over the tensor ranks
        like the base's own product, [.., out]: added before its reduction."""
        return F.linear(F.linear(self._dropped(x), self.A), self.B) * self.scale

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}, {'column' if self.column else 'row'}-parallel"


def attach(layer: nn.Module, rank: int, alpha: float, dropout: float = 0.0, *,
           rng: Any = None, partial: bool = False, expert: bool | None = None) -> LoRA:
    """Give a linear layer whose weight knows its split (ColumnParallelLinear,
    RowParallelLinear, an MoE expert's matrix) an adapter, its `lora`, which
    its forward adds; returns it. `partial`: the gradients are partial over
    the tensor group although the layer has no group of its own (an MoE
    layer's experts, which it reduces once). `expert`: override whether the
    adapter's parameters are a routed expert's (default: as the base's)."""
    spec = getattr(layer.weight, SHARD_ATTR, None) if hasattr(layer, "weight") else None
    if spec is None or not hasattr(layer, "lora"):
        raise TypeError(f"LoRA adapts the tensor-parallel linear layers and the experts' "
                        f"matrices, not {type(layer).__name__}")
    layer.lora = LoRA(layer, rank, alpha, dropout, column=spec.dim == 0, rng=rng,
                      partial=partial)
    if expert is not None:
        for param in (layer.lora.A, layer.lora.B):
            if expert:
                setattr(param, EXPERT_ATTR, True)
            elif hasattr(param, EXPERT_ATTR):
                delattr(param, EXPERT_ATTR)
    return layer.lora
