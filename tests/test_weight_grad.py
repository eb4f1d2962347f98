"""Deferred weight gradients (the B/W split of the zero-bubble schedules):
the backward of layers given a `DeferredWeightGrads` store computes the
input gradients only; `run()` then computes the weight gradients, bitwise
equal to the fused backward's, and the gradient buckets become ready only
then."""

import dataclasses

import pytest
import torch

from ptdp.model.gpt import GPT
from ptdp.parallel.data_parallel import GradBuffer
from ptdp.parallel.tensor import ColumnParallelLinear, RNGStreams, RowParallelLinear
from ptdp.parallel.topology import ParallelContext
from ptdp.parallel.weight_grad import DeferredWeightGrads
from tests.test_gpt import SMALL, _batch
from tests.test_llama import LLAMA

MODELS = {"gpt": SMALL, "llama": dataclasses.replace(LLAMA, num_layers=2, seq_length=16)}


def _model(config):
    return GPT(config, ParallelContext.single(), RNGStreams(torch.device("cpu"))).initialize(7)


def _attach(model):
    store = DeferredWeightGrads()
    linears = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    for linear in linears:
        linear.weight_grads = store
    return store, {p for linear in linears for p in linear.parameters()}


@pytest.mark.parametrize("name", list(MODELS))
def test_b_then_w_equals_the_fused_backward(name):
    config = MODELS[name]
    tokens, labels = _batch(config)
    fused = _model(config)
    fused(tokens, labels).backward()
    split = _model(config)
    store, deferred = _attach(split)
    split(tokens, labels).backward()
    # After B: every gradient except the linear layers' weights and biases.
    for param in split.parameters():
        assert (param.grad is None) == (param in deferred)
    assert store.pending == 4 * config.num_layers
    store.run()
    assert store.pending == 0
    reference = dict(fused.named_parameters())
    for param_name, param in split.named_parameters():
        assert torch.equal(param.grad, reference[param_name].grad), param_name


def test_buckets_become_ready_after_the_last_w():
    """The gradient buffer's hooks fire when W accumulates: a bucket holding a
    linear weight launches its reduction only after `run()`."""
    config = MODELS["gpt"]
    model = _model(config)
    store, deferred = _attach(model)
    buffer = GradBuffer(list(model.parameters()), ParallelContext.single(),
                        param_dtype=torch.float32, bucket_size=500, shard=False)
    buffer.start_iteration(1)
    tokens, labels = _batch(config)
    model(tokens, labels).backward()
    waiting = [b for b in buffer.buckets if not b.launched]
    assert waiting and all(any(p in deferred for p in b.params) for b in waiting)
    store.run()
    assert all(b.launched for b in buffer.buckets)
