"""Causal attention over packed documents (ptdp.parallel.document_attention):
the per-document path, the dense block-diagonal mask and FlexAttention's
forward (where this torch runs it on CPU) all equal each document run alone
through plain causal attention, outputs and q/k/v gradients, in fp32 at the
context-parallel tests' tolerance; attention across documents is shown to
differ, so the comparison can fail."""

import pytest
import torch
import torch.nn.functional as F

from ptdp.parallel.document_attention import (
    DENSE,
    DOCUMENT_KERNELS,
    FLEX,
    PER_DOCUMENT,
    document_attention_lse,
    document_causal_attention,
    document_ids_from_cu_seqlens,
    document_kernel,
    flex_available,
    segment_ids,
)

TOLERANCE = dict(atol=1e-5, rtol=1e-5)
PADDING = -1
# name -> (heads, groups, per-row document lengths; PADDING marks a padding tail)
CASES = {
    "mha": (2, 2, [[5, 9, 3, 7], [11, 13]]),
    "gqa": (4, 2, [[6, 6, 6, 6], [1, 10, 13]]),
    "padding": (2, 1, [[7, 4, (PADDING, 13)], [9, 9, (PADDING, 6)]]),
    "single-document": (2, 2, [[24], [24]]),
    "length-one": (2, 2, [[1, 1, 1, 5, 1, 15], [1] * 24]),
}
SEQ, HEAD_DIM = 24, 8


def _ids(rows):
    """[b, s] int32 document ids: 0, 0, 1, ...; a padding tail gets -1."""
    result = []
    for row in rows:
        ids = []
        for number, length in enumerate(row):
            ids += [PADDING] * length[1] if isinstance(length, tuple) else [number] * length
        assert len(ids) == SEQ
        result.append(ids)
    return torch.tensor(result, dtype=torch.int32)


def _inputs(heads, groups, batch=2, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, n, SEQ, HEAD_DIM, generator=generator)
                 for n in (heads, groups, groups, heads))


def _grads(function, q, k, v, dout):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = function(q, k, v)
    out.backward(dout)
    return (out.detach(), q.grad, k.grad, v.grad)


def _alone(q, k, v, ids):
    """Each document sliced out and run alone through plain causal attention."""
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    seg = segment_ids(ids)
    rows = []
    for row in range(q.shape[0]):
        parts = []
        for number in seg[row].unique_consecutive().tolist():
            where = (seg[row] == number).nonzero().flatten()
            cols = slice(int(where[0]), int(where[-1]) + 1)
            parts.append(F.scaled_dot_product_attention(
                q[row:row + 1, :, cols], k[row:row + 1, :, cols], v[row:row + 1, :, cols],
                is_causal=True, **gqa))
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows)


