"""Each tensor-parallel layer equals its one-process counterpart, forward and
backward, for t in {2, 4} (fp32 on CPU).

Tolerance: the parallel layers split matrix products and sum the partial
results with an all-reduce, which reorders floating-point additions; values
agree to rounding (rtol 1e-5, atol 1e-6 on O(1) values).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from ptdp.parallel.sharding import SHARD_ATTR, TensorShard, gather_logical, shard, unshard
from ptdp.parallel.tensor import (
    ColumnParallelLinear,
    RNGStreams,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tensor_region,
    gather_from_tensor_region,
    reduce_from_tensor_region,
    scatter_to_tensor_region,
    vocab_parallel_cross_entropy,
)
from ptdp.parallel.topology import ParallelContext, RankGrid

TOL = dict(rtol=1e-5, atol=1e-6)
TP_SIZES = [2, 4]


def _tp_context(t: int) -> ParallelContext:
    return ParallelContext.build(RankGrid(tp=t, dp=1, pp=1))


def _split_last(x: torch.Tensor, ctx: ParallelContext, blocks: int = 1) -> torch.Tensor:
    return shard(x, TensorShard(dim=x.ndim - 1, parts=ctx.tp_size, index=ctx.tp_rank, blocks=blocks))


# --- f, g and the gather/scatter pair ------------------------------------------

def _conjugate_ops(rank, t):
    ctx = _tp_context(t)
    g = ctx.tp_group
    x = torch.full((3,), float(rank + 1), requires_grad=True)
    # f: identity forward; backward sums the gradients of all ranks.
    y = copy_to_tensor_region(x, g)
    assert_close(y, x)
    (y * (rank + 1)).sum().backward()
    assert_close(x.grad, torch.full((3,), float(sum(range(1, t + 1)))))

    # g: sums forward; backward passes the gradient through unchanged.
    x = torch.full((3,), float(rank + 1), requires_grad=True)
    y = reduce_from_tensor_region(x * 1.0, g)
    assert_close(y, torch.full((3,), float(sum(range(1, t + 1)))))
    (y * (rank + 1)).sum().backward()
    assert_close(x.grad, torch.full((3,), float(rank + 1)))

    # gather / scatter along the last dimension are each other's inverse.
    full = torch.arange(4.0 * t).reshape(2, 2 * t).requires_grad_()
    part = scatter_to_tensor_region(full, g)
    assert_close(part, full.detach().chunk(t, -1)[rank])
    back = gather_from_tensor_region(part, g)
    assert_close(back, full.detach())
    back.sum().backward()
    assert_close(full.grad, torch.ones_like(full))  # each rank's own slice, gathered


@pytest.mark.parametrize("t", TP_SIZES)
def test_f_and_g_are_conjugate(pools, t):
    pools(t).run(_conjugate_ops, t)


# --- column- and row-parallel linear -------------------------------------------

def _column_parallel(rank, t, blocks, gather_output):
    ctx = _tp_context(t)
    torch.manual_seed(0)
    reference = nn.Linear(16, 6 * t * blocks)
    x = torch.randn(5, 3, 16)
    grad_out = torch.randn(5, 3, 6 * t * blocks)

    layer = ColumnParallelLinear(16, 6 * t * blocks, ctx, blocks=blocks, gather_output=gather_output)
    spec = getattr(layer.weight, SHARD_ATTR)
    with torch.no_grad():
        layer.weight.copy_(shard(reference.weight, spec))
        layer.bias.copy_(shard(reference.bias, spec))

    x_ref, x_par = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y_par = reference(x_ref), layer(x_par)
    y_ref.backward(grad_out)
    if gather_output:
        assert_close(y_par, y_ref, **TOL)
        y_par.backward(grad_out)
    else:
        assert_close(y_par, _split_last(y_ref, ctx, blocks), **TOL)
        y_par.backward(_split_last(grad_out, ctx, blocks))
    assert_close(x_par.grad, x_ref.grad, **TOL)
    assert_close(gather_logical(layer.weight.grad, spec, ctx.tp_group), reference.weight.grad, **TOL)
    assert_close(gather_logical(layer.bias.grad, spec, ctx.tp_group), reference.bias.grad, **TOL)


@pytest.mark.parametrize("t", TP_SIZES)
@pytest.mark.parametrize("blocks,gather_output", [(1, False), (1, True), (3, False)])
def test_column_parallel_linear_matches_linear(pools, t, blocks, gather_output):
    pools(t).run(_column_parallel, t, blocks, gather_output)


def _row_parallel(rank, t, input_is_parallel, skip_bias_add):
    ctx = _tp_context(t)
    torch.manual_seed(1)
    reference = nn.Linear(4 * t, 10)
    x = torch.randn(5, 3, 4 * t)
    grad_out = torch.randn(5, 3, 10)

    layer = RowParallelLinear(4 * t, 10, ctx, input_is_parallel=input_is_parallel,
                              skip_bias_add=skip_bias_add)
    spec = getattr(layer.weight, SHARD_ATTR)
    assert not hasattr(layer.bias, SHARD_ATTR)  # replicated, added after the reduction
    with torch.no_grad():
        layer.weight.copy_(shard(reference.weight, spec))
        layer.bias.copy_(reference.bias)

    x_ref = x.clone().requires_grad_()
    x_par = (_split_last(x, ctx) if input_is_parallel else x.clone()).requires_grad_()
    y_ref = reference(x_ref)
    y_ref.backward(grad_out)
    out = layer(x_par)
    if skip_bias_add:
        y_par, bias = out   # bias None: already added (no kernel fusion on this device)
        y_par = y_par + bias if bias is not None else y_par
    else:
        y_par = out
    assert_close(y_par, y_ref, **TOL)
    y_par.backward(grad_out)
    expected_x_grad = _split_last(x_ref.grad, ctx) if input_is_parallel else x_ref.grad
    assert_close(x_par.grad, expected_x_grad, **TOL)
    assert_close(gather_logical(layer.weight.grad, spec, ctx.tp_group), reference.weight.grad, **TOL)
    assert_close(layer.bias.grad, reference.bias.grad, **TOL)


@pytest.mark.parametrize("t", TP_SIZES)
@pytest.mark.parametrize("input_is_parallel,skip_bias_add", [(True, False), (False, False), (True, True)])
def test_row_parallel_linear_matches_linear(pools, t, input_is_parallel, skip_bias_add):
    pools(t).run(_row_parallel, t, input_is_parallel, skip_bias_add)


# --- vocabulary-parallel embedding and cross entropy ---------------------------

VOCAB, PADDED = 50, 64  # padded to a multiple of 16·t: rows 50..63 are padding


def _vocab_parallel(rank, t):
    ctx = _tp_context(t)
    torch.manual_seed(2)
    table = torch.randn(VOCAB, 8)
    tokens = torch.randint(0, VOCAB, (3, 7))
    tokens[0, :3] = torch.tensor([0, VOCAB - 1, PADDED // t])  # edges of the shards

    embedding = VocabParallelEmbedding(VOCAB, PADDED, 8, ctx)
    spec = getattr(embedding.weight, SHARD_ATTR)
    with torch.no_grad():
        embedding.weight.copy_(shard(table, spec))
    assert embedding.weight.shape == (PADDED // t, 8)
    reference = table.clone().requires_grad_()
    grad_out = torch.randn(3, 7, 8)
    out = embedding(tokens)
    assert_close(out, F.embedding(tokens, reference), **TOL)
    out.backward(grad_out)
    F.embedding(tokens, reference).backward(grad_out)
    # The logical gradient has the unpadded shape; the padding rows get none.
    assert_close(gather_logical(embedding.weight.grad, spec, ctx.tp_group), reference.grad, **TOL)
    full_grad = torch.cat([p for p in _all_gather(embedding.weight.grad, ctx)])
    assert full_grad[VOCAB:].abs().max() == 0

    # Cross entropy on split logits, padding masked, equals F.cross_entropy on
    # the unpadded logits; the padding never changes loss or gradient.
    logits = torch.randn(7, 3, VOCAB)
    target = torch.randint(0, VOCAB, (7, 3))
    target[0, 0], target[1, 0] = 0, VOCAB - 1
    ref_logits = logits.clone().requires_grad_()
    ref_loss = F.cross_entropy(ref_logits.reshape(-1, VOCAB), target.reshape(-1), reduction="none")
    padded = torch.cat([logits, torch.randn(7, 3, PADDED - VOCAB) * 100], dim=-1)  # junk padding
    local = embedding.mask_padding(padded.chunk(t, dim=-1)[rank].clone()).requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, embedding.vocab_start, ctx.tp_group)
    assert_close(loss.reshape(-1), ref_loss, **TOL)
    weights = torch.rand(7, 3)
    (ref_loss.reshape(7, 3) * weights).sum().backward()
    (loss * weights).sum().backward()
    grad = torch.cat(_all_gather(local.grad, ctx), dim=-1)
    assert_close(grad[..., :VOCAB], ref_logits.grad, **TOL)
    assert grad[..., VOCAB:].abs().max() == 0


def _all_gather(x, ctx):
    parts = [torch.empty_like(x) for _ in range(ctx.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=ctx.tp_group)
    return parts


@pytest.mark.parametrize("t", TP_SIZES)
def test_vocab_parallel_embedding_and_cross_entropy(pools, t):
    pools(t).run(_vocab_parallel, t)


def test_cross_entropy_one_rank_matches_torch():
    logits = torch.randn(4, 2, 11, requires_grad=True)
    target = torch.randint(0, 11, (4, 2))
    ours = vocab_parallel_cross_entropy(logits, target, 0, None)
    ref = F.cross_entropy(logits.detach().reshape(-1, 11), target.reshape(-1), reduction="none")
    assert_close(ours.reshape(-1), ref, **TOL)


# --- sharding helpers -----------------------------------------------------------

@pytest.mark.parametrize("parts", [1, 2, 4])
@pytest.mark.parametrize("dim,blocks,logical,padded", [(0, 1, None, None), (1, 1, None, None),
                                                        (0, 3, None, None), (0, 1, 10, 16)])
def test_shard_unshard_round_trip(parts, dim, blocks, logical, padded):
    shape = [12, 8]
    if logical:
        shape[dim] = logical
    full = torch.arange(float(shape[0] * shape[1])).reshape(shape)
    specs = [TensorShard(dim, parts, i, blocks, logical, padded) for i in range(parts)]
    pieces = [shard(full, s) for s in specs]
    assert_close(unshard(pieces, specs[0]), full)
    assert specs[0].logical_shape(pieces[0].shape) == tuple(full.shape)
    if blocks == 3:  # q, k, v blocks: each rank holds a slice of each block
        for i, piece in enumerate(pieces):
            for b, block in enumerate(piece.chunk(3, dim=0)):
                assert_close(block, full.chunk(3, dim=0)[b].chunk(parts, dim=0)[i])


# --- random streams for dropout -------------------------------------------------

def _dropout_streams(rank, t):
    ctx = _tp_context(t)
    streams = RNGStreams(torch.device("cpu"))
    streams.seed(1234, ctx)
    replicated = F.dropout(torch.ones(1000), p=0.5)
    with streams.fork("tensor"):
        in_region = F.dropout(torch.ones(1000), p=0.5)
    after = F.dropout(torch.ones(1000), p=0.5)
    # Re-seeding reproduces the replicated stream untouched by the fork.
    streams.seed(1234, ctx)
    again = F.dropout(torch.ones(1000), p=0.5)
    again_after = F.dropout(torch.ones(1000), p=0.5)
    return replicated, in_region, after, again, again_after


@pytest.mark.parametrize("t", TP_SIZES)
def test_dropout_streams_across_tensor_ranks(pools, t):
    results = pools(t).run(_dropout_streams, t)
    replicated = [r[0] for r in results]
    in_region = [r[1] for r in results]
    for rank in range(1, t):
        # Replicated activations: the same elements dropped on every tensor rank.
        assert torch.equal(replicated[rank], replicated[0])
        assert torch.equal(results[rank][2], results[0][2])
        # Inside a tensor-parallel region: each rank its own mask.
        for other in range(rank):
            assert not torch.equal(in_region[rank], in_region[other])
    for r in results:
        assert not torch.equal(r[0], r[1])
        # The fork does not advance the default stream.
        assert torch.equal(r[0], r[3]) and torch.equal(r[2], r[4])
