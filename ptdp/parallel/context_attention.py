"""Causal attention across context-parallel ranks (Megatron-LM's
--cp-comm-type p2p | all_gather | a2a).

Each context rank holds two chunks of every sequence (ptdp.parallel.
context_layout: rank r holds chunks r and 2c − 1 − r), as q [b, heads, s/c,
d] and k, v [b, groups, s/c, d]; `context_attention` returns this rank's
rows of causal attention over the whole sequence, [b, heads, s/c, d], with
gradients for q, k and v.

- p2p: a ring. Key/value blocks travel to the next rank while the block
  in hand is computed; partial outputs merge by their log-sum-exp. With the
  load-balanced layout a rank's queries see, of another rank's block, either
  its first chunk only (an earlier rank: all query rows, no mask) or all of
  it (a later rank: the second query chunk only, no mask); the own block is
  causal. So every step costs the same on every rank. The backward runs the
  ring again, recomputing each block's softmax from the saved LSE; the
  key/value gradients travel one step behind their blocks and arrive at
  their owners after the last step.
- all_gather: keys and values gathered over the group (the backward
  reduce-scatters their gradients), then each query chunk attends to the
  positions before it.
- a2a (DeepSpeed-Ulysses): all-to-all trades the sequence split for a head
  split (heads/c query heads, groups/c key/value groups per rank, whole
  sequences), plain causal attention, and all-to-all back.

Packed documents (`document_ids` [b, s]: the whole sequence's ids in natural
order, the same on every context rank; a document is a run of equal
consecutive ids, as ptdp.parallel.document_attention.segment_ids): a query
sees only the earlier keys of its own document. Every rank plans its blocks
from the ids alone (a key block's positions follow from its source rank, so
no ids travel), a query chunk against a key chunk (all_gather: against all
earlier positions). Later keys are skipped. Earlier keys share at most one
document with the queries: one unmasked rectangle (the first queries
against the last keys), or nothing. A chunk against itself is one causal
block per document, or one masked "plain" block where that is cheaper
(MASKED_BLOCK_AREA). Batch rows whose documents lie alike share blocks;
rows that differ get their own. A row that sees nothing of a block keeps
LSE −inf and output 0 there. a2a, whose ranks hold whole sequences, plans
the same way over the 2c chunks. The work per rank then follows the
documents, no longer evenly balanced by the layout.

Sliding windows (`window` (L, 0): query i sees keys i − L..i, as ptdp.
parallel.local_attention) are planned from absolute positions too: each
query chunk, cut in WINDOW_BLOCK positions, meets only the keys its rows'
windows reach; keys every row sees run as one unmasked rectangle, the
window's edge as a masked "plain" block (i − L <= j <= i), the own square
causal. A ring step whose key chunks lie wholly outside every local query's
window computes nothing; its block is still passed on, since the layout's
last step always pairs neighbouring chunks (chunk 2c − 1 − r meets
2c − 2 − r), so no rank's ring ends early. Sinks (`sinks` [heads]) are
applied once, after the steps' (or the gathered blocks') merge: out ·
sigmoid(lse − sink), with lse' = logaddexp(lse, sink) kept for the
backward, and the sink's gradient −Σ exp(sink − lse') · rowsum(dO · O) over
this rank's rows (the gradient reduction adds the other context ranks').
Under a2a a rank holds heads/c of the heads, so it applies their part of
the sinks. With packed documents the window's blocks are cut down to each
batch row's documents (_within_documents): a block none of whose pairs in
the window shares a document is skipped, one all of whose do is kept as it
is, and the rest run masked by window and document together.

The attention of each block runs on ptdp.parallel.block_attention's kernel
(`block_kernel` names it). Attention dropout is refused: it would have to
replay the same mask in the backward ring and under recomputation.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.distributed as dist

from ptdp.parallel.block_attention import (KERNELS, accumulation_dtype, block_backward,
                                           block_forward, block_kernel, merge_into,
                                           resolve_kernel)
from ptdp.parallel.context_layout import layout_order, natural_order
from ptdp.parallel.document_attention import segment_ids
from ptdp.parallel.expert import all_to_all
from ptdp.parallel.tensor import gather_from_sequence_region

COMM_TYPES = ("p2p", "all_gather", "a2a")
KERNEL_OPS = {
    "plain": "matrix products in fp32",
    "cpu_flash": "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu",
    "cuda_flash": "torch.ops.aten._scaled_dot_product_flash_attention",
    "cuda_efficient": "torch.ops.aten._efficient_attention_forward",
}
__all__ = ["COMM_TYPES", "KERNELS", "KERNEL_OPS", "block_kernel", "context_attention",
           "check_a2a_heads"]

# A block pair: query rows [q0, q1) against key rows [k0, k1), causal or not.
Pair = tuple[int, int, int, int, bool]
# What runs: batch rows `rows`, query rows [q0, q1) against key rows [k0, k1),
# causal or not, with a bool mask [b, 1, q1 − q0, k1 − k0] or None.
Block = tuple[slice, int, int, int, int, bool, "torch.Tensor | None"]
# Positions held in a row of local rows: (first local row, first natural position, count).
Span = tuple[int, int, int]
# A causal diagonal range of n positions holding several documents runs as
# one kernel call per document, or as one masked "plain" n × n block where
# that is cheaper: when calls × area > n², area being the score entries a
# masked block computes (forward and backward) for the cost of one more call.
# CPU measured (8 heads of 64, fp32, cpu_flash: ~0.12 ms a call, crossover
# near 64 documents in 256 positions and past 256 in 1024); CUDA an estimate
# (launch-bound small calls against fast dense products), not yet measured.
MASKED_BLOCK_AREA = {"cpu": 1024, "cuda": 65536}


def _group_size_rank(group: Any) -> tuple[int, int]:
    return (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))


def check_a2a_heads(heads: int, groups: int, cp_size: int) -> None:
    """ValueError unless a2a can split `heads` query heads and `groups`
    key/value groups evenly over `cp_size` context ranks."""
    if heads % cp_size or groups % cp_size:
        common = math.gcd(heads, groups)
        sizes = [str(n) for n in range(2, common + 1) if common % n == 0]
        other = f", or a --context-parallel-size of {' or '.join(sizes)}" if sizes else ""
        raise ValueError(
            f"--cp-comm-type a2a splits the attention heads over the {cp_size} context ranks, "
            f"but {heads} query heads and {groups} key/value groups do not both divide by "
            f"{cp_size}; use --cp-comm-type p2p or all_gather{other}")


# ------------------------------------------------------------------ block pairs

def _ring_pairs(rank: int, source: int, half: int) -> list[Pair]:
    """What this rank's queries (its two chunks, `half` rows each) compute
    against the key/value block of context rank `source`."""
    if source == rank:
        return [(0, 2 * half, 0, 2 * half, True)]   # chunks r, 2c-1-r: causal as they lie
    if source < rank:
        return [(0, 2 * half, 0, half, False)]      # both query chunks see chunk `source`
    return [(half, 2 * half, 0, 2 * half, False)]   # only chunk 2c-1-r sees, all of it


def _gathered_pairs(rank: int, size: int, half: int) -> list[Pair]:
    """This rank's queries against the whole sequence in natural order."""
    pairs: list[Pair] = []
    for row, chunk in ((0, rank), (half, 2 * size - 1 - rank)):
        if chunk:
            pairs.append((row, row + half, 0, chunk * half, False))
        pairs.append((row, row + half, chunk * half, (chunk + 1) * half, True))
    return pairs


