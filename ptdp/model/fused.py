"""Fused element-wise operators: bias + GeLU, bias + dropout + residual add,
SwiGLU and the other gated units (GeGLU, gpt-oss's clamped quick-GeGLU with
the linear offset), and the zero-centred norm of --apply-layernorm-1p.

Each has a plain path (separate PyTorch ops, one autograd node each) and a
fused path. The fused bias + GeLU is one autograd node that saves only its
input and bias and recomputes the tanh in backward (as Megatron-LM's fused
kernel does), so it stores one activation instead of three. On a GPU with
Triton the fused bodies are compiled with torch.compile into single kernels.
Elsewhere nothing would fuse them, so the linear layers add their biases in
the matrix product instead (addmm, free; see tensor.defers_bias) and hand
over None: the GeLU is then ATen's own kernel (one pass each way, saving
only its input, as the fused node does) and the residual add one pass. The
fused GeLU node given a bias on such a device calls ATen's kernels too. The
GeLU is GPT-2's tanh approximation throughout.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ptdp import device as devices

_SQRT_2_OVER_PI = 0.7978845608028654
_GELU_C = 0.044715


def _bias_gelu_forward(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    y = x + bias
    return 0.5 * y * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (y + _GELU_C * y * y * y)))


def _bias_gelu_backward(grad: torch.Tensor, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    y = x + bias
    tanh = torch.tanh(_SQRT_2_OVER_PI * (y + _GELU_C * y * y * y))
    dtanh = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_C * y * y) * (1.0 - tanh * tanh)
    return grad * (0.5 * (1.0 + tanh) + 0.5 * y * dtanh)


def _bias_dropout_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                      p: float, training: bool) -> torch.Tensor:
    if bias is not None:
        x = x + bias
    if training and p > 0.0:
        x = F.dropout(x, p=p, training=True)
    return residual + x


_compiled: dict[str, Callable] = {}


def _kernel(name: str, fn: Callable, device: torch.device) -> Callable:
    """`fn` compiled into one kernel where the platform supports it."""
    if not devices.can_compile_kernels(device):
        return fn
    if name not in _compiled:
        _compiled[name] = torch.compile(fn, dynamic=True)
    return _compiled[name]


class _BiasGeLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias):
        ctx.save_for_backward(x, bias)
        if devices.can_compile_kernels(x.device):
            return _kernel("bias_gelu_fwd", _bias_gelu_forward, x.device)(x, bias)
        # Eager: ATen's own GeLU kernel is one pass, the formula above is eight.
        return F.gelu(x + bias, approximate="tanh")

    @staticmethod
    def backward(ctx, grad):
        x, bias = ctx.saved_tensors
        if devices.can_compile_kernels(x.device):
            grad_x = _kernel("bias_gelu_bwd", _bias_gelu_backward, x.device)(grad, x, bias)
        else:
            grad_x = torch.ops.aten.gelu_backward(grad, x + bias, approximate="tanh")
        return grad_x, grad_x.reshape(-1, grad_x.shape[-1]).sum(dim=0)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None, fused: bool) -> torch.Tensor:
    """GeLU(x + bias); a bias of None was already added (by the linear layer)."""
    if bias is None:
        return F.gelu(x, approximate="tanh")
    if fused:
        return _BiasGeLU.apply(x, bias)
    return F.gelu(x + bias, approximate="tanh")


def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                     p: float, training: bool, fused: bool) -> torch.Tensor:
    if fused:
        return _kernel("bias_dropout_add", _bias_dropout_add, x.device)(x, bias, residual, p, training)
    return _bias_dropout_add(x, bias, residual, p, training)


def _swiglu_forward(y: torch.Tensor) -> torch.Tensor:
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


def _swiglu_backward(grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    gate, up = y.chunk(2, dim=-1)
    sigmoid = torch.sigmoid(gate)
    silu = gate * sigmoid
    return torch.cat([grad * up * sigmoid * (1.0 + gate * (1.0 - sigmoid)), grad * silu], dim=-1)


class _SwiGLU(torch.autograd.Function):
    """silu(gate) ⊙ up from [gate | up] as one node that saves only its
    input and recomputes the sigmoid in backward (autograd's own graph would
    keep gate, silu(gate) and up: three activations instead of two)."""

    @staticmethod
    def forward(ctx, y):
        ctx.save_for_backward(y)
        return _kernel("swiglu_fwd", _swiglu_forward, y.device)(y)

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return _kernel("swiglu_bwd", _swiglu_backward, y.device)(grad, y)


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """The gated MLP's activation: y = [gate | up] along the last dimension
    (each tensor rank holds matching halves of both) -> silu(gate) ⊙ up."""
    return _SwiGLU.apply(y)


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """GeLU's sigmoid approximation (Megatron-Core's quick_gelu, gpt-oss's alpha)."""
    return x * torch.sigmoid(1.702 * x)


