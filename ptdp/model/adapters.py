"""Which layers get low-rank adapters, their logical names and shapes, and
putting them on a built model (the layer itself: ptdp.parallel.lora).

An adapted layer whose base weight has the logical name `M.weight`
[out, in] (ptdp.model.shapes) gets the logical tensors `M.lora.A` [R, in]
and `M.lora.B` [out, R]. With --lora-share-expert-adapters an MoE layer's
routed experts share one adapter per matrix instead:
`layers.{i}.mlp.experts_adapter.dense_h_to_4h.A` and so on, the shape of
one expert's matrix. The adapted model computes W x + (α/R)·B A x, and
`merged` folds that into W.

Every layer that can take an adapter has two names a target pattern is
matched against (ptdp.config.lora): Megatron-Core's full module name and
ptdp's. A routed expert is `local_experts.{e}` under Megatron-Core's name
with e its global number, so that a pattern means the same under any
expert-parallel layout.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from ptdp.config import ModelConfig
from ptdp.config.lora import TARGET_NAMES, LoRAConfig
from ptdp.model.shapes import logical_shapes

# ptdp's matrix name -> Megatron-Core's, within attention and an MLP or expert.
_MEGATRON = {"attention.query_key_value": "self_attention.linear_qkv",
             "attention.dense": "self_attention.linear_proj",
             "dense_h_to_4h": "linear_fc1", "dense_4h_to_h": "linear_fc2"}
SHARED_EXPERT_ADAPTER = "experts_adapter"


@dataclass(frozen=True)
class AdaptableLayer:
    """One linear layer that can take an adapter."""
    name: str            # ptdp's module name: layers.3.mlp.experts.5.dense_h_to_4h
    megatron_name: str   # decoder.layers.3.mlp.experts.local_experts.5.linear_fc1
    target: str          # linear_qkv, linear_proj, linear_fc1 or linear_fc2
    layer: int
    expert: int | None = None   # a routed expert's global number

    @property
    def column(self) -> bool:
        """Split by output rows under tensor parallelism (else input columns)."""
        return self.target in ("linear_qkv", "linear_fc1")

    def matches(self, pattern: str) -> bool:
        if pattern == self.target:
            return True
        return fnmatch.fnmatchcase(self.megatron_name, pattern) \
            or fnmatch.fnmatchcase(self.name, pattern)


def adaptable_layers(config: ModelConfig) -> list[AdaptableLayer]:
    """Every linear layer of the model that an adapter can go on, in order."""
    pattern = config.moe_layer_pattern if config.is_moe else [False] * config.num_layers
    found = []
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}.", f"decoder.layers.{i}."
        for matrix in ("attention.query_key_value", "attention.dense"):
            found.append(AdaptableLayer(ours + matrix, theirs + _MEGATRON[matrix],
                                        _MEGATRON[matrix].split(".")[-1], i))
        mlps: list[tuple[str, str, int | None]] = [("mlp.", "mlp.", None)]
        if pattern[i]:
            mlps = [(f"mlp.experts.{e}.", f"mlp.experts.local_experts.{e}.", e)
                    for e in range(config.num_experts)]
            if config.moe_shared_expert_intermediate_size:
                mlps.append(("mlp.shared_expert.", "mlp.shared_experts.", None))
        for ours_mlp, theirs_mlp, expert in mlps:
            for matrix in ("dense_h_to_4h", "dense_4h_to_h"):
                found.append(AdaptableLayer(ours + ours_mlp + matrix,
                                            theirs + theirs_mlp + _MEGATRON[matrix],
                                            _MEGATRON[matrix], i, expert))
    return found


def adapted_layers(config: ModelConfig, lora: LoRAConfig) -> list[AdaptableLayer]:
    """The layers that --lora-target-modules picks (none without --lora-rank)."""
    if not lora.enabled:
        return []
    return [layer for layer in adaptable_layers(config)
            if any(layer.matches(pattern) for pattern in lora.lora_target_modules)]


def shared_adapter_name(layer: AdaptableLayer) -> str:
    """A routed expert's matrix's adapter under --lora-share-expert-adapters."""
    return f"layers.{layer.layer}.mlp.{SHARED_EXPERT_ADAPTER}.{layer.name.rsplit('.', 1)[1]}"


def adapter_owner(layer: AdaptableLayer, lora: LoRAConfig) -> str:
    """The module name whose `A` and `B` this layer's adapter is: its own
    `M.lora`, or its MoE layer's shared one."""
    if layer.expert is not None and lora.lora_share_expert_adapters:
        return shared_adapter_name(layer)
    return f"{layer.name}.lora"


def adapter_shapes(config: ModelConfig, lora: LoRAConfig) -> dict[str, tuple[int, ...]]:
    """Every adapter tensor's logical name and shape."""
    base = logical_shapes(config)
    shapes: dict[str, tuple[int, ...]] = {}
    for layer in adapted_layers(config, lora):
        rows, columns = base[f"{layer.name}.weight"]
        owner = adapter_owner(layer, lora)
        shapes[f"{owner}.A"] = (lora.lora_rank, columns)
        shapes[f"{owner}.B"] = (rows, lora.lora_rank)
    return shapes


