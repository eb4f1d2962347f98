"""The model's normalization layers: LayerNorm or RMSNorm (--normalization)
over h (or a head's d) values, optionally with zero-centred weights
(--apply-layernorm-1p: the stored weight w scales by 1 + w). Shared by the
layers of ptdp.model.gpt, multi-latent attention's latent norms and the
multi-token prediction modules."""

from __future__ import annotations

import torch
from torch import nn

from ptdp.config import ModelConfig
from ptdp.model.fused import zero_centred_norm
from ptdp.parallel.sharding import set_init
from ptdp.parallel.tensor import mark_partial_grad


class LayerNorm1p(nn.LayerNorm):
    """LayerNorm whose stored weight w is zero-centred: it scales by 1 + w
    (--apply-layernorm-1p)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return zero_centred_norm(x, self.weight, self.bias, self.eps)


class RMSNorm1p(nn.RMSNorm):
    """RMSNorm whose stored weight w is zero-centred: it scales by 1 + w
    (--apply-layernorm-1p)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return zero_centred_norm(x, self.weight, None, self.eps)


def layer_norm(config: ModelConfig, sequence_parallel: bool = False, *,
               size: int | None = None) -> nn.Module:
    """LayerNorm or RMSNorm (--normalization) over `size` values (default h):
    weight 1, LayerNorm's bias 0; with --apply-layernorm-1p the weight is
    stored as scale - 1, so it starts at 0. `sequence_parallel`: each tensor
    rank's gradient is partial (it sees other positions, or other heads)."""
    one_plus, size = config.apply_layernorm_1p, size or config.hidden_size
    if config.normalization == "RMSNorm":
        norm = (RMSNorm1p if one_plus else nn.RMSNorm)(size, eps=config.epsilon)
    else:
        norm = (LayerNorm1p if one_plus else nn.LayerNorm)(size, eps=config.epsilon)
        set_init(norm.bias, "zeros")
    set_init(norm.weight, "zeros" if one_plus else "ones")
    if sequence_parallel:
        for param in norm.parameters():
            mark_partial_grad(param)
    return norm