_GATE_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu": lambda x: F.gelu(x, approximate="tanh"), "quick_gelu": _quick_gelu}


def _gated_unit(y: torch.Tensor, activation: str, offset: float,
                clamp: float | None) -> torch.Tensor:
    gate, up = y.chunk(2, dim=-1)
    if clamp is not None:  # gpt-oss: the gate from above only, up on both sides
        gate = gate.clamp(max=clamp)
        up = up.clamp(min=-clamp, max=clamp)
    if offset:
        up = up + offset
    return _GATE_ACTIVATIONS[activation](gate) * up


class _GatedUnit(torch.autograd.Function):
    """act(gate) ⊙ (up + offset) from [gate | up], optionally clamped, as one
    node that saves only its input and recomputes the rest in backward
    (autograd's graph would keep the clamped halves, the activation and the
    offset up projection)."""

    @staticmethod
    def forward(ctx, y, activation, offset, clamp):
        ctx.save_for_backward(y)
        ctx.settings = (activation, offset, clamp)
        return _gated_unit(y, activation, offset, clamp)

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        with torch.enable_grad():
            leaf = y.detach().requires_grad_()
            out = _gated_unit(leaf, *ctx.settings)
        (grad_y,) = torch.autograd.grad(out, leaf, grad)
        return grad_y, None, None, None


def gated_unit(y: torch.Tensor, activation: str = "silu", offset: float = 0.0,
               clamp: float | None = None) -> torch.Tensor:
    """A gated MLP's activation from y = [gate | up] (each tensor rank holds
    matching halves of both): act(gate) ⊙ (up + offset), act one of silu
    (SwiGLU), gelu (tanh approximation: GeGLU) or quick_gelu; with `clamp`
    C the gate is first clamped to at most C and up to [-C, C]
    (Megatron-Core's activation_func_clamp_value and glu_linear_offset)."""
    if activation == "silu" and not offset and clamp is None:
        return swiglu(y)
    return _GatedUnit.apply(y, activation, offset, clamp)


def mlp_activation(config) -> Callable[[torch.Tensor], torch.Tensor]:
    """What a ModelConfig's MLP applies between its matrices (the first
    one's bias already added): its gated unit, or GeLU (tanh)."""
    if config.gated_activation is None:
        return lambda y: F.gelu(y, approximate="tanh")
    settings = (config.gated_activation, config.glu_linear_offset,
                config.activation_func_clamp_value)
    return lambda y: gated_unit(y, *settings)


def _normalize(x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
               eps: float) -> torch.Tensor:
    """LayerNorm over the last dimension, or RMSNorm where there is no bias."""
    shape = (x.shape[-1],)
    if bias is None:
        return F.rms_norm(x, shape, scale, eps)
    return F.layer_norm(x, shape, scale, bias, eps)


def _zero_centred_fp32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       eps: float) -> torch.Tensor:
    return _normalize(x.float(), weight.float() + 1.0, None if bias is None else bias.float(), eps)


class _ZeroCentredNorm(torch.autograd.Function):
    """The low-precision path of zero_centred_norm: computed in fp32 (the
    scale 1 + w keeps the bits of a small bf16/fp16 w that adding 1 in that
    dtype would round away), rounded once to the input's dtype. One node that
    saves only its inputs, in their own dtypes, and recomputes the fp32 norm
    in backward: no fp32 copy of the activation is held."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        ctx.save_for_backward(x, weight, bias)
        ctx.eps = eps
        return _zero_centred_fp32(x, weight, bias, eps).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [None if t is None else t.detach().float().requires_grad_() for t in saved]
            y = _normalize(leaves[0], leaves[1] + 1.0, leaves[2], ctx.eps)
        grads = iter(torch.autograd.grad(y, [t for t in leaves if t is not None], grad.float()))
        x_grad, weight_grad, bias_grad = (None if t is None else next(grads).to(t.dtype)
                                          for t in saved)
        return x_grad, weight_grad, bias_grad, None


def zero_centred_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      eps: float) -> torch.Tensor:
    """LayerNorm (or RMSNorm where `bias` is None) scaling by 1 + weight:
    --apply-layernorm-1p's zero-centred scale, as Megatron-LM's
    zero_centered_gamma. In fp32 it is the plain norm given the scale
    1 + w, and trains exactly as a norm storing the scale would."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return _normalize(x, weight + 1.0, bias, eps)
    return _ZeroCentredNorm.apply(x, weight, bias, eps)
