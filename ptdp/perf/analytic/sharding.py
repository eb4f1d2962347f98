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
                 N/d·e + gathered     4·N/d + transient       12·N/d (8·N/d in fp32)

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

ZeRO-3 (ptdp.parallel.sharded_params.ShardedParamBuffer): the model is cut
into units, each transformer layer and a chunk's two ends (the embeddings;
the final norm with the output layer or the tied embedding's copy), and a
bucket holds one unit's parameters, so the buckets are cut unit by unit
(`unit_buckets`). A rank keeps its 1/d shard of every bucket (N/d·e) and
gathers a unit's buckets whole (padded) for its forward and again for its
backward. The ends stay gathered through the iteration. With
reshard-after-forward a layer is let go after its forward and after its
backward's reduce-scatter, the next one gathered ahead: two layers whole at
once (measured); under the zero-bubble schedules a layer stays gathered
from its B until its W reduces its gradients, so every layer can be.
Without reshard-after-forward every unit stays gathered from its first use
to the iteration's end: N·e beside the shard. In fp32 the parameter shard is
the optimizer's main copy (its moments only beside it). With adapters
(LoRA) only the adapters are in the buffer, counted gathered whole (they
are tiny); the frozen base is sharded and gathered unit by unit as the
parameters are (its own buckets, no gradient, no optimizer state), and
whole outside the buffer under the other strategies.

Nothing here imports torch (IN_FLIGHT is ptdp.parallel.sharded_grads's;
tests/test_sharding_memory.py checks that they agree).
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from ptdp.config import ModelConfig
from ptdp.perf.analytic.counts import (FP32, Bucket, _chunk_signature, _layer_parameter_list,
                                       _parameter_layout, _signed_parameters, cut_params,
                                       owned_elements, padded_elements, padded_sizes,
                                       placement_of_parameters)
from ptdp.perf.layout import ByValue, Layout

IN_FLIGHT = 2   # ptdp.parallel.sharded_grads.IN_FLIGHT: reductions pending at most


def transient_gradient_elements(buckets: tuple[Bucket, ...], layout: Layout) -> int:
    """Elements of full fp32 gradients alive at once under ZeRO-2/3 (the
    bound of the module docstring), the tied embedding's bucket included
    (padded as the buffer pads it)."""
    padded = padded_sizes(buckets, layout)
    tied = sum([n for n, bucket in zip(padded, buckets) if bucket.tied])
    sizes = sorted([n for n, bucket in zip(padded, buckets) if not bucket.tied], reverse=True)
    launched = sum(sizes[:IN_FLIGHT + 1])
    if layout.zero_bubble:   # every bucket may hold a gradient from B until W
        return tied + sum(sizes) + launched
    return tied + sum(sizes[:IN_FLIGHT + 1 + layout.v])


class Unit(NamedTuple):
    """One of ZeRO-3's units on one tensor rank: its gradient buffer's
    buckets (a bucket holds one unit's parameters) and whether it is one of
    a chunk's ends (they stay gathered through the iteration)."""
    buckets: tuple[Bucket, ...]
    end: bool

    def elements(self, layout: Layout) -> int:
        """Its parameters whole, as gathered: its buckets padded."""
        return padded_elements(self.buckets, layout)


def rank_units(model: ModelConfig, layout: Layout, rank: int,
               bucket_size: int) -> list[list[Unit]]:
    """ZeRO-3's units of pipeline rank `rank`, per chunk in forward order
    (ptdp.model.gpt.GPT.sharding_units): the embeddings (an end) on the
    first stage, each transformer layer, the final norm with the output
    layer or the tied word embedding's copy (an end) on the last; each cut
    into buckets as GradBuffer cuts a unit's parameters. `model` may be its
    ByValue key already (a search's memory model holds one: no second
    snapshot of the model per rank)."""
    key = model if isinstance(model, ByValue) else ByValue(model)
    return [list(chunk) for chunk in _rank_units(key, placement_of_parameters(layout),
                                                 rank, bucket_size)]


@lru_cache(maxsize=65536)   # (a search asks for thousands: every rank of every placement)
def _rank_units(key: ByValue, layout: Layout, rank: int,
                bucket_size: int) -> tuple[tuple[Unit, ...], ...]:
    model = key.value
    # (chunks alike, as the many middle ranks of a search are, are cut once)
    return tuple(_signed_units(key, _parameter_layout(layout),
                               _chunk_signature(model, layout, rank, chunk), bucket_size)
                 for chunk in range(layout.v))


