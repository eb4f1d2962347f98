"""Causal attention within a sliding window, with attention sinks: the
attention core of gpt-oss (windowed layers, learnable sinks) and Gemma 3
(windowed layers), on one process (under context parallelism: ptdp.
parallel.context_attention's `window` and `sinks`).

Shapes as the model's attention core uses them: q [b, heads, s, d]; k, v
[b, groups, s, d] with heads a multiple of groups (GQA: head i reads group
i // (heads / groups), as block_attention.expand_groups).

`window` = (L, R) with Megatron-LM's meaning (--window-size): query i sees
keys j with i − L <= j <= i + R. Attention here is always causal, so R must
be 0; L = −1 (or window None) leaves the left side unbounded. Hugging Face's
`sliding_window = W` (the W most recent keys, the query's own included) is
window (W − 1, 0).

`sinks` [heads]: one logit per head added to the softmax's denominator
(Megatron-LM's softmax_type learnable; a zero tensor is off-by-one; None is
the vanilla softmax): p_ij = exp(s_ij) / (exp(sink) + Σ_j exp(s_ij)). It is
applied after the key blocks are merged, as out · sigmoid(lse − sink), and
the combined lse' = logaddexp(lse, sink) is kept: the flash backward given
that final output and lse' recomputes exactly the sink's probabilities, and
its row term D = rowsum(dO · O) is the sink's too, so the blocks' backward
needs no change; the sink's own gradient is −Σ_rows exp(sink − lse') · D.

Where the device has a windowed kernel (ptdp.parallel.window_kernel: CUDA's
flash attention with a window, in 16-bit precision) and `kernel` is "auto",
a window shorter than the sequence runs on it in one call. Otherwise the
work is cut into square blocks of `block` positions: each query block
visits only the key blocks that intersect its rows' windows (the
`visited_blocks`), skipping the rest, on ptdp.parallel.block_attention's
kernels (`block_kernel` names the one "auto" runs), merged by their
log-sum-exps. A key block wholly inside every row's window runs unmasked
(the diagonal one causal; consecutive ones as one rectangle); one the window
edge crosses runs with a boolean mask ("plain"). A window that covers the
whole sequence is one causal call. The backward recomputes each block's
softmax from the saved lse, so nothing of size s × s is kept.

Attention dropout is not supported: the caller refuses it with windows or
sinks (its mask would have to be replayed in every block's backward).
"""

from __future__ import annotations

import functools
import math

import torch

from ptdp.parallel.block_attention import resolve_kernel
# Context parallelism's one-process attention over given blocks (sinks
# included), reused as it is: a Block is (batch rows, q0, q1, k0, k1, causal,
# bool mask or None).
from ptdp.parallel.context_attention import _LocalAttention, window_left
from ptdp.parallel.document_attention import per_document_attention
from ptdp.parallel.window_kernel import WindowKernelAttention, windowed_kernel

# Positions per block: a query block and the key blocks it visits. 128 keeps
# the masked edge blocks ("plain", fp32 matrix products) small on a CPU; the
# unmasked interior runs as one rectangle whatever the block.
DEFAULT_BLOCK = 128


def window_mask(s: int, window: tuple[int, int] | None,
                device: torch.device | str | None = None) -> torch.Tensor:
    """[s, s] bool, True where query i sees key j: i − L <= j <= i."""
    left = window_left(window)
    position = torch.arange(s, device=device)
    distance = position.unsqueeze(-1) - position.unsqueeze(0)      # i − j
    seen = distance >= 0
    return seen if left is None else seen & (distance <= left)


def _block_range(index: int, block: int, s: int) -> tuple[int, int]:
    return index * block, min((index + 1) * block, s)


def _key_blocks(query_block: int, block: int, s: int, left: int | None) -> range:
    """The key blocks that hold a key some row of `query_block` sees: from
    the one holding its first row's first key to its own."""
    q0, _ = _block_range(query_block, block, s)
    first = 0 if left is None else max(0, q0 - left) // block
    return range(first, query_block + 1)


def visited_blocks(s: int, block: int, window: tuple[int, int] | None) -> list[tuple[int, int]]:
    """The (query block, key block) index pairs `local_attention` computes
    for s positions cut in blocks of `block`: those where some query sees
    some key; the other pairs of the ceil(s / block)² are skipped. (A window
    that covers the whole sequence runs as one causal call, which costs
    these same pairs.)"""
    if block < 1:
        raise ValueError(f"the attention block must be at least one position; got {block}")
    left = window_left(window)
    blocks = math.ceil(s / block)
    return [(qb, kb) for qb in range(blocks) for kb in _key_blocks(qb, block, s, left)]


def _covered(q0: int, q1: int, k0: int, k1: int, left: int | None) -> bool:
    """Does every row of [q0, q1) see every key of [k0, k1) that is not after
    it (the farthest pair, last query and first key, within the window)?"""
    return left is None or (q1 - 1) - k0 <= left


