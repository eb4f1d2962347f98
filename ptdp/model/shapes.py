"""The names and shapes of a model's logical tensors.

A *logical state* is what ptdp's layout-independent checkpoints hold: the
one-process model's parameter names with unsharded, unpadded shapes (the
word embedding is [vocab_size, h]; ptdp pads it per layout when loading).
Checkpoints are verified against this table (checkpoint/integrity.py),
and every converter checks the states it reads and writes against it.
"""

from __future__ import annotations

import math

from ptdp.config import ModelConfig


def logical_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every logical tensor's name and shape for `config`."""
    h, f, d = config.hidden_size, config.ffn_size, config.head_dim
    heads, groups = config.num_attention_heads, config.query_groups
    norm, linear = _entries(config)
    shapes: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (config.vocab_size, h)}
    if not config.rope:
        shapes["embedding.position_embeddings.weight"] = (config.max_positions, h)
    if config.multi_latent_attention:
        attention = mla_attention_shapes(config)
    else:
        attention = {
            # rows: the queries of every head, then the keys and the values of every group
            **linear("attention.query_key_value", (heads + 2 * groups) * d, h, config.qkv_bias),
            # --qk-layernorm: one norm over each head's d values, for queries and for keys
            **(norm("attention.q_layernorm", d) | norm("attention.k_layernorm", d)
               if config.qk_layernorm else {}),
            **linear("attention.dense", h, heads * d),
            # --softmax-type learnable: a sink logit per head
            **({"attention.sinks": (heads,)} if config.softmax_type == "learnable" else {}),
        }
    per_layer = {
        **norm("input_layernorm"),
        **attention,
        **norm("post_attention_layernorm"),
        # gated (SwiGLU, GeGLU, quick-GeGLU): the gate's rows, then the up projection's
        **linear("mlp.dense_h_to_4h", 2 * f if config.gated_linear_unit else f, h),
        **linear("mlp.dense_4h_to_h", h, f),
        # --sandwich-norm: the norms on attention's and the MLP's outputs
        **(norm("attention_output_layernorm") | norm("mlp_output_layernorm")
           if config.sandwich_norm else {}),
    }
    moe_layer = {name: shape for name, shape in per_layer.items() if not name.startswith("mlp.")}
    if config.is_moe:
        moe_layer.update(_moe_shapes(config, linear))
    pattern = config.moe_layer_pattern if config.is_moe else [False] * config.num_layers
    for i in range(config.num_layers):
        layer = moe_layer if pattern[i] else per_layer
        shapes.update({f"layers.{i}.{name}": shape for name, shape in layer.items()})
    shapes.update(norm("final_layernorm"))
    if not config.tied_output:
        shapes["output_layer.weight"] = (config.vocab_size, h)
    # --mtp-num-layers: each MTP module's norms of the embedding and the
    # hidden state, its 2h -> h projection (columns: the embedding's h, then
    # the hidden state's), its transformer layer (the last layer's kind) and
    # final norm (ptdp.model.mtp)
    last = moe_layer if pattern[-1] else per_layer
    for k in range(config.mtp_depth):
        prefix = f"mtp.layers.{k}"
        shapes.update({f"{prefix}.{name}": shape for name, shape in
                       {**norm("enorm"), **norm("hnorm"), "eh_proj.weight": (h, 2 * h),
                        **{f"transformer_layer.{n}": x for n, x in last.items()},
                        **norm("final_layernorm")}.items()})
    return shapes


def _entries(config: ModelConfig):
    """norm(name, size = h) and linear(name, rows, columns, bias = the
    model's): a norm's or a linear layer's entries of the table."""
    layernorm = config.normalization == "LayerNorm"  # RMSNorm has no bias

    def norm(name: str, size: int = config.hidden_size) -> dict[str, tuple[int, ...]]:
        return {f"{name}.weight": (size,), **({f"{name}.bias": (size,)} if layernorm else {})}

    def linear(name: str, rows: int, columns: int, bias: bool = config.bias
               ) -> dict[str, tuple[int, ...]]:
        return {f"{name}.weight": (rows, columns), **({f"{name}.bias": (rows,)} if bias else {})}
    return norm, linear


