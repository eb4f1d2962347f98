"""Context parallelism's attention (issue 28): the load-balanced chunk layout
against hand-worked examples, and causal attention across 2 and 4 context
ranks with each --cp-comm-type (p2p, all_gather, a2a) against
torch.nn.functional.scaled_dot_product_attention over the whole sequence on
one process: output and the gradients of q, k and v, fp32, within 1e-5.

One call of a 4-rank pool computes every case: c = 4 over all ranks, and
c = 2 over the strided groups {0, 2} and {1, 3} (context groups are not
contiguous once tensor parallelism is innermost), so the ring's peers must
be found by their global ranks.
"""

import functools
import math
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ptdp.parallel import context_attention as context_module
from ptdp.parallel.block_attention import block_backward, block_forward, block_kernel, merge_into
from ptdp.parallel.context_attention import (COMM_TYPES, KERNEL_OPS, check_a2a_heads,
                                             context_attention)
from ptdp.parallel.context_layout import (check_sequence_length, join_sequence, layout_order,
                                          natural_order, rank_positions, split_sequence)
from ptdp.parallel.document_attention import dense_masked_attention

TOLERANCE = dict(atol=1e-5, rtol=1e-5)
# (name, batch, heads, groups, seq, head_dim, kernel)
SMALL = [(f"{shape}-{kernel}", 2, heads, groups, 32, 8, kernel)
         for shape, heads, groups in (("mha", 4, 4), ("gqa", 8, 4))
         for kernel in ("plain", "auto")]
# The acceptance: causal, s = 8192, several head shapes (kept small
# so that it stays fast on CPU), with the ring.
LONG = [("long-mha", 1, 2, 2, 8192, 16, "auto"), ("long-gqa", 1, 4, 2, 8192, 8, "auto")]

# Packed documents over s = 32 (chunks of 4 positions at c = 4, of 8 at c = 2).
# Row 0: a one-token document at 3, a document over 4..16 that crosses chunk
# and rank boundaries, id 0 again at 17..22 (a new document), 23..31. Row 1:
# other boundaries, a long document over 4..23 and six short ones at the end.
PACKED = torch.tensor([[0] * 3 + [1] + [2] * 13 + [0] * 6 + [3] * 9,
                       [7] * 2 + [8] + [7] + [9] * 20 + [1, 2, 3, 4, 5, 6] + [7] * 2])
# (name, document ids, kernel, MASKED_BLOCK_AREA): rows that differ, rows
# alike (blocks over the whole batch), both with a call per document, and
# every diagonal with several documents as one masked block.
PER_DOCUMENT = dict.fromkeys(("cpu", "cuda"), 0)
MASKED = dict.fromkeys(("cpu", "cuda"), math.inf)
DOCUMENT_CASES = [("documents", PACKED, "auto", PER_DOCUMENT),
                  ("documents-alike", PACKED[:1].expand(2, -1), "auto", PER_DOCUMENT),
                  ("documents-masked", PACKED, "plain", MASKED)]
DOCUMENT_SHAPE = (2, 8, 4, 32, 8)   # batch, heads, groups, seq, head_dim: as SMALL's gqa


def _inputs(batch, heads, groups, seq, head_dim, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seq * 1000 + heads * 10 + groups)
    q, k, v, dout = (torch.randn(batch, n, seq, head_dim, generator=generator).to(dtype)
                     for n in (heads, groups, groups, heads))
    return q, k, v, dout


