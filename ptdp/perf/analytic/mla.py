"""What multi-latent attention (ptdp.model.mla) keeps for its backward, per
microbatch on one tensor rank, beyond what ptdp.perf.analytic.memory counts
for any layer (the first norm's output, which the down projections — or
without --q-lora-rank the query projection — keep as their input, and the
output projection's input, a·d_v per token over t), and the recomputation
modules' share of it (--recompute-modules core_attn, mla_up_proj;
ptdp.config.recompute). Measured exactly on CPU (fp32, bf16; t = 1 and t = 2
with sequence parallelism: tests/test_context_parallel_memory.py); the cuda
figure is derived from the kernels' saved tensors.

Notation: a heads, t tensor ranks, T = b·s/c tokens of a microbatch, R the
tokens a rank holds outside the tensor-parallel regions (T, or T/t under
sequence parallelism), r_q = --q-lora-rank, r_kv = --kv-lora-rank, d_n =
--qk-head-dim, d_r = --qk-pos-emb-head-dim, d_v = --v-head-dim, d_qk = d_n +
d_r, e bytes per element.

  latents (replicated, R rows; the up projections keep them as their input,
    gathered again in backward under sequence parallelism):
    query   with --q-lora-rank: its latent R·r_q·e, or with --qk-layernorm
            the latent norm's tensors (as the layer norms': see
            `latent_norm_bytes`) and its output R·r_q·e;
    key/value  the down projection's output R·(r_kv + d_r)·e (the latent
            and the shared rotated key are views of it), or with
            --qk-layernorm the norm's tensors over the latent and its output
            R·r_kv·e;
  attention core (heads a/t over all T tokens): q and k are new tensors
    (the rotated parts concatenated), v a view of the key/value up
    projection's output T·a/t·(d_n + d_v)·e;
    cpu: keys and values of different widths go to PyTorch's math kernel
      (fp32 even for 16-bit inputs): q·scale and kᵀ 2·T·a/t·d_qk·4, the
      softmax a/t·s²·b·4 (with attention dropout also its mask and the
      dropped probabilities, 3 such), v (fp32: the up projection's output
      itself; 16-bit: an fp32 copy T·a/t·d_v·4); keys and values of one
      width (and no attention dropout) its flash kernel: q, k, the up
      projection's output, its own output T·a/t·d_v·e (the output
      projection's input is a reshaped copy of it) and the log-sum-exp
      T·a/t·4;
    cuda: the flash / memory-efficient kernel, keeping what the CPU's flash
      kernel keeps;
  selective recomputation of core_attn keeps q, k and the up projection's
    output instead of the core's tensors; mla_up_proj (output-discarding)
    frees q, k and the up projection's output once the core has used them:
    the core's own copies (the math kernel's) stay, the checkpoint keeps
    the latents (the down projections' outputs) it starts from, and the
    latent norms' tensors and the rotary tables are not kept (they are
    used inside it).
"""

from __future__ import annotations

from ptdp.config import ModelConfig

FP32 = 4


def latent_norm_bytes(model: ModelConfig, rows: int, width: int, stored: int, e: int,
                      cpu: bool) -> int:
    """What a latent norm over `width` values of `rows` tokens keeps,
    besides its output, when its input is a view of a `stored`-wide tensor
    (the key/value latent is a view of the down projection's output):
    LayerNorm the input (its storage) and the mean and rstd; RMSNorm on the
    CPU the fp32 input (the storage itself in fp32, else an fp32 copy of the
    view), the fp32 normalized input and rstd; on GPUs the input and rstd."""
    if model.normalization == "LayerNorm":
        return rows * stored * e + 2 * rows * (e if cpu else FP32)
    if cpu:
        fp32_input = rows * stored * FP32 if e == FP32 else rows * width * FP32
        return fp32_input + rows * width * FP32 + rows * FP32
    return rows * stored * e + rows * FP32


def math_kernel_on_cpu(model: ModelConfig) -> bool:
    """Whether PyTorch's CPU attention takes the math kernel for MLA: values
    of another width than the keys', or attention dropout."""
    return model.mla_query_head_dim != model.v_head_dim or model.attention_dropout > 0


def mla_saved_bytes(model: ModelConfig, t: int, b: int, seq: int, rows: int, e: int, *,
                    cpu: bool, modules: frozenset = frozenset()) -> int:
    """Bytes MLA keeps for backward on one tensor rank beyond the first
    norm's output and the output projection's input (module docstring), for
    `b` sequences of `seq` positions (s/c), `rows` R of them outside the
    tensor-parallel regions (T/t under sequence parallelism) and `modules`
    the --recompute-modules that act (empty without selective recomputation)."""
    a, tokens = model.num_attention_heads // t, b * seq
    r_kv, d_r, d_v = model.kv_lora_rank, model.qk_pos_emb_head_dim, model.v_head_dim
    d_qk, d_n = model.mla_query_head_dim, model.qk_head_dim
    # mla_up_proj: the checkpoint keeps the down projections' outputs only
    normed = model.qk_layernorm and "mla_up_proj" not in modules
    latents = rows * (r_kv + d_r) * e   # the key/value down projection's output
    if normed:
        latents = latent_norm_bytes(model, rows, r_kv, r_kv + d_r, e, cpu) + rows * r_kv * e
    if model.q_lora_rank is not None:
        r_q = model.q_lora_rank
        latents += rows * r_q * e       # the query down projection's output
        if normed:
            latents += latent_norm_bytes(model, rows, r_q, r_q, e, cpu)
    # The up projections' outputs the core reads: q and k (new tensors) and
    # the key/value output v is a view of; freed under mla_up_proj.
    up = 0 if "mla_up_proj" in modules else tokens * a * (2 * d_qk + d_n + d_v) * e
    if "core_attn" in modules:
        return latents + up
    if cpu and math_kernel_on_cpu(model):
        # fp32 copies of q·√scale and k·√scale, the s×s tensors, and v: in
        # fp32 a view of the up projection's output, else an fp32 copy
        scores = a * tokens * seq * FP32 * (3 if model.attention_dropout > 0 else 1)
        value = (tokens * a * d_v * FP32 if e != FP32 else
                 0 if "mla_up_proj" in modules else tokens * a * (d_n + d_v) * e)
        return latents + 2 * tokens * a * d_qk * FP32 + scores + value
    lse = tokens * a * FP32
    # (the kernel's output is [b, heads, s, d_v]: the output projection's
    # input is a reshaped copy of it)
    return latents + up + lse + tokens * a * d_v * e


def mla_weight_grad_bytes(model: ModelConfig, t: int, tokens: int, rows: int, e: int) -> int:
    """What MLA's deferred weight gradients hold from B until W under a
    zero-bubble schedule (ptdp.parallel.weight_grad; derived, as the
    ordinary layer's figure): each tensor-parallel projection's input (the
    query latent's or, without --q-lora-rank, the first norm's output, and
    the key/value latent, R rows each; the output projection's T·a/t·d_v)
    and output gradient (q's T·a/t·d_qk, the key/value up projection's
    T·a/t·(d_n + d_v), the output projection's whole T·h). The down
    projections are replicated, not deferred: their weight gradients are
    computed in B."""
    a = model.num_attention_heads // t
    query_in = model.hidden_size if model.q_lora_rank is None else model.q_lora_rank
    inputs = rows * (query_in + model.kv_lora_rank) + tokens * a * model.v_head_dim
    gradients = (tokens * a * (model.mla_query_head_dim + model.qk_head_dim + model.v_head_dim)
                 + tokens * model.hidden_size)
    return (inputs + gradients) * e
