"""The paper's performance analysis as pure functions: parameters, FLOPs,
pipeline bubble, microbatches in flight and communication volume, for one
`Workload` under one `Layout` (ptdp.perf.layout); memory per device, which
sums these, is ptdp.perf.analytic.memory.

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

Mixture of experts: `parameter_count` counts every expert,
`active_parameter_count` what one token uses (the router, the shared
expert and its gate, k of the E routed experts). Per device an MoE layer
holds, after its attention and norms, the shared-expert gate [1, h], the
router [E, h] (+ [E] with biases), E/EP routed experts each split over ETP
(h→f: up·F/ETP rows; f→h: F/ETP columns, its bias [h] whole) and the shared
expert split over t; GradBuffer keeps the routed experts' parameters in
buckets of their own, replicated over EDP = t·d/(ETP·EP) ranks instead of d.

Memory per device and the activations a rank keeps: ptdp.perf.analytic.memory.
Communication: see `communication_per_rank`. MTP's modules: ptdp.perf.analytic.mtp.
"""

from __future__ import annotations

import math
from functools import lru_cache
from operator import mul
from typing import NamedTuple

import numpy as np

from ptdp.config import ModelConfig, TrainConfig
from ptdp.model.shapes import logical_shapes
from ptdp.schedules.kinds import check_arguments, kind_named, location_of, virtual_stage_of
from ptdp.perf.layout import ByValue, Layout, Workload
from ptdp.perf.analytic.flops import model_flops_per_iteration
from ptdp.perf.analytic.mtp import mtp_parameter_list
from ptdp.perf.analytic.layer_params import (  # noqa: F401 - tests read them here too
    Param, _expert_parameters, _layer_parameter_list, _layer_parameters, _linear_parameters,
    _moe_parameter_list, _norm_parameters)

FP32 = 4


# ------------------------------------------------------------------------------------------
# Parameters


def _position_parameters(model: ModelConfig) -> int:
    """The learned position table (none with rotary embeddings)."""
    return 0 if model.rope else model.max_positions * model.hidden_size


def parameter_count(model: ModelConfig) -> int:
    """Exact logical parameters of ptdp's GPT under its options: the word
    embedding, the position table, l layers, the final norm and the untied
    output layer (a tied output layer is the word embedding, counted once);
    vocabulary unpadded, positions = --max-position-embeddings or s."""
    if model.is_moe or model.mtp_depth:  # every expert (or MTP module) counted
        return sum(math.prod(shape) for shape in logical_shapes(model).values())
    h = model.hidden_size
    output = 0 if model.tied_output else model.vocab_size * h
    return (model.vocab_size * h + _position_parameters(model)
            + model.num_layers * sum(_layer_parameters(model)) + sum(_norm_parameters(model))
            + output)


def active_parameter_count(model: ModelConfig) -> int:
    """The parameters one token uses: `parameter_count` less, in each MoE
    layer, the E − k routed experts it is not sent to (the router, the k
    routed experts and the shared expert count, as Megatron-LM and
    ptdp.perf.analytic.flops count). The total for a dense model."""
    if not model.is_moe:
        return parameter_count(model)
    unused = (model.num_experts - model.moe_router_topk) * _expert_parameters(model)
    return parameter_count(model) - sum(model.moe_layer_pattern) * unused


def paper_parameter_count(model: ModelConfig) -> int:
    """PAPER.md: P = 12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h)), multiplied out
    (12·l·h² + 13·l·h + (V+s)·h), so it stays an exact integer. GPT-2's
    options only (f = 4h whatever --ffn-hidden-size says)."""
    l, h = model.num_layers, model.hidden_size
    return 12 * l * h * h + 13 * l * h + (model.vocab_size + model.seq_length) * h


def _stage_parameters(model: ModelConfig, t: int, layers: int, first: bool, last: bool,
                      shared_word: bool, sequence_parallel: bool = False, *,
                      first_layer: int = 0, ep: int = 1, etp: int | None = None) -> list[Param]:
    """Every parameter of one virtual stage on one tensor rank, in the order
    the model lists them: embeddings (first stage), layers, final norm, then
    (last stage) the untied output layer or a later stage's copy of the tied
    word embedding, and the MTP modules (ptdp.perf.analytic.mtp). `shared_word`:
    the word embedding is shared with another stage (a bucket of its own).
    Under sequence parallelism the position table, norms and row-parallel biases are partial.
    `first_layer`: the stage's first layer's global number (which of its
    layers are MoE layers); `ep`, `etp`: the expert layout."""
    word = model.padded_vocab_size(t) * model.hidden_size // t
    sp = sequence_parallel
    params: list[Param] = []
    if first:
        params.append(Param(word, tied=shared_word))
        if not model.rope:
            params.append(Param(_position_parameters(model), partial=sp))
    if not model.is_moe:
        params += _layer_parameter_list(model, t, sp) * layers
    for moe in model.moe_layer_pattern[first_layer:first_layer + layers] if model.is_moe else []:
        params += _layer_parameter_list(model, t, sp, moe=moe, ep=ep, etp=etp)
    if last:
        params += [Param(n, partial=sp) for n in _norm_parameters(model)]
        if not model.tied_output:
            params.append(Param(word))                    # output_layer, vocabulary-parallel
        elif not first:
            params.append(Param(word, tied=True))         # the tied copy
        params += mtp_parameter_list(model, t, sp, first, word, ep=ep, etp=etp)
    return params


