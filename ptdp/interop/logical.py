"""Logical states for other frameworks.

A *logical state* is what ptdp's layout-independent checkpoints hold: the
one-process model's parameter names with unsharded, unpadded shapes, whose
table is ptdp/model/shapes.py (re-exported here for the converters, which
check every state they read and write against it). Under
--apply-layernorm-1p a norm's logical weight is what the model stores,
scale - 1; converters to other frameworks write the plain scale
(with_plain_norm_scales) and read it back (with_stored_norm_scales).
"""

from __future__ import annotations

import torch

from ptdp.config import ModelConfig
from ptdp.model.shapes import logical_shapes  # the table, re-exported for the converters


def norm_weight_names(config: ModelConfig) -> list[str]:
    """The logical names of every norm's scale (each layer's two, the final
    one; an MTP module's enorm and hnorm too)."""
    return [name for name in logical_shapes(config) if name.endswith("layernorm.weight")
            or name.startswith("mtp.") and name.endswith(("enorm.weight", "hnorm.weight"))]


def with_plain_norm_scales(logical: dict[str, torch.Tensor],
                           config: ModelConfig) -> dict[str, torch.Tensor]:
    """`logical` with each norm's weight as the scale itself, as other
    frameworks store it: under --apply-layernorm-1p the stored w becomes
    1 + w; otherwise the state is returned as it is."""
    return _shift_norm_weights(logical, config, 1.0)


def with_stored_norm_scales(plain: dict[str, torch.Tensor],
                            config: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of with_plain_norm_scales: plain scales as `config`'s
    model stores them (scale - 1 under --apply-layernorm-1p)."""
    return _shift_norm_weights(plain, config, -1.0)


def _shift_norm_weights(state: dict[str, torch.Tensor], config: ModelConfig,
                        shift: float) -> dict[str, torch.Tensor]:
    if not config.apply_layernorm_1p:
        return state
    shifted = dict(state)
    for name in norm_weight_names(config):
        if name in state:  # a state with a missing tensor is refused by its checker
            tensor = state[name]
            # Added in fp32: a bf16 w near 0 has bits that 1 + w in bf16 loses.
            shifted[name] = (tensor.detach().float() + shift).to(tensor.dtype)
    return shifted