# ------------------------------------------------------------------ packed documents

class _Documents:
    """The document (run) index of every position of the whole sequence in
    natural order, [b, s]: on the CPU to plan blocks (ids given on the CPU
    cost no device synchronisation), on q's device only for masks."""

    def __init__(self, document_ids: torch.Tensor, batch: int, device: torch.device):
        self.cpu = segment_ids(document_ids.cpu()).expand(batch, -1)
        self.device = torch.device(device)

    @functools.cached_property
    def on_device(self) -> torch.Tensor:
        return self.cpu.to(self.device)


def _row_groups(keys: list) -> list[tuple[slice, Any]]:
    """Runs of consecutive batch rows with equal keys, as (rows, key)."""
    groups, start = [], 0
    for row in range(1, len(keys) + 1):
        if row == len(keys) or keys[row] != keys[start]:
            groups.append((slice(start, row), keys[start]))
            start = row
    return groups


def _earlier_blocks(docs: _Documents, queries: Span, keys: Span) -> list[Block]:
    """Queries against keys that all lie before them: only the document that
    holds both the last key and the first query is seen, as one rectangle of
    the first queries and last keys in each batch row, with no mask."""
    (row, q_start, q_len), (col, k_start, k_len) = queries, keys
    ids = docs.cpu
    shared = ids[:, q_start] == ids[:, k_start + k_len - 1]
    seen_queries = (ids[:, q_start:q_start + q_len] == ids[:, q_start:q_start + 1]).sum(1)
    seen_keys = (ids[:, k_start:k_start + k_len] == ids[:, k_start + k_len - 1:k_start + k_len]).sum(1)
    sizes = list(zip((seen_queries * shared).tolist(), (seen_keys * shared).tolist()))
    return [(rows, row, row + n_q, col + k_len - n_k, col + k_len, False, None)
            for rows, (n_q, n_k) in _row_groups(sizes) if n_q]


