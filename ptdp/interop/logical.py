"""The names and shapes of a model's logical tensors.

A *logical state* is what ptdp's layout-independent checkpoints hold: the
one-process model's parameter names with unsharded, unpadded shapes (the
word embedding is [vocab_size, h]; ptdp pads it per layout when loading).
Every converter checks the states it reads and writes against this table.
Under --apply-layernorm-1p a norm's logical weight is what the model stores,
scale - 1; converters to other frameworks write the plain scale
(with_plain_norm_scales) and read it back (with_stored_norm_scales).
"""

from __future__ import annotations

import torch

from ptdp.config import ModelConfig


def logical_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every logical tensor's name and shape for `config`."""
    h, f, d = config.hidden_size, config.ffn_size, config.head_dim
    heads, groups = config.num_attention_heads, config.query_groups
    layernorm = config.normalization == "LayerNorm"  # RMSNorm has no bias

    def norm(name: str) -> dict[str, tuple[int, ...]]:
        return {f"{name}.weight": (h,), **({f"{name}.bias": (h,)} if layernorm else {})}

    def linear(name: str, rows: int, columns: int) -> dict[str, tuple[int, ...]]:
        bias = {f"{name}.bias": (rows,)} if config.bias else {}
        return {f"{name}.weight": (rows, columns), **bias}

    shapes: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (config.vocab_size, h)}
    if not config.rope:
        shapes["embedding.position_embeddings.weight"] = (config.max_positions, h)
    per_layer = {
        **norm("input_layernorm"),
        # rows: the queries of every head, then the keys and the values of every group
        **linear("attention.query_key_value", (heads + 2 * groups) * d, h),
        **linear("attention.dense", h, heads * d),
        **norm("post_attention_layernorm"),
        # with SwiGLU: the gate's rows, then the up projection's
        **linear("mlp.dense_h_to_4h", 2 * f if config.swiglu else f, h),
        **linear("mlp.dense_4h_to_h", h, f),
    }
    for i in range(config.num_layers):
        shapes.update({f"layers.{i}.{name}": shape for name, shape in per_layer.items()})
    shapes.update(norm("final_layernorm"))
    if not config.tied_output:
        shapes["output_layer.weight"] = (config.vocab_size, h)
    return shapes


def norm_weight_names(config: ModelConfig) -> list[str]:
    """The logical names of every norm's scale (each layer's two, the final one)."""
    return [name for name in logical_shapes(config) if name.endswith("layernorm.weight")]


def with_plain_norm_scales(logical: dict[str, torch.Tensor],
                           config: ModelConfig) -> dict[str, torch.Tensor]:
    """`logical` with each norm's weight as the scale itself, as other
    frameworks store it: under --apply-layernorm-1p the stored w becomes
    1 + w; otherwise the state is returned as it is."""
    return _shift_norm_weights(logical, config, 1.0)


def with_stored_norm_scales(plain: dict[str, torch.Tensor],
                            config: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of with_plain_norm_scales: plain scales as `config`'s
    model stores them (scale - 1 under --apply-layernorm-1p)."""
    return _shift_norm_weights(plain, config, -1.0)


def _shift_norm_weights(state: dict[str, torch.Tensor], config: ModelConfig,
                        shift: float) -> dict[str, torch.Tensor]:
    if not config.apply_layernorm_1p:
        return state
    shifted = dict(state)
    for name in norm_weight_names(config):
        if name in state:  # a state with a missing tensor is refused by its checker
            tensor = state[name]
            # Added in fp32: a bf16 w near 0 has bits that 1 + w in bf16 loses.
            shifted[name] = (tensor.detach().float() + shift).to(tensor.dtype)
    return shifted
