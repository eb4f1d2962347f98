"""What one transformer layer, the embedding and the output layer cost, in
seconds, for one microbatch on one tensor rank of a hardware profile.

Operator model of one transformer layer, one microbatch, one tensor rank
(b microbatch, s sequence, h hidden, a heads, f MLP width (4h by default),
t tensor size, E bytes per element of the workload's precision):

  GEMMs, priced by `HardwareProfile.gemm_seconds` (GPUs: output tiles over
  the SMs in waves, a fixed cost per tile plus k steps, at least the bytes
  over the bandwidth, see ptdp.perf.price.gemm; CPUs: a roofline with a
  saturating efficiency): QKV [b·s, h]×[h, 3h/t]; scores b·a/t ×
  [s, h/a]×[h/a, s]; context b·a/t × [s, s]×[s, h/a]; projection
  [b·s, h/t]×[h/t, h]; MLP [b·s, h]×[h, f/t] and [b·s, f/t]×[f/t, h].
  Backward: for each GEMM the input gradient and the weight gradient, each
  as much work as the forward. Where the profile has `fused_attention`
  (the GPU profiles: PyTorch's causal scaled_dot_product_attention runs
  flash attention there), the score and context GEMMs and the attention
  core's memory pass are one kernel instead, `HardwareProfile.attention_seconds`
  over b·a/t sequences (forward in F; backward in B, all of it under
  zero-bubble schedules; selective recomputation runs its forward again).
  Memory-bound operators, priced as the bytes they read and write over the
  bandwidth of their class (`HardwareProfile.memory_seconds`: one HBM
  bandwidth on GPUs; measured per class by `ptdp calibrate` on CPUs, where
  eager PyTorch makes e.g. bias+GeLU far slower than a copy): the two
  LayerNorms ("layer_norm"), scale+mask+softmax and dropout over the
  b·(a/t)·s² scores ("attention_core"), the q/k/v and context reshapes
  ("elementwise"), bias+GeLU ("gelu"), two bias+dropout+add ("residual");
  the byte counts are the functions below (calibrate/measure.py uses the same), and
  the weight gradients' accumulation into the fp32 buffer. A fixed
  `launch_overhead` per operator (40 forward, 80 backward per layer, counted
  on ptdp's eager layer). Tensor parallelism: two all-reduces of b·s·h·E
  bytes in forward and two in backward (ring: 2(t−1)/t of the bytes over
  the slowest link of the group and 2(t−1) latency steps, or, where the
  profile has measured times of a 2-process all-reduce T(bytes), (t−1)·T(2·bytes/t)).
  Embedding (first virtual stage): gather, position add, dropout, the
  vocabulary-parallel all-reduce. Output (last virtual stage): final
  LayerNorm, logits GEMM [b·s, h]×[h, V'/t], the cross entropy's passes
  over the b·s·V'/t logits and its three small all-reduces.
  Recomputation: full = the layers' forward again in backward: all of it
  with hidden dropout (PyTorch's non-re-entrant checkpoint stops once every
  saved tensor is rebuilt, and the dropout's mask after the MLP's second
  GEMM is the last) or where the priced run reruns the whole layer
  (`HardwareProfile.recompute_whole_layer`: Megatron-LM's re-entrant
  checkpoint); without hidden dropout all but that last GEMM, its
  all-reduce and the residual add; selective = the attention core again.

  Sequence parallelism (Layout.sequence_parallel, t > 1): the LayerNorms
  and the two bias+dropout+adds run on b·s·h/t elements per rank, and so do
  the embedding's position add and dropout and the final LayerNorm. The
  tensor-group collectives are all-gathers and reduce-scatters (each half an
  all-reduce: (t−1)/t of the bytes, t−1 latency steps): forward 2 + 2 per
  layer (the volume of the 2 all-reduces); backward the row-parallel
  layers' 2 all-gathers, and for QKV and the MLP's first GEMM the re-gather
  of the saved s/t input and the input gradient's reduce-scatter, which run
  under that layer's input-gradient and weight-gradient GEMMs (as ptdp's
  sequence-parallel linear layer overlaps them): only what outlasts its
  GEMM is priced; full recomputation 2 all-gathers and the attention's
  reduce-scatter. The embedding reduce-scatters its lookup (all-gather
  backward); the output layer all-gathers its input (backward: the
  re-gather and the reduce-scatter, overlapped the same way).
  After the flush each gradient bucket holding partial gradients (norms,
  row-parallel biases, the position table) all-reduces them over the tensor
  group (fp32) before the data-parallel reduction; that time is counted as
  "tensor all-reduce" (the category of every tensor-group collective).

  The Llama family's options (g key/value heads, d = h/a): QKV is
  [b·s, h]×[h, (a+2g)·d/t] and the q/k/v reshapes move (a+2g)·d/t + a·d/t
  elements per token; the score and context GEMMs still run for a/t query
  heads. SwiGLU: the first MLP GEMM is [b·s, h]×[h, 2f/t] (gate and up) and
  the activation reads two inputs ("gelu" class, `swiglu_bytes`). Rotary
  embeddings: an element-wise pass over q and k (`rotary_bytes`), and no
  position add in the embedding. RMSNorm is priced as LayerNorm; dropping
  the biases changes no pass. An untied output layer costs what the tied
  one does, except that no embedding gradient is summed between the first
  and the last stage.

Zero-bubble schedules (ZB-H1, ZB-V; Layout.zero_bubble): the backward is
two computes, priced so that B + W is the fused backward's work exactly
(the model FLOPs do not change). W (`layer_backward_parts`): the
weight-gradient GEMMs of QKV, the projection and the two MLP GEMMs
(SwiGLU's first one [h, 2f/t]), the accumulation of those matrices'
gradients into the fp32 buffer (the biases' stay in B), and a few launches
(WEIGHT_GRAD_OPS_PER_LAYER). B: everything else, i.e. the input-gradient
GEMMs, both halves of the score and context GEMMs' backward (two
activations, no weight), the memory-bound operators, the norms' and
embedding's gradients, the whole output layer's backward (ptdp keeps its
weight gradient in B: deferring it would hold the logits' gradient until
W), the cross entropy, recomputation and the collectives. Collectives without sequence parallelism are unchanged (f's
all-reduces, in B). Under sequence parallelism ptdp's deferred linear
layers overlap nothing: B all-gathers the row-parallel output gradients and
reduce-scatters the column-parallel input gradients, W re-gathers the saved
s/t inputs, each priced whole (the fused backward hides what fits under a
GEMM), so B + W carries more collective time than the fused backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ptdp.perf.analytic import counts as analytic
from ptdp.perf.price.context_exchange import CONTEXT_EXCHANGE, context_exchange_seconds
from ptdp.perf.layout import ByValue, Layout, Workload
from ptdp.perf.price import lora
from ptdp.perf.price.machine import Machine
from ptdp.perf.price.operator_bytes import (attention_core_bytes, copy_bytes, cross_entropy_bytes,
                                            layer_memory_ops, layer_norm_bytes, residual_bytes)
from ptdp.perf.analytic.context_window import context_window_work
from ptdp.perf.analytic.local_attention import block_fraction, mean_fraction
from ptdp.perf.price.profiles import HardwareProfile

FORWARD_OPS_PER_LAYER = 40        # operators one layer's forward launches (ptdp.model.gpt, eager)
BACKWARD_OPS_PER_LAYER = 80
# Of those, a zero-bubble W's (ptdp.parallel.weight_grad): per linear layer
# its weight-gradient product, the cast and the accumulation into .grad.
WEIGHT_GRAD_OPS_PER_LAYER = 12
HEAD_BACKWARD_OPS = 24
# The GEMMs of a layer with weights (layer_gemms' names); scores and context
# multiply two activations, so both halves of their backward are input gradients.
LINEAR_GEMMS = ("qkv", "proj", "mlp_up", "mlp_down", "q", "q_down", "q_up", "kv_down")
ROTARY_FORWARD_OPS = 12           # rotating q and k: chunk, neg, cat, two muls, add, each
GRAD_BYTES = 4                    # ptdp keeps and reduces gradients in fp32


@dataclass
class Cost:
    """Seconds of one piece of work. `work` is processor work (GEMMs, memory
    operators, launches) by category; `comm` is collective time."""
    work: dict[str, float] = field(default_factory=dict)
    comm: float = 0.0

    def add(self, category: str, seconds: float) -> "Cost":
        self.work[category] = self.work.get(category, 0.0) + seconds
        return self

    def __iadd__(self, other: "Cost") -> "Cost":
        for category, seconds in other.work.items():
            self.add(category, seconds)
        self.comm += other.comm
        return self

    @property
    def total_work(self) -> float:
        return sum(self.work.values())

    def scaled(self, factor: float) -> "Cost":
        """`factor` times this work (the same operators run `factor` times)."""
        return Cost({category: seconds * factor for category, seconds in self.work.items()},
                    self.comm * factor)


class OperatorModel:
    """Seconds of the pieces of one microbatch on one tensor rank (see the module docstring)."""

    def __init__(self, workload: Workload, layout: Layout, profile: HardwareProfile,
                 machine: Machine, threads: int = 1):
        self.w, self.lay, self.prof, self.machine = workload, layout, profile, machine
        self.threads = threads
        model = workload.model
        # Context parallelism: a rank holds s/c of each sequence's positions
        # (self.s below); its attention covers 1/c of the causal work
        # (`attention_shape`) and exchanges keys and values (context_exchange.py).
        self.c, self.cp_comm = layout.c, layout.cp_comm
        self.h, self.a, self.s = (model.hidden_size, model.num_attention_heads,
                                  model.seq_length // layout.c)
        self.f, self.l = model.ffn_size, model.num_layers
        self.g, self.d = model.query_groups, model.head_dim     # key/value heads, head size
        if model.multi_latent_attention:
            # MLA's core: scores over d_qk = qk_head_dim + qk_pos_emb_head_dim,
            # the context over v_head_dim; the attention kernel and the
            # key/value exchange are priced at their mean width (the same
            # FLOPs), the products in `layer_gemms` at their own.
            self.g = self.a
            self.d = (model.mla_query_head_dim + model.v_head_dim) // 2
        self.V = model.padded_vocab_size(layout.t)
        self.E = workload.bytes_per_element
        self.prec = workload.precision
        self.b, self.t = layout.b, layout.t
        # Sequence parallelism: a rank's norms, dropout and residual adds see
        # n/t of the b·s·h elements, and its tensor-group collectives are
        # all-gathers and reduce-scatters.
        self.sp = layout.splits_sequence
        self.attention_dropout = model.attention_dropout > 0
        # Sliding windows: the mean layer's share of the causal attention
        # blocks the windowed kernel visits (ptdp.perf.analytic.local_attention);
        # under context parallelism the busiest context rank's share of its
        # causal attention (ptdp.perf.analytic.context_window).
        self.window_share = mean_fraction(model, block_fraction if self.c == 1 else (
            lambda s, left: context_window_work(s, self.c, left, self.cp_comm).busiest))
        self.hidden_dropout = model.hidden_dropout > 0
        # Costs already priced (`stage_costs`): every layer of a shape costs the same.
        self.memo: dict[tuple, "ChunkCosts"] = {}
        self.model_key = ByValue(model)

    # -- building blocks ------------------------------------------------------------------
    def gemm(self, m: int, n: int, k: int, batch: int = 1) -> float:
        return self.prof.gemm_seconds(m, n, k, batch=batch, precision=self.prec,
                                      bytes_per_element=self.E) / self.prof.thread_factor(self.threads)

    def gemm_backward(self, m: int, n: int, k: int, batch: int = 1) -> float:
        """Input gradient [m, n]×[n, k] and weight gradient [k, m]×[m, n]."""
        return self.gemm(m, k, n, batch) + self.gemm(k, n, m, batch)

    def memory(self, nbytes: float, op: str = "elementwise", direction: str | None = None) -> float:
        return (self.prof.memory_seconds(nbytes, op, direction)
                / self.prof.thread_factor(self.threads, op))

    def launches(self, count: float) -> float:
        return count * self.prof.launch_overhead

    def outside(self) -> int:
        """Elements of the [s, b, h] activations one rank holds between the
        tensor-parallel regions: b·s·h, or b·s·h/t under sequence parallelism."""
        n = self.b * self.s * self.h
        return n // self.t if self.sp else n

    def tensor_collectives(self, all_reduces: int = 0, gathers: int = 0) -> float:
        """Seconds of `all_reduces` ring all-reduces and `gathers` all-gathers
        or reduce-scatters of b·s·h elements in the tensor group."""
        nbytes = self.b * self.s * self.h * self.E
        return (all_reduces * self.machine.tensor_allreduce(nbytes)
                + gathers * self.machine.tensor_allgather(nbytes))

    # -- one transformer layer ------------------------------------------------------------
    def layer_gemms(self) -> dict[str, tuple[int, int, int, int]]:
        """(m, n, k, batch) of each GEMM of a layer's forward. Grouped
        queries narrow QKV to (a + 2g)·d columns; the score and context
        products run for all a query heads; SwiGLU's first matrix has the
        gate's and up's f/t columns each."""
        b, s, h, a, t, f, g, d = self.b, self.s, self.h, self.a, self.t, self.f, self.g, self.d
        up = 2 * f if self.w.model.gated_linear_unit else f
        heads, length = self.attention_shape()
        if self.w.model.multi_latent_attention:
            return {**self.mla_gemms(), "mlp_up": (b * s, up // t, h, 1),
                    "mlp_down": (b * s, h, f // t, 1)}
        return {"qkv": (b * s, (a + 2 * g) * d // t, h, 1),
                "scores": (length, length, d, heads),
                "context": (length, d, length, heads),
                "proj": (b * s, h, a * d // t, 1),
                "mlp_up": (b * s, up // t, h, 1),
                "mlp_down": (b * s, h, f // t, 1)}

    def mla_gemms(self) -> dict[str, tuple[int, int, int, int]]:
        """Multi-latent attention's products (ptdp.model.mla): the
        replicated down projections over the positions a rank holds
        (b·s/t under sequence parallelism), the query latent's up
        projection (or the direct query projection) to a/t heads of d_qk,
        the key/value latent's to a/t heads of d_n + d_v, the scores over
        d_qk, the context over d_v and the output projection from a/t
        heads of d_v. "qkv" names the key/value up projection, the one
        the sequence-parallel gather is paired with."""
        model = self.w.model
        b, s, h, a, t = self.b, self.s, self.h, self.a, self.t
        rows = b * s // t if self.sp else b * s
        d_qk, d_v, r_kv = model.mla_query_head_dim, model.v_head_dim, model.kv_lora_rank
        heads, length = self.attention_shape()
        shapes = {"kv_down": (rows, r_kv + model.qk_pos_emb_head_dim, h, 1),
                  "qkv": (b * s, a * (model.qk_head_dim + d_v) // t, r_kv, 1)}
        if model.q_lora_rank is None:
            shapes["q"] = (b * s, a * d_qk // t, h, 1)
        else:
            shapes["q_down"] = (rows, model.q_lora_rank, h, 1)
            shapes["q_up"] = (b * s, a * d_qk // t, model.q_lora_rank, 1)
        return {**shapes, "scores": (length, length, d_qk, heads),
                "context": (length, d_v, length, heads), "proj": (b * s, h, a * d_v // t, 1)}

    def attention_shape(self, blocks: float | None = None) -> tuple[int, int]:
        """(sequences, length) the attention of a rank runs over: b·a/t of s
        positions; under context parallelism 1/c of the causal work, as
        ptdp.parallel.context_attention does it: p2p and all_gather as c
        blocks of s/c (each the work of a causal s/c block: the own block
        causal, the others half a block by the load-balanced chunks), a2a as
        b·a/(t·c) whole sequences (the head split); a window's share of it
        (`window_share`). `blocks`: that much of the c blocks' work instead,
        in full causal ring steps (1: one unwindowed step's; below 1, a
        windowed step's share, context_window.ContextWindowWork.steps)."""
        heads = self.b * (self.a // self.t)
        if blocks is None and self.window_share < 1.0:  # sliding windows: the share computed
            heads = heads * self.window_share
        if self.c == 1:
            return heads, self.s
        if self.cp_comm == "a2a":
            return heads // self.c, self.s * self.c
        return heads * (self.c if blocks is None else blocks), self.s

    def score_elements(self, blocks: float | None = None) -> int:
        """Elements of the scores a rank's attention computes (b·a/t·s² at c = 1)."""
        heads, length = self.attention_shape(blocks)
        return heads * length * length

    def attention_core_ops(self, blocks: float | None = None) -> list[tuple[str, float, float]]:
        """The attention core's memory pass over the scores; none where the
        fused kernel keeps the scores on chip."""
        if self.prof.fused_attention:
            return []
        S = self.score_elements(blocks)
        return [("attention_core", *attention_core_bytes(S, self.E, self.attention_dropout))]

    def fused_attention_seconds(self, blocks: float | None = None) -> tuple[float, float]:
        """(forward, backward) of the fused attention kernel over the b·a/t
        causal sequences of a rank (`attention_shape`); (0, 0) where the
        profile prices the attention core as GEMMs and a memory pass."""
        if not self.prof.fused_attention:
            return 0.0, 0.0
        heads, length = self.attention_shape(blocks)
        forward, backward = self.prof.attention_seconds(
            heads, length, self.d, causal=True, precision=self.prec, bytes_per_element=self.E)
        factor = self.prof.thread_factor(self.threads)
        return forward / factor, backward / factor

    def attention_block_seconds(self, share: float = 1.0) -> tuple[float, float]:
        """(forward, backward) of the attention of one ring step's block
        (1/c of a rank's causal attention; with a window, `share` of it):
        what each key/value transfer of the p2p ring hides behind."""
        if share <= 0.0:
            return 0.0, 0.0   # a windowed step that computes nothing
        share = 1 if share == 1.0 else share   # (whole heads price as before, to the bit)
        if self.prof.fused_attention:
            return self.fused_attention_seconds(blocks=share)
        heads, length = self.attention_shape(blocks=share)
        gemms = ((length, length, self.d, heads), (length, self.d, length, heads))
        core = self.attention_core_ops(blocks=share)
        return (sum(self.gemm(m, n, k, batch) for m, n, k, batch in gemms)
                + self.memory_ops_seconds(core, False),
                sum(self.gemm_backward(m, n, k, batch) for m, n, k, batch in gemms)
                + self.memory_ops_seconds(core, True))

    def unfused_gemms(self) -> dict[str, tuple[int, int, int, int]]:
        """`layer_gemms` less the score and context products where the fused
        attention kernel computes them."""
        shapes = self.layer_gemms()
        if self.prof.fused_attention:
            del shapes["scores"], shapes["context"]
        return shapes

    def unfused_memory(self) -> list[tuple[str, float, float]]:
        """`layer_memory` less the attention core's pass where it is fused."""
        ops = self.layer_memory()
        return [op for op in ops if op[0] != "attention_core"] if self.prof.fused_attention else ops

    def layer_memory(self) -> list[tuple[str, float, float]]:
        """(class, forward bytes, backward bytes) of a layer's memory-bound operators."""
        n, E, t = self.b * self.s * self.h, self.E, self.t
        tokens, a, g, d = self.b * self.s, self.a, self.g, self.d
        model = self.w.model
        heads_local = tokens * ((a + 2 * g) * d + a * d) // t
        rotated = tokens * (a + g) * d // t if model.rope else 0
        latent_norms = []
        if model.multi_latent_attention:
            # q, the key/value up projection's output, the concatenated k
            # and the output; the rotated part of a/t query heads and the
            # shared key; with --qk-layernorm the latents' norms
            heads_local = tokens * a * (2 * model.mla_query_head_dim + model.qk_head_dim
                                        + 2 * model.v_head_dim) // t
            rotated = tokens * (a // t + 1) * model.qk_pos_emb_head_dim
            if model.qk_layernorm:
                rows = tokens // t if self.sp else tokens
                latent_norms = [("layer_norm", *layer_norm_bytes(
                    rows * (model.kv_lora_rank + (model.q_lora_rank or 0)), E))]
        return latent_norms + layer_memory_ops(n, n // t, self.b * self.s * self.f // t,
                                self.score_elements(), E,
                                hidden_dropout=self.hidden_dropout,
                                attention_dropout=self.attention_dropout,
                                heads_local=heads_local,
                                swiglu=model.gated_linear_unit,
                                rotated=rotated,
                                fused_rope=self.prof.fused_rope,
                                outside=self.outside(), sandwich=model.sandwich_norm,
                                sinks=tokens * a * d // t if model.has_sinks else 0)

    def memory_ops_seconds(self, ops: list[tuple[str, float, float]], backward: bool) -> float:
        direction = "backward" if backward else "forward"
        return sum(self.memory(bwd if backward else fwd, op, direction) for op, fwd, bwd in ops)

    def _rotary_ops(self) -> int:
        if not self.w.model.rope:
            return 0
        return 2 if self.prof.fused_rope else ROTARY_FORWARD_OPS   # fused: one kernel for q, one for k

    def layer_parameters(self) -> int:
        return sum(analytic._layer_parameters(self.w.model, self.t))

    def layer_forward(self, category: str = "forward compute") -> Cost:
        gemms = sum(self.gemm(*shape[:3], shape[3]) for shape in self.unfused_gemms().values())
        gemms += self.fused_attention_seconds()[0]
        if self.w.lora:
            gemms += lora.adapter_forward_seconds(self)
        cost = Cost().add(category, gemms + self.memory_ops_seconds(self.unfused_memory(), False)
                          + self.launches(FORWARD_OPS_PER_LAYER + self._rotary_ops()))
        # g after attention and after the MLP; under sequence parallelism an
        # all-gather into each region and a reduce-scatter out of it, each
        # next to the GEMM it feeds (QKV, MLP up) or follows (projection, MLP down).
        if self.sp:
            shapes = self.layer_gemms()
            cost.comm = self.gemm_paired_collectives(
                [self.gemm(*shapes[name][:3]) for name in ("qkv", "proj", "mlp_up", "mlp_down")])
        else:
            cost.comm = self.tensor_collectives(2)
        return self._with_context_exchange(cost, backward=False)

    @property
    def overlaps_tensor_comm(self) -> bool:
        """Whether the priced run pipelines its sequence-parallel collectives
        with GEMMs (HardwareProfile.tensor_comm_overlap; dense layers only:
        MoE layers keep pricing theirs whole)."""
        return self.prof.tensor_comm_overlap and self.sp and not self.w.model.is_moe

    def gemm_paired_collectives(self, gemms: list[float]) -> float:
        """Seconds of one sequence-parallel all-gather or reduce-scatter of
        b·s·h elements next to each GEMM of `gemms` (seconds): each whole,
        as ptdp runs them; where the run overlaps tensor communication with
        GEMMs (`overlaps_tensor_comm`, Megatron-LM's --tp-comm-overlap:
        the collective in t steps, each under one t-th of the GEMM), what
        outlasts the GEMM plus the one step the pipeline cannot hide (the
        first chunk's wait or the last chunk's reduction)."""
        collective = self.tensor_collectives(gathers=1)
        if not self.overlaps_tensor_comm:
            return collective * len(gemms)
        return sum(max(0.0, collective - gemm) + collective / self.t for gemm in gemms)

    def _with_context_exchange(self, cost: Cost, backward: bool) -> Cost:
        """`cost` plus what the context-parallel attention's key/value
        exchange adds beyond the attention it overlaps (c > 1 only)."""
        if self.c > 1:
            cost.add(CONTEXT_EXCHANGE, context_exchange_seconds(self, backward))
        return cost

    def layer_backward(self) -> Cost:
        trained = self.layer_parameters()
        if self.w.lora:   # a frozen base: input gradients; the adapters (price/lora.py)
            gemms = (lora.frozen_base_backward_gemm_seconds(self, LINEAR_GEMMS)
                     + lora.adapter_backward_seconds(self))
            trained = lora.adapter_parameters(self)
        else:
            gemms = sum(self.gemm_backward(*shape[:3], shape[3])
                        for shape in self.unfused_gemms().values())
        gemms += self.fused_attention_seconds()[1]
        # Accumulating into the fp32 buffer: read it and the new gradient, write it.
        grad_accumulation = trained * (2 * GRAD_BYTES + (GRAD_BYTES if self.E == 4 else self.E))
        cost = Cost().add("backward compute",
                          gemms + self.memory_ops_seconds(self.unfused_memory(), True)
                          + self.memory(grad_accumulation)
                          + self.launches(BACKWARD_OPS_PER_LAYER + 2 * self._rotary_ops()))
        self._with_context_exchange(cost, backward=True)
        if not self.sp:   # f's all-reduces before QKV and the MLP
            cost.comm = self.tensor_collectives(2)
            return cost
        # The row-parallel layers' all-gathers of their output gradients,
        # then for QKV and the MLP's first GEMM the overlapped pair (see
        # `sequence_parallel_linear_backward_exposed`).
        shapes = self.layer_gemms()
        cost.comm = (self.gemm_paired_collectives([self.gemm(m, k, n) for m, n, k, _ in
                                                   (shapes["proj"], shapes["mlp_down"])])
                     + self.sequence_parallel_linear_backward_exposed(shapes["qkv"])
                     + self.sequence_parallel_linear_backward_exposed(shapes["mlp_up"]))
        return cost

    def layer_backward_parts(self) -> tuple[Cost, Cost]:
        """(B, W) of a layer under a zero-bubble schedule: `layer_backward`
        split in two with the same work. W: the weight-gradient GEMMs of QKV,
        the projection and the two MLP GEMMs (SwiGLU's first one twice as
        wide), the accumulation of those four matrices' gradients into the
        fp32 buffer and WEIGHT_GRAD_OPS_PER_LAYER launches. B: all the rest
        (input-gradient GEMMs, both halves of the score and context GEMMs'
        backward, the memory-bound operators, the norms' and biases' gradient
        accumulation (ptdp adds the biases outside the products, in its fused
        bias operators), the remaining launches, the collectives).
        Collectives: without sequence parallelism f's two all-reduces, in B.
        Under it nothing overlaps any more (ptdp's deferred
        _SequenceParallelLinear): B all-gathers the row-parallel layers'
        output gradients and reduce-scatters the column-parallel layers'
        input gradients, W re-gathers their saved s/t inputs, each exposed.
        A fused attention kernel's backward (no weights) is all in B. With
        adapters on a frozen base nothing waits for W (price/lora.py)."""
        if self.w.lora:
            return self.layer_backward(), Cost()
        shapes = self.unfused_gemms()
        input_grads = sum(self.gemm(m, k, n, batch) for m, n, k, batch in shapes.values())
        input_grads += self.fused_attention_seconds()[1]
        weight_grads = 0.0
        for name, (m, n, k, batch) in shapes.items():
            if name in LINEAR_GEMMS:
                weight_grads += self.gemm(k, n, m, batch)
            else:
                input_grads += self.gemm(k, n, m, batch)
        per_element = 2 * GRAD_BYTES + (GRAD_BYTES if self.E == 4 else self.E)
        # The four weight matrices: their [out, in] elements are the GEMMs' n·k.
        weights = sum(n * k for name, (_, n, k, _) in shapes.items() if name in LINEAR_GEMMS)
        others = self.layer_parameters() - weights      # norms and biases
        launches = BACKWARD_OPS_PER_LAYER + 2 * self._rotary_ops()
        b = Cost().add("backward compute",
                       input_grads + self.memory_ops_seconds(self.unfused_memory(), True)
                       + self.memory(others * per_element)
                       + self.launches(launches - WEIGHT_GRAD_OPS_PER_LAYER))
        self._with_context_exchange(b, backward=True)   # attention's gradients: all in B
        w = Cost().add("backward compute", weight_grads + self.memory(weights * per_element)
                       + self.launches(WEIGHT_GRAD_OPS_PER_LAYER))
        if self.sp:
            b.comm = self.tensor_collectives(gathers=4)
            w.comm = self.tensor_collectives(gathers=2)
        else:
            b.comm = self.tensor_collectives(2)
        return b, w

    def sequence_parallel_linear_backward_exposed(self, shape: tuple[int, int, int, int]) -> float:
        """Collective seconds a column-parallel layer's backward adds under
        sequence parallelism beyond its GEMMs: the re-gather of its saved
        s/t input runs under the input gradient's product and the
        reduce-scatter of that gradient under the weight gradient's
        (ptdp.parallel.tensor._SequenceParallelLinear); only what outlasts
        its GEMM is exposed."""
        m, n, k, batch = shape
        gather = self.tensor_collectives(gathers=1)
        return (max(0.0, gather - self.gemm(m, k, n, batch))
                + max(0.0, gather - self.gemm(k, n, m, batch)))

    @property
    def recomputes_whole_layer(self) -> bool:
        """Whether full recomputation reruns a layer's whole forward:
        Megatron-LM's re-entrant checkpoint always does; so does ptdp's
        non-re-entrant one under hidden dropout, whose mask, saved after the
        MLP's second GEMM and its all-reduce, is the last tensor the
        backward needs."""
        return self.prof.recompute_whole_layer or self.hidden_dropout

    def layer_recompute(self, kind: str | None) -> Cost:
        if kind is None:
            return Cost()
        if kind == "selective":   # --recompute-modules (price/recompute_modules.py)
            from ptdp.perf.price.recompute_modules import selective_recompute_seconds

            others = Cost().add("recompute", selective_recompute_seconds(self))
            if "core_attn" not in self.w.model.recompute_modules:
                return others
            if self.prof.fused_attention:     # the fused kernel's forward again
                others += self._with_context_exchange(Cost().add(
                    "recompute", self.fused_attention_seconds()[0] + self.launches(8)), False)
                return others
            shapes = self.layer_gemms()
            seconds = (self.gemm(*shapes["scores"][:3], shapes["scores"][3])
                       + self.gemm(*shapes["context"][:3], shapes["context"][3])
                       + self.memory_ops_seconds(self.attention_core_ops(), False) + self.launches(8))
            others += self._with_context_exchange(Cost().add("recompute", seconds), False)
            return others
        if kind == "full":
            forward = self.layer_forward("recompute")
            if self.recomputes_whole_layer:
                return forward
            # Without it the recomputation stops before that GEMM, whose
            # all-reduce (reduce-scatter) and residual add do not run again.
            shape = self.layer_gemms()["mlp_down"]
            skipped = (self.gemm(*shape[:3], shape[3])
                       + self.memory(residual_bytes(self.outside(), self.E,
                                                    self.hidden_dropout)[0], "residual", "forward")
                       + self.launches(6))
            forward.work["recompute"] -= skipped
            forward.comm = (self.tensor_collectives(gathers=3) if self.sp
                            else self.tensor_collectives(1))
            return forward
        raise ValueError(f"unknown recomputation {kind!r}: use None, 'selective' or 'full'")

    # -- first and last stage ----------------------------------------------------------------
    def embedding_forward(self) -> Cost:
        """The vocabulary-parallel lookup of all b·s tokens, the position add
        and dropout on the positions a rank keeps (s/t of them under sequence
        parallelism, where the lookup's parts are reduce-scattered straight
        to them instead of all-reduced)."""
        n, kept = self.b * self.s * self.h, self.outside()
        positions = 0.0 if self.w.model.rope else self.memory(copy_bytes(kept, self.E)[0])
        seconds = (self.memory(3 * n * self.E) + positions                             # gather
                   + self.memory(residual_bytes(kept, self.E, self.hidden_dropout)[0], "residual",
                                 "forward")
                   + self.launches(8))
        cost = Cost().add("forward compute", seconds)
        cost.comm = self.tensor_collectives(gathers=1) if self.sp else self.tensor_collectives(1)
        return cost

    def embedding_backward(self) -> Cost:
        if self.w.lora:   # a frozen table: its output carries no gradient
            return Cost()
        n = self.b * self.s * self.h
        table = self.V // self.t * self.h
        cost = Cost().add("backward compute",
                          self.memory(4 * n * self.E + table * (self.E + 2 * GRAD_BYTES))
                          + self.launches(8))
        if self.sp:   # the reduce-scatter's gradient: all-gather the positions' gradients
            cost.comm = self.tensor_collectives(gathers=1)
        return cost

    def _logit_elements(self) -> int:
        return self.b * self.s * self.V // self.t

    def head_forward(self) -> Cost:
        """Final LayerNorm, logits, cross entropy (its passes over the logits:
        operator_bytes.cross_entropy_bytes). Under sequence parallelism the
        norm runs on s/t positions and the logits GEMM gathers the sequence
        first."""
        logits = self._logit_elements()
        seconds = (self.gemm(self.b * self.s, self.V // self.t, self.h)
                   + self.memory(layer_norm_bytes(self.outside(), self.E)[0], "layer_norm", "forward")
                   + self.memory(cross_entropy_bytes(logits, self.E)[0], "cross_entropy", "forward")
                   + self.launches(20))
        cost = Cost().add("forward compute", seconds)
        cost.comm = 3 * self.machine.tensor_allreduce(self.b * self.s * 4)
        if self.sp:
            cost.comm += self.tensor_collectives(gathers=1)
        return cost

    def head_backward(self) -> Cost:
        logits = self._logit_elements()
        table = 0 if self.w.lora else self.V // self.t * self.h   # frozen: no table gradient
        logits_gemm = (self.gemm(self.b * self.s, self.h, self.V // self.t) if self.w.lora
                       else self.gemm_backward(self.b * self.s, self.V // self.t, self.h))
        seconds = (logits_gemm
                   + self.memory(layer_norm_bytes(self.outside(), self.E)[1], "layer_norm",
                                 "backward")
                   + self.memory(cross_entropy_bytes(logits, self.E)[1], "cross_entropy",
                                 "backward")
                   + self.memory(table * 2 * GRAD_BYTES)
                   + self.launches(HEAD_BACKWARD_OPS))
        cost = Cost().add("backward compute", seconds)
        # f before the logits; under sequence parallelism the re-gather of
        # the saved slice and the input gradient's reduce-scatter, each under
        # one of the logits' backward GEMMs.
        cost.comm = (self.sequence_parallel_linear_backward_exposed(
            (self.b * self.s, self.V // self.t, self.h, 1)) if self.sp
            else self.tensor_collectives(1))
        return cost

    # -- parameters --------------------------------------------------------------------------
    def stage_parameters(self, first: bool, last: bool, layers: int) -> int:
        """Parameters of one virtual stage on one tensor rank (analytic/counts.py's count)."""
        shared = self.w.model.tied_output and self.lay.p > 1
        return sum(param.numel for param in analytic._stage_parameters(
            self.w.model, self.t, layers, first, last, shared))
