"""What low-rank adapters change in the analytic model (Workload.lora; the
layer: ptdp.parallel.lora, the adapted layers: ptdp.model.adapters).

Parameters. An adapted layer with base weight [out, in] adds A [R, in] and
B [out, R]; `adapter_parameter_count` counts them over the whole model
(`ptdp.model.adapters.adapter_shapes`), `parameter_count` the frozen base.
On a tensor rank a column-parallel base's adapter keeps A whole and B split
(out/t rows), a row-parallel base's A split (in/t columns) and B whole;
a routed expert's adapter lives with its expert (E/EP per rank, split
over ETP like the expert), a shared adapter (--lora-share-expert-adapters)
on every rank of the layer.

State (bytes on one device; the Trainer's GradBuffer holds the adapters
only): the frozen base in the training dtype, N_base·e, outside every
buffer; the adapters as any trained parameter: N_A·e weights, 4·N_A fp32
gradients (+ 4·N_A/d shard with the distributed optimizer), Adam moments
and fp32 main weights 12·N_A (8·N_A in fp32; 12·N_A/d distributed). N_A is
the adapters' buffer elements, cut into buckets and padded exactly as
GradBuffer does for trained parameters (ptdp.perf.analytic.counts).

Activations (measured with saved-tensor hooks on one CPU process, every
target set, both dropouts, fp32 and bf16; tests/test_lora_plan.py). A
frozen linear layer saves nothing of its own for the backward: its input
gradient needs only its weight, and autograd saves the input only for the
weight's gradient. So per layer, against the full fine-tuning figure
(ptdp.perf.analytic.memory):
  - the input of every linear layer that no other operator keeps is no
    longer saved: QKV's and the MLP's first GEMM's inputs (the norms'
    outputs, `outside`·e each; kept anyway under sequence parallelism,
    whose linear layer saves its s/t slice, and under zero-bubble
    schedules, whose deferred linear layer saves its input), the
    projection's input a·d·s·b/t·e (kept anyway where the attention kernel
    keeps its output as that input: the flash kernel without selective
    recomputation, the context-parallel p2p and all_gather exchanges), and
    the MLP's second GEMM's s·b·f/t·e;
  - an adapted layer's adapter keeps that input for A's gradient (the same
    storage) and its r-wide down projection for B's, s·b·R·e (whole
    positions, also under sequence parallelism, where the column adapter
    gathers it); with --lora-dropout the dropped copy of the input and its
    mask (e bytes an element on the CPU, 1 on GPUs) instead of the input.
  Full recomputation keeps the layer input only, as before.
  Where the model's input carries no gradient (the frozen embedding), the
  operators before the first adapter save nothing: the embedding's extras,
  every layer before the first adapted one, and the first adapted layer's
  first norm (exact when that layer's QKV is adapted; a layer whose first
  adapter is later saves less than counted). The output layer, frozen,
  does not keep the final norm's output (it does under sequence
  parallelism: the s/t slice). Zero-bubble schedules defer no weight
  gradient: nothing is held from B to W. MoE layers: the MLP part keeps
  the full fine-tuning figure (not measured with adapters) plus each
  adapted matrix's down projections of its k routed copies of the tokens
  (and the shared expert's), k·s·b·R·e.
"""

from __future__ import annotations

import math
from functools import lru_cache

from ptdp.config import ModelConfig
from ptdp.perf.analytic.counts import Param, parameter_count
from ptdp.perf.layout import ByValue, Layout, LoRAWork, Workload
from ptdp.schedules.kinds import virtual_stage_of

COLUMN_TARGETS = ("linear_qkv", "linear_fc1")


def adapter_shapes_of(model: ModelConfig, lora: LoRAWork) -> dict[str, tuple[int, ...]]:
    from ptdp.model.adapters import adapter_shapes
    return adapter_shapes(model, lora.config())


def adapter_parameter_count(model: ModelConfig, lora: LoRAWork) -> int:
    """The adapters' logical parameters over the whole model."""
    return sum(math.prod(shape) for shape in adapter_shapes_of(model, lora).values())


def frozen_parameter_count(model: ModelConfig) -> int:
    """The frozen base's logical parameters (every parameter of the model)."""
    return parameter_count(model)


@lru_cache(maxsize=1024)
def _adapted(key: ByValue, lora: LoRAWork) -> tuple:
    from ptdp.model.adapters import adapted_layers
    return tuple(adapted_layers(key.value, lora.config()))


def adapted_targets(model: ModelConfig, lora: LoRAWork) -> tuple[frozenset[str], ...]:
    """Per layer, the target names (linear_qkv …) with at least one adapter."""
    found: list[set[str]] = [set() for _ in range(model.num_layers)]
    for layer in _adapted(ByValue(model), lora):
        found[layer.layer].add(layer.target)
    return tuple(frozenset(targets) for targets in found)


def first_adapted_layer(model: ModelConfig, lora: LoRAWork) -> int:
    """The first layer with an adapter (num_layers if none)."""
    return next((i for i, targets in enumerate(adapted_targets(model, lora)) if targets),
                model.num_layers)


def _base_matrix(model: ModelConfig, target: str, width: int) -> tuple[int, int]:
    """[out, in] of a dense layer's matrix, or of an MLP of `width`."""
    h, d = model.hidden_size, model.head_dim
    up = (2 if model.gated_linear_unit else 1) * width
    return {"linear_qkv": ((model.num_attention_heads + 2 * model.query_groups) * d, h),
            "linear_proj": (h, model.num_attention_heads * d),
            "linear_fc1": (up, h), "linear_fc2": (h, width)}[target]


