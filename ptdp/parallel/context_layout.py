"""Context parallelism's load-balanced sequence layout.

A sequence of s positions is cut into 2c chunks of s/(2c); context rank r
holds chunks r and 2c - 1 - r, in that order. Under a causal mask a query
attends to the positions before it, so early chunks cost little and late
ones much: pairing the r-th cheapest chunk with the r-th dearest gives
every rank the same work (Megatron-LM's layout).

Everything here is plain tensor arithmetic, usable on any rank without
communication: the positions a rank holds (for rotary or learned position
embeddings, labels and loss masks), cutting a whole-sequence tensor into a
rank's piece, and joining the pieces of all ranks back.
"""

from __future__ import annotations

from typing import Sequence

import torch


def check_sequence_length(seq_length: int, cp_size: int) -> None:
    """ValueError unless `seq_length` splits into 2·cp_size equal chunks; the
    message names the nearest lengths that do."""
    if cp_size < 1:
        raise ValueError(f"context-parallel size must be at least 1, not {cp_size}")
    parts = 2 * cp_size
    if seq_length <= 0 or seq_length % parts:
        lower, upper = seq_length // parts * parts, (max(seq_length, 0) // parts + 1) * parts
        choices = f"{lower} or {upper}" if lower > 0 else str(upper)
        raise ValueError(
            f"sequence length {seq_length} does not split into 2 × {cp_size} = {parts} equal "
            f"chunks for context parallelism of {cp_size}; use --seq-length {choices}")


def chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunks (of 2·cp_size) that context rank `cp_rank` holds, in order."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"context rank {cp_rank} is outside 0..{cp_size - 1}")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def rank_positions(seq_length: int, cp_size: int, cp_rank: int,
                   device: torch.device | str | None = None) -> torch.Tensor:
    """The positions (int64, [seq_length / cp_size]) of the sequence that
    context rank `cp_rank` holds, in the order it holds them."""
    check_sequence_length(seq_length, cp_size)
    chunk = seq_length // (2 * cp_size)
    first, second = chunk_ids(cp_rank, cp_size)
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk, device=device),
                      torch.arange(second * chunk, (second + 1) * chunk, device=device)])


def layout_order(seq_length: int, cp_size: int,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """[seq_length] int64: the positions of context ranks 0, 1, ... one after
    the other (what concatenating every rank's piece holds)."""
    return torch.cat([rank_positions(seq_length, cp_size, r, device) for r in range(cp_size)])


def natural_order(seq_length: int, cp_size: int,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """The inverse of `layout_order`: index i of the result is where
    position i lies in the concatenation of the ranks' pieces."""
    return torch.argsort(layout_order(seq_length, cp_size, device))


def split_sequence(x: torch.Tensor, cp_size: int, cp_rank: int, seq_dim: int = 1) -> torch.Tensor:
    """This context rank's piece of a whole-sequence tensor: [b, s, ...] with
    seq_dim=1, [s, b, ...] with seq_dim=0 (any dim works). Differentiable."""
    seq_dim = seq_dim % x.dim()
    seq_length = x.shape[seq_dim]
    check_sequence_length(seq_length, cp_size)
    chunk = seq_length // (2 * cp_size)
    first, second = chunk_ids(cp_rank, cp_size)
    return torch.cat([x.narrow(seq_dim, first * chunk, chunk),
                      x.narrow(seq_dim, second * chunk, chunk)], dim=seq_dim)


def join_sequence(pieces: Sequence[torch.Tensor], seq_dim: int = 1) -> torch.Tensor:
    """The whole sequence from every context rank's piece (`pieces[r]` from
    rank r, as `split_sequence` cut them). Differentiable."""
    cp_size = len(pieces)
    if cp_size == 0:
        raise ValueError("join_sequence needs the piece of at least one context rank")
    seq_dim = seq_dim % pieces[0].dim()
    local = pieces[0].shape[seq_dim]
    if local % 2 or any(p.shape[seq_dim] != local for p in pieces):
        raise ValueError(f"every context rank's piece must hold the same even number of "
                         f"positions; got {[p.shape[seq_dim] for p in pieces]}")
    chunk = local // 2
    chunks: list[torch.Tensor | None] = [None] * (2 * cp_size)
    for rank, piece in enumerate(pieces):
        first, second = chunk_ids(rank, cp_size)
        chunks[first] = piece.narrow(seq_dim, 0, chunk)
        chunks[second] = piece.narrow(seq_dim, chunk, chunk)
    return torch.cat(chunks, dim=seq_dim)
