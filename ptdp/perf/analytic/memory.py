"""Bytes on one device: weights, gradients, optimizer state and the
activations each pipeline rank keeps at its peak, for one `Workload` under
one `Layout`, from what ptdp's code actually allocates and saves (tests
compare it with measurements of real CPU runs). Notation as in
ptdp.perf.analytic.counts, which counts the parameters and walks the schedules'
compute orders this module sums over.

With low-rank adapters (Workload.lora) the buffer holds the adapters only
and the frozen base is N_base·e beside it; activations change as
ptdp.perf.analytic.lora describes (measured like the rest).

Memory (bytes on one device; GradBuffer and Optimizer in ptdp):
    weights     N·e                  the flat parameter buffer (N: its
                                     elements, parameters plus bucket padding)
    gradients   4·N (+ 4·N/d)        fp32 gradient buffer, whatever the
                                     dtype (+ the fp32 reduce-scattered shard
                                     with the distributed optimizer)
    optimizer   12·N/d               distributed: fp32 main + 2 Adam moments
                12·N                 plain, bf16/fp16: fp32 main + moments
                 8·N                 plain, fp32: the model's weights are main
    activations see `activation_bytes` and `memory_per_rank`.
Under ZeRO-2 and ZeRO-3 (Layout.sharding optim_grads, optim_grads_params)
the gradients are the 4·N/d shard plus a few buckets in flight, and ZeRO-3
keeps N/d·e of the weights plus the units gathered at once: see
ptdp.perf.analytic.sharding (the table of every strategy).
The distributed optimizer pads every bucket to a multiple of d (less than
d elements per bucket); it is counted exactly, from the same bucket cutting
GradBuffer does.

Mixture of experts under expert parallelism (Layout.ep, Layout.etp): N
holds this rank's E/EP routed experts of each MoE layer, each split over
ETP (the router, the shared expert and its gate as dense parameters). The
routed experts' parameters sit in buckets of their own, replicated over
the EDP = t·d/(ETP·EP) ranks holding the same expert shard rather than d:
the distributed optimizer pads those buckets to a multiple of EDP and each
rank owns 1/EDP of them, so N/d above reads N_dense/d + N_expert/EDP.

Activations: bytes saved for backward per microbatch, per layer and device
(`activation_bytes`), for ptdp's own layer with t-way tensor parallelism
and dropout on. Two kernel sets:

  kernels="cpu" (eager PyTorch, as tests measure them; exact for torch 2.13):
    replicated [s,b,h]: LN1 input, LN1 output (QKV input), LN2 input, LN2
        output (MLP input): 4·sbh·e; hidden-dropout masks, 2 of them, in the
        activation dtype: 2·sbh·e; LayerNorm mean and rstd: 4·s·b·e
    split over t: attention output (dense input) sbh/t·e, MLP's first
        output (GeLU input) and GeLU output 2·s·b·f/t·e
    attention core with attention dropout: the math kernel, which computes
        in fp32 even for 16-bit inputs: q·scale, kᵀ, v copies 3·sbh/t·4 and
        softmax, dropout mask, dropped probabilities 3·a·s²·b/t·4
    attention core without attention dropout: the flash kernel: q, k, v
        (one buffer) 3·sbh/t·e and logsumexp 4·a·s·b/t; its output is laid
        out like q, [s, b, heads, d], so it is the dense layer's input
        itself (no copy)
  kernels="cuda" (derived from the kernels' saved tensors, not measured
    here): flash / memory-efficient attention also with dropout (so no s×s
    tensor at all): 3·sbh/t·e + 4·a·s·b/t, output taken to be laid out
    like q as on the CPU (if a kernel returns another layout, the reshape
    for the dense layer copies: one more sbh/t·e, 2/34 of a bf16 layer);
    dropout masks bool (1 byte); LayerNorm statistics fp32 (4·s·b·4).

  selective recomputation keeps q, k, v (3·sbh/t·e) instead of the
    attention core's tensors; full recomputation (uniform, 1 layer per
    group) keeps the layer input only, sbh·e.

  So, cpu, f = 4h, t = 1, dropout on: no recomputation
  s·b·h·(15·e + 12 + 12·a·s/h) + 4·s·b·e (fp32: 72 + 12as/h; bf16: 42 +
  12as/h, per s·b·h), selective 18·e·sbh, full e·sbh. For reference,
  Korthikanti et al. (2022) count s·b·h·(34 + 5·a·s/h) for Megatron's
  fp16 layer with its fused softmax (2-byte probabilities, 1-byte masks);
  ptdp's cuda estimate for bf16 is the same tensors, s·b·h·34, without the
  s² term (flash attention keeps none) plus the logsumexp (4·a·s·b) and
  fp32 LayerNorm statistics (16·s·b). The cpu figure exceeds 34 by fp32
  copies of q, k, v (+6) and 2-byte masks (+2), and its s² term is 12as/h
  (three fp32 s×s tensors) instead of 5as/h.

  The Llama family's options change these terms (measured on CPU like the
  rest; the cuda figures are derived):
    RMSNorm: each norm keeps rstd (one value per position) instead of mean
      and rstd. On the CPU torch.rms_norm is decomposed into fp32
      element-wise ops, which keep the fp32 input and the fp32 normalized
      input instead of the input: 2·sbh·4 + s·b·4 per norm; on GPUs the
      fused kernel keeps the input and an fp32 rstd: sbh·e + s·b·4.
    SwiGLU: the MLP's first output [gate | up] (2·s·b·f/t) and the gated
      product (s·b·f/t, the second matrix's input) — ptdp's SwiGLU node
      recomputes the sigmoid — so 3·s·b·f/t·e instead of GeLU's 2.
    grouped-query attention: the QKV output is (a + 2g)·d·s·b/t elements
      (k and v have g heads); flash attention and selective recomputation
      keep it, so 3·sbh/t·e becomes (a + 2g)·d·s·b/t·e. The CPU math
      kernel (attention dropout) repeats k and v to a heads, so its fp32
      copies stay 3·sbh/t·4.
    rotary embeddings: the rotated q and k are new tensors that flash
      attention (or the selective checkpoint) keeps besides the QKV output
      that v is a view of: (a + g)·d·s·b/t·e more; the math kernel copies
      them, so it keeps no more. Each layer's cos and sin tables
      (2·s·d·e) are made once and shared by every microbatch: counted once
      per layer held, not per microbatch. The first stage keeps no
      position ids.
    no linear biases: nothing saved changes (biases are added in the
      matrix product or fused where they exist).
    an untied output layer saves the same as the tied one.

  Stage extras per microbatch: the first stage keeps the token ids (int64;
  with t = 1 the [b, s+1] sample they are a view of), the position ids
  (learned positions only) and the embedding-dropout mask sbh·e; the last
  stage keeps what the final norm saves and its output, the fp32 softmax of the
  cross entropy [s, b, V'/t] (4·s·b·V'/t, whatever the dtype), the local
  targets (int64) and their out-of-range mask (bool).

  Sequence parallelism (Layout.sequence_parallel, t > 1; Korthikanti et
  al. 2022): every replicated [s, b, h] term above is held for the rank's
  own s/t positions, i.e. divided by t — the norms' inputs, outputs and
  statistics, the hidden-dropout masks, and the QKV and MLP inputs, which
  the column-parallel layers save as the s/t slice and all-gather again in
  backward; the split terms are unchanged (the tensor-parallel regions see
  the whole sequence). So a layer keeps (cuda, bf16) s·b·h·34/t + 4·a·s·b/t
  + 16·s·b/t, Korthikanti's s·b·h·(34/t + 5·a·s/(h·t)) without the s² term
  plus the logsumexp and fp32 statistics; full recomputation keeps sbh·e/t
  (the layer input's slice), selective the split q, k, v plus the
  replicated terms over t. Stage extras: the embedding keeps its position
  ids (s/t) and dropout mask (sbh·e/t) for its own positions, the last
  stage its final norm's tensors and the output layer's s/t input; the
  token ids, the logits' softmax and the targets stay whole. Checked
  exactly against one layer and a whole model on every rank of t = 2 and
  t = 4 tensor groups (tests/test_sequence_parallel_perf.py).
  `layer_activation_bytes` gives one layer's figure for any of these.

  Context parallelism (Layout.c, --cp-comm-type Layout.cp_comm): every term
  above is of the rank's own s/c positions (s/(c·t) under sequence
  parallelism), and the attention keeps what `_context_attention_saved`
  lists instead of one rank's q, k, v: at least its output beside the
  dense layer's copy, and for all_gather and a2a the exchanged tensors.
  Stage extras: a context rank keeps its own copy of its token ids. Checked
  exactly for c = 1, 2, 4 (tests/test_context_parallel_memory.py).

  Mixture of experts: each MoE layer saves, instead of the dense MLP's
  input and activations, what ptdp.perf.analytic.moe.moe_saved_bytes lists
  (the router's tensors, the routed pairs and their experts' activations,
  the shared expert), measured exactly on one CPU process
  (tests/test_moe_perf.py); `moe_activation_bytes` adds the difference for
  the MoE layers of each chunk. Zero-bubble schedules' deferred figure is
  the dense layer's for MoE layers too.

  Multi-latent attention (--multi-latent-attention): the attention's terms
  are ptdp.perf.analytic.mla's (the latents, q and k, the up projection's
  output, the kernel's), the output projection's input a·d_v·s·b/t·e and
  the rotary tables 2·s·d_r·e. Multi-token prediction (--mtp-num-layers
  D): the last stage keeps per microbatch what
  ptdp.perf.analytic.mtp.mtp_activation_bytes lists (a layer, two norms, the
  2h-wide concatenation and the output layer again per module), and its D
  layers' rotary tables once.

  --recompute-modules (selective recomputation by module): layernorm keeps
  each norm's input only (its output, which the next product keeps, is
  freed and recomputed); mlp a dense MLP's input only; core_attn (the
  default) q, k, v instead of the core's tensors; mla_up_proj, moe, moe_act
  and shared_experts as ptdp.perf.analytic.mla and .moe say. Measured when
  the forward returns (ptdp.perf.analytic.saved.HeldTensorBytes): the
  output-discarding ones free storages after saving them.

  A rank holds these for every (microbatch, chunk) it has run forward and
  not yet backward. `memory_per_rank` walks the rank's compute order of the
  schedule (the generators' order) and takes the peak of the sum, so the
  embedding and output extras count only for the chunks that have them.

  Zero-bubble schedules (ZB-H1, ZB-V): B frees what the forward saved except
  what the deferred weight gradients hold (ptdp.parallel.weight_grad's
  closures keep each linear layer's input and output gradient; autograd
  frees the rest as B runs), so a (microbatch, chunk) weighs the figures
  above from its F until its B and "weight_grad_layer" per layer from its B
  until its W (the output layer computes its weight gradient in B):
    inputs   the first and second norm outputs (QKV's and the MLP's inputs;
             s/t of the positions under sequence parallelism, the saved
             slice W re-gathers) 2·sbh·e, the context a·d·s·b/t·e, the MLP
             activation's output s·b·f/t·e;
    gradients QKV's output (a + 2g)·d·s·b/t·e, the projection's and the
             second MLP GEMM's [s, b, h] (whole, also under sequence
             parallelism) 2·sbh·e, the first MLP GEMM's s·b·f/t·e (2f with
             SwiGLU);
    output   the final norm's output (s/t under sequence parallelism) and
             the logits' gradient s·b·V'/t·e.
  With full recomputation B rebuilds these inputs, so they are held from B
  to W although F kept only the layer input. The walk follows
  zero_bubble.py's per-rank orders; the count of activations held at once
  (F until W) is Schedule.in_flight_bound. Under ZB-V rank 0 holds the first
  and the last stage (the embedding and the output extras) and one word
  embedding (a tied output layer is the same parameter), and no activation
  or gradient crosses between stages p−1 and p (both on rank p−1).
  Transient memory (a forward's or backward's working tensors, received
  buffers not yet used, 16-bit .grad before it is added to the fp32 buffer)
  is not counted. Neither is what the executor keeps a little too long:
  its local variables hold the graph of the last backwarded microbatch
  (`out`, and on the last stage `loss`) until the next forward ends, and
  with it that microbatch's stage input, up to 2·sbh·e more than counted
  here (measured in the tests).
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from typing import Any, Iterator

from ptdp.config import ModelConfig, TrainConfig
from ptdp.perf.analytic.counts import (FP32, cut_placed_buckets, parameters_per_rank,
                                       placement_of_parameters, stash_peaks)
from ptdp.perf.analytic.sharding import state_bytes, unit_buckets
from ptdp.perf.analytic.lora import (adapted_targets, cut_adapter_buckets, first_adapted_layer,
                                     layer_delta_bytes)
from ptdp.schedules.kinds import virtual_stage_of
from ptdp.perf.layout import BYTES_PER_ELEMENT, ByValue, Layout, Workload
from ptdp.perf.analytic.mla import mla_saved_bytes, mla_weight_grad_bytes
from ptdp.perf.analytic.mtp import mtp_activation_bytes, mtp_rotary_tables
from ptdp.perf.analytic.norm_bytes import norm_saved_bytes
from ptdp.perf.analytic.moe import chunk_moe_layers, moe_layer_activation_delta

KERNELS = ("cuda", "cpu")
INT64 = 8


def activation_bytes(workload: Workload, layout: Layout, *, kernels: str = "cuda",
                     workload_key: ByValue | None = None) -> dict[str, int]:
    """Bytes saved for backward per microbatch on one device: "layer" (one
    transformer layer, with the layout's recomputation), "embedding" (the
    first stage's extra) and "output" (the last stage's extra); and
    "rotary_tables", the cos and sin tables one layer keeps with rotary
    embeddings (2·s·d·e, once per layer, shared by every microbatch). See
    the module docstring for each term. `workload_key`: ByValue(workload),
    made once by a caller that asks for many layouts."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels={kernels!r}: use one of {', '.join(KERNELS)}")
    # What is saved depends on t, b, the recomputation, sequence parallelism
    # and context parallelism (c and its comm type) only.
    return dict(_activation_bytes(ByValue(workload) if workload_key is None else workload_key,
                                  Layout(t=layout.t, b=layout.b, recompute=layout.recompute,
                                         sequence_parallel=layout.splits_sequence, c=layout.c,
                                         cp_comm=layout.cp_comm), kernels))