def _ends_share_a_rank(layout: Layout) -> bool:
    """The first and the last virtual stage are on one pipeline rank: p = 1,
    or a V (rank 0 holds both; a tied output layer is then the embedding's
    own parameter, not a copy)."""
    p, v = layout.p, layout.v
    return p == 1 or location_of(layout.schedule_kind, p, v, 0)[0] == \
        location_of(layout.schedule_kind, p, v, p * v - 1)[0]


def chunk_stage(layout: Layout, rank: int, chunk: int) -> tuple[bool, bool]:
    """(first, last): whether (rank, chunk) is the first or the last virtual
    stage under the layout's schedule."""
    stage = virtual_stage_of(layout.schedule_kind, layout.p, layout.v, rank, chunk)
    return stage == 0, stage == layout.p * layout.v - 1


def _chunk_parameters(model: ModelConfig, layout: Layout, rank: int, chunk: int) -> list[Param]:
    """The parameters of (rank, chunk) on one tensor rank (`_stage_parameters`
    of its virtual stage). Under ZB-V rank 0's last-stage chunk uses the
    first chunk's word embedding as its tied output layer: no copy."""
    return _signed_parameters(model, layout, _chunk_signature(model, layout, rank, chunk))


def _chunk_signature(model: ModelConfig, layout: Layout, rank: int, chunk: int) -> tuple:
    """What, with the layout's t, sequence parallelism, EP and ETP, decides
    the parameters of (rank, chunk): whether its stage is the first or the
    last, whether the word embedding is shared between ranks, its layers,
    and where they start (for an MoE model's layer pattern; 0 otherwise, as
    the layers of a dense model are all alike)."""
    first, last = chunk_stage(layout, rank, chunk)
    shared = model.tied_output and not _ends_share_a_rank(layout)
    stage = virtual_stage_of(layout.schedule_kind, layout.p, layout.v, rank, chunk)
    stage_layers = layout.stage_layers(model.num_layers)
    return (first, last, shared, stage_layers[stage],
            sum(stage_layers[:stage]) if model.is_moe else 0)


def _signed_parameters(model: ModelConfig, layout: Layout, signature: tuple) -> list[Param]:
    first, last, shared, layers, first_layer = signature
    params = _stage_parameters(model, layout.t, layers, first, last, shared,
                               layout.splits_sequence, first_layer=first_layer,
                               ep=layout.ep, etp=layout.etp)
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
    parallelism, the layer split, EP and ETP): the key under which a search
    that prices many layouts computes those once."""
    return Layout(t=layout.t, p=layout.p, v=layout.v, schedule=layout.schedule,
                  sequence_parallel=layout.sequence_parallel, split=layout.split,
                  ep=layout.ep, etp=layout.etp)


class Bucket(NamedTuple):
    """One of GradBuffer's buckets before padding."""
    size: int               # elements
    partial: int            # of which partial: summed over the tensor group first
    expert: bool = False    # routed experts' parameters: replicated over EDP ranks, not d
    tied: bool = False      # a tied word embedding's bucket of its own (summed over the ends first)


def _cut_buckets(model: ModelConfig, layout: Layout, rank: int,
                 bucket_size: int) -> tuple[Bucket, ...]:
    return cut_placed_buckets(ByValue(model), placement_of_parameters(layout), rank, bucket_size)


@lru_cache(maxsize=65536)
def cut_placed_buckets(key: ByValue, layout: Layout, rank: int,
                        bucket_size: int) -> tuple[Bucket, ...]:
    """GradBuffer's buckets on pipeline rank `rank` before padding:
    parameters in reverse order, a bucket closed once it reaches
    `bucket_size` elements or when the next parameter is of the other kind
    (routed expert or not), each tied word embedding a bucket of its own.
    Partial elements: the gradients a bucket sums over the tensor group
    first (sequence parallelism)."""
    model = key.value
    signature = tuple(_chunk_signature(model, layout, rank, chunk) for chunk in range(layout.v))
    # (ranks whose chunks are alike cut alike: a search's many middle ranks cut once)
    return _signed_cut(key, _parameter_layout(layout), signature, bucket_size)


