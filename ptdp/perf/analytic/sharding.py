"""Per-rank bytes of the model state (weights, fp32 gradients, optimizer
state) under each sharding strategy (Layout.sharding, Megatron-LM's
--data-parallel-sharding-strategy values), from the same bucket cutting
GradBuffer does (ptdp.perf.analytic.counts.cut_placed_buckets). N: the
rank's buffer elements (its parameters, each bucket padded to a multiple
of its replicas once anything is sharded), N/d: the elements it owns
(1/replicas of each padded bucket: d·c for dense parameters, EDP for
routed experts'), e: the model dtype's bytes.

                 weights              fp32 gradients          optimizer
  no_shard       N·e                  4·N                     12·N (8·N in fp32)
  optim          N·e                  4·N + 4·N/d             12·N/d
  optim_grads    N·e                  4·N/d + transient       12·N/d
  optim_grads_params
                 N/d·e + gathered     4·N/d + transient       12·N/d

ZeRO-2's transient gradients (ptdp.parallel.sharded_grads.ShardedGradBuffer,
whose `peak_full_grad_bytes` measures them): no full buffer; a bucket's fp32
storage lives from its first gradient of a microbatch until its
reduce-scatter completes. At the moment the most are alive, IN_FLIGHT + 1
reductions have been launched (the newest before the oldest is waited for)
and one bucket is filling; a bucket that spans two chunks of an interleaved
rank fills across two backwards, one more per chunk boundary: the
IN_FLIGHT + 1 + v largest buckets, an upper bound (it assumes a backward
that reaches at least that many buckets). Under the zero-bubble schedules
a bucket with a gradient computed in B (norms, embeddings, the output
layer) and one in W (the deferred linear weights) is allocated from B until
W, so every bucket can be alive at once: all of them plus IN_FLIGHT + 1
in flight. The tied word embedding's bucket (ends on different ranks) keeps
its gradient for the whole iteration, as under ZeRO-1.

ZeRO-3's gathered weights: each unit (the embedding, a transformer layer,
the final norm with the output layer, whose tied weight is gathered again)
is all-gathered whole before its forward and its backward. With
reshard-after-forward a unit is freed after use and the next is gathered
one ahead, so at most two adjacent units of a chunk are whole at once;
without it a stage keeps its gathered parameters across its microbatches
within an iteration, and an interleaved rank runs every chunk's forwards
before its first last backward: the whole rank's parameters.

Nothing here imports torch (IN_FLIGHT is ptdp.parallel.sharded_grads's;
tests/test_sharding_memory.py checks that they agree).
"""

from __future__ import annotations

from ptdp.config import ModelConfig
from ptdp.perf.analytic.counts import (FP32, Bucket, _layer_parameter_list, _norm_parameters,
                                       _position_parameters, chunk_stage, owned_elements,
                                       padded_elements, parameters_per_rank)
from ptdp.perf.layout import Layout
from ptdp.schedules.kinds import virtual_stage_of

IN_FLIGHT = 2   # ptdp.parallel.sharded_grads.IN_FLIGHT: reductions pending at most


def transient_gradient_elements(buckets: tuple[Bucket, ...], layout: Layout) -> int:
    """Elements of full fp32 gradients alive at once under ZeRO-2/3 (the
    bound of the module docstring), the tied embedding's bucket included
    (padded as the buffer pads it)."""
    tied = sum(padded_elements((bucket,), layout) for bucket in buckets if bucket.tied)
    sizes = sorted((padded_elements((bucket,), layout) for bucket in buckets if not bucket.tied),
                   reverse=True)
    launched = sum(sizes[:IN_FLIGHT + 1])
    if layout.zero_bubble:   # every bucket may hold a gradient from B until W
        return tied + sum(sizes) + launched
    return tied + sum(sizes[:IN_FLIGHT + 1 + layout.v])


def unit_elements(model: ModelConfig, layout: Layout, rank: int) -> list[list[int]]:
    """ZeRO-3's units of pipeline rank `rank` (one tensor rank's elements),
    per chunk in forward order: the embedding (word and positions) on the
    first stage, each transformer layer, the final norm and the output
    layer (untied, or the tied word embedding gathered again) on the last."""
    t, h = layout.t, model.hidden_size
    word = model.padded_vocab_size(t) * h // t
    stages = layout.stage_layers(model.num_layers)
    pattern = model.moe_layer_pattern if model.is_moe else [False] * model.num_layers
    chunks = []
    for chunk in range(layout.v):
        first, last = chunk_stage(layout, rank, chunk)
        stage = virtual_stage_of(layout.schedule_kind, layout.p, layout.v, rank, chunk)
        start = sum(stages[:stage])
        units = [word + _position_parameters(model)] if first else []
        units += [sum(param.numel for param in _layer_parameter_list(
            model, t, layout.splits_sequence, moe=moe, ep=layout.ep, etp=layout.etp))
            for moe in pattern[start:start + stages[stage]]]
        if last:
            units.append(sum(_norm_parameters(model)) + word)
        chunks.append(units)
    return chunks


def gathered_elements(model: ModelConfig, layout: Layout, rank: int) -> int:
    """ZeRO-3: elements of whole (gathered) parameters alive at once on
    pipeline rank `rank`: two adjacent units of a chunk at most with
    reshard-after-forward; every chunk's parameters without."""
    if not layout.reshard_after_forward:   # (a tied output layer on the rank: one matrix)
        return parameters_per_rank(model, layout)[rank]
    chunks = unit_elements(model, layout, rank)
    return max((max([units[0]] + [a + b for a, b in zip(units, units[1:])])
                for units in chunks if units), default=0)


def state_bytes(model: ModelConfig, layout: Layout, rank: int, buckets: tuple[Bucket, ...],
                e: int, precision: str, frozen: int = 0) -> dict[str, int]:
    """Weights, fp32 gradients and optimizer state of one device of
    pipeline rank `rank` under `layout.sharding` (the table of the module
    docstring). `buckets`: its gradient buffer's; `frozen`: a frozen base's
    elements outside the buffer (adapters, ptdp.perf.analytic.lora),
    sharded over the d·c replicas under ZeRO-3 too."""
    n, owned = padded_elements(buckets, layout), owned_elements(buckets, layout)
    if layout.shards_parameters:
        weights = (owned + -(-frozen // layout.gradient_replicas)
                   + gathered_elements(model, layout, rank)) * e
    else:
        weights = (n + frozen) * e
    if layout.shards_gradients:
        gradients = (owned + transient_gradient_elements(buckets, layout)) * FP32
    elif layout.distributed_optimizer:
        gradients = (n + owned) * FP32
    else:
        gradients = n * FP32
    if layout.distributed_optimizer:
        optimizer = 3 * owned * FP32   # fp32 main weights and two Adam moments
    else:
        optimizer = (2 if precision == "fp32" else 3) * n * FP32
    return {"weights": weights, "gradients": gradients, "optimizer": optimizer}