@lru_cache(maxsize=4096)
def _activation_bytes(key: ByValue, layout: Layout, kernels: str) -> dict[str, int]:
    workload = key.value
    model, e = workload.model, workload.bytes_per_element
    t, b, c = layout.t, layout.b, layout.c
    # Context parallelism: every term below is of the rank's own s/c positions.
    s, h, a, f = model.seq_length // c, model.hidden_size, model.num_attention_heads, model.ffn_size
    g, d = model.query_groups, model.head_dim
    sb = s * b
    # Positions a rank holds outside the tensor-parallel regions (norms,
    # dropout, residual adds, the column-parallel layers' saved inputs):
    # all s, or its own s/t under sequence parallelism.
    rows = sb // t if layout.splits_sequence else sb
    outside = rows * h
    cpu = kernels == "cpu"
    mask = (e if cpu else 1) if model.hidden_dropout > 0 else 0   # bytes per masked element
    norm = norm_saved_bytes(model, rows, e, cpu)
    # What the attention core keeps of q, k and v: the QKV output (q, k and
    # v are views of it; grouped queries shrink k and v to g heads) and,
    # with rotary embeddings, the rotated q and k (new tensors; v stays a
    # view, so the whole QKV output stays alive).
    qkv = (a + 2 * g) * d * sb // t * e
    if model.rope:
        qkv += (a + g) * d * sb // t * e
    # GeLU: its input, output; gated (SwiGLU, GeGLU): [gate | up], output
    mlp_saved = 3 if model.gated_linear_unit else 2

    # --recompute-modules (selective): layernorm keeps each norm's input
    # only, its output (what the next product keeps) freed; mlp keeps the
    # dense MLP's input only; core_attn keeps q, k, v instead of the core's.
    modules = recomputed_modules(model, layout.recompute)
    norm_kept = outside * e if "layernorm" in modules else outside * e + norm
    mlp_kept = 0 if "mlp" in modules else mlp_saved * s * b * f // t * e
    context = a * (model.v_head_dim if model.multi_latent_attention else d) * sb // t * e
    if layout.recompute == "full":
        layer = outside * e
    elif model.multi_latent_attention:
        layer = (2 * norm_kept + 2 * outside * mask + context + mlp_kept
                 + mla_saved_bytes(model, t, b, s, rows, e, cpu=cpu, modules=modules))
    else:
        layer = 2 * norm_kept + 2 * outside * mask + context + mlp_kept
        if "core_attn" in modules:
            layer += qkv
        elif cpu and model.attention_dropout > 0:
            # The math kernel's fp32 q·scale, kᵀ and v (k and v repeated to
            # all a heads under grouped queries) and its three s×s tensors.
            layer += 3 * a * d * sb // t * FP32 + 3 * (a // t) * s * s * b * FP32
        elif c == 1:
            layer += qkv + (a // t) * s * b * FP32
        else:   # the log-sum-exp as above; q, k, v and the exchange's own tensors
            layer += _context_attention_saved(model, layout, sb, e, qkv) + (a // t) * sb * FP32

    # The token ids: one process keeps the [b, s+1] sample they view, a
    # context rank its own copy of its s/c positions' ids, a tensor rank its
    # local ids and their out-of-range mask.
    if t == 1:
        tokens = INT64 * b * (s + 1) if c == 1 else INT64 * sb
    else:
        tokens = INT64 * sb + sb
    positions = 0 if model.rope else INT64 * (s // t if layout.splits_sequence else s)
    embedding = tokens + positions + outside * mask
    padded = model.padded_vocab_size(t)
    output = (norm + outside * e + FP32 * sb * padded // t + INT64 * sb + sb
              + (padded // t if padded > model.vocab_size else 0))
    # (MLA rotates its d_r-wide part only)
    rotated = model.qk_pos_emb_head_dim if model.multi_latent_attention else d
    tables = 2 * s * rotated * e if model.rope else 0
    # Zero-bubble schedules: what a microbatch keeps from its B until its W
    # (ptdp.parallel.weight_grad): each deferred linear layer's input (the
    # first norm's output, or its s/t slice under sequence parallelism; the
    # context; the second norm's output; the MLP activation's output) and
    # output gradient (QKV's; the projection's and the second MLP GEMM's
    # whole [s, b, h], all-gathered under sequence parallelism; the first
    # MLP GEMM's, SwiGLU's gate and up). The output layer keeps its weight
    # gradient in B: nothing of it waits for W.
    up = (2 if model.gated_linear_unit else 1) * f
    weight_grad_layer = (2 * outside + a * d * sb // t + sb * f // t
                         + (a + 2 * g) * d * sb // t + 2 * sb * h + sb * up // t) * e
    if model.multi_latent_attention:
        # (the MLP's: the second norm's output, its activation, both output gradients)
        weight_grad_layer = mla_weight_grad_bytes(model, t, sb, rows, e) + (
            outside + sb * f // t + sb * h + sb * up // t) * e
    return {"layer": layer, "embedding": embedding, "output": output, "rotary_tables": tables,
            "weight_grad_layer": weight_grad_layer}


def recomputed_modules(model: ModelConfig, recompute: str | None) -> frozenset:
    """The --recompute-modules that act: the model's under selective
    recomputation (core_attn alone by default), none otherwise."""
    return frozenset(model.recompute_modules) if recompute == "selective" else frozenset()


def _context_attention_saved(model: ModelConfig, layout: Layout, sb: int, e: int,
                             qkv: int) -> int:
    """What ptdp.parallel.context_attention keeps for its backward (c > 1,
    no recomputation) besides the log-sum-exp, for the rank's sb = s/c·b
    positions; `qkv` is what the single-rank kernel keeps of q, k and v.
    Measured on CPU (tests/test_context_parallel_memory.py); the same code
    runs on GPUs, so the cuda figure is the same.

    p2p and all_gather keep their output laid out as the dense layer's
    input, one storage (counted with the layer); a2a's output is head-split,
    so it keeps it besides the dense input, a·d·sb/t·e.
      p2p: q, k and v as given, like one rank (`qkv`); the backward ring
        passes the key/value blocks again.
      all_gather: q as given (with rotary embeddings the rotated q alone,
        as k and v go into the gather, which keeps nothing of them; without,
        q is a view of the whole QKV output), the gathered keys and values
        of the whole sequence 2·g·d·s·b/t·e, and the int64 index of the
        whole sequence that puts them in natural order (8·s).
      a2a: nothing of the local q, k, v (the all-to-all keeps nothing); the
        head-split q, k, v, of the same size as the QKV output, and the
        two int64 reorder indices of the whole sequence (16·s)."""
    g, d, a, t, c = model.query_groups, model.head_dim, model.num_attention_heads, layout.t, layout.c
    seq = model.seq_length
    out = a * d * sb // t * e
    if layout.cp_comm == "all_gather":
        q = a * d * sb // t * e if model.rope else (a + 2 * g) * d * sb // t * e
        return q + 2 * g * d * sb * c // t * e + INT64 * seq
    if layout.cp_comm == "a2a":
        return (a + 2 * g) * d * sb // t * e + out + 2 * INT64 * seq
    return qkv


def korthikanti_activation_bytes_per_layer(model: ModelConfig, b: int, t: int = 1, *,
                                           sequence_parallel: bool = False) -> float:
    """Reference (Korthikanti et al. 2022, Megatron's fp16 layer):
    s·b·h·(10 + 24/t + 5·a·s/(h·t)), 34 + 5as/h at t = 1; with sequence
    parallelism the replicated 10 is split too: s·b·h·(34/t + 5·a·s/(h·t))."""
    s, h, a = model.seq_length, model.hidden_size, model.num_attention_heads
    replicated = 10 / t if sequence_parallel else 10
    return s * b * h * (replicated + 24 / t + 5 * a * s / (h * t))


def _precision(dtype: Any) -> str:
    """"fp32", "bf16" or "fp16" from those names, torch's dtype names
    ("float32", "bfloat16", "float16") or a torch.dtype."""
    name = str(dtype).removeprefix("torch.")
    name = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16",
            "half": "fp16"}.get(name, name)
    if name not in BYTES_PER_ELEMENT:
        raise ValueError(f"dtype {dtype!r}: use fp32, bf16 or fp16")
    return name


AS_CONFIGURED = "as configured"


def layer_activation_bytes(model: ModelConfig, b: int, t: int = 1, *,
                           sequence_parallel: bool = False,
                           recompute: str | None = AS_CONFIGURED,
                           dtype: Any = "bf16", kernels: str = "cpu", c: int = 1,
                           cp_comm: str = "p2p") -> int:
    """Bytes one transformer layer's forward saves for its backward on one
    tensor (and context) rank, per microbatch of `b` sequences of
    `model.seq_length`: what saved-tensor hooks
    (ptdp.perf.analytic.saved.SavedTensorBytes) measure around one layer built with
    `GPT(..., pre_process=False, post_process=False, sequence_parallel=...,
    cp_comm_type=...)`; with `c` context ranks (--cp-comm-type `cp_comm`)
    it is fed the rank's [s/c, b, h] ([s/(c·t), b, h] under sequence
    parallelism). `recompute`: None, "selective" or "full"
    (a layer is its own checkpoint group); by default the model's
    recompute_granularity. `dtype`: "fp32", "bf16", "fp16" or a
    torch.dtype; `kernels`: "cpu" (eager PyTorch, exact on torch 2.13) or
    "cuda" (derived). With rotary embeddings it includes the layer's cos
    and sin tables (2·s·d·e; MLA's 2·s·d_r·e) where the layer's autograd
    saves them (`tables_saved`); `memory_per_rank` counts those once per
    layer, not per microbatch, whatever the recomputation (each layer's
    Rotary caches them). Raises ValueError for a t the model
    cannot take, or sequence parallelism with t = 1 or t not dividing s."""
    if recompute == AS_CONFIGURED:
        recompute = model.recompute_granularity
    layout = Layout(t=t, b=b, recompute=recompute, sequence_parallel=sequence_parallel, c=c,
                    cp_comm=cp_comm)
    problems = layout.valid_for(model, global_batch=b)
    if problems:
        raise ValueError("; ".join(problems))
    figures = activation_bytes(Workload(model, b, _precision(dtype)), layout, kernels=kernels)
    return figures["layer"] + (figures["rotary_tables"] if tables_saved(model, recompute) else 0)


def tables_saved(model: ModelConfig, recompute: str | None) -> bool:
    """Whether a layer's autograd saves its rotary cos and sin tables (each
    layer's Rotary caches them, so `memory_per_rank` counts them either
    way): not where they are used only inside a checkpoint, under full
    recomputation or MLA's --recompute-modules mla_up_proj."""
    return recompute != "full" and not (model.multi_latent_attention and "mla_up_proj" in
                                        recomputed_modules(model, recompute))


def memory_per_rank(workload: Workload, layout: Layout, *, kernels: str = "cuda",
                    bucket_size: int | None = None) -> list[dict[str, int]]:
    """Bytes on one device of each pipeline rank: weights, gradients,
    optimizer, activations (peak over the iteration) and total. `kernels`:
    "cuda" for GPUs, "cpu" for eager CPU runs (see the module docstring);
    `bucket_size`: --ddp-bucket-size (default TrainConfig's)."""
    return list(_ranks_memory(workload, layout, kernels, bucket_size))


def memory_fits(workload: Workload, layout: Layout, limit: float, *, kernels: str = "cuda",
                bucket_size: int | None = None, keys: tuple[ByValue, ByValue] | None = None
                ) -> dict[str, int] | None:
    """`memory_per_device` where every rank's total is at most `limit`
    bytes, else None: the ranks are priced in order and the first over the
    limit ends it (a search rejects most layouts it checks at rank 0,
    which holds the most activations under 1F1B). `keys`: (ByValue(workload),
    ByValue(workload.model)), made once by a search that checks many layouts."""
    ranks = []
    for memory in _ranks_memory(workload, layout, kernels, bucket_size, keys):
        if memory["total"] > limit:
            return None
        ranks.append(memory)
    return max(ranks, key=lambda memory: memory["total"])


def _ranks_memory(workload: Workload, layout: Layout, kernels: str,
                  bucket_size: int | None, keys: tuple[ByValue, ByValue] | None = None
                  ) -> Iterator[dict[str, int]]:
    """`memory_per_rank`, rank by rank."""
    model, e = workload.model, workload.bytes_per_element
    p, v = layout.p, layout.v
    m = layout.microbatches(workload.global_batch)
    workload_key, model_key = keys if keys is not None else (ByValue(workload), ByValue(model))
    acts = activation_bytes(workload, layout, kernels=kernels, workload_key=workload_key)
    placement = placement_of_parameters(layout)
    bucket_size = bucket_size or TrainConfig().ddp_bucket_size
    lora = workload.lora
    frozen = parameters_per_rank(model, layout) if lora else None
    # The states read neither b nor the recomputation: a search's layouts
    # that differ only there share them.
    states_key = (None if lora else
                  (model_key, dataclasses.replace(layout, b=1, recompute=None), e,
                   workload.precision, bucket_size, workload.main_grads_bytes))
    states = _STATES.get(states_key) if states_key else None
    if states is None:
        states = []
        if states_key:
            if len(_STATES) > 4096:
                _STATES.clear()
            _STATES[states_key] = states
    kind, stage_layers = layout.schedule_kind, layout.stage_layers(model.num_layers)
    for rank in range(p):
        if rank == len(states):   # (made when first asked: a search rejects most layouts at rank 0)
            states.append(_rank_states(workload, layout, model_key, placement, rank, bucket_size,
                                       frozen[rank] if lora else 0))
        state = states[rank]
        chunk_bytes, deferred_bytes = [], []
        # Each chunk's virtual stage, found once: its layers (chunk_layers),
        # and whether it is the first or the last (chunk_stage).
        stages = [virtual_stage_of(kind, p, v, rank, chunk) for chunk in range(v)]
        # Rotary tables: made once per layer, kept for every microbatch.
        layers = [stage_layers[stage] for stage in stages]
        tables = sum(layers) * acts["rotary_tables"]
        if lora:
            chunk_bytes, tables = _lora_chunk_bytes(workload, layout, acts, kernels, rank)
            deferred = (0,) * v if layout.zero_bubble else None   # no weight gradient deferred
            layers = []
        for chunk, per_chunk in enumerate(layers):
            first, last = stages[chunk] == 0, stages[chunk] == p * v - 1
            chunk_bytes.append(per_chunk * acts["layer"] + moe_activation_bytes(
                               workload, layout, rank, chunk)
                               + (acts["embedding"] if first else 0)
                               + (acts["output"] + _mtp_bytes(workload, layout, acts, kernels)
                                  if last else 0))
            if last:
                tables += mtp_rotary_tables(model, acts)
            deferred_bytes.append(per_chunk * acts["weight_grad_layer"])
        if not lora:
            deferred = tuple(deferred_bytes) if layout.zero_bubble else None
        activations = (stash_peaks(kind, p, m, v, rank, tuple(chunk_bytes),
                                    deferred)[1] + tables)
        memory = {**state, "activations": activations}
        memory["total"] = sum(memory.values())
        yield memory


_STATES: dict[tuple, list[dict[str, int]]] = {}   # memory_per_rank's states, per rank


def _rank_states(workload: Workload, layout: Layout, model_key: ByValue, placement: Layout,
                 rank: int, bucket_size: int, frozen: int) -> dict[str, int]:
    """`state_bytes` of pipeline rank `rank`, its buckets cut as the layout's
    buffer cuts them."""
    lora = workload.lora
    if lora:   # the adapters in the buffer; the frozen base outside it, in the dtype
        buckets = cut_adapter_buckets(model_key, lora, placement, rank, bucket_size)
    elif layout.shards_parameters:   # ZeRO-3: a bucket holds one unit's parameters
        buckets = unit_buckets(model_key, layout, rank, bucket_size)
    else:
        buckets = cut_placed_buckets(model_key, placement, rank, bucket_size)
    return state_bytes(model_key, layout, rank, buckets, workload.bytes_per_element,
                       workload.precision, frozen, bucket_size, workload.main_grads_bytes)


def _lora_chunk_bytes(workload: Workload, layout: Layout, acts: dict[str, int], kernels: str,
                      rank: int) -> tuple[list[int], int]:
    """With adapters on a frozen base (ptdp.perf.analytic.lora): what each
    chunk of pipeline rank `rank` saves per microbatch, and the rotary
    tables its layers keep. Nothing before the first adapter (the input
    carries no gradient); the first adapted layer without its first norm's
    tensors; the output layer without the final norm's output (kept as the
    s/t slice under sequence parallelism)."""
    model, e, cpu = workload.model, workload.bytes_per_element, kernels == "cpu"
    targets = adapted_targets(model, workload.lora)
    start = first_adapted_layer(model, workload.lora)
    pattern = model.moe_layer_pattern if model.is_moe else [False] * model.num_layers
    moe = (moe_layer_activation_delta(
        model, layout.t, layout.b, e, sequence_parallel=layout.splits_sequence,
        recompute=layout.recompute, ep=layout.ep, etp=layout.etp, c=layout.c)
        if model.is_moe else 0)
    sb = model.seq_length // layout.c * layout.b
    rows = sb // layout.t if layout.splits_sequence else sb
    stages = layout.stage_layers(model.num_layers)
    full = layout.recompute == "full"   # every checkpoint keeps its layer's input
    # RMSNorm on the CPU: a frozen weight keeps no fp32 normalized input.
    norm = norm_saved_bytes(model, rows, e, cpu)
    norm_change = norm_saved_bytes(model, rows, e, cpu, frozen=True) - norm
    norms = 2 + (2 if model.qk_layernorm else 0)
    chunk_bytes, tables = [], 0
    for chunk in range(layout.v):
        stage = virtual_stage_of(layout.schedule_kind, layout.p, layout.v, rank, chunk)
        first_layer = sum(stages[:stage])
        total = 0
        for i in range(first_layer if full else max(first_layer, start),
                       first_layer + stages[stage]):
            total += acts["layer"] + (moe if pattern[i] else 0) + layer_delta_bytes(
                workload, layout, targets[i], kernels=kernels, zero_bubble=layout.zero_bubble,
                moe=pattern[i]) + (0 if full else norms * norm_change)
            if i == start and not full:   # its first norm's input carries no gradient
                total -= norm + norm_change
                if "linear_qkv" in targets[i] and workload.lora.dropout and model.hidden_dropout:
                    total -= rows * model.hidden_size * (e if cpu else 1)   # nor its dropout's
            tables += 0 if full else acts["rotary_tables"]
        if stage == layout.p * layout.v - 1:
            total += acts["output"] + norm_change - (0 if layout.splits_sequence
                                                     else rows * model.hidden_size * e)
        chunk_bytes.append(total)
    return chunk_bytes, tables


def _mtp_bytes(workload: Workload, layout: Layout, acts: dict[str, int], kernels: str) -> int:
    """What the MTP modules keep per microbatch on the last stage
    (ptdp.perf.analytic.mtp; 0 without --mtp-num-layers)."""
    model = workload.model
    if not model.mtp_depth:
        return 0
    moe = bool(model.moe_layer_pattern[-1]) if model.is_moe else False
    delta = moe_layer_activation_delta(
        model, layout.t, layout.b, workload.bytes_per_element,
        sequence_parallel=layout.splits_sequence, recompute=layout.recompute, ep=layout.ep,
        etp=layout.etp, c=layout.c) if moe else 0
    return mtp_activation_bytes(model, acts, t=layout.t, b=layout.b, c=layout.c,
                                sequence_parallel=layout.splits_sequence,
                                recompute=layout.recompute, e=workload.bytes_per_element,
                                cpu=kernels == "cpu", moe_delta=delta)


def moe_activation_bytes(workload: Workload, layout: Layout, rank: int, chunk: int) -> int:
    """What the MoE layers of (rank, chunk) save beyond the dense layers'
    figure (ptdp.perf.analytic.moe; 0 for a dense model)."""
    moe_layers = chunk_moe_layers(workload.model, layout, rank, chunk)
    if not moe_layers:
        return 0
    return moe_layers * moe_layer_activation_delta(
        workload.model, layout.t, layout.b, workload.bytes_per_element,
        sequence_parallel=layout.splits_sequence, recompute=layout.recompute, ep=layout.ep,
        etp=layout.etp, c=layout.c)


def memory_per_device(workload: Workload, layout: Layout, *, kernels: str = "cuda",
                      bucket_size: int | None = None) -> dict[str, int]:
    """`memory_per_rank` of the device that needs the most memory."""
    return max(memory_per_rank(workload, layout, kernels=kernels, bucket_size=bucket_size),
               key=lambda memory: memory["total"])