def placed_chunk_parameter_count(key: ByValue, layout: Layout, rank: int, chunk: int) -> int:
    """Elements of `_chunk_parameters` (key: ByValue(model)), counted once
    for all the chunks alike."""
    return _signed_count(key, _parameter_layout(layout),
                         _chunk_signature(key.value, layout, rank, chunk))


def _parameter_layout(layout: Layout) -> Layout:
    """What of `layout`, besides a chunk's signature, decides its parameters."""
    return Layout(t=layout.t, sequence_parallel=layout.sequence_parallel, ep=layout.ep,
                  etp=layout.etp)


@lru_cache(maxsize=65536)
def _signed_count(key: ByValue, layout: Layout, signature: tuple) -> int:
    return sum(param.numel for param in _signed_parameters(key.value, layout, signature))


@lru_cache(maxsize=65536)
def _signed_cut(key: ByValue, layout: Layout, signature: tuple, bucket_size: int
                ) -> tuple[Bucket, ...]:
    params: list[Param] = []
    for chunk in signature:
        params += _signed_parameters(key.value, layout, chunk)
    return cut_params(params, bucket_size)


def cut_params(params: list[Param], bucket_size: int) -> tuple[Bucket, ...]:
    """`params` (in module order) cut into GradBuffer's buckets."""
    cut, size, partial, expert = [], 0, 0, False
    for param in reversed(params):
        if param.tied:
            cut.append(Bucket(param.numel, 0, tied=True))
            continue
        if size and param.expert != expert:
            cut.append(Bucket(size, partial, expert))
            size = partial = 0
        expert = param.expert
        size += param.numel
        partial += param.numel if param.partial else 0
        if size >= bucket_size:
            cut.append(Bucket(size, partial, expert))
            size = partial = 0
    if size:
        cut.append(Bucket(size, partial, expert))
    return tuple(cut)


def _buckets(model: ModelConfig, layout: Layout, rank: int, bucket_size: int) -> list[int]:
    """Sizes of GradBuffer's buckets on pipeline rank `rank` before padding."""
    return [bucket.size for bucket in _cut_buckets(model, layout, rank, bucket_size)]


def partial_gradient_buckets(model: ModelConfig, layout: Layout, rank: int,
                             bucket_size: int | None = None) -> list[int]:
    """Under sequence parallelism, the elements each bucket of pipeline rank
    `rank` all-reduces over the tensor group before its data-parallel
    reduction (one fp32 all-reduce per bucket that holds partial gradients:
    norms, row-parallel biases, the position table); empty otherwise."""
    bucket_size = bucket_size or TrainConfig().ddp_bucket_size
    return [bucket.partial for bucket in _cut_buckets(model, layout, rank, bucket_size)
            if bucket.partial]


def buffer_elements(model: ModelConfig, layout: Layout, rank: int,
                    bucket_size: int | None = None) -> int:
    """Elements of the flat parameter and gradient buffers of a device of
    pipeline rank `rank`: its parameters, plus with the distributed
    optimizer each bucket padded to a multiple of its replicas (d; EDP for
    routed experts' buckets)."""
    bucket_size = bucket_size or TrainConfig().ddp_bucket_size
    return padded_elements(_cut_buckets(model, layout, rank, bucket_size), layout)


def padded_elements(buckets: tuple[Bucket, ...], layout: Layout) -> int:
    """Elements of these buckets, each padded to a multiple of its replicas
    (d, or EDP for routed experts) under the distributed optimizer."""
    return sum(padded_sizes(buckets, layout))


