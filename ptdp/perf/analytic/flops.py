"""The paper's FLOP count (its Appendix formula, generalised to the Llama
family's options): model FLOPs of one training iteration, with what
activation recomputation adds. Training's report and the performance model
both use it.

With low-rank adapters on a frozen base (`lora`, ptdp.perf.layout.LoRAWork)
the paper's definition is kept, model FLOPs of the products the iteration
needs, counted for what is really computed: the base's linear layers and
the output layer run forward and their input gradients only (2× their
forward instead of 3×: no weight gradient for a frozen weight), the
attention's score and context products forward and both halves of their
backward (3×, as before: both operands carry gradients), and the adapters'
two products per adapted layer 3× (2·R·(in + out) per token forward; a
routed expert's adapter for the k of E experts a token visits, a shared one
for each of its k copies). The layers before the first adapter, whose
backward a first stage skips, are still counted with their input
gradients: a simplification of at most one stage's backward. So a LoRA
run's MFU compares what it computes with the machine's peak, not the 6·N·D
of full training. (Megatron-LM's num_floating_point_operations, which
Megatron-Bridge reports, has no adapter term: it reports a LoRA run as if
it trained every weight; we did not find a Bridge convention that differs.)

Multi-token prediction (--mtp-num-layers D) adds, per module, its 2h -> h
projection, its transformer layer (the model's last layer's kind) and the
output layer, 3× their forward (Megatron-LM's num_floating_point_operations
counts the same products, and the modules' norms besides)."""

from __future__ import annotations

from ptdp.config import ModelConfig
from ptdp.perf.analytic.local_attention import pair_fraction
from ptdp.perf.analytic.moe import mlp_columns, router_columns


def model_flops_per_iteration(config: ModelConfig, global_batch: int, *, recompute: str | None,
                              recomputed_layers: int | None = None, lora=None) -> float:
    """The paper's FLOPs of one iteration (forward and backward of
    `global_batch` sequences over all devices together).

    `recompute` is None, "full" or "selective". With "full", every layer is
    recomputed unless `recomputed_layers` says how many are (the block
    method recomputes only the first --recompute-num-layers of each chunk;
    see `recomputed_layer_count`). `lora`: a LoRAWork (see the module docstring)."""
    B, s, h, l = global_batch, config.seq_length, config.hidden_size, config.num_layers
    V = config.vocab_size
    # 24·B·s·h² per layer for GPT-2's options (g = a, a·d = h, a [4h, h] MLP);
    # a windowed layer's score and context products: the window's share
    # (ptdp.perf.analytic.local_attention)
    attention = [2 * B * s * s * core * share
                 for core, share in zip([attention_core_columns(config)] * l,
                                        attention_shares(config))]
    projections = attention_projection_macs(config)
    layers = [2 * B * s * (projections + h * width) + layer_attention
              for width, layer_attention in zip(mlp_widths(config), attention)]
    layer = sum(layers) / l   # (the mean layer: MoE and dense layers differ)
    output_layer = 2 * B * s * h * V
    # --mtp-num-layers D: each module's 2h -> h projection and transformer
    # layer (built as the last layer), and the output layer once more
    mtp_layer = 2 * B * s * 2 * h * h + layers[-1]
    mtp = config.mtp_depth
    total = 3 * sum(layers) + 3 * output_layer + 3 * mtp * (mtp_layer + output_layer)
    if lora is not None:   # frozen base: input gradients only; adapters trained
        adapters = adapter_flops_forward(config, lora, B)
        total = 2 * (sum(layers) + output_layer) + sum(attention) + 3 * adapters
        layer += adapters / l
    if recompute is None:
        return float(total)
    if recompute == "selective":
        return float(total + selective_recompute_flops(config, B, attention))
    if recompute == "full":  # (the MTP modules are recomputed whatever the method)
        recomputed = l if recomputed_layers is None else recomputed_layers
        if not 0 <= recomputed <= l:
            raise ValueError(f"recomputed_layers = {recomputed} is not in 0..{l}")
        return float(total + recomputed * layer + mtp * mtp_layer)
    raise ValueError(f"unknown recompute {recompute!r}: use None, 'full' or 'selective'")


