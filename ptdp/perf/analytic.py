"""The paper's performance analysis as pure functions: parameters, FLOPs,
pipeline bubble, microbatches in flight, communication volume and memory
per device, for one `Workload` under one `Layout` (ptdp.perf.layout).

Nothing here starts a process or allocates a tensor. Where PAPER.md gives a
formula it is used as written (and tests reproduce it); the rest is derived
from what ptdp's code actually allocates, sends and saves, and tests compare
it with measurements of real CPU runs (tests/test_analytic.py).

Notation as in PAPER.md: l layers, h hidden, a heads, s sequence, V
vocabulary (unpadded; V' padded to a multiple of 128·t), f MLP width (4h by
default), b microbatch, m = B/(b·d) microbatches per pipeline, t, p, d, v.
e is the bytes per element of the model's dtype (2 for bf16/fp16, 4 for
fp32); "sbh" is s·b·h elements.

Parameters (exact for ptdp's GPT: pre-LN, biases everywhere, learned
positions, word embedding tied to the output layer):

    P = V·h + P_pos·h + l·(4h + 3h² + 3h + h² + h + 2·h·f + f + h) + 2h
      = 12·l·h² + 13·l·h + (V + s)·h + 2h          when f = 4h and P_pos = s

PAPER.md's P = 12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h)) is the same sum
without the final LayerNorm (2h): the paper counts l layers of 12h² + 13h
weights (4h of them the two LayerNorms) and the two embeddings, not the
LayerNorm after the last layer. `parameter_count` is exact (tests compare
it with a built model); `paper_parameter_count` is the paper's formula.

The Llama family's options (d = h/a, g key/value heads, g = a without
grouped-query attention; k = 2 with SwiGLU, else 1; n = 2h per LayerNorm,
h per RMSNorm; β = 1 with linear biases, 0 with --disable-bias-linear):

    P_layer = 2n + (a + 2g)·d·h + a·d·h + k·f·h + f·h
              + β·((a + 2g)·d + h + k·f + h)
    P = V·h + P_pos·h + l·P_layer + n + V·h (untied output layer only)

with P_pos = 0 under rotary embeddings. Llama 2 7B (l 32, h 4096, a = g =
32, f 11008, V 32000, RMSNorm, SwiGLU, rope, untied, no biases) gives
6,738,415,616; Llama 3 8B (g 8, f 14336, V 128256) 8,030,261,248.

Per device (a tensor rank of pipeline rank r): each layer holds its
column- and row-parallel weights and column-parallel biases divided by t
(QKV: a/t query heads and g/t key/value groups; the MLP's f/t, of the gate
and of up alike) and its norms and row-parallel biases whole; the first
stage adds V'·h/t word embedding and P_pos·h positions, the last stage the
final norm and, when p > 1, its own copy of the tied word embedding
(V'·h/t), which is memory like any other weight; an untied output layer is
V'·h/t on the last stage whatever p is.

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
The distributed optimizer pads every bucket to a multiple of d (less than
d elements per bucket); it is counted exactly, from the same bucket cutting
GradBuffer does.

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

  A rank holds these for every (microbatch, chunk) it has run forward and
  not yet backward. `memory_per_rank` walks the rank's compute order of the
  schedule (the generators' order) and takes the peak of the sum, so the
  embedding and output extras count only for the chunks that have them.

  Zero-bubble schedules (zb-h1, zbv): B frees what the forward saved except
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
  (F until W) is Schedule.in_flight_bound. Under zbv rank 0 holds the first
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

Communication: see `communication_per_rank`.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Iterator, NamedTuple

from ptdp.config import ModelConfig, TrainConfig
from ptdp.parallel.pipeline.schedules import (
    ZERO_BUBBLE_KINDS,
    backward_order,
    check_arguments,
    forward_order,
    location_of,
    virtual_stage_of,
    warmup_forwards,
)
from ptdp.parallel.pipeline.zero_bubble import zb_h1_order, zbv_order
from ptdp.perf.layout import BYTES_PER_ELEMENT, ByValue, Layout, Workload
from ptdp.perf.flops import model_flops_per_iteration

KERNELS = ("cuda", "cpu")
FP32 = 4
INT64 = 8


# ------------------------------------------------------------------------------------------
# Parameters


def _norm_parameters(model: ModelConfig) -> list[int]:
    """A normalization layer's parameters: LayerNorm's weight and bias, or
    RMSNorm's weight alone."""
    h = model.hidden_size
    return [h, h] if model.normalization == "LayerNorm" else [h]


def _linear_parameters(weight: int, bias: int, model: ModelConfig) -> list[int]:
    """A linear layer's weight and, unless --disable-bias-linear, its bias."""
    return [weight, bias] if model.bias else [weight]


