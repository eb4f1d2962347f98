"""Attention over one block of queries and keys that also returns each query
row's log-sum-exp (LSE) of scores, and the gradients of such a block given the
final output and LSE: the two steps of the flash-attention recurrence that
context parallelism needs. Partial outputs from different key blocks are
merged by their LSEs (`merge_into`); a block's backward recomputes its
softmax from the final LSE, so nothing of size s × s is kept.

Shapes: q [b, heads, sq, d]; k, v [b, groups, sk, d] with heads a multiple of
groups (GQA: head i reads key/value group i // (heads / groups), as
torch's scaled_dot_product_attention with enable_gqa). `causal` blocks are
square (sq == sk) and aligned on the diagonal: query i sees keys 0..i. A
boolean `mask` [b or 1, 1, sq, sk] (packed documents, ptdp.parallel.
context_attention) narrows that further and runs "plain"; a row it leaves
without keys gets LSE −inf and output 0, which `merge_into` takes as nothing.

Kernels, by name:
- "plain": matrix products in fp32 (fp64 for fp64 inputs), any device;
- "cpu_flash": torch.ops.aten._scaled_dot_product_flash_attention_for_cpu;
- "cuda_flash": torch.ops.aten._scaled_dot_product_flash_attention (fp16/bf16);
- "cuda_efficient": torch.ops.aten._efficient_attention_forward.
A fused kernel runs only after a small probe on that device, dtype and head
size agrees with "plain" (output, LSE and the three gradients); otherwise
"plain" runs. `block_kernel(device, dtype, head_dim)` names the one that runs.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch

KERNELS = ("plain", "cpu_flash", "cuda_flash", "cuda_efficient")
_HALF = (torch.float16, torch.bfloat16)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp16/bf16/fp32 inputs (fp64 stays fp64): merges and gradient sums."""
    return torch.promote_types(dtype, torch.float32)


def expand_groups(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, groups, s, d] -> [b, heads, s, d]: each group repeated for its heads."""
    groups = kv.shape[1]
    return kv if groups == heads else kv.repeat_interleave(heads // groups, dim=1)


def fold_groups(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The adjoint of `expand_groups`: [b, heads, s, d] -> [b, groups, s, d], summed."""
    b, heads, s, d = grad.shape
    return grad if groups == heads else grad.view(b, groups, heads // groups, s, d).sum(2)


def _above_diagonal(n: int, device: torch.device) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).triu(1)


# ------------------------------------------------------------------ plain

def _plain_scores(q, k, causal, scale, acc, mask=None):
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)).mul_(scale)
    if causal:
        scores.masked_fill_(_above_diagonal(q.shape[2], q.device), -math.inf)
    if mask is not None:
        scores.masked_fill_(~mask, -math.inf)
    return scores


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with −inf (a row that sees no key) as 0, so exp(scores − lse) is
    exp(−inf) = 0 in that row rather than NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _plain_forward(q, k, v, causal, scale, mask=None):
    acc = accumulation_dtype(q.dtype)
    scores = _plain_scores(q, k, causal, scale, acc, mask)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(scores.sub_(_finite(lse).unsqueeze(-1)).exp_(), v.to(acc))
    return out, lse


def _plain_backward(dout, q, k, v, out, lse, causal, scale, mask=None):
    acc = accumulation_dtype(q.dtype)
    dout, out = dout.to(acc), out.to(acc)
    probs = _plain_scores(q, k, causal, scale, acc, mask)
    probs.sub_(_finite(lse.to(acc)).unsqueeze(-1)).exp_()
    dv = torch.matmul(probs.transpose(-1, -2), dout)
    dprobs = torch.matmul(dout, v.to(acc).transpose(-1, -2))
    delta = (dout * out).sum(dim=-1, keepdim=True)     # the softmax's Jacobian, row by row
    dscores = probs.mul_(dprobs.sub_(delta)).mul_(scale)
    dq = torch.matmul(dscores, k.to(acc))
    dk = torch.matmul(dscores.transpose(-1, -2), q.to(acc))
    return dq, dk, dv


# ------------------------------------------------------------------ fused kernels of torch

def _cpu_flash_forward(q, k, v, causal, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, scale=scale)
    return out, lse


def _cpu_flash_backward(dout, q, k, v, out, lse, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.to(q.dtype).contiguous(), q.contiguous(), k.contiguous(), v.contiguous(),
        out.to(q.dtype).contiguous(), lse.float().contiguous(), 0.0, causal, scale=scale)


def _cuda_flash_forward(q, k, v, causal, scale):
    results = torch.ops.aten._scaled_dot_product_flash_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, False, scale=scale)
    return results[0], results[1]