def selective_recompute_flops(config: ModelConfig, global_batch: int,
                              attention: list[float]) -> float:
    """What selective recomputation's --recompute-modules run again, over
    the layers and the MTP modules' layers (the last layer's kind): core_attn
    the attention's score and context products (`attention`, per layer),
    mlp a dense MLP's products, moe an MoE layer's (router and active
    experts), shared_experts its shared expert's (unless moe), mla_up_proj
    MLA's up projections (or the direct query projection); layernorm and
    moe_act recompute element-wise work only."""
    modules = config.recompute_modules
    tokens = 2 * global_batch * config.seq_length   # 2 FLOPs per multiply-add, per token
    h, up = config.hidden_size, 2 if config.gated_linear_unit else 1
    pattern = config.moe_layer_pattern if config.is_moe else [False] * config.num_layers
    columns = mlp_widths(config)
    per_layer = []
    for moe, width, core in zip(pattern, columns, attention):
        flops = core if "core_attn" in modules else 0.0
        if moe and "moe" in modules:
            flops += tokens * h * width
        elif moe and "shared_experts" in modules:
            flops += tokens * h * (up + 1) * (config.moe_shared_expert_intermediate_size or 0)
        elif not moe and "mlp" in modules:
            flops += tokens * h * width
        if "mla_up_proj" in modules and config.multi_latent_attention:
            flops += tokens * mla_up_projection_macs(config)
        per_layer.append(flops)
    return sum(per_layer) + config.mtp_depth * per_layer[-1]


def mla_up_projection_macs(config: ModelConfig) -> int:
    """Multiply-adds per token of MLA's up projections (what --recompute-modules
    mla_up_proj runs again): the query latent's to a heads of d_qk (or the
    direct query projection from h) and the key/value latent's to a heads
    of d_n + d_v."""
    a = config.num_attention_heads
    query = a * config.mla_query_head_dim
    q = (config.hidden_size if config.q_lora_rank is None else config.q_lora_rank) * query
    return q + config.kv_lora_rank * a * (config.qk_head_dim + config.v_head_dim)


def attention_projection_macs(config: ModelConfig) -> int:
    """Multiply-adds per token of a layer's attention projections: h·((a +
    2g)·d + a·d) for ordinary attention (q/k/v in, the output back); with
    multi-latent attention its down and up projections (the query latent,
    or the direct query projection, the key/value latent with the shared
    rotated key, the up projection to per-head keys and values) and the
    output from a·v_head_dim, as Megatron-LM's num_floating_point_operations
    counts them (less its norms' terms)."""
    h, a = config.hidden_size, config.num_attention_heads
    if not config.multi_latent_attention:
        g, d = config.query_groups, config.head_dim
        return h * ((a + 2 * g) * d + a * d)
    query = a * config.mla_query_head_dim
    q = h * query if config.q_lora_rank is None else config.q_lora_rank * (h + query)
    kv = (config.kv_lora_rank * (h + a * (config.qk_head_dim + config.v_head_dim))
          + h * config.qk_pos_emb_head_dim)
    return q + kv + a * config.v_head_dim * h


def attention_core_columns(config: ModelConfig) -> int:
    """Per query and key position pair, the multiply-adds of the scores and
    the context: 2·a·d for ordinary attention (the paper's 4·B·s²·a·d for
    both, forward), a·(qk_head_dim + qk_pos_emb_head_dim + v_head_dim) with
    multi-latent attention."""
    a = config.num_attention_heads
    if config.multi_latent_attention:
        return a * (config.mla_query_head_dim + config.v_head_dim)
    return 2 * a * config.head_dim


def attention_shares(config: ModelConfig) -> list[float]:
    """Per layer, the share of the full layer's attention products it
    computes: 1, or a windowed layer's `pair_fraction`."""
    windowed = config.windowed_layers
    share = pair_fraction(config.seq_length, config.window[0]) if any(windowed) else 1.0
    return [share if w else 1.0 for w in windowed]


def adapter_flops_forward(config: ModelConfig, lora, global_batch: int) -> float:
    """The adapters' forward FLOPs over `global_batch` sequences: 2 per
    multiply-add of A and B for each token that passes the adapted layer
    (k/E of the tokens through each routed expert's own adapter, k copies
    of each through a shared one)."""
    from ptdp.model.adapters import SHARED_EXPERT_ADAPTER, adapter_shapes

    tokens = global_batch * config.seq_length
    total = 0.0
    for name, shape in adapter_shapes(config, lora.config()).items():
        per_token = shape[0] * shape[1]
        if f".{SHARED_EXPERT_ADAPTER}." in name:
            per_token *= config.moe_router_topk
        elif ".mlp.experts." in name:
            per_token *= config.moe_router_topk / config.num_experts
        total += 2 * tokens * per_token
    return total


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
                                   stage_layers: list[int] | None = None, lora=None) -> float:
    """`model_flops_per_iteration` with the recomputation `config` asks for;
    `lora`: a LoRAConfig or LoRAWork (None or rank 0: every weight trained)."""
    from ptdp.perf.layout import LoRAWork

    if lora is not None and not isinstance(lora, LoRAWork):
        lora = LoRAWork.of(lora)
    return model_flops_per_iteration(
        config, global_batch, recompute=config.recompute_granularity,
        recomputed_layers=recomputed_layer_count(config, num_model_chunks, stage_layers),
        lora=lora)
