"""The names and shapes of a model's logical tensors.

A *logical state* is what ptdp's layout-independent checkpoints hold: the
one-process model's parameter names with unsharded, unpadded shapes (the
word embedding is [vocab_size, h]; ptdp pads it per layout when loading).
Checkpoints are verified against this table (train/checkpoint_integrity.py),
and every converter checks the states it reads and writes against it.
"""

from __future__ import annotations

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