def _adapter_params(out: int, inp: int, r: int, column: bool, parts: int, partial: bool,
                    expert: bool = False) -> list[Param]:
    """A and B of one adapter on a rank, split as ptdp.parallel.lora splits them."""
    a = r * (inp if column else inp // parts)
    b = (out // parts if column else out) * r
    return [Param(a, partial=partial and column, expert=expert),
            Param(b, partial=partial and not column, expert=expert)]


def layer_adapter_parameters(model: ModelConfig, lora: LoRAWork, layout: Layout,
                             layer: int) -> list[Param]:
    """The adapters' parameters of one layer on one tensor rank, in module
    order (attention; the dense MLP, or this EP rank's routed experts, the
    shared expert, then the shared adapters)."""
    t, r = layout.t, lora.rank
    etp, ep = layout.expert_tensor, layout.ep
    dispatches = (ep, etp) != (1, t)
    params: list[Param] = []
    shared: dict[str, list[Param]] = {}
    local_experts = model.num_experts // ep if model.is_moe else 0
    for adapted in _adapted(ByValue(model), lora):
        if adapted.layer != layer:
            continue
        column = adapted.target in COLUMN_TARGETS
        if adapted.expert is None:
            width = (model.moe_shared_expert_intermediate_size or 0) \
                if ".shared_expert." in adapted.name else model.ffn_size
            out, inp = _base_matrix(model, adapted.target, width)
            params += _adapter_params(out, inp, r, column, t, t > 1)
            continue
        out, inp = _base_matrix(model, adapted.target, model.moe_ffn_size)
        if lora.share_expert_adapters:
            shared.setdefault(adapted.target,
                              _adapter_params(out, inp, r, column, etp, t > 1))
        elif adapted.expert < local_experts:   # one EP rank's share (every rank holds as many)
            params += _adapter_params(out, inp, r, column, etp, t > 1 and not dispatches,
                                      expert=True)
    for target in ("linear_fc1", "linear_fc2"):
        params += shared.get(target, [])
    return params


def chunk_adapter_parameters(model: ModelConfig, lora: LoRAWork, layout: Layout, rank: int,
                             chunk: int) -> list[Param]:
    stage = virtual_stage_of(layout.schedule_kind, layout.p, layout.v, rank, chunk)
    stages = layout.stage_layers(model.num_layers)
    first = sum(stages[:stage])
    return [param for layer in range(first, first + stages[stage])
            for param in layer_adapter_parameters(model, lora, layout, layer)]


def rank_adapter_parameters(model: ModelConfig, lora: LoRAWork, layout: Layout,
                            rank: int) -> list[Param]:
    """The adapters of pipeline rank `rank` on one tensor rank, chunk by chunk."""
    return [param for chunk in range(layout.v)
            for param in chunk_adapter_parameters(model, lora, layout, rank, chunk)]


@lru_cache(maxsize=16384)
def cut_adapter_buckets(key: ByValue, lora: LoRAWork, layout: Layout, rank: int,
                        bucket_size: int) -> tuple:
    """GradBuffer's buckets of the adapters of pipeline rank `rank`
    (ptdp.perf.analytic.counts.cut_placed_buckets's cutting)."""
    from ptdp.perf.analytic.counts import cut_params
    return cut_params(rank_adapter_parameters(key.value, lora, layout, rank), bucket_size)


def _linear_inputs(model: ModelConfig, sb: int, outside: int, t: int) -> dict[str, int]:
    """Elements of each linear layer's input on one tensor rank."""
    return {"linear_qkv": outside, "linear_proj": model.num_attention_heads * model.head_dim
            * sb // t, "linear_fc1": outside, "linear_fc2": sb * model.ffn_size // t}


def layer_delta_bytes(workload: Workload, layout: Layout, targets: frozenset[str], *,
                      kernels: str, zero_bubble: bool = False, moe: bool = False) -> int:
    """What one layer with adapters on `targets` (and a frozen base) saves
    beyond the full fine-tuning figure, per microbatch (see the module
    docstring; negative where it saves less)."""
    model, lora, e = workload.model, workload.lora, workload.bytes_per_element
    if layout.recompute == "full":
        return 0
    t, c = layout.t, layout.c
    sb = model.seq_length // c * layout.b
    outside = (sb // t if layout.splits_sequence else sb) * model.hidden_size
    cpu = kernels == "cpu"
    attention_keeps_output = (layout.recompute is None and not (cpu and model.attention_dropout > 0)
                              if c == 1 else layout.cp_comm != "a2a")
    kept = {"linear_qkv": layout.splits_sequence or zero_bubble,
            "linear_fc1": layout.splits_sequence or zero_bubble,
            "linear_proj": attention_keeps_output or zero_bubble,
            "linear_fc2": zero_bubble}
    mask = e if cpu else 1
    inputs = _linear_inputs(model, sb, outside, t)
    delta = 0
    for target, size in inputs.items():
        if moe and target in ("linear_fc1", "linear_fc2"):
            if target in targets:   # the routed copies' (and shared expert's) down projections
                copies = model.moe_router_topk + (
                    1 if model.moe_shared_expert_intermediate_size else 0)
                delta += copies * sb * lora.rank * e
            continue
        if target in targets:
            delta += sb * lora.rank * e
            if lora.dropout:
                delta += size * (e + mask) - (0 if kept[target] else size * e)
        elif not kept[target]:
            delta -= size * e
    return delta
