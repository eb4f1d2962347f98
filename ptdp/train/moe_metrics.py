"""What the training loop does for MoE layers at each iteration: give their
load-balancing losses the main loss's backward scale, move the expert
biases of aux-loss-free balancing, and report those losses as Megatron-LM
logs them (without their coefficients, averaged over the iteration's
microbatches and over the model's MoE layers, whichever pipeline stage
holds them, and over the data-parallel replicas)."""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from ptdp.config import ModelConfig
from ptdp.model.moe import BALANCING_NAMES, MoELayer
from ptdp.parallel.topology import ParallelContext


def moe_layers(chunks: Iterable[torch.nn.Module]) -> list[MoELayer]:
    return [module for chunk in chunks for module in chunk.modules() if isinstance(module, MoELayer)]


def set_aux_loss_scale(layers: list[MoELayer], scale: float) -> None:
    """The gradient a balancing loss starts its backward with: the main
    loss's (loss scale / microbatches, as the pipeline executor gives it)."""
    for layer in layers:
        layer.aux_loss_scale = scale


def start_iteration(layers: list[MoELayer]) -> None:
    for layer in layers:
        layer.start_iteration()


def logged_names(config: ModelConfig) -> list[str]:
    """The balancing losses a run of `config` reports (Megatron-LM's names)."""
    names = []
    if config.moe_aux_loss_coeff > 0 and config.moe_router_load_balancing_type in BALANCING_NAMES:
        names.append(BALANCING_NAMES[config.moe_router_load_balancing_type])
    if config.moe_z_loss_coeff:
        names.append("z_loss")
    return names


def balancing_metrics(layers: list[MoELayer], config: ModelConfig, ctx: ParallelContext,
                      device: torch.device) -> dict[str, float]:
    """This iteration's balancing losses, and how evenly the experts were
    loaded over the global batch: the busiest and the idlest expert's share
    of the tokens the experts took (over every MoE layer: 1/E each when
    balanced), and under a capacity factor the fraction of the top-k's
    assignments dropped. Collective over the pipeline and data-parallel
    groups (every rank calls it, with or without MoE layers)."""
    names = logged_names(config)
    taken = [layer.take_metrics() for layer in layers]
    sums = torch.zeros(len(names) + 2, dtype=torch.float64, device=device)
    for metrics in taken:
        for i, name in enumerate(names):
            if metrics.get(name):
                sums[i] += torch.stack(metrics[name]).double().mean()
    # Each layer's tokens per expert over the global batch (the microbatches
    # here, summed over the replicas), and its assignments.
    counts = torch.stack([torch.stack(m["tokens_per_expert"]).double().sum(dim=0)
                          for m in taken if m.get("tokens_per_expert")]) if layers else \
        torch.zeros(0, config.num_experts, dtype=torch.float64, device=device)
    # The replicas are the data × context group: context ranks route other
    # positions of the same sequences, and their balancing losses are parts
    # that add up to their replica's (ptdp.model.moe).
    replicas = ctx.grad_reduce_group
    if replicas is not None and len(counts):
        dist.all_reduce(counts, group=replicas)
    # Summed over the stages and replicas below: this rank's assignments,
    # and its share of the (already summed) tokens taken.
    sums[-2] = sum(float(sum(m.get("assigned", []))) for m in taken)
    sums[-1] = counts.sum() / ctx.grad_reduce_size
    shares = counts / counts.sum(dim=1, keepdim=True).clamp(min=1.0)
    extremes = torch.tensor([shares.max().item() if len(counts) else 0.0,
                             -shares.min().item() if len(counts) else -1.0],
                            dtype=torch.float64, device=device)
    for group in (ctx.pp_group, replicas):
        if group is not None:
            dist.all_reduce(sums, group=group)
    if ctx.pp_group is not None:
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=ctx.pp_group)
    sums[:len(names)] /= sum(config.moe_layer_pattern) * ctx.dp_size
    if "global_load_balancing_loss" in names:  # each replica holds a part of it: their sum
        sums[names.index("global_load_balancing_loss")] *= ctx.dp_size
    metrics = dict(zip(names, sums[:len(names)].tolist()))
    metrics["moe_busiest_expert_share"] = extremes[0].item()
    metrics["moe_idlest_expert_share"] = -extremes[1].item()
    if config.moe_expert_capacity_factor is not None:
        metrics["moe_dropped_fraction"] = 1.0 - sums[-1].item() / max(sums[-2].item(), 1.0)
    return metrics


@torch.no_grad()
def update_expert_biases(layers: list[MoELayer], rate: float, ctx: ParallelContext) -> None:
    """Aux-loss-free balancing, after the iteration's backward (before the
    optimizer step, whether or not it is skipped, as Megatron-Core does):
    each expert's bias moves by `rate` towards balance, + when it took fewer
    tokens than the mean over the layer's experts, − when more. The counts
    are the global batch's: every tensor rank routed its replica's whole
    microbatches (ptdp.model.moe), so they are summed over the data-parallel
    replicas and the context ranks (which route other positions) only
    (Megatron-Core, whose tensor ranks route s/t tokens each, sums over
    tensor × context × data). Collective over the data × context group."""
    routers = [layer.router for layer in layers if layer.router.expert_bias is not None]
    if not routers:
        return
    counts = torch.stack([router.tokens_per_expert for router in routers])
    if ctx.grad_reduce_group is not None:
        dist.all_reduce(counts, group=ctx.grad_reduce_group)
    step = torch.sign(counts.mean(dim=1, keepdim=True) - counts) * rate
    for router, change in zip(routers, step):
        router.expert_bias += change
        router.tokens_per_expert.zero_()