class Param(NamedTuple):
    """One parameter of one tensor rank as the gradient buffer sees it."""
    numel: int
    tied: bool = False      # a tied word embedding: GradBuffer gives it a bucket of its own
    partial: bool = False   # sequence parallelism: its gradient is summed over the tensor group


def _layer_parameter_list(model: ModelConfig, t: int = 1,
                          sequence_parallel: bool = False) -> list[Param]:
    """One transformer layer's parameters on one tensor rank, in module order:
    norm 1, QKV, dense, norm 2, h→f, f→h (each linear layer's weight, then
    its bias). Column-parallel weights and biases (QKV, h→f) and row-parallel
    weights are split over t; norms and row-parallel biases are whole, and
    under sequence parallelism they see s/t positions per rank, so their
    gradients are partial (summed over the tensor group once per iteration)."""
    h, f, d = model.hidden_size, model.ffn_size, model.head_dim
    qkv = (model.num_attention_heads + 2 * model.query_groups) * d   # queries, keys, values
    context = model.num_attention_heads * d                          # the dense layer's input
    up = (2 if model.swiglu else 1) * f                              # SwiGLU: gate and up
    sp = sequence_parallel

    def norm() -> list[Param]:
        return [Param(n, partial=sp) for n in _norm_parameters(model)]

    def linear(weight: int, bias: int, replicated_bias: bool) -> list[Param]:
        weight_and_bias = _linear_parameters(weight, bias, model)
        return [Param(weight)] + [Param(bias, partial=sp and replicated_bias)
                                  for bias in weight_and_bias[1:]]

    return (norm() + linear(qkv * h // t, qkv // t, False)
            + linear(h * context // t, h, True)
            + norm() + linear(up * h // t, up // t, False)
            + linear(h * f // t, h, True))


def _layer_parameters(model: ModelConfig, t: int = 1) -> list[int]:
    """The elements of `_layer_parameter_list`, in module order."""
    return [param.numel for param in _layer_parameter_list(model, t)]


def _position_parameters(model: ModelConfig) -> int:
    """The learned position table (none with rotary embeddings)."""
    return 0 if model.rope else model.max_positions * model.hidden_size


def parameter_count(model: ModelConfig) -> int:
    """Exact logical parameters of ptdp's GPT under its options: the word
    embedding, the position table, l layers, the final norm and the untied
    output layer (a tied output layer is the word embedding, counted once);
    vocabulary unpadded, positions = --max-position-embeddings or s."""
    h = model.hidden_size
    output = 0 if model.tied_output else model.vocab_size * h
    return (model.vocab_size * h + _position_parameters(model)
            + model.num_layers * sum(_layer_parameters(model)) + sum(_norm_parameters(model))
            + output)


def paper_parameter_count(model: ModelConfig) -> int:
    """PAPER.md: P = 12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h)), multiplied out
    (12·l·h² + 13·l·h + (V+s)·h), so it stays an exact integer. GPT-2's
    options only (f = 4h whatever --ffn-hidden-size says)."""
    l, h = model.num_layers, model.hidden_size
    return 12 * l * h * h + 13 * l * h + (model.vocab_size + model.seq_length) * h


def _stage_parameters(model: ModelConfig, t: int, layers: int, first: bool, last: bool,
                      shared_word: bool, sequence_parallel: bool = False) -> list[Param]:
    """Every parameter of one virtual stage on one tensor rank, in the order
    the model lists them: embeddings (first stage), layers, final norm, then
    (last stage) the untied output layer or a later stage's copy of the tied
    word embedding. `shared_word`: the word embedding is shared with another
    stage (tied, p > 1), so GradBuffer keeps it in a bucket of its own.
    Under sequence parallelism the position table (each rank looks up its
    own positions), the norms and the row-parallel biases are partial."""
    word = model.padded_vocab_size(t) * model.hidden_size // t
    sp = sequence_parallel
    params: list[Param] = []
    if first:
        params.append(Param(word, tied=shared_word))
        if not model.rope:
            params.append(Param(_position_parameters(model), partial=sp))
    params += _layer_parameter_list(model, t, sp) * layers
    if last:
        params += [Param(n, partial=sp) for n in _norm_parameters(model)]
        if not model.tied_output:
            params.append(Param(word))                    # output_layer, vocabulary-parallel
        elif not first:
            params.append(Param(word, tied=True))         # the tied copy
    return params


def _ends_share_a_rank(layout: Layout) -> bool:
    """The first and the last virtual stage are on one pipeline rank: p = 1,
    or zbv's V (rank 0 holds both; a tied output layer is then the
    embedding's own parameter, not a copy)."""
    return layout.p == 1 or layout.schedule_kind == "zbv"


def _chunk_stage(layout: Layout, rank: int, chunk: int) -> tuple[bool, bool]:
    """(first, last): whether (rank, chunk) is the first or the last virtual
    stage under the layout's schedule."""
    stage = virtual_stage_of(layout.schedule_kind, layout.p, layout.v, rank, chunk)
    return stage == 0, stage == layout.p * layout.v - 1


def _chunk_parameters(model: ModelConfig, layout: Layout, rank: int, chunk: int) -> list[Param]:
    """The parameters of (rank, chunk) on one tensor rank (`_stage_parameters`
    of its virtual stage). Under zbv rank 0's last-stage chunk uses the
    first chunk's word embedding as its tied output layer: no copy."""
    first, last = _chunk_stage(layout, rank, chunk)
    shared = model.tied_output and not _ends_share_a_rank(layout)
    layers = layout.chunk_layers(model.num_layers, rank, chunk)
    params = _stage_parameters(model, layout.t, layers, first, last, shared,
                               layout.splits_sequence)
    if last and not first and model.tied_output and not shared:
        params = params[:-1]    # the tied copy: the same parameter as the embedding's
    return params


def _rank_parameters(model: ModelConfig, layout: Layout, rank: int) -> list[Param]:
    """Every parameter of pipeline rank `rank` on one tensor rank, in the
    order the Trainer lists them (chunk by chunk; in a chunk: embeddings,
    layers, final norm, the output layer or the tied copy). `tied` marks a
    word embedding that GradBuffer keeps in a bucket of its own (tied output
    layer with the first and last stage on different ranks: the copies of
    the first and last stage)."""
    params: list[Param] = []
    for chunk in range(layout.v):
        params += _chunk_parameters(model, layout, rank, chunk)
    return params


def parameters_per_rank(model: ModelConfig, layout: Layout) -> list[int]:
    """Parameters one device of each pipeline rank holds (every tensor and
    data rank of a pipeline rank holds as many); includes the last stage's
    copy of the tied word embedding (or its untied output layer) and the
    vocabulary padding."""
    return [sum(param.numel for param in _rank_parameters(model, layout, r))
            for r in range(layout.p)]


def parameters_per_device(model: ModelConfig, layout: Layout) -> int:
    """Parameters of the most loaded device."""
    return max(parameters_per_rank(model, layout))


def placement_of_parameters(layout: Layout) -> Layout:
    """`layout` with only what decides which parameters a device holds and
    how GradBuffer buckets them (t, p, v, the schedule, sequence
    parallelism, the layer split): the key under which a search that
    prices many layouts computes those once."""
    return Layout(t=layout.t, p=layout.p, v=layout.v, schedule=layout.schedule,
                  sequence_parallel=layout.sequence_parallel, split=layout.split)


def _cut_buckets(model: ModelConfig, layout: Layout, rank: int,
                 bucket_size: int) -> tuple[tuple[int, int], ...]:
    return _cut_placed_buckets(ByValue(model), placement_of_parameters(layout), rank, bucket_size)


@lru_cache(maxsize=65536)
def _cut_placed_buckets(key: ByValue, layout: Layout, rank: int,
                        bucket_size: int) -> tuple[tuple[int, int], ...]:
    """(elements, partial elements) of GradBuffer's buckets on pipeline rank
    `rank` before padding: parameters in reverse order, a bucket closed once
    it reaches `bucket_size` elements, each tied word embedding a bucket of
    its own. Partial elements: the gradients a bucket sums over the tensor
    group first (sequence parallelism)."""
    cut, size, partial = [], 0, 0
    for param in reversed(_rank_parameters(key.value, layout, rank)):
        if param.tied:
            cut.append((param.numel, 0))
            continue
        size += param.numel
        partial += param.numel if param.partial else 0
        if size >= bucket_size:
            cut.append((size, partial))
            size = partial = 0
    if size:
        cut.append((size, partial))
    return tuple(cut)


def _buckets(model: ModelConfig, layout: Layout, rank: int, bucket_size: int) -> list[int]:
    """Sizes of GradBuffer's buckets on pipeline rank `rank` before padding."""
    return [size for size, _ in _cut_buckets(model, layout, rank, bucket_size)]


def partial_gradient_buckets(model: ModelConfig, layout: Layout, rank: int,
                             bucket_size: int | None = None) -> list[int]:
    """Under sequence parallelism, the elements each bucket of pipeline rank
    `rank` all-reduces over the tensor group before its data-parallel
    reduction (one fp32 all-reduce per bucket that holds partial gradients:
    norms, row-parallel biases, the position table); empty otherwise."""
    bucket_size = bucket_size or TrainConfig().ddp_bucket_size
    return [partial for _, partial in _cut_buckets(model, layout, rank, bucket_size) if partial]


def buffer_elements(model: ModelConfig, layout: Layout, rank: int,
                    bucket_size: int | None = None) -> int:
    """Elements of the flat parameter and gradient buffers of a device of
    pipeline rank `rank`: its parameters, plus with the distributed
    optimizer each bucket padded to a multiple of d."""
    bucket_size = bucket_size or TrainConfig().ddp_bucket_size
    return _padded(_cut_buckets(model, layout, rank, bucket_size), layout)


def _padded(buckets: tuple[tuple[int, int], ...], layout: Layout) -> int:
    """Elements of these buckets, each padded to a multiple of d under the
    distributed optimizer."""
    if not layout.distributed_optimizer:
        return sum(size for size, _ in buckets)
    d = layout.d
    return sum(-(-size // d) * d for size, _ in buckets)


# ------------------------------------------------------------------------------------------
# FLOPs


def flops_per_iteration(workload: Workload, layout: Layout) -> float:
    """The paper's model FLOPs of one iteration, all devices together
    (ptdp.perf.flops: 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)) without
    recomputation, 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) with full; under
    the Llama family's options 6·B·s·h·(l·((a + 2g)·d + h + (k + 1)·f + 2s)
    + V) and 8·B·s·h·(l·(…) + 3V/4), k = 2 with SwiGLU)."""
    return model_flops_per_iteration(workload.model, workload.global_batch,
                                     recompute=layout.recompute)


# ------------------------------------------------------------------------------------------
# Pipeline: bubble and microbatches in flight


def bubble_fraction(layout: Layout, m: int) -> float:
    """Bubble time over ideal time: (p−1)/m, interleaved (p−1)/(m·v)."""
    return (layout.p - 1) / (m * layout.v)


def _compute_order(kind: str, p: int, m: int, v: int, rank: int) -> Iterator[tuple[str, int]]:
    """(op, chunk) of rank `rank`'s computes in schedule order, from the
    generators in schedules.py: the warm-up forwards, then one forward and
    one backward per step, then the remaining backwards (build_schedule's
    computes without its exchanges, which are slow to build for large m)."""
    forwards, backwards = forward_order(kind, p, m, v), backward_order(kind, p, m, v)
    warmup = warmup_forwards(kind, p, m, v, rank)
    for _, chunk in forwards[:warmup]:
        yield "F", chunk
    for k in range(len(forwards) - warmup):
        yield "F", forwards[warmup + k][1]
        yield "B", backwards[k][1]
    for _, chunk in backwards[len(forwards) - warmup:]:
        yield "B", chunk


def _zero_bubble_order(kind: str, p: int, m: int, rank: int) -> Iterator[tuple[str, int]]:
    """(op, chunk) of rank `rank`'s computes under zb-h1 or zbv, in the
    order build_schedule gives them (zero_bubble.py's orders)."""
    order = zbv_order(p, m, rank) if kind == "zbv" else zb_h1_order(p, m, rank)
    return ((c.op, c.chunk) for c in order)


@lru_cache(maxsize=65536)
def _stash_peaks(kind: str, p: int, m: int, v: int, rank: int, chunk_weights: tuple[int, ...],
                 deferred_weights: tuple[int, ...] | None = None) -> tuple[int, int]:
    """(most (microbatch, chunk) activations held at once, largest sum of
    their `chunk_weights`) on pipeline rank `rank`. Zero-bubble kinds: an
    activation counts from its F until its W; it weighs `chunk_weights`
    from F until B and `deferred_weights` (what W needs; default the same)
    from B until W."""
    deferred = chunk_weights if deferred_weights is None else deferred_weights
    weights = (*chunk_weights, *deferred)
    peak_count = peak_weight = 0
    for state in _held_states(kind, p, m, v, rank):
        peak_count = max(peak_count, sum(state))
        peak_weight = max(peak_weight, sum(n * w for n, w in zip(state, weights)))
    return peak_count, peak_weight


@lru_cache(maxsize=16384)
def _held_states(kind: str, p: int, m: int, v: int, rank: int) -> tuple[tuple[int, ...], ...]:
    """What rank `rank` holds as its computes run, as (activations of each
    chunk from F until B, ... from B until W (zero-bubble kinds only)):
    the states no other state holds as much of in every entry, so that the
    peak of any weighted sum is one of theirs. Walked once per schedule;
    `_stash_peaks` prices it for any weights."""
    check_arguments(kind, p, m, v)
    zero_bubble = kind in ZERO_BUBBLE_KINDS
    order = _zero_bubble_order(kind, p, m, rank) if zero_bubble else \
        _compute_order(kind, p, m, v, rank)
    held = [0] * (2 * v)
    states = set()
    for op, chunk in order:
        # A forward only adds: the state before it is no peak.
        if op == "F":
            held[chunk] += 1
            continue
        states.add(tuple(held))
        if op == "B":
            held[chunk] -= 1
            held[v + chunk] += zero_bubble
        else:
            held[v + chunk] -= 1
    states.add(tuple(held))
    # Keep the maximal states (most held first, so a dominated one meets its better).
    kept: list[tuple[int, ...]] = []
    for state in sorted(states, key=sum, reverse=True):
        if not any(all(a >= b for a, b in zip(other, state)) for other in kept):
            kept.append(state)
    return tuple(kept)


def peak_in_flight_per_rank(layout: Layout, m: int) -> list[int]:
    """For each pipeline rank, the most (microbatch, chunk) activations it
    stores at once under the layout's schedule (what the executor measures
    as peak_stored; under zb-h1 and zbv counted from F until W, as
    Schedule.in_flight_bound and the executor's peak_awaiting_weight_grads)."""
    kind, ones = layout.schedule_kind, (1,) * layout.v
    return [_stash_peaks(kind, layout.p, m, layout.v, r, ones)[0] for r in range(layout.p)]


def peak_in_flight(layout: Layout, m: int) -> int:
    """Most (microbatch, chunk) activations stored at once on the most
    loaded rank (rank 0): GPipe m; 1F1B min(p, m); interleaved
    min(2·(p−1) + (v−1)·p + 1, m·v), and m·v when m = p. Each is 1/v of a
    stage's layers."""
    return max(peak_in_flight_per_rank(layout, m))


# ------------------------------------------------------------------------------------------
# Communication


def _ring(n: int, elements: float) -> float:
    """Elements each device sends in a bandwidth-optimal (ring) all-reduce
    of `elements` over n devices: a reduce-scatter and an all-gather, each
    (n−1)/n of the tensor. It receives as many."""
    return 2 * (n - 1) / n * elements


def tensor_collectives_per_layer(workload: Workload, layout: Layout) -> dict[str, int]:
    """Collectives of b·s·h elements in the tensor group per layer and
    microbatch, by kind ("all_reduce", "all_gather", "reduce_scatter").

    Without sequence parallelism, all-reduces: g after attention and after
    the MLP in forward, f's before QKV and before the MLP in backward (4);
    full recomputation repeats the forward's g's in backward: both when
    hidden dropout is on, only the attention's when it is off (the
    non-reentrant checkpoint stops once every saved tensor is rebuilt; the
    MLP's second GEMM and its all-reduce only feed the hidden-dropout mask).

    With sequence parallelism, forward: an all-gather of the sequence into
    QKV and into the MLP, a reduce-scatter out of the attention's dense layer
    and out of the MLP (2 + 2, the volume of the 2 all-reduces). Backward:
    the column-parallel layers' input gradients reduce-scattered (2), the
    row-parallel layers' output gradients all-gathered (2), and the two
    column-parallel layers' saved s/t input slices all-gathered again for
    their weight gradients (2 more): 4 all-gathers and 2 reduce-scatters.
    Full recomputation adds the recomputed forward's two all-gathers and
    its reduce-scatters: both with hidden dropout, the attention's alone
    without (the same early stop).

    Selective recomputation rebuilds only the attention core, which has no
    communication."""
    dropout = workload.model.hidden_dropout > 0
    full = layout.recompute == "full"
    if not layout.splits_sequence:
        return {"all_reduce": 4 + ((2 if dropout else 1) if full else 0),
                "all_gather": 0, "reduce_scatter": 0}
    return {"all_reduce": 0,
            "all_gather": 2 + 4 + (2 if full else 0),
            "reduce_scatter": 2 + 2 + ((2 if dropout else 1) if full else 0)}


def tensor_all_reduces_per_layer(workload: Workload, layout: Layout) -> int:
    """All-reduces of [s, b, h] per layer and microbatch (none under
    sequence parallelism): see `tensor_collectives_per_layer`."""
    return tensor_collectives_per_layer(workload, layout)["all_reduce"]


def _tensor_bytes_sent(t: int, elements: float, collectives: dict[str, int], e: int) -> float:
    """Bytes one rank sends for these ring collectives of `elements` each:
    2·(t−1)/t of them per all-reduce, (t−1)/t per all-gather or
    reduce-scatter."""
    halves = (2 * collectives["all_reduce"] + collectives["all_gather"]
              + collectives["reduce_scatter"])
    return halves * (t - 1) / t * elements * e


def tensor_traffic_per_layer(workload: Workload, layout: Layout) -> float:
    """Bytes one device sends for the tensor-parallel collectives of one
    layer and one microbatch: 4 ring all-reduces of b·s·h elements,
    4·2·(t−1)/t·b·s·h = PAPER.md's 8·b·s·h·(t−1)/t elements, times e
    (×6/4 with full recomputation and hidden dropout). Under sequence
    parallelism the forward's 4 all-gathers and reduce-scatters move what
    its 2 all-reduces did, and the backward's 2 re-gathers add 2 halves:
    10·b·s·h·(t−1)/t elements (14 with full recomputation and hidden
    dropout, 13 without)."""
    model = workload.model
    sbh = model.seq_length * layout.b * model.hidden_size
    return _tensor_bytes_sent(layout.t, sbh, tensor_collectives_per_layer(workload, layout),
                              workload.bytes_per_element)


def communication_per_rank(workload: Workload, layout: Layout, *,
                           bucket_size: int | None = None) -> list[dict[str, float]]:
    """Bytes one device of each pipeline rank sends per iteration (a ring
    collective receives as much as it sends), by kind:

    tensor     collectives in the tensor group: per layer and microbatch
               `tensor_traffic_per_layer`; the first stage adds the
               vocabulary-parallel embedding's g (one all-reduce of s·b·h;
               under sequence parallelism a reduce-scatter forward and its
               all-gather backward, the same volume), the last stage the
               output layer's f (one all-reduce of s·b·h, backward; under
               sequence parallelism an all-gather forward, a reduce-scatter
               and the re-gather of the saved slice backward: 3 halves) and
               the cross entropy's three all-reduces of s·b fp32 (max,
               target logit, sum of exponentials).
    tensor_gradients
               sequence parallelism only: the partial gradients (norms,
               row-parallel biases, the position table) summed over the
               tensor group once per iteration, fp32, one all-reduce per
               bucket that holds them: 2·(t−1)/t·4 bytes per element.
    pipeline   point-to-point sends: per microbatch and chunk, the output
               activation (unless last virtual stage) and the input gradient
               (unless first): b·s·h·e each, b·s·h·e/t with scatter/gather
               or sequence parallelism (each rank's own s/t positions).
               None across zbv's stages p−1 and p, which rank p−1 both holds.
    pipeline_all_gather
               scatter/gather's all-gather of every received tensor in the
               tensor group: (t−1)/t·b·s·h·e sent per received tensor. None
               under sequence parallelism: the slice is what the next stage
               computes on.
    data       the gradient reduction over d replicas, once per iteration,
               fp32: ring all-reduce 2·(d−1)/d·N·4; distributed optimizer:
               reduce-scatter (d−1)/d·N·4 plus the all-gather of updated
               weights in the model dtype (d−1)/d·N·e (N: buffer elements).
    embedding  p > 1: the tied word embedding's gradient summed over its two
               copies (first and last stage), fp32: V'·h/t·4. None with an
               untied output layer (each stage's matrix is its own), nor
               under zbv (rank 0 holds both ends and one matrix).
    total      their sum.
    Scalar collectives (gradient norm, inf check) are left out.
    """
    model, e = workload.model, workload.bytes_per_element
    t, p, d, v, b = layout.t, layout.p, layout.d, layout.v, layout.b
    m = layout.microbatches(workload.global_batch)
    s, h = model.seq_length, model.hidden_size
    sbh, sb = s * b * h, s * b
    stage_layers = layout.stage_layers(model.num_layers)
    layer = tensor_traffic_per_layer(workload, layout)
    sent = sbh / t if layout.sends_slices else sbh
    output_layer = ({"all_reduce": 0, "all_gather": 2, "reduce_scatter": 1}
                    if layout.splits_sequence else {"all_reduce": 1, "all_gather": 0,
                                                    "reduce_scatter": 0})
    word = model.padded_vocab_size(t) * h // t
    kind = layout.schedule_kind

    def local(boundary: int) -> bool:   # stages boundary and boundary + 1 on one rank
        return location_of(kind, p, v, boundary)[0] == location_of(kind, p, v, boundary + 1)[0]

    results = []
    for rank in range(p):
        tensor = pipeline = gathered = 0.0
        holds_word = False
        for chunk in range(v):
            stage = virtual_stage_of(kind, p, v, rank, chunk)
            first, last = stage == 0, stage == p * v - 1
            holds_word |= first or last
            tensor += m * stage_layers[stage] * layer
            if first:
                tensor += m * _ring(t, sbh) * e
            if last:
                tensor += m * (_tensor_bytes_sent(t, sbh, output_layer, e)
                               + 3 * _ring(t, sb) * FP32)
            # Sends (receives are as many); none across zbv's boundary inside a rank.
            transfers = ((not last and not local(stage)) + (not first and not local(stage - 1)))
            pipeline += m * transfers * sent * e
            if layout.gathers_received:
                gathered += m * transfers * (t - 1) / t * sbh * e
        partial = sum(partial_gradient_buckets(model, layout, rank, bucket_size))
        n = buffer_elements(model, layout, rank, bucket_size)
        if d == 1:
            data = 0.0
        elif layout.distributed_optimizer:
            data = (d - 1) / d * n * (FP32 + e)
        else:
            data = _ring(d, n) * FP32
        embedding = 0.0
        if not _ends_share_a_rank(layout) and holds_word and model.tied_output:
            padded = -(-word // d) * d if layout.distributed_optimizer else word
            embedding = _ring(2, padded) * FP32
        volume = {"tensor": tensor, "tensor_gradients": _ring(t, partial) * FP32,
                  "pipeline": pipeline, "pipeline_all_gather": gathered,
                  "data": data, "embedding": embedding}
        volume["total"] = sum(volume.values())
        results.append(volume)
    return results


def communication_volume(workload: Workload, layout: Layout, *,
                         bucket_size: int | None = None) -> dict[str, float]:
    """`communication_per_rank` of the device that sends the most in all."""
    return max(communication_per_rank(workload, layout, bucket_size=bucket_size),
               key=lambda volume: volume["total"])


# ------------------------------------------------------------------------------------------
# Memory


def _norm_saved_bytes(model: ModelConfig, tokens: int, e: int, cpu: bool) -> int:
    """Bytes a normalization layer saves for backward over `tokens` = s·b
    positions, besides its output (which the next layer saves as its
    input). LayerNorm: its input and the mean and rstd per position
    (statistics in the activation dtype on the CPU, fp32 on GPUs). RMSNorm on
    the CPU (torch.rms_norm decomposed into element-wise ops, which compute in
    fp32): the fp32 input, the fp32 normalized input and rstd; on GPUs (the
    fused kernel): the input and rstd in fp32."""
    h = model.hidden_size
    if model.normalization == "LayerNorm":
        return tokens * h * e + 2 * tokens * (e if cpu else FP32)
    if cpu:
        return 2 * tokens * h * FP32 + tokens * FP32
    return tokens * h * e + tokens * FP32


def activation_bytes(workload: Workload, layout: Layout, *,
                     kernels: str = "cuda") -> dict[str, int]:
    """Bytes saved for backward per microbatch on one device: "layer" (one
    transformer layer, with the layout's recomputation), "embedding" (the
    first stage's extra) and "output" (the last stage's extra); and
    "rotary_tables", the cos and sin tables one layer keeps with rotary
    embeddings (2·s·d·e, once per layer, shared by every microbatch). See
    the module docstring for each term."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels={kernels!r}: use one of {', '.join(KERNELS)}")
    # What is saved depends on t, b, the recomputation and sequence parallelism only.
    return dict(_activation_bytes(ByValue(workload),
                                  Layout(t=layout.t, b=layout.b, recompute=layout.recompute,
                                         sequence_parallel=layout.splits_sequence), kernels))


@lru_cache(maxsize=4096)
def _activation_bytes(key: ByValue, layout: Layout, kernels: str) -> dict[str, int]:
    workload = key.value
    model, e = workload.model, workload.bytes_per_element
    t, b = layout.t, layout.b
    s, h, a, f = model.seq_length, model.hidden_size, model.num_attention_heads, model.ffn_size
    g, d = model.query_groups, model.head_dim
    sb = s * b
    # Positions a rank holds outside the tensor-parallel regions (norms,
    # dropout, residual adds, the column-parallel layers' saved inputs):
    # all s, or its own s/t under sequence parallelism.
    rows = sb // t if layout.splits_sequence else sb
    outside = rows * h
    cpu = kernels == "cpu"
    mask = (e if cpu else 1) if model.hidden_dropout > 0 else 0   # bytes per masked element
    norm = _norm_saved_bytes(model, rows, e, cpu)
    # What the attention core keeps of q, k and v: the QKV output (q, k and
    # v are views of it; grouped queries shrink k and v to g heads) and,
    # with rotary embeddings, the rotated q and k (new tensors; v stays a
    # view, so the whole QKV output stays alive).
    qkv = (a + 2 * g) * d * sb // t * e
    if model.rope:
        qkv += (a + g) * d * sb // t * e
    mlp_saved = 3 if model.swiglu else 2   # GeLU: its input, output; SwiGLU: [gate | up], output

    if layout.recompute == "full":
        layer = outside * e
    else:
        layer = (2 * outside * e + 2 * norm + 2 * outside * mask
                 + a * d * sb // t * e + mlp_saved * s * b * f // t * e)
        if layout.recompute == "selective":
            layer += qkv
        elif cpu and model.attention_dropout > 0:
            # The math kernel's fp32 q·scale, kᵀ and v (k and v repeated to
            # all a heads under grouped queries) and its three s×s tensors.
            layer += 3 * a * d * sb // t * FP32 + 3 * (a // t) * s * s * b * FP32
        else:
            layer += qkv + (a // t) * s * b * FP32

    tokens = INT64 * b * (s + 1) if t == 1 else INT64 * sb + sb
    positions = 0 if model.rope else INT64 * (s // t if layout.splits_sequence else s)
    embedding = tokens + positions + outside * mask
    padded = model.padded_vocab_size(t)
    output = (norm + outside * e + FP32 * sb * padded // t + INT64 * sb + sb
              + (padded // t if padded > model.vocab_size else 0))
    tables = 2 * s * d * e if model.rope else 0
    # Zero-bubble schedules: what a microbatch keeps from its B until its W
    # (ptdp.parallel.weight_grad): each deferred linear layer's input (the
    # first norm's output, or its s/t slice under sequence parallelism; the
    # context; the second norm's output; the MLP activation's output) and
    # output gradient (QKV's; the projection's and the second MLP GEMM's
    # whole [s, b, h], all-gathered under sequence parallelism; the first
    # MLP GEMM's, SwiGLU's gate and up). The output layer keeps its weight
    # gradient in B: nothing of it waits for W.
    up = (2 if model.swiglu else 1) * f
    weight_grad_layer = (2 * outside + a * d * sb // t + sb * f // t
                         + (a + 2 * g) * d * sb // t + 2 * sb * h + sb * up // t) * e
    return {"layer": layer, "embedding": embedding, "output": output, "rotary_tables": tables,
            "weight_grad_layer": weight_grad_layer}


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
                           dtype: Any = "bf16", kernels: str = "cpu") -> int:
    """Bytes one transformer layer's forward saves for its backward on one
    tensor rank, per microbatch of `b` sequences of `model.seq_length`: what
    saved-tensor hooks (ptdp.perf.saved.SavedTensorBytes) measure around one
    layer built with `GPT(..., pre_process=False, post_process=False,
    sequence_parallel=...)`. `recompute`: None, "selective" or "full"
    (a layer is its own checkpoint group); by default the model's
    recompute_granularity. `dtype`: "fp32", "bf16", "fp16" or a
    torch.dtype; `kernels`: "cpu" (eager PyTorch, exact on torch 2.13) or
    "cuda" (derived). With rotary embeddings it includes the layer's cos
    and sin tables (2·s·d·e) unless the layer is fully recomputed (the
    checkpoint keeps only its input); `memory_per_rank` counts those once
    per layer, not per microbatch. Raises ValueError for a t the model
    cannot take, or sequence parallelism with t = 1 or t not dividing s."""
    if recompute == AS_CONFIGURED:
        recompute = model.recompute_granularity
    layout = Layout(t=t, b=b, recompute=recompute, sequence_parallel=sequence_parallel)
    problems = layout.valid_for(model, global_batch=b)
    if problems:
        raise ValueError("; ".join(problems))
    figures = activation_bytes(Workload(model, b, _precision(dtype)), layout, kernels=kernels)
    return figures["layer"] + (figures["rotary_tables"] if recompute != "full" else 0)


def memory_per_rank(workload: Workload, layout: Layout, *, kernels: str = "cuda",
                    bucket_size: int | None = None) -> list[dict[str, int]]:
    """Bytes on one device of each pipeline rank: weights, gradients,
    optimizer, activations (peak over the iteration) and total. `kernels`:
    "cuda" for GPUs, "cpu" for eager CPU runs (see the module docstring);
    `bucket_size`: --ddp-bucket-size (default TrainConfig's)."""
    model, e = workload.model, workload.bytes_per_element
    p, d, v = layout.p, layout.d, layout.v
    m = layout.microbatches(workload.global_batch)
    acts = activation_bytes(workload, layout, kernels=kernels)
    sharded = layout.distributed_optimizer
    results = []
    model_key, placement = ByValue(model), placement_of_parameters(layout)
    bucket_size = bucket_size or TrainConfig().ddp_bucket_size
    for rank in range(p):
        n = _padded(_cut_placed_buckets(model_key, placement, rank, bucket_size), layout)
        weights = n * e
        gradients = n * FP32 + (n // d * FP32 if sharded else 0)
        if sharded:
            optimizer = 3 * (n // d) * FP32
        elif workload.precision == "fp32":
            optimizer = 2 * n * FP32
        else:
            optimizer = 3 * n * FP32
        chunk_bytes, deferred_bytes = [], []
        # Rotary tables: made once per layer, kept for every microbatch.
        layers = [layout.chunk_layers(model.num_layers, rank, chunk) for chunk in range(v)]
        tables = sum(layers) * acts["rotary_tables"]
        for chunk, per_chunk in enumerate(layers):
            first, last = _chunk_stage(layout, rank, chunk)
            chunk_bytes.append(per_chunk * acts["layer"]
                               + (acts["embedding"] if first else 0)
                               + (acts["output"] if last else 0))
            deferred_bytes.append(per_chunk * acts["weight_grad_layer"])
        deferred = tuple(deferred_bytes) if layout.zero_bubble else None
        activations = (_stash_peaks(layout.schedule_kind, p, m, v, rank, tuple(chunk_bytes),
                                    deferred)[1] + tables)
        memory = {"weights": weights, "gradients": gradients, "optimizer": optimizer,
                  "activations": activations}
        memory["total"] = sum(memory.values())
        results.append(memory)
    return results


def memory_per_device(workload: Workload, layout: Layout, *, kernels: str = "cuda",
                      bucket_size: int | None = None) -> dict[str, int]:
    """`memory_per_rank` of the device that needs the most memory."""
    return max(memory_per_rank(workload, layout, kernels=kernels, bucket_size=bucket_size),
               key=lambda memory: memory["total"])

