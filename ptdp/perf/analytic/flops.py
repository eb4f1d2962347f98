"""The paper's FLOP count (its Appendix formula, generalised to the Llama
family's options): model FLOPs of one training iteration, with what
activation recomputation adds. Training's report and the performance model
both use it."""

from __future__ import annotations

from ptdp.config import ModelConfig
from ptdp.perf.analytic.moe import mlp_columns, router_columns


def model_flops_per_iteration(config: ModelConfig, global_batch: int, *, recompute: str | None,
                              recomputed_layers: int | None = None) -> float:
    """The paper's FLOPs of one iteration (forward and backward of
    `global_batch` sequences over all devices together).

    `recompute` is None, "full" or "selective". With "full", every layer is
    recomputed unless `recomputed_layers` says how many are (the block
    method recomputes only the first --recompute-num-layers of each chunk;
    see `recomputed_layer_count`)."""
    B, s, h, l = global_batch, config.seq_length, config.hidden_size, config.num_layers
    V = config.vocab_size
    a, g, d = config.num_attention_heads, config.query_groups, config.head_dim
    # 24·B·s·h² per layer for GPT-2's options (g = a, a·d = h, a [4h, h] MLP)
    layer_attention = 4 * B * s * s * a * d
    layers = [2 * B * s * h * ((a + 2 * g) * d + a * d + width) + layer_attention
              for width in mlp_widths(config)]
    layer = sum(layers) / l   # (the mean layer: MoE and dense layers differ)
    output_layer = 2 * B * s * h * V
    total = 3 * sum(layers) + 3 * output_layer
    if recompute is None:
        return float(total)
    if recompute == "selective":
        return float(total + l * layer_attention)
    if recompute == "full":
        recomputed = l if recomputed_layers is None else recomputed_layers
        if not 0 <= recomputed <= l:
            raise ValueError(f"recomputed_layers = {recomputed} is not in 0..{l}")
        return float(total + recomputed * layer)
    raise ValueError(f"unknown recompute {recompute!r}: use None, 'full' or 'selective'")


def mlp_widths(config: ModelConfig) -> list[int]:
    """Per layer, the columns its MLP multiplies each token's h values by:
    (up + 1)·f for a dense MLP (up = 2 with SwiGLU: the first matrix is
    [2f, h]); in an MoE layer the router's E, the k routed experts' and the
    shared expert's (active parameters only). Megatron-LM's
    num_floating_point_operations counts the same experts and dense layers
    but not the router (ptdp.perf.analytic.moe.mlp_columns,
    `router_flops_per_iteration`)."""
    return mlp_columns(config)


def router_flops_per_iteration(config: ModelConfig, global_batch: int) -> float:
    """What `model_flops_per_iteration` counts beyond Megatron-LM's
    num_floating_point_operations for an MoE model: the routers' [h, E]
    products, 6·B·s·h·E per MoE layer (0 for a dense model)."""
    return float(6 * global_batch * config.seq_length * config.hidden_size
                 * router_columns(config))


def recomputed_layer_count(config: ModelConfig, num_model_chunks: int,
                           stage_layers: list[int] | None = None) -> int:
    """Layers whose forward is recomputed under `config`'s full
    recomputation; `num_model_chunks` is p·v, the model chunks of one
    pipeline, and `stage_layers` their layer counts when uneven
    (ptdp.schedules.split). Uniform checkpoints every layer; block
    the first --recompute-num-layers layers of each chunk."""
    if config.recompute_granularity != "full":
        return 0
    if config.recompute_method == "block":
        counts = stage_layers or [config.num_layers // num_model_chunks] * num_model_chunks
        return sum(min(config.recompute_num_layers, count) for count in counts)
    return config.num_layers


def configured_flops_per_iteration(config: ModelConfig, global_batch: int, num_model_chunks: int,
                                   stage_layers: list[int] | None = None) -> float:
    """`model_flops_per_iteration` with the recomputation `config` asks for."""
    return model_flops_per_iteration(
        config, global_batch, recompute=config.recompute_granularity,
        recomputed_layers=recomputed_layer_count(config, num_model_chunks, stage_layers))