def _query_block_plan(qb: int, block: int, s: int, left: int | None, masks: dict,
                      device: torch.device) -> list:
    """The Blocks of one query block: masked ones where the window's edge
    crosses, the fully seen earlier key blocks as one rectangle, the diagonal."""
    q0, q1 = _block_range(qb, block, s)
    plan, interior = [], None
    for kb in _key_blocks(qb, block, s, left):
        k0, k1 = _block_range(kb, block, s)
        diagonal = kb == qb
        if _covered(q0, q1, k0, k1, left):
            if diagonal:
                plan.append((slice(None), q0, q1, k0, k1, True, None))
            else:
                interior = (interior[0], k1) if interior else (k0, k1)
            continue
        shape = (q0 - k0, q1 - q0, k1 - k0)   # equal offsets and sizes give equal masks
        if shape not in masks:
            query = torch.arange(q0, q1, device=device).unsqueeze(-1)
            key = torch.arange(k0, k1, device=device).unsqueeze(0)
            distance = query - key
            masks[shape] = ((distance >= 0) & (distance <= left)).view(1, 1, q1 - q0, k1 - k0)
        plan.append((slice(None), q0, q1, k0, k1, False, masks[shape]))
    if interior:
        plan.append((slice(None), q0, q1, interior[0], interior[1], False, None))
    return plan


@functools.lru_cache(maxsize=64)
def _plan(s: int, block: int, left: int | None, device: torch.device) -> tuple:
    """Every Block the forward and backward run, for these positions, block
    and window on this device (kept: the same for every layer and step)."""
    if left is None or left >= s - 1:
        return ((slice(None), 0, s, 0, s, True, None),)
    masks: dict = {}
    return tuple(b for qb in range(math.ceil(s / block))
                 for b in _query_block_plan(qb, block, s, left, masks, device))


def _check_inputs(q, k, v, sinks, block):
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"local attention takes q [b, heads, s, d] and k, v [b, groups, s, d]; "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    (b, heads, s, d), (kb, groups, ks, kd) = q.shape, k.shape
    if (kb, ks, kd) != (b, s, d) or heads % groups:
        raise ValueError(f"k, v {tuple(k.shape)} do not match q {tuple(q.shape)}: same batch, "
                         f"positions and head size, and key/value groups dividing the heads")
    if sinks is not None and tuple(sinks.shape) != (heads,):
        raise ValueError(f"sinks are one logit per attention head, [{heads}]; got "
                         f"{tuple(sinks.shape)} (None for the vanilla softmax)")
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"the attention block must be a positive number of positions; got "
                         f"{block!r}")


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                    window: tuple[int, int] | None, sinks: torch.Tensor | None,
                    scale: float | None = None, block: int = DEFAULT_BLOCK,
                    kernel: str = "auto") -> torch.Tensor:
    """Causal attention of q over (k, v) within `window` (L, R = 0;
    None or L = −1: unbounded), with per-head `sinks` [heads] (None: none),
    returned [b, heads, s, d] in q's dtype, differentiable in q, k, v and
    sinks. `scale` defaults to 1/√d (Gemma 3 passes
    query_pre_attn_scalar^−½). `block`: positions per block (see the module
    docstring). `kernel`: "auto" (the device's windowed kernel where it has
    one, else the block plan on block_attention's choice) or a name of
    block_attention.KERNELS for the block plan. No dropout."""
    _check_inputs(q, k, v, sinks, block)
    left = window_left(window)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if kernel == "auto" and left is not None and left < q.shape[2] - 1 and \
            windowed_kernel(q.device, q.dtype, q.shape[-1]):
        return WindowKernelAttention.apply(q, k, v, sinks, left, scale)
    kernel = resolve_kernel(kernel, q)
    blocks = _plan(q.shape[2], block, left, q.device)
    return _LocalAttention.apply(q, k, v, sinks, blocks, scale, kernel)


def document_local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             document_ids: torch.Tensor, *, window: tuple[int, int] | None,
                             sinks: torch.Tensor | None, scale: float | None = None,
                             plans: dict | None = None) -> torch.Tensor:
    """`local_attention` within each document of packed sequences
    (`document_ids` [b, s] or [s], as ptdp.parallel.document_attention takes
    them): documents of equal length run as one batch. A window counts
    positions back from the query, so within a document it is what it is in
    a sequence of that document alone."""
    ids = document_ids if document_ids.dim() == 2 else document_ids.expand(q.shape[0], -1)
    return per_document_attention(
        q, k, v, ids, scale, 0.0, plans,
        attend=lambda qg, kg, vg: local_attention(qg, kg, vg, window=window, sinks=sinks,
                                                  scale=scale))