def padded_sizes(buckets: tuple[Bucket, ...], layout: Layout) -> list[int]:
    """Each bucket's elements, padded as padded_elements pads them."""
    if not layout.distributed_optimizer:
        return [bucket.size for bucket in buckets]
    # A bucket's replicas: d·c (data × context ranks), or EDP for routed
    # experts' (read once: a search pads many buckets).
    dense = layout.gradient_replicas
    return [-(-bucket.size // n) * n for bucket in buckets
            for n in [layout.edp if bucket.expert else dense]]


def owned_elements(buckets: tuple[Bucket, ...], layout: Layout) -> int:
    """Elements whose fp32 gradient shard, main weights and Adam moments one
    rank keeps: all of them, or with the distributed optimizer 1/replicas of
    each padded bucket (1/d; 1/EDP of routed experts' buckets)."""
    if not layout.distributed_optimizer:
        return sum(bucket.size for bucket in buckets)
    dense = layout.gradient_replicas
    return sum([-(-bucket.size // (layout.edp if bucket.expert else dense)) for bucket in buckets])


# ------------------------------------------------------------------------------------------
# FLOPs


def flops_per_iteration(workload: Workload, layout: Layout) -> float:
    """The paper's model FLOPs of one iteration, all devices together
    (ptdp.perf.analytic.flops: 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)) without
    recomputation, 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) with full; under
    the Llama family's options 6·B·s·h·(l·((a + 2g)·d + h + (k + 1)·f + 2s)
    + V) and 8·B·s·h·(l·(…) + 3V/4), k = 2 with SwiGLU)."""
    return model_flops_per_iteration(workload.model, workload.global_batch,
                                     recompute=layout.recompute, lora=workload.lora)


# ------------------------------------------------------------------------------------------
# Pipeline: bubble and microbatches in flight


def bubble_fraction(layout: Layout, m: int) -> float:
    """Bubble time over ideal time: (p−1)/m, interleaved (p−1)/(m·v)."""
    return (layout.p - 1) / (m * layout.v)


def _compute_codes(kind: str, p: int, m: int, v: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """(op (F 0, B 1, W 2), chunk) arrays of rank `rank`'s computes in
    schedule order, from the kind's generator (its record's `op_codes`, or
    its `order`: build_schedule's computes without its exchanges, which are
    slow to build for large m)."""
    record = kind_named(kind)
    if record.op_codes is not None:
        return record.op_codes(p, m, v, rank)
    computes = record.order(p, m, v, rank)
    return (np.array(["FBW".index(c.op) for c in computes], np.int8),
            np.array([c.chunk for c in computes], np.int64))


@lru_cache(maxsize=65536)
def stash_peaks(kind: str, p: int, m: int, v: int, rank: int, chunk_weights: tuple[int, ...],
                 deferred_weights: tuple[int, ...] | None = None) -> tuple[int, int]:
    """(most (microbatch, chunk) activations held at once, largest sum of
    their `chunk_weights`) on pipeline rank `rank`. Zero-bubble kinds: an
    activation counts from its F until its W; it weighs `chunk_weights`
    from F until B and `deferred_weights` (what W needs; default the same)
    from B until W."""
    deferred = chunk_weights if deferred_weights is None else deferred_weights
    weights = (*chunk_weights, *deferred)
    states = _held_states(kind, p, m, v, rank)
    return (max(0, *map(sum, states)),
            max(0, *(sum(map(mul, state, weights)) for state in states)))


@lru_cache(maxsize=16384)
def _held_states(kind: str, p: int, m: int, v: int, rank: int) -> tuple[tuple[int, ...], ...]:
    """What rank `rank` holds as its computes run, as (activations of each
    chunk from F until B, ... from B until W (zero-bubble kinds only)):
    the states no other state holds as much of in every entry, so that the
    peak of any weighted sum is one of theirs. Found once per schedule;
    `stash_peaks` prices it for any weights."""
    check_arguments(kind, p, m, v)
    zero_bubble = kind_named(kind).splits_backward
    ops, chunks = _compute_codes(kind, p, m, v, rank)
    n = len(ops)
    # Row k + 1: what compute k changes (row 0: nothing), so that the running
    # sum's row k is the state before compute k and its last row the final one.
    changes = np.zeros((n + 1, 2 * v), np.int64)
    after = np.arange(1, n + 1)
    forward, backward, weight = ops == 0, ops == 1, ops == 2
    changes[after[forward], chunks[forward]] = 1
    changes[after[backward], chunks[backward]] = -1
    changes[after[backward], v + chunks[backward]] = zero_bubble
    changes[after[weight], v + chunks[weight]] = -1
    held = np.cumsum(changes, axis=0)
    # A forward only adds: the state before it is no peak. A W only takes
    # away, and so does B where nothing is deferred: the state after them is
    # below the one before, so only the state before a B or W that follows a
    # forward (or a deferring B, or starts the order) can be a peak, and the last.
    rising = np.ones(n, bool)
    rising[1:] = forward[:-1] | (backward[:-1] & zero_bubble)
    peaks = np.append(np.flatnonzero(rising & ~forward), n)
    return tuple(map(tuple, _maximal_rows(_distinct_rows(held[peaks])).tolist()))


def _distinct_rows(rows: np.ndarray) -> np.ndarray:
    """`rows` without repeats, each row read as one integer (its entries as
    digits, each column in its own range) where that fits in 62 bits:
    np.unique of whole rows is slow."""
    lowest = rows.min(axis=0)
    ranges = [int(n) for n in rows.max(axis=0) - lowest + 1]
    if math.prod(ranges) >= 2**62:
        return np.unique(rows, axis=0)
    place_values = np.cumprod([1] + ranges[:-1], dtype=np.int64)
    keys = (rows - lowest) @ place_values
    return rows[np.unique(keys, return_index=True)[1]]


def _maximal_rows(states: np.ndarray) -> np.ndarray:
    """The rows of `states` (distinct) that no other row matches or exceeds
    in every entry. Compared a block of rows at a time, so that the
    comparison table stays small however many states a schedule has."""
    block = 512
    kept = np.ones(len(states), bool)
    for start in range(0, len(states), block):
        rows = states[start:start + block]
        covered = np.ones((len(rows), len(states)), bool)   # [i, j]: row j >= rows[i] so far
        for column in range(states.shape[1]):
            covered &= states[None, :, column] >= rows[:, None, column]
        covered[np.arange(len(rows)), np.arange(start, start + len(rows))] = False   # itself
        kept[start:start + len(rows)] = ~covered.any(axis=1)
    return states[kept]


def peak_in_flight_per_rank(layout: Layout, m: int) -> list[int]:
    """For each pipeline rank, the most (microbatch, chunk) activations it
    stores at once under the layout's schedule (what the executor measures
    as peak_stored; under ZB-H1 and ZB-V counted from F until W, as
    Schedule.in_flight_bound and the executor's peak_awaiting_weight_grads)."""
    kind, ones = layout.schedule_kind, (1,) * layout.v
    return [stash_peaks(kind, layout.p, m, layout.v, r, ones)[0] for r in range(layout.p)]


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
               None across ZB-V's stages p−1 and p, which rank p−1 both holds.
    pipeline_all_gather
               scatter/gather's all-gather of every received tensor in the
               tensor group: (t−1)/t·b·s·h·e sent per received tensor. None
               under sequence parallelism: the slice is what the next stage
               computes on.
    data       the gradient reduction over d replicas, once per iteration,
               fp32: ring all-reduce 2·(d−1)/d·N·4; distributed optimizer:
               reduce-scatter (d−1)/d·N·4 plus the all-gather of updated
               weights in the model dtype (d−1)/d·N·e (N: buffer elements).
               ZeRO-2 (Layout.shards_gradients) reduce-scatters every
               microbatch: (d−1)/d·N·(4m + e). ZeRO-3 gathers no updated
               weights but each unit before its forward and its backward,
               every microbatch with reshard-after-forward (d−1)/d·N·(4m +
               2m·e), once an iteration without (d−1)/d·N·(4m + e) (a
               chunk's ends, gathered once, counted as the layers).
    embedding  p > 1: the tied word embedding's gradient summed over its two
               copies (first and last stage), fp32: V'·h/t·4. None with an
               untied output layer (each stage's matrix is its own), nor
               under ZB-V (rank 0 holds both ends and one matrix).
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
            # Sends (receives are as many); none across ZB-V's boundary inside a rank.
            transfers = ((not last and not local(stage)) + (not first and not local(stage - 1)))
            pipeline += m * transfers * sent * e
            if layout.gathers_received:
                gathered += m * transfers * (t - 1) / t * sbh * e
        partial = sum(partial_gradient_buckets(model, layout, rank, bucket_size))
        n = buffer_elements(model, layout, rank, bucket_size)
        data = _data_parallel_bytes(layout, n, e, m)
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


def _data_parallel_bytes(layout: Layout, n: int, e: int, m: int) -> float:
    """`communication_per_rank`'s "data": the gradient reduction (and the
    weights' gathers) of n buffer elements over the d replicas, per strategy."""
    d = layout.d
    if d == 1:
        return 0.0
    if layout.shards_parameters:   # per microbatch: its reduce-scatter and its gathers
        gathers = 2 * m if layout.reshard_after_forward else 1
        return (d - 1) / d * n * (m * FP32 + gathers * e)
    if layout.shards_gradients:
        return (d - 1) / d * n * (m * FP32 + e)
    if layout.distributed_optimizer:
        return (d - 1) / d * n * (FP32 + e)
    return _ring(d, n) * FP32


def communication_volume(workload: Workload, layout: Layout, *,
                         bucket_size: int | None = None) -> dict[str, float]:
    """`communication_per_rank` of the device that sends the most in all."""
    return max(communication_per_rank(workload, layout, bucket_size=bucket_size),
               key=lambda volume: volume["total"])
