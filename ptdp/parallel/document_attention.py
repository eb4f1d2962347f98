"""Causal attention over packed sequences: several documents back to back in
one sequence, each attending only to its own earlier positions (a
block-diagonal causal mask), so that packing changes no document's result.

Documents are given either as `document_ids` [b, s] (or [s] for every row),
one id per position, a document being a run of equal consecutive ids (a
padding tail is simply one more run), or as `cu_seqlens` [n + 1], the
cumulative document lengths (0, l0, l0 + l1, ..., s) shared by every row.

Shapes as the model's attention core uses them: q [b, heads, s, d]; k, v
[b, groups, s, d] with heads a multiple of groups (grouped-query attention:
head j reads group j // (heads / groups), as scaled_dot_product_attention's
enable_gqa). The result is [b, heads, s, d], as the dense causal path.

Kernels, by name (`document_kernel` says which one "auto" runs):
- "per-document sdpa": each document's slice through
  scaled_dot_product_attention(is_causal=True), documents of equal length
  batched together; nothing of size s × s, any device;
- "flex attention (document mask)": torch's FlexAttention with a block mask
  built from the document ids, which skips the blocks across documents
  (CUDA, torch >= 2.5, no dropout);
- "dense masked sdpa": a boolean [b, 1, s, s] block-diagonal causal mask
  into scaled_dot_product_attention: the reference the others are checked
  against.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ptdp.parallel.block_attention import (
    accumulation_dtype,
    block_forward,
    resolve_kernel,
)

PER_DOCUMENT = "per-document sdpa"
FLEX = "flex attention (document mask)"
DENSE = "dense masked sdpa"
DOCUMENT_KERNELS = (PER_DOCUMENT, FLEX, DENSE)

# A document in a pack: (batch row, first position, length).
Segment = tuple[int, int, int]


@dataclass(frozen=True)
class Documents:
    """Where a microbatch's documents lie, travelling with it to every
    pipeline stage: `position_ids` [b, s] (each position's distance from
    its document's first token, or 0..s-1) and `document_ids` [b, s]
    (runs of equal ids are documents, attention keeps inside each; None:
    attention runs across them, as --reset-position-ids alone asks). Both
    cover the whole sequence; under context parallelism each rank takes its
    own positions of them."""
    position_ids: torch.Tensor
    document_ids: torch.Tensor | None = None
    # What the kernels derive from the ids (the per-document grouping, the
    # block mask), kept for the microbatch's other layers and its recomputation.
    plans: dict = field(default_factory=dict, compare=False, repr=False)

    def to(self, device: torch.device | str) -> "Documents":
        ids = None if self.document_ids is None else self.document_ids.to(device)
        return Documents(self.position_ids.to(device), ids)


# ------------------------------------------------------------------ describing the documents

def document_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, seq_length: int) -> torch.Tensor:
    """[s] int32 ids 0, 0, ..., 1, 1, ... from cumulative lengths that end at s."""
    cu = cu_seqlens.to(device="cpu", dtype=torch.int64)
    if cu.dim() != 1 or len(cu) < 2 or int(cu[0]) != 0 or int(cu[-1]) != seq_length \
            or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must rise from 0 to the sequence length {seq_length}; "
                         f"got {cu.tolist()}")
    lengths = cu[1:] - cu[:-1]
    ids = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), lengths)
    return ids.to(cu_seqlens.device)


def segment_ids(document_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] int64: the run index of each position (0 at each row's start,
    +1 where the id changes), so ids that repeat after another document
    still name two documents."""
    ids = document_ids if document_ids.dim() == 2 else document_ids.unsqueeze(0)
    changed = torch.zeros_like(ids, dtype=torch.int64)
    changed[:, 1:] = (ids[:, 1:] != ids[:, :-1]).to(torch.int64)
    return changed.cumsum(dim=1)


def segments(document_ids: torch.Tensor, batch: int) -> list[Segment]:
    """Every document of every row as (row, start, length), rows in order."""
    ids = document_ids if document_ids.dim() == 2 else document_ids.unsqueeze(0)
    ids = ids.expand(batch, -1).cpu()
    found = []
    for row in range(batch):
        _, counts = torch.unique_consecutive(ids[row], return_counts=True)
        start = 0
        for length in counts.tolist():
            found.append((row, start, length))
            start += length
    return found


def _documents(q: torch.Tensor, document_ids, cu_seqlens) -> torch.Tensor:
    """The document ids to use, [b, s] or [s], from whichever was given."""
    if (document_ids is None) == (cu_seqlens is None):
        raise ValueError("give exactly one of document_ids and cu_seqlens")
    s = q.shape[2]
    if document_ids is None:
        return document_ids_from_cu_seqlens(cu_seqlens, s)
    if document_ids.shape[-1] != s or document_ids.dim() not in (1, 2):
        raise ValueError(f"document_ids must be [b, {s}] or [{s}]; got "
                         f"{tuple(document_ids.shape)}")
    return document_ids


def document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s] bool, True where query i may see key j: same document and j <= i."""
    seg = segment_ids(document_ids)
    s = seg.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=seg.device).tril()
    return ((seg.unsqueeze(-1) == seg.unsqueeze(-2)) & causal).unsqueeze(1)


# ------------------------------------------------------------------ kernels

def _gqa(q: torch.Tensor, k: torch.Tensor) -> dict:
    # Passed only when needed, as the model's attention does: the flag exists from torch 2.5.
    return {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}


def dense_masked_attention(q, k, v, document_ids, scale=None, dropout=0.0):
    """The reference: one [b, 1, s, s] mask into scaled_dot_product_attention."""
    mask = document_mask(document_ids).to(q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                          scale=scale, **_gqa(q, k))


def _grouped_by_length(found: list[Segment], seq: int) -> tuple[list[tuple[int, int]],
                                                                  torch.Tensor]:
    """The documents reordered so that equal lengths are adjacent: [(length,
    how many)] in that order, and the permutation of the b·s positions
    (row-major) that lists their positions in it."""
    by_length: dict[int, list[Segment]] = {}
    for segment in found:
        by_length.setdefault(segment[2], []).append(segment)
    groups, starts = [], []
    for length, members in by_length.items():
        groups.append((length, len(members)))
        starts += [row * seq + start for row, start, _ in members]
    lengths = torch.tensor([length for length, n in groups for _ in range(n)])
    offsets = torch.repeat_interleave(torch.tensor(starts), lengths)
    within = torch.arange(len(offsets)) - torch.repeat_interleave(lengths.cumsum(0) - lengths,
                                                                   lengths)
    return groups, offsets + within


def _planned(plans: dict | None, key: tuple, build):
    """`build()`, or what it gave for `key` before in `plans` (None: no memory)."""
    if plans is None:
        return build()
    if key not in plans:
        plans[key] = build()
    return plans[key]


def per_document_attention(q, k, v, document_ids, scale=None, dropout=0.0, plans=None,
                           attend=None):
    """Each document through causal scaled_dot_product_attention; documents
    of the same length (in any row) run as one batch. Positions are gathered
    into that order with one permutation and scattered back with its inverse,
    so the backward costs O(s), whatever the number of documents. `plans`: a
    dict that keeps the grouping for other calls on the same ids. `attend`
    (q, k, v) -> out runs each group instead of causal SDPA (sliding windows
    and sinks: ptdp.parallel.local_attention.document_local_attention)."""
    b, heads, s, d = q.shape

    def plan():
        groups, order = _grouped_by_length(segments(document_ids, b), s)
        order = order.to(q.device)
        return groups, order, torch.argsort(order)

    groups, order, inverse = _planned(plans, (PER_DOCUMENT, b, s, q.device), plan)

    def pieces(x):  # [b, n, s, d] -> per group [documents, n, length, d]
        flat = x.transpose(1, 2).reshape(b * s, x.shape[1], d)[order]
        chunks = torch.split(flat, [length * n for length, n in groups])
        return [chunk.view(n, length, x.shape[1], d).transpose(1, 2)
                for chunk, (length, n) in zip(chunks, groups)]

    def causal(qg, kg, vg):
        return F.scaled_dot_product_attention(qg, kg, vg, dropout_p=dropout, is_causal=True,
                                              scale=scale, **_gqa(q, k))

    attend = attend or causal
    outputs = [attend(qg, kg, vg).transpose(1, 2).reshape(-1, heads, d)
               for qg, kg, vg in zip(pieces(q), pieces(k), pieces(v))]
    restored = torch.cat(outputs)[inverse]
    return restored.view(b, s, heads, d).transpose(1, 2)


@functools.lru_cache(maxsize=None)
def _flex_functions(device_type: str):
    """(flex_attention, create_block_mask), compiled on CUDA (eager FlexAttention
    is a slow reference there); None where this torch has no FlexAttention."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    if device_type == "cuda":
        flex_attention = torch.compile(flex_attention, dynamic=False)
    return flex_attention, create_block_mask