def adapter_problems(config: ModelConfig, lora: LoRAConfig, *, tensor_parallel: int = 1,
                     expert_parallel: int = 1, expert_tensor_parallel: int = 1) -> list[str]:
    """What in --lora-* cannot work on this model and layout: a target that
    matches no layer, a rank larger than an adapted layer, a layout the
    experts' adapters do not support."""
    if not lora.enabled:
        return []
    problems = []
    layers = adaptable_layers(config)
    chosen = adapted_layers(config, lora)
    for pattern in lora.lora_target_modules:
        if not any(layer.matches(pattern) for layer in layers):
            examples = ", ".join(layer.megatron_name for layer in layers[:2])
            problems.append(
                f"--lora-target-modules {pattern!r} matches no layer of this model: give one of "
                f"{' '.join(TARGET_NAMES)}, or a wildcard pattern of a layer's full name (this "
                f"model's are like {examples}, {layers[-1].megatron_name}; or ptdp's, like "
                f"{layers[0].name})")
    base = logical_shapes(config)
    too_large = [(layer, base[f"{layer.name}.weight"]) for layer in chosen
                 if lora.lora_rank > min(base[f"{layer.name}.weight"])]
    if too_large:
        layer, shape = too_large[0]
        smallest = min(min(shape) for _, shape in too_large)
        problems.append(f"--lora-rank {lora.lora_rank} is larger than {len(too_large)} of the "
                        f"adapted layers, e.g. {layer.megatron_name} ({shape[0]} × {shape[1]}): "
                        f"a rank above min(out, in) adds nothing; use --lora-rank ≤ {smallest}, "
                        f"or leave those layers out of --lora-target-modules")
    experts = any(layer.expert is not None for layer in chosen)
    if experts and expert_tensor_parallel > 1 \
            and (expert_parallel > 1 or expert_tensor_parallel != tensor_parallel):
        problems.append("adapters on routed experts need the experts whole on each rank "
                        "(--expert-tensor-parallel-size 1) or split exactly like the dense MLP "
                        "(--expert-model-parallel-size 1 with --expert-tensor-parallel-size equal "
                        "to --tensor-model-parallel-size): other expert-tensor splits would need "
                        "a sum over the expert-tensor group that ptdp does not do; change "
                        "--expert-tensor-parallel-size, or leave the experts out of "
                        "--lora-target-modules (e.g. '*.self_attention.*')")
    if lora.lora_share_expert_adapters and not experts:
        problems.append("--lora-share-expert-adapters shares adapters among routed experts, but "
                        "no routed expert's layer is adapted (the model has none, or "
                        "--lora-target-modules leaves them out): leave the flag out")
    return problems


def merged(base: dict, adapters: dict, config: ModelConfig, lora: LoRAConfig) -> dict:
    """The base's logical state with every adapter folded in: W + (α/R)·B A,
    computed in float32 and stored in W's dtype."""
    out = dict(base)
    for layer in adapted_layers(config, lora):
        owner = adapter_owner(layer, lora)
        name = f"{layer.name}.weight"
        weight = base[name]
        delta = adapters[f"{owner}.B"].float() @ adapters[f"{owner}.A"].float()
        out[name] = (weight.float() + lora.scale * delta).to(weight.dtype)
    return out



def attach_adapters(chunk, config: ModelConfig, lora: LoRAConfig, tensor_parallel: int,
                    rng=None) -> int:
    """Freeze every parameter of a built model chunk (ptdp.model.gpt.GPT) and
    put the --lora-* adapters on its layers, before its `initialize`, which
    draws their initial values by logical name as every parameter's; returns
    how many adapters it holds. A routed expert's matrix is split over the
    tensor group only where its MoE layer does not dispatch (EP = 1,
    ETP = t), and its adapter's gradient is partial there; a shared
    expert's always is at t > 1 (its layer reduces once)."""
    from ptdp.parallel.lora import attach

    for param in chunk.parameters():
        param.requires_grad_(False)
    modules = dict(chunk.named_modules())
    owners = set()
    for layer in adapted_layers(config, lora):
        base = modules.get(layer.name)
        if base is None:
            continue  # another chunk's layer, or another expert-parallel rank's expert
        settings = (lora.lora_rank, lora.lora_alpha, lora.lora_dropout)
        owners.add(adapter_owner(layer, lora))
        if layer.expert is None:
            attach(base, *settings, rng=rng, partial=".shared_expert." in layer.name
                   and tensor_parallel > 1)
            continue
        moe = modules[f"layers.{layer.layer}.mlp"]
        moe.grouped_gemm = False  # the adapters run beside each expert's own product
        if lora.lora_share_expert_adapters:
            _share(moe, base, layer.name.rsplit(".", 1)[1], settings, rng,
                   partial=tensor_parallel > 1)
        else:
            attach(base, *settings, rng=rng, partial=tensor_parallel > 1 and not moe.dispatches)
    return len(owners)


def _share(moe, base, matrix: str, settings: tuple, rng, partial: bool) -> None:
    """--lora-share-expert-adapters: the MoE layer's one adapter for this
    matrix of all its routed experts (built on the first, registered on the
    layer; each expert's matrix refers to it without owning it). It is not a
    routed expert's parameter: every rank holds it, and its gradient, summed
    over the tokens every local expert took, is reduced over the replicas
    (and the tensor group, where tokens or rows were split there) as a
    dense weight's."""
    from torch import nn

    from ptdp.parallel.lora import LoRA
    from ptdp.parallel.sharding import EXPERT_ATTR, SHARD_ATTR

    if not hasattr(moe, SHARED_EXPERT_ADAPTER):
        setattr(moe, SHARED_EXPERT_ADAPTER, nn.ModuleDict())
    shared = getattr(moe, SHARED_EXPERT_ADAPTER)
    if matrix not in shared:
        spec = getattr(base.weight, SHARD_ATTR)
        shared[matrix] = LoRA(base, *settings, column=spec.dim == 0, rng=rng, partial=partial)
        for param in shared[matrix].parameters():
            if hasattr(param, EXPERT_ATTR):
                delattr(param, EXPERT_ATTR)
    base.__dict__["lora"] = shared[matrix]  # referred to, not registered a second time