def _cuda_flash_backward(dout, q, k, v, out, lse, causal, scale):
    none = torch.empty(0, dtype=torch.int64, device=q.device)   # no dropout, dense batch
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout.to(q.dtype).contiguous(), q.contiguous(), k.contiguous(), v.contiguous(),
        out.to(q.dtype).contiguous(), lse.float().contiguous(), none, none, q.shape[2], k.shape[2],
        0.0, causal, none, none, scale=scale)


# The memory-efficient kernel takes [b, s, heads, d]; mask type 1 is causal
# from the top left, 0 none.
def _cuda_efficient_forward(q, k, v, causal, scale):
    out, lse = torch.ops.aten._efficient_attention_forward(
        q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(),
        v.transpose(1, 2).contiguous(), None, None, None, None, None, 0.0, int(causal), True,
        scale=scale)[:2]
    return out.transpose(1, 2), lse[..., :q.shape[2]]


def _cuda_efficient_backward(dout, q, k, v, out, lse, causal, scale):
    sq = q.shape[2]
    padded = torch.nn.functional.pad(lse.float(), (0, -sq % 32)).contiguous()
    none = torch.empty(0, dtype=torch.int64, device=q.device)
    grads = torch.ops.aten._efficient_attention_backward(
        dout.to(q.dtype).transpose(1, 2).contiguous(), q.transpose(1, 2).contiguous(),
        k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(), None,
        out.to(q.dtype).transpose(1, 2).contiguous(), None, None, sq, k.shape[2], padded, 0.0,
        none, none, int(causal), False, scale=scale)
    return tuple(g.transpose(1, 2) for g in grads[:3])


_FORWARD: dict[str, Callable] = {"plain": _plain_forward, "cpu_flash": _cpu_flash_forward,
                                 "cuda_flash": _cuda_flash_forward,
                                 "cuda_efficient": _cuda_efficient_forward}
_BACKWARD: dict[str, Callable] = {"plain": _plain_backward, "cpu_flash": _cpu_flash_backward,
                                  "cuda_flash": _cuda_flash_backward,
                                  "cuda_efficient": _cuda_efficient_backward}


def _candidates(device_type: str, dtype: torch.dtype, head_dim: int) -> list[str]:
    if device_type == "cpu" and hasattr(torch.ops.aten,
                                        "_scaled_dot_product_flash_attention_for_cpu"):
        return ["cpu_flash"]
    if device_type == "cuda":
        flash = ["cuda_flash"] if dtype in _HALF and head_dim % 8 == 0 and head_dim <= 256 else []
        return flash + (["cuda_efficient"] if dtype != torch.float64 else [])
    return []


