"""The whole GPT under tensor parallelism computes what one process computes.

For t in {2, 4}: the same seed gives bitwise the same logical weights, and
the loss and every parameter's gradient equal the one-process model's (fp32
on CPU). Tolerance: all-reduces reorder floating-point sums, so values
agree to rounding, not bitwise: the loss to rtol 1e-6, gradients to rtol 1e-5
plus atol 2e-7. Observed: equal losses, gradient differences at most 9e-8
(5e-7 of the largest gradient) for t = 2 and 4.
"""

import dataclasses

import pytest
import torch
from torch.testing import assert_close

from ptdp.config import ModelConfig
from ptdp.model.fused import bias_dropout_add, bias_gelu
from ptdp.model.gpt import GPT
from ptdp.parallel.sharding import COPY_ATTR, PARTIAL_GRAD_ATTR, SHARD_ATTR, gather_logical, logical_shape
from ptdp.parallel.tensor import RNGStreams, sum_partial_grads
from ptdp.parallel.topology import ParallelContext, RankGrid

SEED = 7
# vocab 100 pads to 104 / 112 / 128 at t = 1 / 2 / 4: padding differs per layout.
SMALL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=100, make_vocab_size_divisible_by=8, hidden_dropout=0.0,
                    attention_dropout=0.0)
LOSS_TOL = dict(rtol=1e-6, atol=1e-6)
GRAD_TOL = dict(rtol=1e-5, atol=2e-7)


def _build(config, ctx):
    rng = RNGStreams(torch.device("cpu"))
    rng.seed(SEED, ctx)
    return GPT(config, ctx, rng).initialize(SEED)


def _batch(config, batch=3):
    generator = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, config.vocab_size, (batch, config.seq_length + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _serial_vs_tensor_parallel(rank, t, config, loss_mask):
    ctx = ParallelContext.build(RankGrid(tp=t, dp=1, pp=1))
    serial = _build(config, ParallelContext.single())
    parallel = _build(config, ctx)
    tokens, labels = _batch(config)
    mask = None
    if loss_mask:
        mask = (torch.arange(config.seq_length) % 3 != 0).float().expand_as(labels)
    serial_loss = serial(tokens, labels, mask)
    parallel_loss = parallel(tokens, labels, mask)
    serial_loss.backward()
    parallel_loss.backward()
    assert_close(parallel_loss, serial_loss, **LOSS_TOL)

    serial_params = dict(serial.named_parameters())
    assert set(serial_params) == {n for n, _ in parallel.named_parameters()}
    # What the gradient buffer completes after backward: a replicated weight
    # each rank uses on its own heads (--qk-layernorm) holds a partial sum.
    sum_partial_grads([p.grad for p in parallel.parameters()
                       if getattr(p, PARTIAL_GRAD_ATTR, False)], ctx.tp_group)
    for name, param in parallel.named_parameters():
        spec = getattr(param, SHARD_ATTR, None)
        reference = serial_params[name]
        reference_spec = getattr(reference, SHARD_ATTR, None)
        assert logical_shape(param) == logical_shape(reference), name
        # Layout-independent initialisation: bitwise the same logical weights
        # (the serial model's vocabulary is padded less: logical views compared).
        assert torch.equal(gather_logical(param.detach(), spec, ctx.tp_group),
                           gather_logical(reference.detach(), reference_spec, None)), name
        assert_close(gather_logical(param.grad, spec, ctx.tp_group),
                     gather_logical(reference.grad, reference_spec, None), **GRAD_TOL,
                     msg=lambda m, name=name: f"{name}: {m}")
    return parallel_loss.item(), serial_loss.item()


@pytest.mark.parametrize("t", [2, 4])
def test_tensor_parallel_gpt_equals_one_process(pools, t):
    results = pools(t).run(_serial_vs_tensor_parallel, t, SMALL, False)
    assert len({r[0] for r in results}) == 1  # every tensor rank reports the same loss


def test_tensor_parallel_gpt_with_loss_mask_and_unfused_ops(pools):
    config = dataclasses.replace(SMALL, bias_gelu_fusion=False, bias_dropout_fusion=False,
                                 ffn_hidden_size=48)
    pools(2).run(_serial_vs_tensor_parallel, 2, config, True)


def _dropout_in_model(rank, t):
    """With dropout on, activations that every tensor rank holds in full stay
    identical across ranks: replicated dropout draws the same mask everywhere,
    while attention dropout (inside the tensor-parallel region) differs."""
    ctx = ParallelContext.build(RankGrid(tp=t, dp=1, pp=1))
    config = dataclasses.replace(SMALL, hidden_dropout=0.3, attention_dropout=0.3)
    model = _build(config, ctx).train()
    tokens, labels = _batch(config)
    hidden = model.embedding(tokens)
    for layer in model.layers.values():
        hidden = layer(hidden)
    loss = model(tokens, labels)
    model.eval()
    eval_loss = model(tokens, labels)
    return hidden.detach(), loss.item(), eval_loss.item(), model.layers["0"].attention.rng.states["tensor"]


def test_dropout_identical_where_replicated_and_distinct_where_split(pools):
    results = pools(2).run(_dropout_in_model, 2)
    (hidden0, loss0, eval0, tensor_state0), (hidden1, loss1, eval1, tensor_state1) = results
    assert torch.equal(hidden0, hidden1)
    assert loss0 == loss1
    assert eval0 == eval1 and eval0 != loss0  # dropout is active in training only
    assert not torch.equal(tensor_state0, tensor_state1)


def test_serial_dropout_changes_loss_and_is_reproducible():
    config = dataclasses.replace(SMALL, hidden_dropout=0.2, attention_dropout=0.2)
    tokens, labels = _batch(config)
    losses = [_build(config, ParallelContext.single()).train()(tokens, labels).item() for _ in range(2)]
    eval_loss = _build(config, ParallelContext.single()).eval()(tokens, labels).item()
    assert losses[0] == losses[1] != eval_loss


def test_padding_never_changes_the_loss():
    """Same logical model, vocabulary padded to 104 or to 256: same loss."""
    tokens, labels = _batch(SMALL)
    losses = []
    for multiple in (8, 256):
        config = dataclasses.replace(SMALL, make_vocab_size_divisible_by=multiple)
        model = _build(config, ParallelContext.single())
        assert model.embedding.word_embeddings.weight.shape[0] == config.padded_vocab_size(1)
        logits = model.eval()(tokens)
        assert torch.isinf(logits[..., config.vocab_size:]).all()
        losses.append(model(tokens, labels))
    assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)