def _diagonal_blocks(docs: _Documents, queries: Span, col: int) -> list[Block]:
    """Queries against the same positions, causal: one causal block per
    document, or one masked block where that would be many small calls."""
    row, start, length = queries
    ids = docs.cpu[:, start:start + length]
    runs = [tuple(torch.unique_consecutive(r, return_counts=True)[1].tolist()) for r in ids]
    groups = _row_groups(runs)
    calls = sum(len(lengths) for _, lengths in groups)
    area = MASKED_BLOCK_AREA.get(docs.device.type)
    area = MASKED_BLOCK_AREA["cuda"] if area is None else area   # other accelerators as CUDA
    if calls > 1 and calls * area > length * length:
        local = docs.on_device[:, start:start + length]
        mask = (local.unsqueeze(-1) == local.unsqueeze(-2)).unsqueeze(1)
        return [(slice(None), row, row + length, col, col + length, True, mask)]
    blocks = []
    for rows, lengths in groups:
        offset = 0
        for n in lengths:
            blocks.append((rows, row + offset, row + offset + n, col + offset, col + offset + n,
                           True, None))
            offset += n
    return blocks


def _document_blocks(docs: _Documents, pairs: list[tuple[Span, Span]]) -> list[Block]:
    """The blocks that compute each (queries, keys) span pair under the
    document mask. The keys of a pair are either the queries' own positions
    (causal) or lie before them or after them (nothing seen: skipped)."""
    blocks: list[Block] = []
    for queries, keys in pairs:
        if keys[1] == queries[1]:
            blocks += _diagonal_blocks(docs, queries, keys[0])
        elif keys[1] + keys[2] <= queries[1]:
            blocks += _earlier_blocks(docs, queries, keys)
    return blocks


def _chunk_spans(rank: int, size: int, half: int) -> list[Span]:
    """A rank's two chunks as spans of its local rows."""
    return [(0, rank * half, half), (half, (2 * size - 1 - rank) * half, half)]


def _ring_blocks(rank: int, source: int, size: int, half: int, docs: _Documents | None,
                 window: _Window | None = None) -> list[Block] | tuple:
    """This rank's queries against context rank `source`'s key/value block
    (empty: the ring step computes nothing)."""
    pairs = [(queries, keys) for queries in _chunk_spans(rank, size, half)
             for keys in _chunk_spans(source, size, half)]
    if window is not None:
        return window.plan(pairs, docs)
    if docs is None:
        return _whole_batch(_ring_pairs(rank, source, half))
    return _document_blocks(docs, pairs)