@functools.lru_cache(maxsize=None)
def _reference(batch, heads, groups, seq, head_dim, dtype=torch.float32):
    q, k, v, dout = (t.float().requires_grad_() for t in
                     _inputs(batch, heads, groups, seq, head_dim, dtype))
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(heads // groups, 1),
                                         v.repeat_interleave(heads // groups, 1), is_causal=True)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


@functools.lru_cache(maxsize=None)
def _document_reference(name):
    """One process, the whole sequence: the dense block-diagonal causal mask
    (in fp64, returned as fp32)."""
    ids = next(case[1] for case in DOCUMENT_CASES if case[0] == name)
    return _dense_document_attention(_inputs(*DOCUMENT_SHAPE), ids)


def _dense_document_attention(inputs, ids):
    heads, groups = DOCUMENT_SHAPE[1:3]
    q, k, v, dout = (t.double().requires_grad_() for t in inputs)
    out = dense_masked_attention(q, k.repeat_interleave(heads // groups, 1),
                                 v.repeat_interleave(heads // groups, 1), ids)
    out.backward(dout)
    return tuple(t.float() for t in (out.detach(), q.grad, k.grad, v.grad))


def _local_run(inputs, size, rank, group, comm_type, kernel, document_ids=None):
    """This rank's (out, dq, dk, dv) pieces."""
    pieces = [split_sequence(t, size, rank, seq_dim=2).clone() for t in inputs]
    q, k, v, dout = pieces
    for t in (q, k, v):
        t.requires_grad_()
    out = context_attention(q, k, v, group, comm_type, kernel=kernel,
                            document_ids=document_ids)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _document_cases(results, size, context_rank, group):
    inputs = _inputs(*DOCUMENT_SHAPE)
    default = context_module.MASKED_BLOCK_AREA
    try:
        for name, ids, kernel, area in DOCUMENT_CASES:
            context_module.MASKED_BLOCK_AREA = area
            for comm_type in COMM_TYPES:
                results[size, name, comm_type] = (context_rank, _local_run(
                    inputs, size, context_rank, group, comm_type, kernel, ids))
    finally:
        context_module.MASKED_BLOCK_AREA = default


def _cases_on_four_ranks(rank):
    """Every case, on c = 4 (all ranks) and c = 2 (ranks {0, 2} and {1, 3})."""
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    layouts = {4: dist.group.WORLD, 2: pairs[rank % 2]}
    results, seconds = {}, {}
    try:
        for size, group in layouts.items():
            context_rank = dist.get_rank(group)
            for name, batch, heads, groups, seq, head_dim, kernel in SMALL:
                inputs = _inputs(batch, heads, groups, seq, head_dim)
                for comm_type in COMM_TYPES:
                    results[size, name, comm_type] = (context_rank, _local_run(
                        inputs, size, context_rank, group, comm_type, kernel))
            _document_cases(results, size, context_rank, group)
            inputs = _inputs(2, 4, 2, 32, 8, torch.bfloat16)
            results[size, "bf16", "p2p"] = (context_rank, _local_run(
                inputs, size, context_rank, group, "p2p", "auto"))
            for name, batch, heads, groups, seq, head_dim, kernel in LONG:
                inputs = _inputs(batch, heads, groups, seq, head_dim)
                dist.barrier(group)
                start = time.perf_counter()
                results[size, name, "p2p"] = (context_rank, _local_run(
                    inputs, size, context_rank, group, "p2p", kernel))
                seconds[size, name] = time.perf_counter() - start
        q, k, v, _ = (split_sequence(t, 4, rank, seq_dim=2) for t in _inputs(1, 6, 2, 16, 4))
        try:
            context_attention(q, k, v, dist.group.WORLD, "a2a")
            refusal = None
        except ValueError as error:
            refusal = str(error)
    finally:
        dist.barrier()
        for group in pairs:
            dist.destroy_process_group(group)
    return results, seconds, refusal, block_kernel("cpu", torch.float32, 16)


@pytest.fixture(scope="module")
def four_ranks(pools):
    start = time.perf_counter()
    answers = pools(4).run(_cases_on_four_ranks)
    wall = time.perf_counter() - start
    joined = {}
    for key in answers[0][0]:
        # c = 4: the four ranks' pieces; c = 2: each strided pair separately.
        size = key[0]
        teams = [[0, 1, 2, 3]] if size == 4 else [[0, 2], [1, 3]]
        for team in teams:
            by_context_rank = sorted((answers[r][0][key] for r in team), key=lambda a: a[0])
            joined.setdefault(key, []).append(tuple(
                join_sequence([pieces[i] for _, pieces in by_context_rank], seq_dim=2)
                for i in range(4)))
    return joined, [a[1] for a in answers], answers[0][2], answers[0][3], wall


def _assert_equal_to_one_process(got, case, **tolerance):
    _, batch, heads, groups, seq, head_dim, _ = case
    expected = _reference(batch, heads, groups, seq, head_dim)
    for team in got:
        for what, a, b in zip(("output", "dq", "dk", "dv"), team, expected):
            torch.testing.assert_close(a.float(), b, **(tolerance or TOLERANCE), msg=what)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("comm_type", COMM_TYPES)
@pytest.mark.parametrize("case", SMALL, ids=[c[0] for c in SMALL])
def test_equals_one_process(four_ranks, size, comm_type, case):
    joined = four_ranks[0]
    _assert_equal_to_one_process(joined[size, case[0], comm_type], case)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("comm_type", COMM_TYPES)
@pytest.mark.parametrize("name", [c[0] for c in DOCUMENT_CASES])
def test_packed_documents_equal_one_process(four_ranks, size, comm_type, name):
    """Output and gradients equal the dense document mask on one process,
    and differ from causal attention across documents on the same inputs."""
    joined = four_ranks[0]
    expected = _document_reference(name)
    for team, across in zip(joined[size, name, comm_type], joined[size, "gqa-auto", comm_type]):
        for what, a, b in zip(("output", "dq", "dk", "dv"), team, expected):
            torch.testing.assert_close(a, b, **TOLERANCE, msg=what)
        assert (team[0] - across[0]).abs().max() > 0.1


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("case", LONG, ids=[c[0] for c in LONG])
def test_ring_at_8192_positions(four_ranks, size, case):
    joined, seconds = four_ranks[0], four_ranks[1]
    _assert_equal_to_one_process(joined[size, case[0], "p2p"], case)
    print(f"c={size} {case[0]}: {max(s[size, case[0]] for s in seconds):.2f} s per rank")


@pytest.mark.parametrize("size", [2, 4])
def test_bf16_merges_in_fp32(four_ranks, size):
    """bf16 inputs: within bf16 rounding of fp32 attention on the same (rounded) inputs."""
    case = ("bf16", 2, 4, 2, 32, 8, "auto")
    got = four_ranks[0][size, "bf16", "p2p"]
    expected = _reference(2, 4, 2, 32, 8, torch.bfloat16)
    for team in got:
        assert team[0].dtype == torch.bfloat16 and team[1].dtype == torch.bfloat16
        for a, b in zip(team, expected):
            torch.testing.assert_close(a.float(), b, atol=2e-2, rtol=2e-2)
    assert case[0] == "bf16"


def test_a2a_refuses_heads_that_do_not_divide(four_ranks):
    assert four_ranks[2] == (
        "--cp-comm-type a2a splits the attention heads over the 4 context ranks, but 6 query "
        "heads and 2 key/value groups do not both divide by 4; use --cp-comm-type p2p or "
        "all_gather, or a --context-parallel-size of 2")


def test_cpu_runs_torch_flash_kernel(four_ranks):
    assert four_ranks[3] == "cpu_flash"
    assert KERNEL_OPS["cpu_flash"] == "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu"


# ------------------------------------------------------------------ one process

def test_chunk_layout_by_hand():
    # s = 16, c = 2: chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert rank_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert rank_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    # s = 16, c = 4: chunks of 2; rank r holds chunks r and 7 - r.
    assert [rank_positions(16, 4, r).tolist() for r in range(4)] == [
        [0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert layout_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert natural_order(8, 2).tolist() == [0, 1, 4, 5, 6, 7, 2, 3]


def test_split_and_join_by_hand():
    batch_first = torch.arange(24).view(2, 12)                   # [b, s]
    assert split_sequence(batch_first, 2, 0).tolist() == [[0, 1, 2, 9, 10, 11],
                                                           [12, 13, 14, 21, 22, 23]]
    assert split_sequence(batch_first, 2, 1).tolist() == [[3, 4, 5, 6, 7, 8],
                                                           [15, 16, 17, 18, 19, 20]]
    seq_first = torch.arange(8).view(8, 1) * 10 + torch.arange(2)  # [s, b]
    assert split_sequence(seq_first, 4, 1, seq_dim=0)[:, 0].tolist() == [10, 60]
    for x, dim, c in ((batch_first, 1, 2), (seq_first, 0, 4), (batch_first.view(2, 12, 1), -2, 3)):
        pieces = [split_sequence(x, c, r, seq_dim=dim) for r in range(c)]
        assert torch.equal(join_sequence(pieces, seq_dim=dim), x)


def test_sequence_length_must_split_into_2c_chunks():
    check_sequence_length(8192, 4)
    with pytest.raises(ValueError, match=r"sequence length 100 does not split into 2 × 4 = 8 "
                                         r"equal chunks .*; use --seq-length 96 or 104"):
        check_sequence_length(100, 4)
    with pytest.raises(ValueError, match="use --seq-length 4$"):
        split_sequence(torch.zeros(1, 3), 2, 0)


def test_refusals():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="attention dropout .* set --attention-dropout 0"):
        context_attention(q, q, q, None, dropout_p=0.1)
    with pytest.raises(ValueError, match="unknown --cp-comm-type 'ring'; use one of p2p, "
                                         "all_gather, a2a"):
        context_attention(q, q, q, None, "ring")
    with pytest.raises(ValueError, match="key/value groups dividing the heads"):
        context_attention(q, torch.zeros(1, 3, 4, 8), torch.zeros(1, 3, 4, 8), None)
    check_a2a_heads(8, 4, 4)
    with pytest.raises(ValueError, match="8 query heads and 2 key/value groups do not both "
                                         "divide by 4"):
        check_a2a_heads(8, 2, 4)


@pytest.mark.parametrize("kernel", ["plain", "auto"])
def test_one_rank_equals_torch(kernel):
    case = ("one", 2, 4, 2, 24, 8, kernel)
    inputs = _inputs(*case[1:6])
    for comm_type in COMM_TYPES:
        got = _local_run(inputs, 1, 0, None, comm_type, kernel)
        _assert_equal_to_one_process([got], case)


def test_merge_of_two_halves_equals_the_whole():
    scores = torch.randn(3, 10, dtype=torch.float64)
    values = torch.randn(10, 2, dtype=torch.float64)
    out = torch.zeros(3, 2, dtype=torch.float64)
    lse = torch.full((3,), -math.inf, dtype=torch.float64)
    for part in (slice(0, 4), slice(4, 10)):
        part_lse = scores[:, part].logsumexp(-1)
        merge_into(out, lse, (scores[:, part] - part_lse[:, None]).exp() @ values[part], part_lse)
    torch.testing.assert_close(out, scores.softmax(-1) @ values)
    torch.testing.assert_close(lse, scores.logsumexp(-1))


def test_a_fused_kernel_that_disagrees_is_not_used(monkeypatch):
    """The probe: a fused kernel whose LSE differs from plain's (here by a
    base-2 logarithm) is passed over for plain."""
    from ptdp.parallel import block_attention

    def base_two(q, k, v, causal, scale):
        out, lse = block_attention._plain_forward(q, k, v, causal, scale)
        return out, lse / math.log(2)

    monkeypatch.setitem(block_attention._FORWARD, "cpu_flash", base_two)
    block_attention._chosen.cache_clear()
    try:
        assert block_kernel("cpu", torch.float32, 12) == "plain"
    finally:
        block_attention._chosen.cache_clear()


# ------------------------------------------------------------------ packed documents, one process

def test_masked_block_row_without_keys_is_empty_not_nan():
    """A row the mask leaves no key: LSE −inf, output 0 and zero gradients,
    no NaN; the other rows as softmax over their allowed keys (GQA)."""
    generator = torch.Generator().manual_seed(3)
    q, dout = torch.randn(2, 2, 4, 4, 8, generator=generator)   # [b, heads, sq, d]
    k, v = torch.randn(2, 2, 1, 6, 8, generator=generator)      # one key/value group
    mask = torch.rand(1, 1, 4, 6, generator=generator) > 0.4
    mask[..., 0, :] = True
    mask[..., 2, :] = False
    out, lse = block_forward(q, k, v, False, 0.5, "cpu_flash", mask)
    assert torch.isneginf(lse[:, :, 2]).all() and not out.isnan().any()
    assert out[:, :, 2].abs().max() == 0
    scores = (q @ k.repeat_interleave(4, 1).transpose(-1, -2) * 0.5).masked_fill(~mask, -math.inf)
    seen = [0, 1, 3]
    torch.testing.assert_close(lse[:, :, seen], scores.logsumexp(-1)[:, :, seen])
    probs = scores[:, :, seen].softmax(-1)
    torch.testing.assert_close(out[:, :, seen], probs @ v.repeat_interleave(4, 1))
    dq, dk, dv = block_backward(dout, q, k, v, out, lse, False, 0.5, "cpu_flash", mask)
    assert not any(g.isnan().any() for g in (dq, dk, dv)) and dq[:, :, 2].abs().max() == 0


def test_document_blocks_by_hand(monkeypatch):
    """s = 32, c = 2 (chunks of 8), PACKED's row 0: documents 0..2, 3, 4..16, 17..22, 23..31."""
    docs = context_module._Documents(PACKED[:1], 1, torch.device("cpu"))
    # CPU's measured rule: chunk 2's three documents in 8 positions as one masked
    # block; two documents in 128 positions as two causal calls.
    (rows, *bounds, mask), = context_module._diagonal_blocks(docs, (8, 16, 8), 8)
    assert bounds == [8, 16, 8, 16, True] and mask.shape == (1, 1, 8, 8)
    assert mask[0, 0].int().tolist()[:3] == [[1, 0, 0, 0, 0, 0, 0, 0], [0, 1, 1, 1, 1, 1, 1, 0],
                                              [0, 1, 1, 1, 1, 1, 1, 0]]
    long_docs = context_module._Documents(torch.tensor([[0] * 100 + [1] * 28]), 1,
                                          torch.device("cpu"))
    assert [block[1:7] for block in context_module._diagonal_blocks(long_docs, (0, 0, 128), 0)] \
        == [(0, 100, 0, 100, True, None), (100, 128, 100, 128, True, None)]
    monkeypatch.setattr(context_module, "MASKED_BLOCK_AREA", PER_DOCUMENT)
    everything = slice(0, 1)
    # Rank 0 (chunks 0, 3) against rank 1 (chunks 1, 2): only chunk 3's queries see
    # earlier keys, all 8 of them the last key of chunk 2 (position 23, their document).
    assert context_module._ring_blocks(0, 1, 2, 8, docs) == [
        (everything, 8, 16, 15, 16, False, None)]
    # Rank 1 (chunks 1, 2) against rank 0: chunk 1 (8..15) sees 4..7 of chunk 0,
    # chunk 2's first row (16) too; chunk 3 is later than both.
    assert context_module._ring_blocks(1, 0, 2, 8, docs) == [
        (everything, 0, 8, 4, 8, False, None), (everything, 8, 9, 4, 8, False, None)]
    # Its own block: chunk 1 is one document (causal); chunk 2 holds three
    # (16, 17..22, 23); chunk 2 sees position 16's document 8..15 of chunk 1.
    assert context_module._ring_blocks(1, 1, 2, 8, docs) == [
        (everything, 0, 8, 0, 8, True, None), (everything, 8, 9, 0, 8, False, None),
        (everything, 8, 9, 8, 9, True, None), (everything, 9, 15, 9, 15, True, None),
        (everything, 15, 16, 15, 16, True, None)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_rank_documents_equal_dense_mask(dtype):
    inputs = _inputs(*DOCUMENT_SHAPE, dtype=dtype)
    expected = _dense_document_attention(inputs, PACKED)   # on the same (rounded) inputs
    tolerance = TOLERANCE if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for comm_type in COMM_TYPES:
        for kernel in ("plain", "auto"):
            got = _local_run(inputs, 1, 0, None, comm_type, kernel, PACKED)
            assert got[0].dtype == dtype
            for what, a, b in zip(("output", "dq", "dk", "dv"), got, expected):
                torch.testing.assert_close(a.float(), b, **tolerance, msg=what)


def test_document_ids_must_cover_the_whole_sequence():
    q = torch.zeros(2, 2, 4, 8)
    with pytest.raises(ValueError, match=r"document_ids must be integer ids of the whole "
                                         r"sequence in natural order, \[2, 4\] .* got "
                                         r"torch.int64 \(2, 3\)"):
        context_attention(q, q, q, None, document_ids=torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="got torch.float32"):
        context_attention(q, q, q, None, document_ids=torch.zeros(2, 4))