def _agrees(kernel: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Does `kernel` give plain's output, LSE and gradients on a small block
    pair (a causal square one and a rectangular one without mask)?"""
    generator = torch.Generator().manual_seed(0)
    tolerance = 3e-2 if dtype in _HALF else 1e-4

    def tensor(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    try:
        for causal, sq, sk in ((True, 40, 40), (False, 24, 56)):
            q, k, v = tensor(1, 2, sq, head_dim), tensor(1, 2, sk, head_dim), \
                tensor(1, 2, sk, head_dim)
            dout = tensor(1, 2, sq, head_dim)
            scale = head_dim ** -0.5
            out, lse = _plain_forward(q, k, v, causal, scale)
            expected = (out, lse, *_plain_backward(dout, q, k, v, out, lse, causal, scale))
            got_out, got_lse = _FORWARD[kernel](q, k, v, causal, scale)
            got = (got_out, got_lse,
                   *_BACKWARD[kernel](dout, q, k, v, out.to(dtype), lse, causal, scale))
            for a, b in zip(expected, got):
                if a.shape != b.shape or not torch.allclose(a.float(), b.float(), atol=tolerance,
                                                            rtol=tolerance):
                    return False
    except Exception:  # noqa: BLE001 - any failure means plain: an op this torch lacks
        return False   # raises AttributeError, a refused shape RuntimeError, ...
    return True


@functools.lru_cache(maxsize=None)
def _chosen(device_type: str, index: int | None, dtype: torch.dtype, head_dim: int) -> str:
    device = torch.device(device_type, index) if index is not None else torch.device(device_type)
    for kernel in _candidates(device_type, dtype, head_dim):
        if _agrees(kernel, device, dtype, head_dim):
            return kernel
    return "plain"


def block_kernel(device: torch.device | str, dtype: torch.dtype, head_dim: int) -> str:
    """The kernel `block_forward`/`block_backward` run with kernel="auto"
    for these inputs: a name of KERNELS (probed once per device, dtype and
    head size, then remembered)."""
    device = torch.device(device)
    return _chosen(device.type, device.index, dtype, head_dim)


def resolve_kernel(kernel: str, q: torch.Tensor) -> str:
    """"auto" -> `block_kernel` for q; a name of KERNELS as it is."""
    if kernel == "auto":
        return block_kernel(q.device, q.dtype, q.shape[-1])
    if kernel not in KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; use auto or one of "
                         f"{', '.join(KERNELS)}")
    return kernel


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float, kernel: str,
                  mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [b, heads, sq, d], lse [b, heads, sq]) of softmax(q kᵀ·scale) v,
    both in the accumulation dtype (fp32 for 16-bit inputs). `mask`, a bool
    [b or 1, 1, sq, sk] (True: the query sees the key), runs "plain"
    whatever `kernel` says; a row it leaves no key gets lse −inf and out 0."""
    heads = q.shape[1]
    k, v = expand_groups(k, heads), expand_groups(v, heads)
    if mask is not None:
        out, lse = _plain_forward(q, k, v, causal, scale, mask)
    else:
        out, lse = _FORWARD[kernel](q, k, v, causal, scale)
    acc = accumulation_dtype(q.dtype)
    return out.to(acc), lse.to(acc)


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float,
                   kernel: str, mask: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's share of (dq, dk, dv), in the accumulation dtype, given
    the FINAL output and LSE of the rows (over all key blocks): the block's
    probabilities are recomputed as exp(scores − lse). `mask` as in
    `block_forward` (then "plain"; rows with lse −inf get zero gradients)."""
    heads, groups = q.shape[1], k.shape[1]
    k, v = expand_groups(k, heads), expand_groups(v, heads)
    if mask is not None:
        dq, dk, dv = _plain_backward(dout, q, k, v, out, lse, causal, scale, mask)
    else:
        dq, dk, dv = _BACKWARD[kernel](dout, q, k, v, out, lse, causal, scale)
    acc = accumulation_dtype(q.dtype)
    return dq.to(acc), fold_groups(dk.to(acc), groups), fold_groups(dv.to(acc), groups)


def merge_into(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
               block_lse: torch.Tensor) -> None:
    """Fold a block's (output, LSE) into the running (out, lse) of the same
    rows, in place: each is weighted by its share exp(lse_i − lse_new) of the
    new total. Rows that have seen no key yet hold lse = −inf."""
    new_lse = torch.logaddexp(lse, block_lse)
    finite = torch.where(torch.isinf(new_lse), torch.zeros_like(new_lse), new_lse)
    old_weight = torch.exp(lse - finite).unsqueeze(-1)
    block_weight = torch.exp(block_lse - finite).unsqueeze(-1)
    out.mul_(old_weight).add_(block_out * block_weight)
    lse.copy_(new_lse)


def attention_kernel(config, device, dtype) -> str:
    """The kernel PyTorch's scaled_dot_product_attention picks for one rank's
    attention in this run (its shapes, precision and device), as PyTorch
    names its backends; asked of PyTorch itself, not guessed (reported when
    --use-flash-attn or --attention-backend is given)."""
    m = config.model
    t = config.parallel.tensor_model_parallel_size
    heads, groups = m.num_attention_heads // t, max(1, m.query_groups // t)
    if m.has_sinks or any(m.windowed_layers):
        # Windows and sinks run on the block kernels, never on SDPA: each
        # block's log-sum-exp is what merges blocks and applies the sinks.
        return (f"ptdp's block attention (sliding windows, sinks) runs "
                f"{block_kernel(device, dtype, m.head_dim)} blocks, each returning its rows' "
                f"log-sum-exp, for {str(dtype).replace('torch.', '')} on {device.type}, {heads} "
                f"heads of width {m.head_dim} per rank, sequence {m.seq_length}, causal")
    shape = (config.train.micro_batch_size, heads, m.seq_length, m.head_dim)
    q = torch.empty(shape, device=device, dtype=dtype)
    kv = torch.empty((shape[0], groups, shape[2], shape[3]), device=device, dtype=dtype)
    gqa = {"enable_gqa": True} if groups != heads else {}  # as ptdp's attention calls it
    try:
        from torch.nn.attention import SDPBackend

        choice = torch._fused_sdp_choice(q, kv, kv, None, m.attention_dropout, True, **gqa)
        name = SDPBackend(choice).name
    except (AttributeError, RuntimeError, TypeError, ValueError):  # a PyTorch without the query
        return "PyTorch's scaled_dot_product_attention (its kernel choice cannot be queried here)"
    readable = {"FLASH_ATTENTION": "flash attention", "EFFICIENT_ATTENTION":
                "memory-efficient attention", "CUDNN_ATTENTION": "cuDNN attention",
                "MATH": "the unfused math path", "OVERRIDEABLE": "a device-specific kernel"}
    return (f"PyTorch's scaled_dot_product_attention picks {readable.get(name, name)} ({name}) "
            f"for {str(dtype).replace('torch.', '')} on {device.type}, {heads} heads of width "
            f"{m.head_dim} per rank, sequence {m.seq_length}, causal")