def _assert_all_close(got, expected):
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected):
        torch.testing.assert_close(a, b, **TOLERANCE, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("case", CASES)
def test_per_document_and_dense_equal_each_document_alone(case):
    heads, groups, rows = CASES[case]
    ids = _ids(rows)
    q, k, v, dout = _inputs(heads, groups)
    expected = _grads(lambda q, k, v: _alone(q, k, v, ids), q, k, v, dout)
    for kernel in (PER_DOCUMENT, DENSE):
        got = _grads(lambda q, k, v, kernel=kernel: document_causal_attention(q, k, v, ids,
                                                                          kernel=kernel),
                     q, k, v, dout)
        _assert_all_close(got, expected)


def test_single_document_is_plain_causal_attention():
    q, k, v, dout = _inputs(2, 2)
    ids = torch.zeros(SEQ, dtype=torch.int32)
    expected = _grads(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                      q, k, v, dout)
    for kernel in (PER_DOCUMENT, DENSE):
        got = _grads(lambda q, k, v, kernel=kernel: document_causal_attention(q, k, v, ids,
                                                                          kernel=kernel),
                     q, k, v, dout)
        _assert_all_close(got, expected)


def test_attention_across_documents_differs():
    """Plain causal attention over the whole pack lets later documents see
    earlier ones: the comparison above would catch a kernel that did so."""
    heads, groups, rows = CASES["mha"]
    ids = _ids(rows)
    q, k, v, _ = _inputs(heads, groups)
    across = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    expected = _alone(q, k, v, ids)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(across, expected, **TOLERANCE)
    # The first document of each row is untouched by the others: only the later ones differ.
    torch.testing.assert_close(across[0, :, :5], expected[0, :, :5], **TOLERANCE)


def test_cu_seqlens_equals_document_ids():
    q, k, v, _ = _inputs(2, 1, batch=1)
    cu = torch.tensor([0, 3, 4, 12, 24], dtype=torch.int32)
    ids = document_ids_from_cu_seqlens(cu, SEQ)
    assert ids.tolist() == [0] * 3 + [1] + [2] * 8 + [3] * 12
    torch.testing.assert_close(document_causal_attention(q, k, v, cu_seqlens=cu),
                               _alone(q, k, v, ids.unsqueeze(0)), **TOLERANCE)
    with pytest.raises(ValueError, match="rise from 0"):
        document_causal_attention(q, k, v, cu_seqlens=torch.tensor([0, 5, 20]))
    with pytest.raises(ValueError, match="exactly one"):
        document_causal_attention(q, k, v)


def test_repeated_id_after_another_document_is_a_new_document():
    q, k, v, _ = _inputs(2, 2, batch=1)
    ids = torch.tensor([[0] * 8 + [1] * 8 + [0] * 8], dtype=torch.int32)
    renumbered = torch.tensor([[0] * 8 + [1] * 8 + [2] * 8], dtype=torch.int32)
    for kernel in (PER_DOCUMENT, DENSE):
        torch.testing.assert_close(document_causal_attention(q, k, v, ids, kernel=kernel),
                                   _alone(q, k, v, renumbered), **TOLERANCE)


def test_log_sum_exp_variant():
    heads, groups, rows = CASES["gqa"]
    ids = _ids(rows)
    q, k, v, _ = _inputs(heads, groups)
    out, lse = document_attention_lse(q, k, v, ids)
    torch.testing.assert_close(out, _alone(q, k, v, ids), **TOLERANCE)
    seg = segment_ids(ids)
    allowed = (seg.unsqueeze(-1) == seg.unsqueeze(-2)) & torch.ones(SEQ, SEQ).tril().bool()
    k_full = k.repeat_interleave(heads // groups, dim=1)
    scores = (q @ k_full.transpose(-1, -2) * HEAD_DIM ** -0.5).masked_fill(
        ~allowed.unsqueeze(1), float("-inf"))
    torch.testing.assert_close(lse, scores.logsumexp(-1), **TOLERANCE)


@pytest.mark.skipif(not flex_available("cpu"), reason="this torch has no FlexAttention")
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_forward_on_cpu():
    """FlexAttention's eager forward runs on the CPU build (not its backward):
    the document block mask gives the same outputs."""
    heads, groups, rows = CASES["padding"]
    ids = _ids(rows)
    q, k, v, _ = _inputs(heads, groups)
    with torch.no_grad():
        try:
            got = document_causal_attention(q, k, v, ids, kernel=FLEX)
        except (NotImplementedError, RuntimeError) as error:  # a CPU build without it
            pytest.skip(f"FlexAttention does not run on this CPU build: {error}")
    torch.testing.assert_close(got, _alone(q, k, v, ids), **TOLERANCE)


def test_kernel_choice_and_names():
    assert document_kernel("cpu") == PER_DOCUMENT
    assert document_kernel("cpu", dropout=0.1) == PER_DOCUMENT
    assert set(DOCUMENT_KERNELS) == {PER_DOCUMENT, FLEX, DENSE}
    q, k, v, _ = _inputs(2, 2, batch=1)
    with pytest.raises(ValueError, match="unknown document attention kernel"):
        document_causal_attention(q, k, v, torch.zeros(SEQ), kernel="ring")
    with pytest.raises(ValueError, match="no attention dropout"):
        document_causal_attention(q, k, v, torch.zeros(SEQ), kernel=FLEX, dropout=0.1)