def test_fused_and_plain_paths_agree():
    torch.manual_seed(3)
    x = torch.randn(6, 2, 40, requires_grad=True)
    bias = torch.randn(40, requires_grad=True)
    grad = torch.randn(6, 2, 40)
    outputs = []
    for fused in (True, False):
        x.grad = bias.grad = None
        y = bias_gelu(x, bias, fused)
        y.backward(grad)
        outputs.append((y.detach(), x.grad.clone(), bias.grad.clone()))
    for a, b in zip(*outputs):
        assert_close(a, b, rtol=1e-5, atol=1e-6)

    residual = torch.randn(6, 2, 40)
    for training in (False, True):
        torch.manual_seed(5)
        fused = bias_dropout_add(x, bias, residual, 0.4, training, fused=True)
        torch.manual_seed(5)
        plain = bias_dropout_add(x, bias, residual, 0.4, training, fused=False)
        assert_close(fused, plain)

    # The whole model: fusion on and off give the same loss and gradients.
    tokens, labels = _batch(SMALL)
    results = []
    for fusion in (True, False):
        config = dataclasses.replace(SMALL, bias_gelu_fusion=fusion, bias_dropout_fusion=fusion)
        model = _build(config, ParallelContext.single())
        loss = model(tokens, labels)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    assert_close(results[0][0], results[1][0], rtol=1e-6, atol=1e-6)
    for name, grad in results[0][1].items():
        assert_close(grad, results[1][1][name], rtol=1e-5, atol=1e-7)


def test_model_pieces_hold_only_their_layers():
    """A pipeline piece builds only its layers under their global names, the
    embedding only on the first piece and the output layer only on the last."""
    ctx = ParallelContext.single()
    config = dataclasses.replace(SMALL, num_layers=4)
    full = _build(config, ctx)
    first = GPT(config, ctx, RNGStreams(torch.device("cpu")), layer_ids=[0, 1], post_process=False)
    last = GPT(config, ctx, RNGStreams(torch.device("cpu")), layer_ids=[2, 3], pre_process=False)
    first.initialize(SEED)
    last.initialize(SEED)
    full_params = dict(full.named_parameters())
    for piece in (first, last):
        for name, param in piece.named_parameters():
            assert torch.equal(param, full_params[name]), name
    assert not any(n.startswith("layers.2") for n, _ in first.named_parameters())
    # The last piece's tied embedding is a marked copy: counted once in norms.
    assert getattr(last.embedding.word_embeddings.weight, COPY_ATTR)
    assert not getattr(first.embedding.word_embeddings.weight, COPY_ATTR, False)
    assert not hasattr(first, "final_layernorm") and not hasattr(last.embedding, "position_embeddings")
    tokens, labels = _batch(config)
    assert_close(last(first(tokens), labels), full(tokens, labels), rtol=1e-6, atol=1e-6)


def test_compiled_fused_kernels_match_plain(monkeypatch):
    """The torch.compile path (taken on GPUs with Triton) computes the same as
    the plain ops; compiled here for the CPU so that CI runs it too."""
    from ptdp import device as devices
    from ptdp.model import fused as fused_module

    monkeypatch.setattr(devices, "can_compile_kernels", lambda device: True)
    monkeypatch.setattr(fused_module, "_compiled", {})
    torch.manual_seed(4)
    x = torch.randn(5, 2, 24, requires_grad=True)
    bias = torch.randn(24, requires_grad=True)
    residual = torch.randn(5, 2, 24)
    grad = torch.randn(5, 2, 24)
    results = []
    for fused in (True, False):
        x.grad = bias.grad = None
        y = bias_dropout_add(bias_gelu(x, bias, fused), bias, residual, 0.0, True, fused)
        y.backward(grad)
        results.append((y.detach(), x.grad.clone(), bias.grad.clone()))
    assert set(fused_module._compiled) == {"bias_gelu_fwd", "bias_gelu_bwd", "bias_dropout_add"}
    for a, b in zip(*results):
        assert_close(a, b, rtol=1e-5, atol=1e-6)
