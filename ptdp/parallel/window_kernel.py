"""A device's own sliding-window attention kernel, where it has one.

PyTorch's flash attention for CUDA (torch.ops.aten._flash_attention_forward
and _flash_attention_backward, with `window_size_left`; 16-bit inputs, head
width a multiple of 8 up to 256) computes causal attention within a window
(query i sees keys i − L..i) in one call, skipping the tiles outside the
window itself, with grouped key/value heads, and returns each row's
log-sum-exp. So sinks apply after it exactly as after the block plan of
ptdp.parallel.local_attention: out · sigmoid(lse − sink), the backward
given the final output and lse' = logaddexp(lse, sink).

It runs only after a probe on that device, dtype and head width agrees
with the masked dense computation in fp32 (output and the gradients of q,
k, v and the sinks, with grouped key/value heads and a window shorter than
the sequence). Where there is none (every CPU; fp32; a PyTorch whose flash
kernel lacks windows or refuses the shapes), `windowed_kernel` says None
and local_attention runs its block plan, which skips whole key blocks
outside the window on every device.
"""

from __future__ import annotations

import functools

import torch

from ptdp.parallel.block_attention import accumulation_dtype
from ptdp.parallel.context_attention import _apply_sinks, _sink_gradient

WINDOW_KERNEL = "cuda_flash_window"
_HALF = (torch.float16, torch.bfloat16)
# Largest |error| / largest |reference| per tensor the probe accepts: 16-bit
# kernels round their probabilities and outputs to 8 (bf16) or 11 bits.
_PROBE_TOLERANCE = 3e-2


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[b, heads, s, d] -> [b·s, heads, d], the kernel's variable-length
    layout (every row of the batch one sequence of s positions)."""
    b, heads, s, d = x.shape
    return x.transpose(1, 2).reshape(b * s, heads, d)


def _unflat(x: torch.Tensor, b: int) -> torch.Tensor:
    return x.view(b, -1, *x.shape[1:]).transpose(1, 2)


def _cumulative(q: torch.Tensor) -> torch.Tensor:
    b, s = q.shape[0], q.shape[2]
    return torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=q.device)


# The calls are those of torch.nn.attention.varlen.varlen_attn (PyTorch's own
# use of these ops), with every batch row as one sequence.
def _forward(q, k, v, left: int, scale: float):
    """(out [b, heads, s, d], lse [b, heads, s], the kernel's lse layout)."""
    b, heads, s, _ = q.shape
    cumulative = _cumulative(q)
    out, lse = torch.ops.aten._flash_attention_forward(
        _flat(q), _flat(k), _flat(v), cumulative, cumulative, s, s, 0.0, True,
        return_debug_mask=False, scale=scale, window_size_left=left, window_size_right=0)[:2]
    kernel_layout = lse.dim()
    if kernel_layout == 2:  # [heads, b·s]
        lse = lse.view(heads, b, s).transpose(0, 1)
    return _unflat(out, b), lse[..., :s], kernel_layout


def _backward(dout, q, k, v, out, lse, left: int, scale: float, kernel_layout: int):
    b, heads, s, _ = q.shape
    cumulative = _cumulative(q)
    if kernel_layout == 2:
        lse = lse.transpose(0, 1).reshape(heads, b * s)
    rng_state = torch.zeros((2,), dtype=torch.uint64, device=q.device)  # no dropout
    unused = torch.empty(0, device=q.device)
    grads = torch.ops.aten._flash_attention_backward(
        _flat(dout.to(q.dtype)), _flat(q), _flat(k), _flat(v), _flat(out.to(q.dtype)),
        lse.float().contiguous(), cumulative, cumulative, s, s, 0.0, True, rng_state, unused,
        scale=scale, window_size_left=left, window_size_right=0)
    return tuple(_unflat(g, b) for g in grads[:3])


class WindowKernelAttention(torch.autograd.Function):
    """Causal attention within a window of `left` keys on the device's
    window kernel, sinks applied from its log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, left, scale):
        out, lse, state = _forward(q, k, v, left, scale)
        acc = accumulation_dtype(q.dtype)
        out = out.to(acc)
        lse = _apply_sinks(out, lse.to(acc), sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.left, ctx.scale, ctx.state = left, scale, state
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv = _backward(dout, q, k, v, out, lse, ctx.left, ctx.scale, ctx.state)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                _sink_gradient(ctx, dout, out, lse, sinks), None, None)


def _dense_reference(q, k, v, sinks, left: int, scale: float) -> torch.Tensor:
    """The masked dense attention with a sink column, in fp32."""
    heads, groups, s = q.shape[1], k.shape[1], q.shape[2]
    k, v = (x.repeat_interleave(heads // groups, dim=1) for x in (k, v))
    scores = (q @ k.transpose(-1, -2)) * scale
    distance = torch.arange(s, device=q.device).view(-1, 1) - torch.arange(s, device=q.device)
    scores = scores.masked_fill(~((distance >= 0) & (distance <= left)), float("-inf"))
    sink = sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    probabilities = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return probabilities @ v


def _agrees(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    generator = torch.Generator().manual_seed(0)

    def tensor(*shape):
        return torch.randn(*shape, generator=generator)

    try:
        left, scale = 17, head_dim ** -0.5
        inputs = [tensor(1, 4, 96, head_dim), tensor(1, 2, 96, head_dim),
                  tensor(1, 2, 96, head_dim), tensor(4)]
        dout = tensor(1, 4, 96, head_dim)
        rounded = [x.to(device=device, dtype=dtype).float() for x in inputs[:3]]
        want_in = [x.clone().requires_grad_() for x in (*rounded, inputs[3].to(device))]
        want = _dense_reference(*want_in, left, scale)
        want.backward(dout.to(device))
        got_in = [x.to(dtype).detach().requires_grad_() for x in rounded] + \
            [inputs[3].to(device).requires_grad_()]
        got = WindowKernelAttention.apply(*got_in, left, scale)
        got.backward(dout.to(device=device, dtype=dtype))
        pairs = [(got, want)] + [(g.grad, w.grad) for g, w in zip(got_in, want_in)]
        return all(a.shape == b.shape and (a.float() - b).abs().max().item()
                   <= _PROBE_TOLERANCE * b.abs().max().item() for a, b in pairs)
    except Exception:  # noqa: BLE001 - any failure means the block plan: an op this
        return False   # torch lacks, a refused shape or argument, ...


@functools.lru_cache(maxsize=None)
def _probed(device_type: str, index: int | None, dtype: torch.dtype, head_dim: int) -> bool:
    if device_type != "cuda" or dtype not in _HALF or head_dim % 8 or head_dim > 256:
        return False
    device = torch.device(device_type, index) if index is not None else torch.device(device_type)
    return _agrees(device, dtype, head_dim)


def windowed_kernel(device: torch.device | str, dtype: torch.dtype, head_dim: int) -> str | None:
    """WINDOW_KERNEL where this device runs it for these inputs (probed once
    per device, dtype and head width), else None."""
    device = torch.device(device)
    return WINDOW_KERNEL if _probed(device.type, device.index, dtype, head_dim) else None
