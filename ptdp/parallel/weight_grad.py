"""Deferred weight gradients: a linear layer's backward in two parts, for the
zero-bubble pipeline schedules (Qi et al., 2024).

B, the part the previous pipeline stage waits for, computes the input
gradient at once and records what the weight gradient needs (the layer's
input and the output gradient); W, which nobody waits for, computes the
weight (and bias) gradients later, when the schedule has a gap for it.

    store = DeferredWeightGrads()        # one per model chunk, given to its linear layers
    loss.backward()                      # B: the layers with the store compute input gradients
    store.run()                          # W: every deferred weight gradient of the chunk

A layer given a store always defers. Its weight and bias enter the product
detached, so the backward has no edge to them at all (an edge given no
gradient would still fire the parameters' post-accumulate hooks). W hands
each gradient to autograd as the backward of the parameter itself
(`torch.autograd.backward(param, grad)`), so it accumulates into `.grad`
and fires those hooks exactly as a fused backward would: the data-parallel
buckets (ptdp.parallel.data_parallel) become ready after the last W, with no change
there. Layers without a store compute both parts in one backward, as before.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


class DeferredWeightGrads:
    def __init__(self):
        self._pending: list[Callable[[], None]] = []

    def add(self, work: Callable[[], None]) -> None:
        self._pending.append(work)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def run(self) -> None:
        """Compute every deferred weight gradient, oldest first."""
        pending, self._pending = self._pending, []
        with torch.no_grad():  # plain products: nothing here is differentiated again
            for work in pending:
                work()

    def take(self) -> "DeferredWeightGrads":
        """Move the pending work into a new store (one microbatch's W, to run
        later) and leave this one empty for the next backward."""
        taken = DeferredWeightGrads()
        taken._pending, self._pending = self._pending, []
        return taken


def accumulate_weight_grads(x: torch.Tensor, grad: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> None:
    """Accumulate W's and b's gradients of y = x Wᵀ + b through autograd on
    the parameters (so their post-accumulate hooks fire). A frozen parameter
    (LoRA's base) gets none: its product is not computed."""
    grad_2d = grad.reshape(-1, grad.shape[-1])
    params, grads = [], []
    if weight.requires_grad:
        params.append(weight)
        grads.append(grad_2d.t().matmul(x.reshape(-1, x.shape[-1])).to(weight.dtype))
    if bias is not None and bias.requires_grad:
        params.append(bias)
        grads.append(grad_2d.sum(dim=0).to(bias.dtype))
    if params:
        torch.autograd.backward(params, grads)


class _DeferredLinear(torch.autograd.Function):
    """y = x Wᵀ + b; backward gives x's gradient and leaves W's and b's to the
    store. `params` (weight, bias) ride in a tuple, outside autograd's view."""

    @staticmethod
    def forward(ctx, x, weight, bias, store, params):
        ctx.store, ctx.params = store, params
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        real_weight, real_bias = ctx.params
        if real_weight.requires_grad or (real_bias is not None and real_bias.requires_grad):
            ctx.store.add(lambda: accumulate_weight_grads(x, grad, real_weight, real_bias))
        return grad.matmul(weight), None, None, None, None


def deferrable_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      store: DeferredWeightGrads | None) -> torch.Tensor:
    """F.linear, or with a store, a product whose weight gradients wait for `store.run()`."""
    if store is None:
        return F.linear(x, weight, bias)
    return _DeferredLinear.apply(x, weight.detach(), None if bias is None else bias.detach(),
                                 store, (weight, bias))