# Untested on a GPU here: the CPU build runs only FlexAttention's eager
# forward (its CPU backward is not implemented), which the tests compare
# with the dense path; on CUDA the compiled kernel with this block mask is
# torch's documented document-masking recipe.
def flex_document_attention(q, k, v, document_ids, scale=None, plans=None):
    """FlexAttention with a block mask from the document ids (no dropout);
    `plans` keeps the block mask for other calls on the same ids."""
    functions = _flex_functions(q.device.type)
    if functions is None:
        raise RuntimeError("this torch has no torch.nn.attention.flex_attention")
    flex_attention, create_block_mask = functions
    b, s = q.shape[0], q.shape[2]
    seg = segment_ids(document_ids).to(q.device).expand(b, -1)

    def same_document_causal(batch, head, q_index, kv_index):
        return (seg[batch, q_index] == seg[batch, kv_index]) & (q_index >= kv_index)

    block_mask = _planned(plans, (FLEX, b, s, q.device), lambda: create_block_mask(
        same_document_causal, b, None, s, s, device=q.device))
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale,
                          enable_gqa=k.shape[1] != q.shape[1])


def flex_available(device: torch.device | str) -> bool:
    return _flex_functions(torch.device(device).type) is not None


def document_kernel(device: torch.device | str, dropout: float = 0.0) -> str:
    """The kernel `document_causal_attention` runs with kernel="auto": FlexAttention
    on CUDA where this torch has it and there is no attention dropout, else the
    per-document path (never the dense mask, whose memory grows as s²)."""
    device = torch.device(device)
    if device.type == "cuda" and dropout == 0.0 and flex_available(device):
        return FLEX
    return PER_DOCUMENT