@lru_cache(maxsize=65536)
def _signed_units(key: ByValue, layout: Layout, signature: tuple,
                  bucket_size: int) -> tuple[Unit, ...]:
    """The units of a chunk of this signature (counts._chunk_signature)
    under `layout`'s t, sequence parallelism, EP and ETP."""
    model = key.value
    first, last, _, layers, start = signature
    params = _signed_parameters(model, layout, signature)
    pattern = model.moe_layer_pattern if model.is_moe else [False] * model.num_layers
    cut = 1 + (not model.rope) if first else 0   # the word embedding and positions
    units = [Unit(cut_params(params[:cut], bucket_size), True)] if first else []
    for moe in pattern[start:start + layers]:
        count = len(_layer_parameter_list(model, layout.t, layout.splits_sequence, moe=moe,
                                          ep=layout.ep, etp=layout.etp))
        units.append(Unit(cut_params(params[cut:cut + count], bucket_size), False))
        cut += count
    if last:
        units.append(Unit(cut_params(params[cut:], bucket_size), True))
    return tuple(units)


def unit_buckets(model: ModelConfig | ByValue, layout: Layout, rank: int,
                 bucket_size: int) -> tuple[Bucket, ...]:
    """Pipeline rank `rank`'s buckets under ZeRO-3: each unit's own."""
    return tuple(bucket for chunk in rank_units(model, layout, rank, bucket_size)
                 for unit in chunk for bucket in unit.buckets)


def gathered_elements(model: ModelConfig | ByValue, layout: Layout, rank: int, bucket_size: int) -> int:
    """ZeRO-3: elements of whole (gathered) parameters alive at once on
    pipeline rank `rank` (padded, as gathered): with reshard-after-forward
    the chunks' ends and two layers (the one computing and the next, gathered
    ahead), every layer under the zero-bubble schedules (a layer's weight
    gradients come in W, and it stays gathered until they are reduced);
    without, every unit."""
    units = [unit for chunk in rank_units(model, layout, rank, bucket_size) for unit in chunk]
    if not layout.reshard_after_forward:
        return sum(unit.elements(layout) for unit in units)
    ends = sum(unit.elements(layout) for unit in units if unit.end)
    layers = sorted((unit.elements(layout) for unit in units if not unit.end), reverse=True)
    return ends + sum(layers if layout.zero_bubble else layers[:2])


def state_bytes(model: ModelConfig | ByValue, layout: Layout, rank: int,
                buckets: tuple[Bucket, ...],
                e: int, precision: str, frozen: int = 0,
                bucket_size: int | None = None, grad_bytes: int = FP32) -> dict[str, int]:
    """Weights, fp32 gradients and optimizer state of one device of
    pipeline rank `rank` under `layout.sharding` (the table of the module
    docstring). `buckets`: its gradient buffer's (under ZeRO-3
    `unit_buckets`'); `frozen`: a frozen base's elements outside the buffer
    (adapters, ptdp.perf.analytic.lora), whole under every strategy;
    `bucket_size`: --ddp-bucket-size (ZeRO-3's units); `grad_bytes`: a main
    gradient's (2 with --main-grads-dtype bf16: every gradient buffer bf16);
    `model` read through `rank_units` only (its ByValue key will do)."""
    n, owned = padded_elements(buckets, layout), owned_elements(buckets, layout)
    if layout.shards_parameters and frozen:
        # adapters whole (tiny); the base's shard of each unit, and its units gathered
        base = owned_elements(unit_buckets(model, layout, rank, bucket_size), layout)
        weights = (owned + n + base + gathered_elements(model, layout, rank, bucket_size)) * e
    elif layout.shards_parameters:
        weights = (owned + gathered_elements(model, layout, rank, bucket_size)) * e
    else:
        weights = (n + frozen) * e
    if layout.shards_gradients:
        gradients = (owned + transient_gradient_elements(buckets, layout)) * grad_bytes
    elif layout.distributed_optimizer:
        gradients = (n + owned) * grad_bytes
    else:
        gradients = n * grad_bytes
    if layout.shards_parameters and precision == "fp32":
        optimizer = 2 * owned * FP32   # Adam moments: the fp32 parameter shard is the main copy
    elif layout.distributed_optimizer:
        optimizer = 3 * owned * FP32   # fp32 main weights and two Adam moments
    else:
        optimizer = (2 if precision == "fp32" else 3) * n * FP32
    return {"weights": weights, "gradients": gradients, "optimizer": optimizer}
