"""Bytes the memory-bound operators of ptdp's layers read and write.

The cost model prices these operators as their bytes over the bandwidth of
their class (`HardwareProfile.memory_seconds`); `ptdp calibrate` measures
each class with the same byte counts (ptdp.perf.calibrate.measure), so a class's
measured bandwidth and its predicted bytes agree by construction. Each
function returns (forward bytes, backward bytes); E is the bytes per
element of the workload's precision.
"""

from __future__ import annotations

OPTIMIZER_BYTES_PER_PARAMETER = 112   # ptdp's eager AdamW + inf check + norm + clip (fp32 state)
# Megatron-LM's and NeMo's step (HardwareProfile.fused_optimizer): fused
# multi-tensor kernels (apex's or Transformer Engine's), per parameter the
# gradient norm's read of the fp32 gradient (4) and Adam's read of weight,
# gradient and both moments and write of weight and moments (28); with a
# loss scale (fp16) the unscale and inf check read and write the gradient
# first (8). Gradients are scaled for clipping only when the norm exceeds
# the threshold, not counted.
FUSED_OPTIMIZER_BYTES_PER_PARAMETER = 32
FUSED_UNSCALE_BYTES_PER_PARAMETER = 8


def optimizer_bytes_per_parameter(fused: bool, precision: str) -> int:
    """Bytes the optimizer step moves per parameter a rank owns (fp32 state),
    before the copy of the main weights into the model's."""
    if not fused:
        return OPTIMIZER_BYTES_PER_PARAMETER
    return FUSED_OPTIMIZER_BYTES_PER_PARAMETER + (
        FUSED_UNSCALE_BYTES_PER_PARAMETER if precision == "fp16" else 0)


def attention_core_bytes(scores: int, E: int, dropout: bool) -> tuple[float, float]:
    """(forward, backward) bytes of scale+mask+softmax (and dropout) over
    `scores` = b·(a/t)·s² elements."""
    forward, backward = 2 * scores * E, 3 * scores * E
    if dropout:
        forward += 2 * scores * E + scores      # read, write, 1-byte mask
        backward += 2 * scores * E + scores
    return forward, backward


def layer_norm_bytes(n: int, E: int) -> tuple[float, float]:
    return 2 * n * E, 3 * n * E


def gelu_bytes(ffn: int, E: int) -> tuple[float, float]:
    """bias + GeLU over `ffn` = b·s·f/t elements; backward recomputes it."""
    return 2 * ffn * E, 3 * ffn * E


def swiglu_bytes(ffn: int, E: int) -> tuple[float, float]:
    """silu(gate) ⊙ up over `ffn` = b·s·f/t outputs: forward reads gate and
    up and writes the product; backward reads the gradient, gate and up and
    writes both their gradients (the sigmoid recomputed)."""
    return 3 * ffn * E, 5 * ffn * E


def rotary_bytes(elements: int, E: int, fused: bool = False) -> tuple[float, float]:
    """Rotating `elements` of q and k as ptdp.model.rotary runs it, eagerly:
    x·cos + cat(−x₂, x₁)·sin is five passes of N = `elements` (x·cos 2N,
    the negated half N, the cat 2N, ·sin 2N, the add 3N: 10N reads and
    writes; the tables are small and stay in cache). Backward the same
    count: the gradient times sin and cos (2N each), the negated half (N),
    the halves put back together (2N) and the two paths added (3N).
    `fused` (a run with a fused RoPE kernel, HardwareProfile.fused_rope):
    one read and one write each way."""
    passes = 2 if fused else 10
    return passes * elements * E, passes * elements * E


def residual_bytes(n: int, E: int, dropout: bool) -> tuple[float, float]:
    """bias + dropout + residual add over `n` = b·s·h elements."""
    return 3 * n * E + (n if dropout else 0), 2 * n * E + (n if dropout else 0)


def copy_bytes(elements: int, E: int) -> tuple[float, float]:
    """A layout change (permute + contiguous) forward, and its gradient's."""
    return 2 * elements * E, 2 * elements * E


def layer_memory_ops(n: int, n_local: int, ffn: int, scores: int, E: int, *,
                     hidden_dropout: bool, attention_dropout: bool, heads_local: int | None = None,
                     swiglu: bool = False, rotated: int = 0, fused_rope: bool = False,
                     outside: int | None = None, sandwich: bool = False,
                     sinks: int = 0) -> list[tuple[str, float, float]]:
    """(class, forward bytes, backward bytes) of one transformer layer's
    memory-bound operators: n = b·s·h, n_local = n/t, ffn = b·s·f/t,
    scores = b·(a/t)·s². `outside`: the elements each rank's norms and
    bias+dropout+adds run on, n (the default), or n/t under sequence
    parallelism. The Llama options: `heads_local` = b·s·(a + 2g)·d/t
    + b·s·a·d/t, the q/k/v and context elements reshaped (4·n_local without
    grouped queries); `swiglu` prices the gated activation instead of GeLU
    (in the "gelu" class, the element-wise activation); `rotated` =
    b·s·(a + g)·d/t, the q and k elements rotary embeddings rotate
    (`fused_rope`: by one fused kernel). RMSNorm
    is priced as LayerNorm (one read and one write forward, as fused
    kernels do; its statistics are 1/h of that). `sandwich` (Gemma 3's
    --sandwich-norm) adds the norms after attention and after the MLP;
    `sinks` = b·s·a·d/t, the attention output the sinks rescale (a read and
    a write forward; backward the sink gradient's rowsum(dO · O) reads both)."""
    reshaped = 4 * n_local if heads_local is None else heads_local
    outside = n if outside is None else outside
    ops = [("layer_norm", *layer_norm_bytes(outside, E)),
           ("elementwise", *copy_bytes(reshaped, E))]           # q/k/v to heads, context back
    if rotated:
        ops.append(("elementwise", *rotary_bytes(rotated, E, fused_rope)))
    if sinks:
        ops.append(("elementwise", 2 * sinks * E, 2 * sinks * E))
    ops += [("attention_core", *attention_core_bytes(scores, E, attention_dropout)),
            ("layer_norm", *layer_norm_bytes(outside, E)),
            ("gelu", *(swiglu_bytes if swiglu else gelu_bytes)(ffn, E)),
            ("residual", *residual_bytes(outside, E, hidden_dropout)),
            ("residual", *residual_bytes(outside, E, hidden_dropout))]
    if sandwich:
        ops += [("layer_norm", *layer_norm_bytes(outside, E))] * 2
    return ops


def cross_entropy_bytes(logits: int, E: int = 4) -> tuple[float, float]:
    """ptdp's vocabulary-parallel cross entropy (ptdp.parallel.tensor) over
    `logits` elements of E bytes, as it runs: forward the cast to fp32
    (read E, write 4; none at E = 4), the max (read 4), the shift (read and
    write 4), exp in place (8), the sum (4) and the softmax's division in
    place (8); backward the scale in place (8) and the cast back (read 4,
    write E; none at E = 4). The gather and the one-hot's scatter touch one
    element per token."""
    cast = E + 4 if E != 4 else 0
    return (cast + 4 + 8 + 8 + 4 + 8) * logits, (8 + cast) * logits
