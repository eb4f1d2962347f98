"""What sliding windows leave of the attention's work (--window-size,
--window-attn-skip-freq), for the FLOP count and the performance model.

A windowed layer's query i sees min(i, L) + 1 keys instead of i + 1. The
model FLOPs (ptdp.perf.analytic.flops) count what is computed: a windowed
layer's score and context products are the causal count's share
`pair_fraction` of the full layer's (whose 4·B·s²·a·d convention is
Megatron-LM's). The kernel (ptdp.parallel.local_attention) visits whole key
blocks of `BLOCK` positions, those the window touches, so its time is the
share `block_fraction` of the causal blocks; the performance model prices
the attention of the mean layer at that share (a pipeline stage's layers
are taken as the model's mix). Sinks add one element-wise pass over the
attention's output and are not priced.

Nothing here imports torch."""

from __future__ import annotations

BLOCK = 128  # ptdp.parallel.local_attention.DEFAULT_BLOCK (a test checks they agree)


def pair_fraction(s: int, left: int) -> float:
    """Of a causal attention's s(s+1)/2 (query, key) pairs, the share a
    window of `left` keys before each query keeps."""
    if left < 0 or left >= s - 1:
        return 1.0
    kept = (left + 1) * (left + 2) // 2 + (s - left - 1) * (left + 1)
    return kept / (s * (s + 1) / 2)


def block_fraction(s: int, left: int, block: int = BLOCK) -> float:
    """Of the causal (query block, key block) pairs, the share the windowed
    kernel visits: for query block q, key blocks from the one holding
    q·block − left up to the diagonal."""
    if left < 0 or left >= s - 1:
        return 1.0
    blocks = -(-s // block)
    visited = sum(q - max(0, q * block - left) // block + 1 for q in range(blocks))
    return visited / (blocks * (blocks + 1) / 2)


def mean_fraction(model, fraction) -> float:
    """The mean over `model`'s layers of `fraction(s, left)` for its windowed
    layers and 1 for the others."""
    windowed = model.windowed_layers
    if not any(windowed):
        return 1.0
    share = fraction(model.seq_length, model.window[0])
    return sum(share if w else 1.0 for w in windowed) / len(windowed)
