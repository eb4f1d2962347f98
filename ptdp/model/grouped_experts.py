"""--moe-grouped-gemm: a rank's local experts in one grouped matrix product
per layer (torch.nn.functional.grouped_mm) instead of one product per
expert.

The rows are the (token, expert) pairs sorted by expert; `offsets[e]` is
where expert e's rows end. Each expert keeps its own parameters (its own
logical name, as checkpoints want): their weights are stacked for the
product, and its backward hands each parameter its own gradient through
autograd, so the data-parallel buckets' hooks fire as with separate
products. Under the zero-bubble schedules the weight gradients wait for
the chunk's W pass (ptdp.parallel.weight_grad), as a single linear's do.

Where grouped_mm is missing (torch before 2.9) or cannot take the shapes
(its operands' row strides must be multiples of 16 bytes: widths divisible
by 4 in fp32, by 8 in 16-bit), the experts run one product each: the same
numbers, and `grouped_gemm_used` says which ran.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from ptdp.parallel.weight_grad import DeferredWeightGrads

_grouped_mm = getattr(F, "grouped_mm", None)


def grouped_gemm_used(widths: Sequence[int], dtype: torch.dtype) -> bool:
    """Whether grouped_mm runs for matrices of these input/output widths."""
    if _grouped_mm is None:
        return False
    elements = 16 // torch.empty((), dtype=dtype).element_size()
    return all(width % elements == 0 for width in widths)


class _GroupedLinear(torch.autograd.Function):
    """y[rows of e] = x[rows of e] W_eᵀ for every expert e at once. The
    weights enter detached; the real parameters ride in `params`."""

    @staticmethod
    def forward(ctx, x, offsets, store, params, *weights):
        stacked = torch.stack(weights)  # [E, out, in]
        ctx.save_for_backward(x, stacked, offsets)
        ctx.store, ctx.params = store, params
        return _grouped_mm(x, stacked.transpose(1, 2), offs=offsets)

    @staticmethod
    def backward(ctx, grad):
        x, stacked, offsets = ctx.saved_tensors
        grad = grad.contiguous()
        params = ctx.params

        def weight_grads() -> None:
            # [E, out, in]: expert e's gradᵀ x over its rows (none: zeros).
            grads = _grouped_mm(grad.t(), x, offs=offsets)
            torch.autograd.backward(list(params), [g.to(p.dtype) for g, p in zip(grads, params)])

        if not any(param.requires_grad for param in params):
            pass  # frozen experts (LoRA's base): the input's gradient only
        elif ctx.store is not None:
            ctx.store.add(weight_grads)
        else:
            with torch.no_grad():
                weight_grads()
        return (_grouped_mm(grad, stacked, offs=offsets), None, None, None,
                *([None] * len(params)))


def grouped_linear(x: torch.Tensor, offsets: torch.Tensor, weights: Sequence[torch.nn.Parameter],
                   store: DeferredWeightGrads | None) -> torch.Tensor:
    """x [rows, in] sorted by expert -> [rows, out], expert e's rows through
    weights[e] ([out, in]); with `store`, the weight gradients wait for W."""
    return _GroupedLinear.apply(x, offsets, store, tuple(weights), *(w.detach() for w in weights))


def grouped_experts(experts: Sequence[torch.nn.Module], x: torch.Tensor, probs: torch.Tensor,
                    counts: torch.Tensor) -> torch.Tensor:
    """Every expert's MLP (ptdp.model.moe.Expert) on its rows of x (sorted by
    expert, counts[e] rows each) in two grouped products: Σ-free, one output
    row per input row, scaled by its probability as Expert.forward does."""
    offsets = counts.cumsum(0).to(torch.int32)
    first = [expert.dense_h_to_4h for expert in experts]
    second = [expert.dense_4h_to_h for expert in experts]
    store = first[0].weight_grads
    rows_expert = None
    if first[0].bias is not None:
        rows_expert = torch.repeat_interleave(torch.arange(len(experts), device=x.device), counts)
    y = grouped_linear(x, offsets, [layer.weight for layer in first], store)
    if rows_expert is not None:
        y = y + torch.stack([layer.bias for layer in first])[rows_expert]
    a = experts[0].activation(y)
    a = (a * probs.unsqueeze(-1)).to(a.dtype)
    out = grouped_linear(a.contiguous(), offsets, [layer.weight for layer in second], store)
    if rows_expert is not None:
        out = out + torch.stack([expert.output_bias() for expert in experts])[rows_expert] \
            * probs.unsqueeze(-1).to(out.dtype)
    return out
