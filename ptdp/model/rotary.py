"""Rotary position embeddings (RoPE; Su et al., 2021), as Llama uses them.

Each head's query and key vectors are rotated by an angle that grows with the
position, pair of dimensions by pair of dimensions, so that q·k depends only
on the two positions' distance. Pairs are (i, i + d/2), Hugging Face's
"rotate half" convention (Megatron-LM's default too), so Llama checkpoints
load without permuting rows. Pair i turns by position · base^(-2i/d).

There are no parameters: a tensor rank rotates its own heads, and every
layout computes the same rotations. With Llama 3.1's rescaling
(`scaling_factor`) the low frequencies are slowed down. The cos/sin tables are kept per
(length, device, dtype), computed in fp32 and then cast, as Hugging Face does.
"""

from __future__ import annotations

import math

import torch

from ptdp.parallel.context_layout import rank_positions


# Llama 3.1's rescaling (--use-rope-scaling): the context it was trained at and
# the two wavelength bounds' factors. Megatron-LM fixes them as Meta published
# them; only the factor is a flag.
ORIGINAL_CONTEXT = 8192
LOW_FREQUENCY_FACTOR = 1.0
HIGH_FREQUENCY_FACTOR = 4.0


def llama3_frequencies(inverse_frequencies: torch.Tensor, factor: float) -> torch.Tensor:
    """Llama 3.1's rescaled frequencies: pairs turning slower than once per
    ORIGINAL_CONTEXT / LOW_FREQUENCY_FACTOR positions are slowed by `factor`,
    those faster than once per ORIGINAL_CONTEXT / HIGH_FREQUENCY_FACTOR are
    kept, and those between blend the two by where their wavelength lies."""
    wavelengths = 2 * math.pi / inverse_frequencies
    long_wavelength = ORIGINAL_CONTEXT / LOW_FREQUENCY_FACTOR
    short_wavelength = ORIGINAL_CONTEXT / HIGH_FREQUENCY_FACTOR
    blend = ((ORIGINAL_CONTEXT / wavelengths - LOW_FREQUENCY_FACTOR)
             / (HIGH_FREQUENCY_FACTOR - LOW_FREQUENCY_FACTOR))
    blended = (1 - blend) * inverse_frequencies / factor + blend * inverse_frequencies
    scaled = torch.where(wavelengths > long_wavelength, inverse_frequencies / factor,
                         inverse_frequencies)
    between = (wavelengths >= short_wavelength) & (wavelengths <= long_wavelength)
    return torch.where(between, blended, scaled)


class Rotary:
    def __init__(self, head_dim: int, base: float, scaling_factor: float | None = None):
        if head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head dimension, not {head_dim}")
        self.head_dim, self.base, self.scaling_factor = head_dim, base, scaling_factor
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def inverse_frequencies(self, device: torch.device) -> torch.Tensor:
        """Pair i's turn per position, base^(-2i/d) (rescaled for Llama 3.1), fp32."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device)
        inverse_frequencies = 1.0 / (self.base ** (exponents / self.head_dim))
        if self.scaling_factor is not None:
            inverse_frequencies = llama3_frequencies(inverse_frequencies, self.scaling_factor)
        return inverse_frequencies

    def tables(self, length: int, device: torch.device, dtype: torch.dtype,
               context: tuple[int, int] = (1, 0)):
        """cos and sin, each [length, d], for positions 0 .. length - 1; with
        `context` = (c, r) for the `length` positions context rank r of c
        holds of a c·length sequence (ptdp.parallel.context_layout)."""
        key = (length, device, dtype, context)
        if key not in self._tables:
            inverse_frequencies = self.inverse_frequencies(device)
            cp_size, cp_rank = context
            positions = (torch.arange(length, device=device) if cp_size == 1 else
                         rank_positions(length * cp_size, cp_size, cp_rank, device))
            angles = torch.outer(positions.to(torch.float32), inverse_frequencies)
            angles = torch.cat([angles, angles], dim=-1)
            self._tables[key] = (angles.cos().to(dtype), angles.sin().to(dtype))
        return self._tables[key]

    def position_tables(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos and sin, each [b, 1, s, d], for the positions [b, s] of packed
        documents (each restarting at 0): the same products as `tables`,
        row by row, so a document rotates as it would alone."""
        inverse_frequencies = self.inverse_frequencies(positions.device)
        angles = positions.to(torch.float32).unsqueeze(-1) * inverse_frequencies
        angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def __call__(self, x: torch.Tensor, context: tuple[int, int] = (1, 0),
                 positions: torch.Tensor | None = None) -> torch.Tensor:
        """x [b, heads, s, d], rotated by position (`context`: see `tables`;
        `positions` [b, s]: these positions instead)."""
        cos, sin = (self.tables(x.shape[-2], x.device, x.dtype, context) if positions is None
                    else self.position_tables(positions, x.dtype))
        first, second = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-second, first], dim=-1) * sin