def _whole_sequence_blocks(query_spans: list[Span], docs: _Documents | None,
                           fallback: list[Pair], window: _Window | None = None
                           ) -> list[Block] | tuple:
    """Queries (spans of their rows) against the whole sequence in natural
    order: each span against its own positions and against all before it."""
    if window is not None:
        return window.plan([(queries, (0, 0, window.seq)) for queries in query_spans], docs)
    if docs is None:
        return _whole_batch(fallback)
    pairs = []
    for queries in query_spans:
        start = queries[1]
        pairs.append((queries, (start, start, queries[2])))
        if start:
            pairs.append((queries, (0, 0, start)))
    return _document_blocks(docs, pairs)


# ------------------------------------------------------------------ sliding windows

# Query positions per block under a window: each query block visits only the
# key positions its rows' windows reach (local_attention's DEFAULT_BLOCK).
WINDOW_BLOCK = 128


def _window_masks(a: int, b: int, x: int, y: int, left: int | None, masks: dict,
                  device: torch.device) -> torch.Tensor:
    """[1, 1, b − a, y − x] bool: query position i in [a, b) sees key j in
    [x, y) iff i − L <= j <= i (absolute positions, so right for any chunk
    pair); kept by shape, since equal offsets and sizes give equal masks."""
    shape = (a - x, b - a, y - x)
    if shape not in masks:
        distance = (torch.arange(a, b, device=device).unsqueeze(-1)
                    - torch.arange(x, y, device=device).unsqueeze(0))
        seen = distance >= 0
        if left is not None:
            seen &= distance <= left
        masks[shape] = seen.view(1, 1, b - a, y - x)
    return masks[shape]


def _window_query_block(a: int, b: int, queries: Span, keys: Span, left: int | None,
                        masks: dict, device: torch.device) -> list[Block]:
    """Query positions [a, b) of span `queries` against the keys of span
    `keys` their windows reach: the keys every row sees (before a, within
    the farthest row's window) as one unmasked rectangle; the rest masked,
    or causal where it is the block's own square wholly inside the window."""
    (row, q_start, _), (col, k_start, k_len) = queries, keys
    lo = k_start if left is None else max(k_start, a - left)
    hi = min(k_start + k_len, b)
    if lo >= hi:
        return []   # every key of this span lies outside (or after) the rows' windows
    inner = (max(lo, b - 1 - left) if left is not None else lo, min(hi, a))
    parts = [(lo, hi)] if inner[0] >= inner[1] else [(lo, inner[0]), (inner[1], hi)]

    def block(x, y, causal, mask):
        return (slice(None), row + a - q_start, row + b - q_start, col + x - k_start,
                col + y - k_start, causal, mask)

    blocks = [block(*inner, False, None)] if inner[0] < inner[1] else []
    for x, y in parts:
        if x >= y:
            continue
        if (x, y) == (a, b) and (left is None or b - 1 - a <= left):
            blocks.append(block(x, y, True, None))
        else:
            blocks.append(block(x, y, False, _window_masks(a, b, x, y, left, masks, device)))
    return blocks


@functools.lru_cache(maxsize=256)
def _window_plan(pairs: tuple, left: int | None, device: torch.device) -> tuple[tuple, tuple]:
    """The Blocks of (queries, keys) span pairs under the causal window of
    left side `left`: each query span cut in WINDOW_BLOCK positions, each
    block against the keys of the pair's span its rows see; key positions
    outside every row's window are skipped (kept: the same for every layer
    and step). With them, each block's absolute (query, key) position ranges
    (a, b, x, y), for documents' masks."""
    masks: dict = {}
    blocks: list[Block] = []
    spans: list[tuple[int, int, int, int]] = []
    for queries, keys in pairs:
        (row, start, length), (col, k_start, _) = queries, keys
        for a in range(start, start + length, WINDOW_BLOCK):
            b = min(a + WINDOW_BLOCK, start + length)
            for block in _window_query_block(a, b, queries, keys, left, masks, device):
                _, r0, r1, c0, c1, _, _ = block
                blocks.append(block)
                spans.append((r0 - row + start, r1 - row + start, c0 - col + k_start,
                              c1 - col + k_start))
    return tuple(blocks), tuple(spans)


