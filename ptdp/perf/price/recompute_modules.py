"""What selective recomputation runs again in a layer's backward, by
--recompute-modules (ptdp.config.recompute; ptdp.model.recompute says how
each is recomputed), in seconds of one microbatch on one tensor rank:

    core_attn       the attention core's forward (the fused kernel, or the
                    score and context products and their memory pass)
    layernorm       the layer's two norms' forward passes
    mlp             a dense MLP's two products and its activation
    mla_up_proj     multi-latent attention's up projections (or the direct
                    query projection), the latent norms and the rotation
    moe, moe_act, shared_experts   an MoE layer's: ptdp.perf.price.moe
                    (`moe_layer_costs` swaps mlp's price for them)

Each module's forward is priced as OperatorModel prices it in the layer's
forward, so recomputing every module of a layer costs what its forward
does, less the output projection, the residual adds and the collectives
(the output-discarding recomputations refill storages in place: no
communication is repeated)."""

from __future__ import annotations

from ptdp.perf.analytic.memory import recomputed_modules
from ptdp.perf.price.operator_bytes import gelu_bytes, layer_norm_bytes, rotary_bytes, swiglu_bytes

LAUNCHES = {"core_attn": 8, "layernorm": 2, "mlp": 4, "mla_up_proj": 16}


def selective_recompute_seconds(ops) -> float:
    """Seconds of the --recompute-modules of a dense layer (or the dense
    part of an MoE layer) recomputed in backward, besides core_attn's
    (which OperatorModel.layer_recompute prices with its context
    exchange). `ops`: a ptdp.perf.price.pricing.OperatorModel."""
    model = ops.w.model
    modules = recomputed_modules(model, "selective")
    shapes = ops.layer_gemms()
    seconds = 0.0
    if "layernorm" in modules:
        seconds += 2 * ops.memory(layer_norm_bytes(ops.outside(), ops.E)[0], "layer_norm",
                                  "forward")
    if "mlp" in modules:
        seconds += dense_mlp_forward(ops)
    if "mla_up_proj" in modules and model.multi_latent_attention:
        for name in ("q", "q_up", "qkv"):
            if name in shapes:
                seconds += ops.gemm(*shapes[name][:3], shapes[name][3])
        tokens = ops.b * ops.s
        seconds += ops.memory(rotary_bytes(tokens * (ops.a // ops.t + 1)
                                           * model.qk_pos_emb_head_dim, ops.E,
                                           ops.prof.fused_rope)[0])
        if model.qk_layernorm:
            rows = tokens // ops.t if ops.sp else tokens
            seconds += ops.memory(layer_norm_bytes(
                rows * (model.kv_lora_rank + (model.q_lora_rank or 0)), ops.E)[0], "layer_norm",
                "forward")
    return seconds + ops.launches(sum(LAUNCHES[name] for name in modules
                                      if name in LAUNCHES and name != "core_attn"))


def dense_mlp_forward(ops) -> float:
    """A dense MLP's forward: its two products and its activation."""
    shapes = ops.layer_gemms()
    act = (swiglu_bytes if ops.w.model.gated_linear_unit else gelu_bytes)(
        ops.b * ops.s * ops.f // ops.t, ops.E)
    return (ops.gemm(*shapes["mlp_up"][:3]) + ops.gemm(*shapes["mlp_down"][:3])
            + ops.memory(act[0], "gelu", "forward"))
