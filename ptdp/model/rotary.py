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

Variants: YaRN's frequencies and attention factor (ptdp.model.yarn), which
multiplies the tables; partial rotation (--rotary-percent p, Hugging Face's
partial_rotary_factor): only the first int(p·d) dimensions of each head turn,
paired "rotate half" over that width as Megatron-Core and GPT-NeoX do, and
the rest pass unchanged; linear position interpolation
(--rotary-seq-len-interpolation-factor F, Hugging Face's rope_type 'linear'):
every frequency divided by F, which turns position p as p / F, Megatron-Core's
seq_len_interpolation_factor; and Gemma 3's second base for sliding-window
layers (`rotary_for(config, local=True)`), which is never interpolated.
"""

from __future__ import annotations

import math

from typing import TYPE_CHECKING

import torch

from ptdp.model.yarn import YarnScaling
from ptdp.parallel.context_layout import rank_positions

if TYPE_CHECKING:
    from ptdp.config.model import ModelConfig


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


def rotary_for(config: "ModelConfig", local: bool = False) -> "Rotary | None":
    """The rotation of a layer of `config` (None without rotary embeddings).
    `local`: a sliding-window layer's; with --rotary-base-local it turns at
    that base, unscaled and not interpolated (Gemma 3's local layers use
    default rope), else it is the global layers' rotation (Megatron-LM's one
    RotaryEmbedding, interpolated on every layer)."""
    if not config.rope:
        return None
    if local and config.rotary_base_local is not None:
        return Rotary(config.head_dim, config.rotary_base_local,
                      rotary_percent=config.rotary_percent)
    scaling = config.rope_scaling_factor if config.use_rope_scaling else None
    yarn = None
    if config.yarn:
        yarn = YarnScaling(config.rotary_scaling_factor, config.yarn_original_max_position_embeddings,
                           config.yarn_beta_fast, config.yarn_beta_slow, config.mscale,
                           config.mscale_all_dim, config.yarn_correction_range_round_to_int)
    return Rotary(config.head_dim, config.rotary_base, scaling_factor=scaling,
                  rotary_percent=config.rotary_percent, yarn=yarn,
                  interpolation_factor=config.rotary_seq_len_interpolation_factor)


class Rotary:
    def __init__(self, head_dim: int, base: float, scaling_factor: float | None = None,
                 rotary_percent: float = 1.0, yarn: YarnScaling | None = None,
                 interpolation_factor: float | None = None):
        # The rotated width: Megatron-Core's int(d·p), Hugging Face's int(d·partial_rotary_factor).
        width = int(head_dim * rotary_percent)
        if width % 2 or width < 2:
            raise ValueError(f"rotary embeddings need an even rotated width, not {width} "
                             f"({rotary_percent} of {head_dim})")
        self.head_dim, self.width, self.base = head_dim, width, base
        self.scaling_factor, self.yarn = scaling_factor, yarn
        self.interpolation_factor = interpolation_factor
        self.attention_factor = 1.0 if yarn is None else yarn.attention_factor
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def inverse_frequencies(self, device: torch.device) -> torch.Tensor:
        """Pair i's turn per position, base^(-2i/w) over the rotated width w
        (rescaled for Llama 3.1 or YaRN; divided by the interpolation factor
        after that, as Hugging Face's 'linear'), fp32."""
        if self.yarn is not None:
            inverse_frequencies = self.yarn.inverse_frequencies(self.width, self.base, device)
        else:
            exponents = torch.arange(0, self.width, 2, dtype=torch.float32, device=device)
            inverse_frequencies = 1.0 / (self.base ** (exponents / self.width))
            if self.scaling_factor is not None:
                inverse_frequencies = llama3_frequencies(inverse_frequencies, self.scaling_factor)
        if self.interpolation_factor is not None:
            inverse_frequencies = inverse_frequencies / self.interpolation_factor
        return inverse_frequencies

    def _cos_sin(self, angles: torch.Tensor, dtype: torch.dtype):
        """cos and sin of [..., w/2] angles, each [..., w], times YaRN's
        attention factor in fp32 before the cast (as Hugging Face)."""
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)

    def tables(self, length: int, device: torch.device, dtype: torch.dtype,
               context: tuple[int, int] = (1, 0)):
        """cos and sin, each [length, w], for positions 0 .. length - 1; with
        `context` = (c, r) for the `length` positions context rank r of c
        holds of a c·length sequence (ptdp.parallel.context_layout)."""
        key = (length, device, dtype, context)
        if key not in self._tables:
            inverse_frequencies = self.inverse_frequencies(device)
            cp_size, cp_rank = context
            positions = (torch.arange(length, device=device) if cp_size == 1 else
                         rank_positions(length * cp_size, cp_size, cp_rank, device))
            angles = torch.outer(positions.to(torch.float32), inverse_frequencies)
            self._tables[key] = self._cos_sin(angles, dtype)
        return self._tables[key]

    def position_tables(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos and sin, each [b, 1, s, w], for the positions [b, s] of packed
        documents (each restarting at 0): the same products as `tables`,
        row by row, so a document rotates as it would alone."""
        inverse_frequencies = self.inverse_frequencies(positions.device)
        angles = positions.to(torch.float32).unsqueeze(-1) * inverse_frequencies
        return self._cos_sin(angles.unsqueeze(1), dtype)

    def tables_for(self, x: torch.Tensor, context: tuple[int, int] = (1, 0),
                   positions: torch.Tensor | None = None):
        """cos and sin for x [b, heads, s, d]: `tables`, or `position_tables`
        for the given `positions` [b, s]."""
        return (self.tables(x.shape[-2], x.device, x.dtype, context) if positions is None
                else self.position_tables(positions, x.dtype))

    def __call__(self, x: torch.Tensor, context: tuple[int, int] = (1, 0),
                 positions: torch.Tensor | None = None) -> torch.Tensor:
        """x [b, heads, s, d], rotated by position (`context`: see `tables`;
        `positions` [b, s]: these positions instead); only its first w
        dimensions under partial rotation."""
        cos, sin = self.tables_for(x, context, positions)
        return rotate(x, cos, sin, self.width)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, width: int) -> torch.Tensor:
    """x [..., d] turned by the tables' angles, its first `width` dimensions
    ("rotate half" pairs); the rest pass unchanged. Pure computation (--compile
    compiles it: ptdp.model.compiled)."""
    rotated, passed = (x, None) if width == x.shape[-1] else x.split(
        [width, x.shape[-1] - width], dim=-1)
    first, second = rotated.chunk(2, dim=-1)
    rotated = rotated * cos + torch.cat([-second, first], dim=-1) * sin
    return rotated if passed is None else torch.cat([rotated, passed], dim=-1)