def _within_documents(blocks: tuple, spans: tuple, left: int, docs: _Documents) -> list[Block]:
    """The window's blocks cut down to each batch row's documents: a block
    no pair of which shares a document is skipped, one whose every pair in
    the window does is kept as it is, and the rest run masked by window and
    document together."""
    kept = []
    for block, (a, b, x, y) in zip(blocks, spans):
        distance = torch.arange(a, b).unsqueeze(-1) - torch.arange(x, y).unsqueeze(0)
        seen = (distance >= 0) & (distance <= left)                        # [b − a, y − x]
        ids = docs.cpu
        both = (ids[:, a:b].unsqueeze(-1) == ids[:, x:y].unsqueeze(-2)) & seen
        if not both.any():
            continue
        if bool((both == seen).all()):
            kept.append(block)
            continue
        rows, r0, r1, c0, c1, _, _ = block
        kept.append((rows, r0, r1, c0, c1, False, both.unsqueeze(1).to(docs.device)))
    return kept


class _Window:
    """A causal window of left side `left` (finite, below the sequence) over
    sequences of `seq` positions, planned on `device`."""

    def __init__(self, left: int, seq: int, device: torch.device):
        self.left, self.seq, self.device = left, seq, torch.device(device)

    def plan(self, pairs: list[tuple[Span, Span]], docs: _Documents | None = None
             ) -> tuple | list[Block]:
        blocks, spans = _window_plan(tuple(pairs), self.left, self.device)
        return blocks if docs is None else _within_documents(blocks, spans, self.left, docs)


# ------------------------------------------------------------------ sinks

def _apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None
                 ) -> torch.Tensor:
    """Adds each head's sink logit to the merged softmax's denominator: out
    scaled in place by sigmoid(lse − sink); returns lse' = logaddexp(lse,
    sink), with which the blocks' backward recomputes the sink's
    probabilities (as ptdp.parallel.local_attention)."""
    if sinks is None:
        return lse
    total = torch.logaddexp(lse, sinks.to(lse.dtype).view(1, -1, 1))
    out.mul_(torch.exp(lse - total).unsqueeze(-1))
    return total


def _sink_gradient(ctx, dout, out, lse, sinks) -> torch.Tensor | None:
    """−Σ over batch and rows of exp(sink − lse') · rowsum(dO · O): this
    rank's rows' part (the gradient reduction sums the context ranks')."""
    if sinks is None or not ctx.needs_input_grad[3]:
        return None
    acc = lse.dtype
    rows = (dout.to(acc) * out.to(acc)).sum(-1)
    return (-(torch.exp(sinks.to(acc).view(1, -1, 1) - lse) * rows).sum(dim=(0, 2))
            ).to(sinks.dtype)


def _whole_batch(pairs: list[Pair]) -> list[Block]:
    return [(slice(None), *pair, None) for pair in pairs]


def _forward_blocks(q, k, v, blocks, scale, kernel, out, lse) -> None:
    for rows, q0, q1, k0, k1, causal, mask in blocks:
        block_out, block_lse = block_forward(q[rows, :, q0:q1], k[rows, :, k0:k1],
                                             v[rows, :, k0:k1], causal, scale, kernel, mask)
        merge_into(out[rows, :, q0:q1], lse[rows, :, q0:q1], block_out, block_lse)


def _backward_blocks(dout, q, k, v, out, lse, blocks, scale, kernel, dq, dk, dv) -> None:
    for rows, q0, q1, k0, k1, causal, mask in blocks:
        gq, gk, gv = block_backward(dout[rows, :, q0:q1], q[rows, :, q0:q1], k[rows, :, k0:k1],
                                    v[rows, :, k0:k1], out[rows, :, q0:q1], lse[rows, :, q0:q1],
                                    causal, scale, kernel, mask)
        dq[rows, :, q0:q1] += gq
        dk[rows, :, k0:k1] += gk
        dv[rows, :, k0:k1] += gv


