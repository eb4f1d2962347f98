"""What the training loop does for MoE layers at each iteration: give their
load-balancing losses the main loss's backward scale, and report those
losses as Megatron-LM logs them (without their coefficients, averaged over
the iteration's microbatches and over the model's MoE layers, whichever
pipeline stage holds them, and over the data-parallel replicas)."""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from ptdp.config import ModelConfig
from ptdp.model.moe import MoELayer
from ptdp.parallel.topology import ParallelContext


def moe_layers(chunks: Iterable[torch.nn.Module]) -> list[MoELayer]:
    return [module for chunk in chunks for module in chunk.modules() if isinstance(module, MoELayer)]


def set_aux_loss_scale(layers: list[MoELayer], scale: float) -> None:
    """The gradient a balancing loss starts its backward with: the main
    loss's (loss scale / microbatches, as the pipeline executor gives it)."""
    for layer in layers:
        layer.aux_loss_scale = scale


def logged_names(config: ModelConfig) -> list[str]:
    """The balancing losses a run of `config` reports (Megatron-LM's names)."""
    names = []
    if config.moe_aux_loss_coeff > 0 and config.moe_router_load_balancing_type == "aux_loss":
        names.append("load_balancing_loss")
    if config.moe_aux_loss_coeff > 0 and config.moe_router_load_balancing_type == "seq_aux_loss":
        names.append("seq_load_balancing_loss")
    if config.moe_z_loss_coeff:
        names.append("z_loss")
    return names


def balancing_metrics(layers: list[MoELayer], config: ModelConfig, ctx: ParallelContext,
                      device: torch.device) -> dict[str, float]:
    """This iteration's balancing losses; collective over the pipeline and
    data-parallel groups (every rank calls it, with or without MoE layers)."""
    names = logged_names(config)
    if not names:
        return {}
    sums = torch.zeros(len(names), dtype=torch.float64, device=device)
    for layer in layers:
        taken = layer.take_metrics()
        for i, name in enumerate(names):
            if taken.get(name):
                sums[i] += torch.stack(taken[name]).double().mean()
    for group in (ctx.pp_group, ctx.dp_group):
        if group is not None:
            dist.all_reduce(sums, group=group)
    sums /= sum(config.moe_layer_pattern) * ctx.dp_size
    return dict(zip(names, sums.tolist()))