def mla_attention_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A layer's multi-latent attention, in module order (ptdp.model.mla,
    whose docstring maps the names to Megatron-Core's and transformers'):
    the down projections and latent norms are replicated over the tensor
    ranks; the up projections' (and the direct query projection's) rows are
    per head ([q_n; q_r] and [k_n; v]) and split with the heads, the output
    projection's columns likewise, its bias whole."""
    norm, linear = _entries(config)
    h, heads, latent = config.hidden_size, config.num_attention_heads, config.kv_lora_rank
    query_rows = heads * config.mla_query_head_dim
    if config.q_lora_rank is None:
        query = linear("attention.query", query_rows, h, False)
    else:
        query = {**linear("attention.query_down", config.q_lora_rank, h, False),
                 **(norm("attention.query_latent_layernorm", config.q_lora_rank)
                    if config.qk_layernorm else {}),
                 **linear("attention.query_up", query_rows, config.q_lora_rank, False)}
    return {**query,
            **linear("attention.key_value_down", latent + config.qk_pos_emb_head_dim, h, False),
            **(norm("attention.key_value_latent_layernorm", latent) if config.qk_layernorm else {}),
            **linear("attention.key_value_up", heads * (config.qk_head_dim + config.v_head_dim),
                     latent, False),
            **linear("attention.dense", h, heads * config.v_head_dim)}


# Multi-latent attention's tensors split over the tensor ranks, by dimension
# (ptdp.model.mla): the up projections' (and the direct query projection's)
# rows and the output projection's columns, with the heads. The others (the
# down projections, the latent norms, the output bias) are replicated.
MLA_SPLIT_DIMS = {"query_up.weight": 0, "query.weight": 0, "key_value_up.weight": 0,
                  "dense.weight": 1}


def mla_rank_sizes(config: ModelConfig, t: int) -> list[tuple[int, bool]]:
    """(elements on one of t tensor ranks, whether split) of each tensor of
    a layer's multi-latent attention, in module order."""
    return [(math.prod(shape) // t, True) if name.removeprefix("attention.") in MLA_SPLIT_DIMS
            else (math.prod(shape), False) for name, shape in mla_attention_shapes(config).items()]


def _moe_shapes(config: ModelConfig, linear) -> dict[str, tuple[int, ...]]:
    """An MoE layer's MLP: the router, each expert under its own name (so a
    checkpoint holds every expert whatever the layout), the shared expert."""
    h, E = config.hidden_size, config.num_experts

    def mlp(name: str, width: int) -> dict[str, tuple[int, ...]]:
        return {**linear(f"{name}.dense_h_to_4h", 2 * width if config.gated_linear_unit else width, h),
                **linear(f"{name}.dense_4h_to_h", h, width)}

    shapes = {"mlp.router.weight": (E, h), **({"mlp.router.bias": (E,)} if config.bias else {})}
    for e in range(E):
        shapes.update(mlp(f"mlp.experts.{e}", config.moe_ffn_size))
    if config.moe_shared_expert_intermediate_size:
        shapes.update(mlp("mlp.shared_expert", config.moe_shared_expert_intermediate_size))
        if config.moe_shared_expert_gate:
            shapes["mlp.shared_expert_gate"] = (1, h)
    return shapes


def state_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The model's saved state that is not a parameter (float32 whatever
    the training precision, replicated on every rank): the MoE routers'
    expert biases of aux-loss-free balancing."""
    if not (config.is_moe and config.moe_router_enable_expert_bias):
        return {}
    biases = {f"layers.{i}.mlp.router.expert_bias": (config.num_experts,)
              for i, is_moe in enumerate(config.moe_layer_pattern) if is_moe}
    if config.moe_layer_pattern[-1]:  # the MTP modules' layers are the last layer's kind
        biases.update({f"mtp.layers.{k}.transformer_layer.mlp.router.expert_bias":
                       (config.num_experts,) for k in range(config.mtp_depth)})
    return biases