def _empty_result(q):
    """The running (output, LSE) of q's rows. The output is stored [s, b,
    heads, d] and viewed [b, heads, s, d]: the layer's output projection
    takes it as [s, b, heads·d] without a copy, so the output saved here and
    the projection's saved input are one storage (as with one rank's kernel)."""
    acc = accumulation_dtype(q.dtype)
    b, heads, s, d = q.shape
    out = torch.zeros(s, b, heads, d, dtype=acc, device=q.device).permute(1, 2, 0, 3)
    return out, torch.full(q.shape[:3], -math.inf, dtype=acc, device=q.device)


class _LocalAttention(torch.autograd.Function):
    """Attention of q over (k, v) made of the given blocks, no communication."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, blocks, scale, kernel):
        out, lse = _empty_result(q)
        _forward_blocks(q, k, v, blocks, scale, kernel, out, lse)
        lse = _apply_sinks(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.blocks, ctx.scale, ctx.kernel = blocks, scale, kernel
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        acc = accumulation_dtype(q.dtype)
        dq, dk, dv = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (q, k, v))
        _backward_blocks(dout, q, k, v, out, lse, ctx.blocks, ctx.scale, ctx.kernel, dq, dk, dv)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                _sink_gradient(ctx, dout, out, lse, sinks), None, None, None)


# ------------------------------------------------------------------ p2p: the ring

class _Shift:
    """One step of the ring in flight: `tensor` to the next rank, the
    previous rank's into a new buffer; `wait()` returns that buffer."""

    def __init__(self, tensor: torch.Tensor, ring: "_Ring", tag: int):
        self.sent, self.received = tensor, torch.empty_like(tensor)
        self.works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, tensor, ring.next, ring.group, tag),
            dist.P2POp(dist.irecv, self.received, ring.previous, ring.group, tag)])

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.received


class _Ring:
    def __init__(self, group: Any):
        self.group = group
        self.size, self.rank = _group_size_rank(group)
        if self.size > 1:
            ranks = dist.get_process_group_ranks(group)   # peers by global rank
            self.next = ranks[(self.rank + 1) % self.size]
            self.previous = ranks[(self.rank - 1) % self.size]

    def shift(self, tensor: torch.Tensor, tag: int) -> _Shift:
        return _Shift(tensor.contiguous(), self, tag)


_KEY_VALUES, _GRADIENTS = 0, 1   # message tags: the two streams around the ring


class _RingAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, sinks, group, scale, kernel, docs, window):
        ring = _Ring(group)
        half = q.shape[2] // 2
        out, lse = _empty_result(q)
        kv = torch.stack([k, v])
        for step in range(ring.size):
            coming = ring.shift(kv, _KEY_VALUES) if step + 1 < ring.size else None
            blocks = _ring_blocks(ring.rank, (ring.rank - step) % ring.size, ring.size, half, docs,
                                  window)
            _forward_blocks(q, kv[0], kv[1], blocks, scale, kernel, out, lse)
            if coming is not None:
                kv = coming.wait()
        lse = _apply_sinks(out, lse, sinks)   # once, on the merge of every step
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.group, ctx.scale, ctx.kernel, ctx.docs = group, scale, kernel, docs
        ctx.window = window
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        ring = _Ring(ctx.group)
        half = q.shape[2] // 2
        acc = accumulation_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v])
        gradients_coming = None
        for step in range(ring.size):
            coming = ring.shift(kv, _KEY_VALUES) if step + 1 < ring.size else None
            dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
            blocks = _ring_blocks(ring.rank, (ring.rank - step) % ring.size, ring.size, half,
                                  ctx.docs, ctx.window)
            _backward_blocks(dout, q, kv[0], kv[1], out, lse, blocks, ctx.scale, ctx.kernel,
                            dq, dkv[0], dkv[1])
            if gradients_coming is not None:
                # The previous rank's sums for the block in hand, one step behind it.
                dkv += gradients_coming.wait()
            gradients_coming = ring.shift(dkv, _GRADIENTS) if ring.size > 1 else None
            if coming is not None:
                kv = coming.wait()
        # After the last step the sums for this rank's own block arrive.
        dkv = gradients_coming.wait() if gradients_coming is not None else dkv
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype),
                _sink_gradient(ctx, dout, out, lse, sinks), None, None, None, None, None)


