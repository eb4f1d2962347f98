"""--moe-router-force-load-balancing: random router logits that balance the
experts' load, for benchmarks (Megatron-LM's flag).

Megatron-LM replaces the logits with normal draws from each rank's own
generator, so its routing depends on the layout. Here each value is a
function of (layer, position in the sequence, expert) alone: a counter-based
hash turned into a standard normal. Every layout (tensor, sequence, context,
pipeline, data, expert ranks) draws the same value for the same token, so a
parallel run still computes what one process computes; the price is that the
draws repeat across the sequences of a batch and across steps. Over a
sequence's positions the experts' loads are as even as independent draws
make them, which is what the benchmark wants. The gradient passes to the
real logits unchanged (a straight-through estimator, as Megatron-LM's)."""

from __future__ import annotations

import math

import torch

_MASK = 0xFFFFFFFF


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (int64 holding values below 2**32): the low 32
    bits of each product are exact even where int64 wraps."""
    x = x & _MASK
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK
    return x ^ (x >> 16)


def _uniform(positions: torch.Tensor, layer: int, experts: int, salt: int) -> torch.Tensor:
    """[len(positions), experts] floats in (0, 1), one per (layer, position, expert)."""
    expert = torch.arange(experts, dtype=torch.int64, device=positions.device)
    key = _mix(torch.full_like(positions, (layer * 2 + salt) * 0x9E3779B9))
    key = _mix(key + positions)
    bits = _mix(key.unsqueeze(1) * 0x85EBCA6B + expert)
    # 24 bits: exact in fp32; the half step keeps both ends open.
    return ((bits >> 8).to(torch.float32) + 0.5) / float(1 << 24)


def balanced_logits(positions: torch.Tensor, layer: int, experts: int) -> torch.Tensor:
    """Standard normal values [len(positions), experts] (Box-Muller) for the
    tokens at these sequence positions in this layer."""
    radius = torch.sqrt(-2.0 * torch.log(_uniform(positions, layer, experts, 0)))
    return radius * torch.cos(2.0 * math.pi * _uniform(positions, layer, experts, 1))


def force_balanced(logits: torch.Tensor, positions: torch.Tensor, layer: int) -> torch.Tensor:
    """The router's logits [tokens, experts] replaced by `balanced_logits`;
    the gradient reaches `logits` unchanged. `positions`: each row's
    position in its sequence."""
    noise = balanced_logits(positions, layer, logits.shape[-1]).to(logits.dtype)
    return noise + (logits - logits.detach())