def document_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              document_ids: torch.Tensor | None = None,
                              cu_seqlens: torch.Tensor | None = None, *,
                              scale: float | None = None, dropout: float = 0.0,
                              kernel: str = "auto", plans: dict | None = None) -> torch.Tensor:
    """softmax(q kᵀ·scale) v with each query seeing only the earlier keys of
    its own document: [b, heads, s, d]. `scale` defaults to 1/√d; `dropout`
    is the attention dropout probability (the caller passes 0 in eval);
    `kernel` is "auto" or a name of DOCUMENT_KERNELS; `plans` (a
    Documents' own) keeps what the kernel derives from the ids for the
    microbatch's other layers. (Sliding windows and sinks within each
    document: ptdp.parallel.local_attention.document_local_attention.)"""
    ids = _documents(q, document_ids, cu_seqlens)
    if kernel == "auto":
        kernel = document_kernel(q.device, dropout)
    if kernel == PER_DOCUMENT:
        return per_document_attention(q, k, v, ids, scale, dropout, plans)
    if kernel == DENSE:
        return dense_masked_attention(q, k, v, ids, scale, dropout)
    if kernel == FLEX:
        if dropout:
            raise ValueError("FlexAttention has no attention dropout; use the per-document "
                             "kernel")
        return flex_document_attention(q, k, v, ids, scale, plans)
    raise ValueError(f"unknown document attention kernel {kernel!r}; use auto or one of "
                     f"{', '.join(DOCUMENT_KERNELS)}")


# ------------------------------------------------------------------ with log-sum-exp

def document_attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           document_ids: torch.Tensor | None = None,
                           cu_seqlens: torch.Tensor | None = None, *,
                           scale: float | None = None,
                           block_kernel: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(out [b, heads, s, d], lse [b, heads, s]) in the accumulation dtype,
    each document a causal block of ptdp.parallel.block_attention (forward
    only, no autograd): what context parallelism merges across blocks."""
    ids = _documents(q, document_ids, cu_seqlens)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kernel = resolve_kernel(block_kernel, q)
    acc = accumulation_dtype(q.dtype)
    out = torch.empty(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:3], -math.inf, dtype=acc, device=q.device)
    for row, start, length in segments(ids, q.shape[0]):
        rows, cols = slice(row, row + 1), slice(start, start + length)
        block_out, block_lse = block_forward(q[rows, :, cols], k[rows, :, cols],
                                             v[rows, :, cols], True, scale, kernel)
        out[rows, :, cols] = block_out
        lse[rows, :, cols] = block_lse
    return out, lse