# ------------------------------------------------------------------ all_gather

def _all_gather_attention(q, k, v, sinks, group, scale, kernel, docs, window):
    size, rank = _group_size_rank(group)
    seq = q.shape[2] * size
    kv = torch.stack([k, v]).permute(3, 0, 1, 2, 4)             # [s/c, 2, b, groups, d]
    whole = gather_from_sequence_region(kv, group)              # ranks' pieces one after another
    whole = whole.index_select(0, natural_order(seq, size, q.device)).permute(1, 2, 3, 0, 4)
    half = q.shape[2] // 2
    blocks = _whole_sequence_blocks(_chunk_spans(rank, size, half), docs,
                                    _gathered_pairs(rank, size, half), window)
    return _LocalAttention.apply(q, whole[0], whole[1], sinks, blocks, scale, kernel)


# ------------------------------------------------------------------ a2a (Ulysses)

def _sequence_to_heads(x, group, size, order):
    """[..., n, s/c, d] (this rank's piece, all n heads) -> [..., n/c, s, d]
    (this rank's n/c heads, whole sequences in natural order)."""
    n = x.shape[-3]
    parts = [n // size] * size
    y = all_to_all(x.movedim(-3, 0), parts, parts, group)       # rank j's piece of my heads
    y = y.unflatten(0, (size, n // size)).movedim(0, -3).flatten(-3, -2)
    return y.index_select(-2, order).movedim(0, -3)


def _heads_to_sequence(x, group, size, layout):
    """The inverse of `_sequence_to_heads`."""
    n = x.shape[-3] * size
    parts = [n // size] * size
    y = x.index_select(-2, layout).movedim(-3, 0)
    y = y.unflatten(-2, (size, -1)).movedim(-3, 0).flatten(0, 1)
    return all_to_all(y, parts, parts, group).movedim(0, -3)


def _a2a_attention(q, k, v, sinks, group, scale, kernel, docs, window):
    size, rank = _group_size_rank(group)
    check_a2a_heads(q.shape[1], k.shape[1], size)
    seq = q.shape[2] * size
    order = natural_order(seq, size, q.device)
    whole_q = _sequence_to_heads(q, group, size, order)
    whole_kv = _sequence_to_heads(torch.stack([k, v]), group, size, order)
    # With documents the sequence is taken in the 2c chunks of the layout, so
    # that a masked block (many small documents) is at most a chunk square.
    half = q.shape[2] // 2
    chunks = [(start, start, half) for start in range(0, seq, half)]
    blocks = _whole_sequence_blocks(chunks, docs, [(0, seq, 0, seq, True)], window)
    if sinks is not None:   # this rank's heads: the rank-th of the c parts
        heads = whole_q.shape[1]
        sinks = sinks[rank * heads:(rank + 1) * heads]
    out = _LocalAttention.apply(whole_q, whole_kv[0], whole_kv[1], sinks, blocks, scale, kernel)
    return _heads_to_sequence(out, group, size, layout_order(seq, size, q.device))


# ------------------------------------------------------------------ entry point

def _check_inputs(q, k, v, comm_type, dropout_p):
    if comm_type not in COMM_TYPES:
        raise ValueError(f"unknown --cp-comm-type {comm_type!r}; use one of "
                         f"{', '.join(COMM_TYPES)}")
    if dropout_p:
        raise ValueError(f"attention dropout ({dropout_p}) is not supported with context "
                         f"parallelism; set --attention-dropout 0")
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"context attention takes q [b, heads, s, d] and k, v [b, groups, s, "
                         f"d]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    (b, heads, s, d), (kb, groups, ks, kd) = q.shape, k.shape
    if (kb, ks, kd) != (b, s, d) or heads % groups:
        raise ValueError(f"k, v {tuple(k.shape)} do not match q {tuple(q.shape)}: same batch, "
                         f"positions and head size, and key/value groups dividing the heads")
    if s % 2:
        raise ValueError(f"each context rank holds two equal chunks, so its positions must be "
                         f"even; got {s}")


def _check_documents(document_ids, q, size):
    b, seq = q.shape[0], q.shape[2] * size
    shape = tuple(document_ids.shape)
    if document_ids.dim() not in (1, 2) or shape[-1] != seq or \
            (document_ids.dim() == 2 and shape[0] not in (1, b)) or \
            document_ids.is_floating_point():
        raise ValueError(f"document_ids must be integer ids of the whole sequence in natural "
                         f"order, [{b}, {seq}] (batch by {size} context ranks × {q.shape[2]} "
                         f"local positions), the same tensor on every context rank; got "
                         f"{document_ids.dtype} {shape}")


def window_left(window: tuple[int, int] | None) -> int | None:
    """L of a causal window (L, 0), None where the left side is unbounded
    (window None or L = −1); ValueError for a window causal attention cannot
    take."""
    if window is None:
        return None
    if len(window) != 2 or not all(isinstance(n, int) for n in window):
        raise ValueError(f"a window is two integers (L, R), as --window-size L,R; got {window!r}")
    left, right = window
    if right != 0:
        raise ValueError(f"the attention is causal, so a window's right side R must be 0; got "
                         f"window ({left}, {right}): use --window-size {left},0")
    if left < -1:
        raise ValueError(f"a window's left side L is the number of earlier keys a query sees "
                         f"(0 or more), or -1 for all of them; got {left}")
    return None if left == -1 else left


def _window_and_sinks(window, sinks, q, size) -> _Window | None:
    """The checked window (None where it bounds nothing); ValueError for
    sinks of the wrong shape."""
    left, seq = window_left(window), q.shape[2] * size
    if sinks is not None and tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"sinks are one logit per attention head of this rank, "
                         f"[{q.shape[1]}]; got {tuple(sinks.shape)} (None for the vanilla "
                         f"softmax)")
    if left is None or left >= seq - 1:
        return None   # every earlier key is in the window: plain causal attention
    return _Window(left, seq, q.device)


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any,
                      comm_type: str = "p2p", *, scale: float | None = None,
                      dropout_p: float = 0.0, kernel: str = "auto",
                      document_ids: torch.Tensor | None = None,
                      window: tuple[int, int] | None = None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention over sequences split across the context group.

    q [b, heads, s/c, d], k and v [b, groups, s/c, d]: this rank's two chunks
    (context_layout.split_sequence), heads a multiple of groups. `group` is
    the context group (its rank order is the context rank; None is one
    rank). `scale` defaults to 1/sqrt(d). `kernel`: "auto" (see
    block_kernel) or a name of KERNELS. `document_ids`: packed documents,
    integer ids [b, s] (or [s] for every row) of the WHOLE sequence in
    natural order, the same on every context rank; a document is a run of
    equal consecutive ids, and a query sees only the earlier keys of its own
    document. `window` (L, 0): query i sees keys i − L..i (as
    ptdp.parallel.local_attention; within each document with document_ids);
    `sinks` [heads]:
    a logit per head of q added to the softmax's denominator (under a2a each
    rank applies its part of them). Returns [b, heads, s/c, d] in q's dtype,
    differentiable in q, k, v and sinks."""
    _check_inputs(q, k, v, comm_type, dropout_p)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    kernel = resolve_kernel(kernel, q)
    size = _group_size_rank(group)[0]
    docs = None
    if document_ids is not None:
        _check_documents(document_ids, q, size)
        docs = _Documents(document_ids, q.shape[0], q.device)
    local = _window_and_sinks(window, sinks, q, size)
    if comm_type == "p2p":
        return _RingAttention.apply(q, k, v, sinks, group, scale, kernel, docs, local)
    if comm_type == "all_gather":
        return _all_gather_attention(q, k, v, sinks, group, scale, kernel, docs, local)
    return _a2a_attention(q, k, v, sinks, group, scale, kernel, docs, local)
