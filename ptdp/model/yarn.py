"""YaRN's rotary frequencies and attention factor (Peng et al., 2023), as
Megatron-Core's YarnRotaryEmbedding and Hugging Face's "yarn" rope type
compute them (gpt-oss, DeepSeek-V3, Qwen's long-context variants).

A model trained with `original_context` positions is stretched `factor`
times: each rotary pair keeps or slows its frequency by how many turns it
makes over the original context. Pairs turning more than `beta_fast` times
keep their frequency (they only see short distances, already learned); those
turning fewer than `beta_slow` times are slowed by `factor` (interpolated
into the range they were trained on); those between blend the two linearly
in the pair's index. The cos/sin tables are then multiplied by the attention
factor, so every query-key logit grows by its square: the longer context's
flatter softmax is sharpened again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class YarnScaling:
    """Megatron-LM's --rotary-scaling-factor, --yarn-original-max-position-embeddings,
    --yarn-beta-fast, --yarn-beta-slow, --mscale, --mscale-all-dim and
    --yarn-correction-range-round-to-int (Hugging Face: factor,
    original_max_position_embeddings, beta_fast, beta_slow, mscale,
    mscale_all_dim, truncate)."""
    factor: float = 1.0
    original_context: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    round_to_int: bool = True

    def correction_range(self, width: int, base: float) -> tuple[float, float]:
        """The pair indices where the blend starts and ends: the pairs that
        turn beta_fast and beta_slow times over the original context."""
        def pair_turning(turns: float) -> float:
            return (width * math.log(self.original_context / (turns * 2 * math.pi))
                    / (2 * math.log(base)))
        low, high = pair_turning(self.beta_fast), pair_turning(self.beta_slow)
        if self.round_to_int:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, width - 1)

    def inverse_frequencies(self, width: int, base: float, device: torch.device) -> torch.Tensor:
        """The width/2 pairs' turns per position, fp32 (width: the rotated part of a head)."""
        wavelength_factors = base ** (torch.arange(0, width, 2, dtype=torch.float32) / width)
        kept = 1.0 / wavelength_factors
        slowed = 1.0 / (self.factor * wavelength_factors)
        low, high = self.correction_range(width, base)
        if low == high:
            high += 0.001  # one pair: a step instead of a ramp (as both references do)
        ramp = ((torch.arange(width // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        kept_share = 1 - ramp
        return (slowed * (1 - kept_share) + kept * kept_share).to(device)

    @property
    def attention_factor(self) -> float:
        """What cos and sin are multiplied by: Megatron-Core's concentration
        factor mscale(factor, --mscale) / mscale(factor, --mscale-all-dim),
        mscale(f, m) = 0.1·m·ln f + 1 (1 for f <= 1). Its defaults (1, 0) give
        Hugging Face's default, 0.1·ln f + 1; DeepSeek-V3's equal pair gives 1."""
        return _mscale(self.factor, self.mscale) / _mscale(self.factor, self.mscale_all_dim)


def _mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
