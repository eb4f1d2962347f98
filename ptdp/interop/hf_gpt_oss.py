"""Hugging Face gpt-oss (GptOssForCausalLM) checkpoints <-> ptdp.

gpt-oss is a decoder of RMSNorm, grouped-query attention with biases and a
learnable sink logit per head, alternating sliding-window and full layers,
YaRN rotary embeddings, and an MoE MLP in every layer. In ptdp's (Megatron-
LM's) flags:

    config.json                              ptdp
    layer_types, sliding_window W            --window-size W-1,0 and --window-attn-skip-freq
                                             [1,0,...] (1: "sliding_attention")
    self_attn.sinks                          --softmax-type learnable (layers.i.attention.sinks)
    rope_parameters (rope_type yarn):        --position-embedding-type yarn --rotary-base θ
      factor, original_max_position_emb.,    --rotary-scaling-factor, --yarn-original-max-
      beta_fast, beta_slow, truncate         position-embeddings, --yarn-beta-fast/-slow,
                                             --[no-]yarn-correction-range-round-to-int
    attention_bias true                      biases everywhere (no --disable-bias-linear): the
                                             experts and the router always have them
    num_local_experts, num_experts_per_tok   --num-experts, --moe-router-topk (top-k of the
                                             router's logits, softmax over those k: ptdp's
                                             default, no --moe-router-pre-softmax)
    intermediate_size                        --moe-ffn-hidden-size (and --ffn-hidden-size)
    swiglu_limit C, swiglu_alpha 1.702       --quick-geglu --glu-linear-offset 1
                                             --activation-func-clamp-value C (1.702 is
                                             quick-GeLU's fixed gain)

The experts are stored fused: `mlp.experts.gate_up_proj` [E, h, 2f] (x @ W,
the gate and up columns interleaved: [..., ::2] and [..., 1::2]) with
`gate_up_proj_bias` [E, 2f], and `down_proj` [E, f, h] with `down_proj_bias`
[E, h]; ptdp keeps each expert's dense_h_to_4h as [gate rows | up rows].
Published checkpoints hold the expert matrices in MXFP4 (`*_blocks` and
`*_scales`, quantization_config.quant_method "mxfp4"): import dequantizes
them (`dequantize_mxfp4`); export writes plain floating point.
Anything else that changes what the model computes is refused, naming the
key or the flag.
"""

from __future__ import annotations

import math
import re
import sys
from typing import Any, Mapping

import torch

from ptdp.config import ModelConfig
from ptdp.interop.family import ModuleFamily
from ptdp.config.moe import moe_problems
from ptdp.interop.hf_dense_families import common_model_fields, positive_int
from ptdp.interop.hf_files import (
    ConversionError,
    carriers_matching,
    check_sizes,
    check_state,
    layer_disagreement,
    shape_of,
    size_disagreement,
    split_state,
)
from ptdp.interop.hf_llama import attention_name_pairs, check_output_layer
from ptdp.interop.logical import logical_shapes, with_plain_norm_scales, with_stored_norm_scales

HF_CLASS, MODEL_TYPE = "GptOssForCausalLM", "gpt_oss"
OUTPUT = "lm_head.weight"
QUICK_GELU_ALPHA = 1.702  # ptdp's (Megatron-Core's) quick-GeLU gain, fixed
DEFAULT_THETA = 150000.0  # GptOssConfig.default_theta
_IGNORED = re.compile(r"^(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq$")
_EXPERTS = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")
_MXFP4 = re.compile(r"^(.*\.experts\.(?:gate_up_proj|down_proj))_(blocks|scales)$")
# FP4 E2M1 codes 0..15 (bit 3: sign), as the OCP Microscaling spec and
# transformers' integrations/mxfp4.py list them.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


# ------------------------------------------------------------------ MXFP4

def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An MXFP4 tensor as gpt-oss stores its experts: `blocks` [..., rows, G,
    16] uint8, two FP4 E2M1 codes a byte (the low nibble first), 32 values
    a group; `scales` [..., rows, G] uint8, each group's E8M0 exponent
    (2^(s - 127)). Returns the values [..., rows, G·32] transposed on the
    last two axes, [..., G·32, rows] (as transformers' convert_moe_packed_tensors):
    the x @ W layout of gate_up_proj / down_proj."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ConversionError(f"MXFP4 blocks and scales must be uint8, not {blocks.dtype} and "
                              f"{scales.dtype}")
    if blocks.dim() < 3 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ConversionError(f"MXFP4 blocks {tuple(blocks.shape)} and scales "
                              f"{tuple(scales.shape)}: expected blocks [..., G, 16] and scales "
                              f"[..., G]")
    table = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # low nibble first
    values = table[codes].flatten(-2)  # [..., G, 32]
    exponents = scales.to(torch.int32) - 127
    values = torch.ldexp(values, exponents.unsqueeze(-1).to(torch.float32))
    values = values.flatten(-2)  # [..., rows, G·32]
    return values.transpose(-1, -2).contiguous().to(dtype)


def _dequantized_shape(blocks: tuple[int, ...]) -> tuple[int, ...]:
    return (*blocks[:-3], blocks[-2] * blocks[-1] * 2, blocks[-3])


def _quantization_problems(hf: dict[str, Any]) -> list[str]:
    quantization = hf.get("quantization_config")
    if quantization is None:
        return []
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if method == "mxfp4":
        return []
    return [f"quantization_config={quantization!r} is not a format ptdp reads: ptdp dequantizes "
            f"gpt-oss's MXFP4 experts (quant_method 'mxfp4') only; dequantize the model "
            f"first (e.g. load it in transformers and save_pretrained it in bf16 or fp32)"]


def load_state(weights: Any) -> dict[str, torch.Tensor]:
    """The tensors of an HFWeights (hf_weights.py) the model uses, MXFP4
    pairs dequantized into the fused experts' names (`...experts.gate_up_proj`),
    in the dtype of their biases; refuses a pair whose half is missing."""
    from safetensors import safe_open

    keys = [key for key in weights.tensors if not _IGNORED.match(key.removeprefix("model."))]
    quantized = {key for key in keys if _MXFP4.match(key)}
    state = weights.load(key for key in keys if key not in quantized)
    for key in sorted(quantized):
        base, part = _MXFP4.match(key).groups()
        if part == "scales":
            continue
        if base + "_scales" not in quantized:
            raise ConversionError(f"{key} has no {base}_scales beside it: MXFP4 blocks need "
                                  f"their scales")
        pair = []
        for name in (key, base + "_scales"):
            stored = weights.tensors[name]
            if stored.dtype != "U8":
                raise ConversionError(f"{stored.file}: {name} is {stored.dtype}; MXFP4 blocks and "
                                      f"scales are U8 (another format ptdp does not read)")
            with safe_open(str(stored.file), framework="pt") as handle:
                pair.append(handle.get_tensor(name))
        bias = state.get(base + "_bias")
        value = dequantize_mxfp4(*pair, bias.dtype if bias is not None else torch.float32)
        if not bool(torch.isfinite(value).all()):
            raise ConversionError(f"{key}: MXFP4 scales beyond the dtype's range (infinite "
                                  f"weights): the file is damaged")
        state[base] = value
    for key in quantized:
        base = _MXFP4.match(key).group(1)
        if base not in state:
            raise ConversionError(f"{key} has no {base}_blocks beside it")
    return state


# ------------------------------------------------------------------ config.json -> ModelConfig

def _rope_fields(hf: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """The rotary settings of `rope_parameters` (transformers 5) or the
    older `rope_scaling` + `rope_theta`: plain or YaRN, as transformers'
    _compute_yarn_parameters reads them."""
    given = {key: hf[key] for key in ("rope_parameters", "rope_scaling")
             if isinstance(hf.get(key), dict)}
    settings = dict(next(iter(given.values()), {"rope_type": "yarn", "factor": 32.0,
                                                "beta_fast": 32.0, "beta_slow": 1.0,
                                                "truncate": False,
                                                "original_max_position_embeddings": 4096}))
    if len(given) == 2 and {k: v for k, v in given["rope_parameters"].items() if k != "rope_theta"} \
            != {k: v for k, v in given["rope_scaling"].items() if k != "rope_theta"}:
        problems.append(f"rope_parameters={given['rope_parameters']!r} and rope_scaling="
                        f"{given['rope_scaling']!r} disagree; keep one")
    theta = settings.get("rope_theta", hf.get("rope_theta", DEFAULT_THETA))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not theta > 0:
        problems.append(f"rope_theta={theta!r} must be a positive number")
    if settings.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append(f"partial_rotary_factor={settings['partial_rotary_factor']!r}: ptdp "
                        f"rotates whole heads")
    kind = settings.get("rope_type", settings.get("type"))
    if kind in (None, "default"):
        return dict(position_embedding_type="rope", rotary_base=float(theta))
    if kind != "yarn":
        problems.append(f"rope_type {kind!r} is not supported: ptdp reads gpt-oss's 'yarn' and "
                        f"plain ('default') rotary embeddings")
        return {}
    original = settings.get("original_max_position_embeddings")
    factor = settings.get("factor")
    if factor is None and positive_int(original):  # (as transformers infers it)
        factor = hf.get("max_position_embeddings", 0) / original
    if not positive_int(original):
        problems.append(f"rope_parameters.original_max_position_embeddings={original!r} must "
                        f"be a positive integer")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not factor >= 1:
        problems.append(f"rope_parameters.factor={factor!r} must be a number of at least 1")
        return {}
    scales = _mscales(settings, factor, problems)
    truncate = settings.get("truncate", True)
    if not isinstance(truncate, bool):
        problems.append(f"rope_parameters.truncate={truncate!r} must be true or false")
    return dict(position_embedding_type="yarn", rotary_base=float(theta),
                rotary_scaling_factor=float(factor), yarn_original_max_position_embeddings=original,
                yarn_beta_fast=float(settings.get("beta_fast") or 32.0),
                yarn_beta_slow=float(settings.get("beta_slow") or 1.0), mscale=scales[0],
                mscale_all_dim=scales[1], yarn_correction_range_round_to_int=bool(truncate))


def _mscales(settings: dict[str, Any], factor: float, problems: list[str]) -> tuple[float, float]:
    """(--mscale, --mscale-all-dim) giving transformers' YaRN attention
    factor: `attention_factor` when given, else the ratio of the two
    mscales when both are non-zero, else 0.1·ln f + 1 (ptdp's defaults 1, 0)."""
    mscale, all_dim = settings.get("mscale"), settings.get("mscale_all_dim")
    numbers = all(isinstance(x, (int, float, type(None))) and not isinstance(x, bool)
                  for x in (mscale, all_dim))
    given = (float(mscale or 1.0), float(all_dim or 0.0)) if numbers else (1.0, 0.0)
    wanted = settings.get("attention_factor")
    if wanted is None:
        return given if mscale and all_dim and numbers else (1.0, 0.0)
    for scales in (given, (1.0, 0.0)):
        if isinstance(wanted, (int, float)) and math.isclose(
                wanted, _mscale(factor, scales[0]) / _mscale(factor, scales[1]), rel_tol=1e-9):
            return scales
    problems.append(f"rope_parameters.attention_factor={wanted!r} is not supported: ptdp "
                    f"computes YaRN's factor from factor, mscale and mscale_all_dim, which "
                    f"give another here; drop it or give the mscales")
    return (1.0, 0.0)


def _mscale(factor: float, scale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0


def _window_fields(hf: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    layers, types = hf.get("num_hidden_layers"), hf.get("layer_types")
    if types is None and positive_int(layers):  # GptOssConfig's default: sliding first
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or (positive_int(layers) and len(types) != layers):
        problems.append(f"layer_types={types!r} must list one type per layer")
        return {}
    windowed = [kind == "sliding_attention" for kind in types]
    if not any(windowed):
        return {}
    width = hf.get("sliding_window")
    if not positive_int(width):
        problems.append(f"sliding_window={width!r} must be a positive integer (the keys each "
                        f"'sliding_attention' query sees, its own included)")
        return {}
    return dict(window_size=f"{width - 1},0", window_attn_skip_freq=None if all(windowed) else
                "[" + ",".join("1" if w else "0" for w in windowed) + "]")


def model_config_from_hf_config(hf: dict[str, Any], **overrides: Any) -> ModelConfig:
    """The ModelConfig of a gpt-oss config.json; refuses, naming the key,
    what ptdp cannot compute. `overrides` set other ModelConfig fields."""
    problems = _quantization_problems(hf)
    # The sizes, heads, norm and tying as every Llama-like config gives them;
    # the rotary settings, windows and activation are gpt-oss's own (below).
    plain = {k: v for k, v in hf.items()
             if k not in ("rope_parameters", "rope_scaling", "rope_theta", "layer_types",
                          "hidden_act")}
    fields = common_model_fields(plain, problems)
    fields.update(_rope_fields(hf, problems), **_window_fields(hf, problems))
    if hf.get("attention_bias", True) is not True:
        problems.append(f"attention_bias={hf['attention_bias']!r} is not supported: gpt-oss's "
                        f"experts and router have biases, and ptdp has biases on every linear "
                        f"layer or on none")
    alpha, limit = hf.get("swiglu_alpha", QUICK_GELU_ALPHA), hf.get("swiglu_limit", 7.0)
    if alpha != QUICK_GELU_ALPHA:
        problems.append(f"swiglu_alpha={alpha!r} is not supported: ptdp's quick-GeLU gain is "
                        f"{QUICK_GELU_ALPHA}")
    if not isinstance(limit, (int, float)) or isinstance(limit, bool) or not limit > 0:
        problems.append(f"swiglu_limit={limit!r} must be a positive number")
    if hf.get("attention_dropout") not in (None, 0, 0.0):
        problems.append(f"attention_dropout={hf['attention_dropout']!r} is not supported: "
                        f"ptdp's attention with sinks has no dropout; set it to 0.0")
    experts, topk = hf.get("num_local_experts"), hf.get("num_experts_per_tok")
    for key, value in (("num_local_experts", experts), ("num_experts_per_tok", topk)):
        if not positive_int(value):
            problems.append(f"{key}={value!r} must be a positive integer")
    coefficient = hf.get("router_aux_loss_coef", 0.001)
    if not isinstance(coefficient, (int, float)) or isinstance(coefficient, bool) \
            or not coefficient >= 0:
        problems.append(f"router_aux_loss_coef={coefficient!r} must be a non-negative number")
    if problems:
        raise ConversionError("cannot convert this gpt-oss config:\n"
                              + "\n".join(f"  - {p}" for p in problems))
    fields.update(swiglu=False, quick_geglu=True, glu_linear_offset=1.0,
                  activation_func_clamp_value=float(limit), disable_bias_linear=False,
                  softmax_type="learnable", num_experts=experts, moe_router_topk=topk,
                  moe_ffn_hidden_size=hf["intermediate_size"], moe_router_pre_softmax=False,
                  moe_router_load_balancing_type="aux_loss",
                  moe_aux_loss_coeff=float(coefficient))
    config = ModelConfig(**fields)
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise ConversionError(f"unknown ModelConfig field {key!r}")
        setattr(config, key, value)
    left = moe_problems(config)
    if left:  # a Megatron-LM check the keys above do not name (top-1 routing)
        raise ConversionError("cannot convert this gpt-oss config: " + "; ".join(left))
    return config


# ------------------------------------------------------------------ ModelConfig -> config.json

def gpt_oss_obstacles(config: ModelConfig) -> list[str]:
    """What keeps `config` from being a GptOssForCausalLM (empty: it is one)."""
    c = config
    found = [] if c.is_moe else ["no --num-experts (every gpt-oss layer is MoE)"]
    named = [
        (c.is_moe and not all(c.moe_layer_pattern), "dense layers in --moe-layer-freq (every "
                                                    "gpt-oss layer is MoE)"),
        (bool(c.moe_shared_expert_intermediate_size), "--moe-shared-expert-intermediate-size"),
        (not c.quick_geglu, "no --quick-geglu (gpt-oss's experts are quick-GeGLU)"),
        (c.glu_linear_offset != 1.0, f"--glu-linear-offset {c.glu_linear_offset:g} (gpt-oss: 1)"),
        (c.activation_func_clamp_value is None, "no --activation-func-clamp-value (gpt-oss "
                                                "clamps: swiglu_limit)"),
        (c.softmax_type != "learnable", f"--softmax-type {c.softmax_type} (gpt-oss has "
                                        f"learnable sinks)"),
        (c.normalization != "RMSNorm", f"--normalization {c.normalization}"),
        (not c.bias, "--disable-bias-linear (gpt-oss has biases on every linear layer)"),
        (c.qk_layernorm, "--qk-layernorm"), (c.sandwich_norm, "--sandwich-norm"),
        (c.scale_embeddings, "--scale-embeddings"),
        (c.softmax_scale is not None, f"--softmax-scale {c.softmax_scale}"),
        (not c.rope, f"--position-embedding-type {c.position_embedding_type} (gpt-oss has "
                     f"rotary embeddings)"),
        (c.rope and c.rotary_percent != 1.0, f"--rotary-percent {c.rotary_percent:g}"),
        (c.use_rope_scaling, "--use-rope-scaling (Llama 3.1's; gpt-oss's is YaRN)"),
        (c.rotary_base_local is not None, "--rotary-base-local"),
        (c.moe_router_score_function != "softmax",
         f"--moe-router-score-function {c.moe_router_score_function}"),
        (c.moe_router_pre_softmax, "--moe-router-pre-softmax (gpt-oss takes the softmax of "
                                   "the top-k logits)"),
        (c.moe_router_topk_scaling_factor is not None, "--moe-router-topk-scaling-factor"),
        (c.moe_router_num_groups is not None, "--moe-router-num-groups"),
        (c.moe_router_enable_expert_bias, "--moe-router-enable-expert-bias"),
        (c.moe_expert_capacity_factor is not None, "--moe-expert-capacity-factor (gpt-oss "
                                                   "drops no tokens)"),
        (c.multi_latent_attention, "--multi-latent-attention (gpt-oss has grouped-query "
                                   "attention)"),
        (c.mtp_depth > 0, f"--mtp-num-layers {c.mtp_depth} (gpt-oss has no MTP layers)"),
    ]
    found += [what for on, what in named if on]
    if any(c.windowed_layers) and c.window[1] != 0:
        found.append(f"--window-size {c.window_size} (gpt-oss's windows are causal: L,0)")
    return found


def hf_config_from_model_config(config: ModelConfig, *, bos_token_id: int | None = None,
                                eos_token_id: int | None = None) -> dict[str, Any]:
    """GptOssForCausalLM's config.json for `config` (which must have no obstacles)."""
    obstacles = gpt_oss_obstacles(config)
    if obstacles:
        raise ConversionError("this model is not a gpt-oss: " + "; ".join(obstacles))
    c = config
    for name, token in (("bos", bos_token_id), ("eos", eos_token_id)):
        if token is not None and not 0 <= token < c.vocab_size:
            raise ConversionError(f"{name} token {token} is outside the vocabulary "
                                  f"(0..{c.vocab_size - 1})")
    if c.yarn:
        rope = {"rope_type": "yarn", "factor": c.rotary_scaling_factor,
                "original_max_position_embeddings": c.yarn_original_max_position_embeddings,
                "beta_fast": c.yarn_beta_fast, "beta_slow": c.yarn_beta_slow,
                "truncate": c.yarn_correction_range_round_to_int}
        if (c.mscale, c.mscale_all_dim) != (1.0, 0.0):
            rope.update(mscale=c.mscale, mscale_all_dim=c.mscale_all_dim,
                        attention_factor=_mscale(c.rotary_scaling_factor, c.mscale)
                        / _mscale(c.rotary_scaling_factor, c.mscale_all_dim))
    else:
        rope = {"rope_type": "default"}
    windowed = c.windowed_layers
    return {
        "architectures": [HF_CLASS], "model_type": MODEL_TYPE,
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.moe_ffn_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.query_groups,
        "head_dim": c.head_dim, "hidden_act": "silu", "max_position_embeddings": c.max_positions,
        "initializer_range": c.init_method_std, "rms_norm_eps": c.epsilon,
        "tie_word_embeddings": c.tied_output, "attention_dropout": c.attention_dropout,
        "attention_bias": True, "rope_parameters": {**rope, "rope_theta": c.rotary_base},
        "layer_types": ["sliding_attention" if w else "full_attention" for w in windowed],
        "sliding_window": c.window[0] + 1 if any(windowed) else None,
        "num_local_experts": c.num_experts, "num_experts_per_tok": c.moe_router_topk,
        "swiglu_alpha": QUICK_GELU_ALPHA, "swiglu_limit": c.activation_func_clamp_value,
        "router_aux_loss_coef": float(c.moe_aux_loss_coeff or 0.0),
        "output_router_logits": False, "use_cache": True,
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": None,
    }


# ------------------------------------------------------------------ tensors

def _logical_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """logical_shapes with each layer's sinks (which that table may lack)."""
    sinks = {f"layers.{i}.attention.sinks": (config.num_attention_heads,)
             for i in range(config.num_layers)}
    return {**logical_shapes(config), **sinks}


def _fused_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Each layer's sinks, router and fused experts, under bare names."""
    E, f, h, shapes = config.num_experts, config.moe_ffn_size, config.hidden_size, {}
    for i in range(config.num_layers):
        block = f"layers.{i}."
        shapes.update({
            block + "self_attn.sinks": (config.num_attention_heads,),
            block + "mlp.router.weight": (E, h), block + "mlp.router.bias": (E,),
            block + "mlp.experts.gate_up_proj": (E, h, 2 * f),
            block + "mlp.experts.gate_up_proj_bias": (E, 2 * f),
            block + "mlp.experts.down_proj": (E, f, h),
            block + "mlp.experts.down_proj_bias": (E, h)})
    return shapes


def _attention_pairs(config: ModelConfig):
    """hf_llama's name table of the embedding, norms, attention and output
    layer (no MLP names: gpt-oss's are all fused experts)."""
    return [(ours, theirs) for ours, theirs in attention_name_pairs(config)
            if ".mlp." not in ours]


def to_hf_state(logical: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """GptOssForCausalLM's state dict for a logical state (fused experts, a
    tied lm_head.weight as a copy of the word embedding)."""
    check_state(logical, _logical_shapes(config), "ptdp logical state",
                padded_hint=config.vocab_size)
    logical = with_plain_norm_scales(logical, config)
    state = {}
    for ours, theirs in _attention_pairs(config):
        for (name, _), piece in zip(theirs, logical[ours].detach().split(
                [rows for _, rows in theirs])):
            state[name] = piece.contiguous().clone()
    f = config.moe_ffn_size
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        state[theirs + "self_attn.sinks"] = logical[ours + "attention.sinks"].detach().clone()
        for kind in ("weight", "bias"):
            state[theirs + f"mlp.router.{kind}"] = logical[ours + f"mlp.router.{kind}"].detach().clone()
        experts = [f"{ours}mlp.experts.{e}." for e in range(config.num_experts)]
        # [2f, h] gate rows then up rows -> [h, 2f] with the two interleaved
        gate_up = torch.stack([logical[e + "dense_h_to_4h.weight"].detach() for e in experts])
        state[theirs + "mlp.experts.gate_up_proj"] = torch.stack(
            [gate_up[:, :f].transpose(1, 2), gate_up[:, f:].transpose(1, 2)],
            dim=-1).flatten(2, 3).contiguous()
        bias = torch.stack([logical[e + "dense_h_to_4h.bias"].detach() for e in experts])
        state[theirs + "mlp.experts.gate_up_proj_bias"] = torch.stack(
            [bias[:, :f], bias[:, f:]], dim=-1).flatten(1, 2).contiguous()
        state[theirs + "mlp.experts.down_proj"] = torch.stack(
            [logical[e + "dense_4h_to_h.weight"].detach().t() for e in experts]).contiguous()
        state[theirs + "mlp.experts.down_proj_bias"] = torch.stack(
            [logical[e + "dense_4h_to_h.bias"].detach() for e in experts]).contiguous()
    if config.tied_output:
        state[OUTPUT] = logical["embedding.word_embeddings.weight"].detach().contiguous().clone()
    return state


def _unquantized_shapes(state: Mapping[str, Any]) -> dict[str, Any]:
    """`state` (tensors or shapes) with each MXFP4 pair's shapes as the
    dequantized tensor's; refuses a pair that does not fit together."""
    out = {}
    for key, value in state.items():
        match = _MXFP4.match(key)
        if match is None:
            out[key] = value
        elif match.group(2) == "blocks":
            blocks, scales = shape_of(value), shape_of(state.get(match.group(1) + "_scales", ()))
            if len(blocks) < 3 or blocks[-1] != 16 or blocks[:-1] != scales:
                raise ConversionError(f"{key}: {blocks} with {match.group(1)}_scales {scales}: "
                                      f"not MXFP4 (blocks [..., G, 16], scales [..., G])")
            out[match.group(1)] = _dequantized_shape(blocks)
    return out


def check_hf_tensors(state: Mapping[str, Any], config: ModelConfig) -> None:
    """Refuse a state (tensors or the headers' shapes; MXFP4 pairs or plain
    experts) that does not fit `config`: config.json's sizes first, then
    every name and shape."""
    bare, lm_head = split_state(_unquantized_shapes(state), "model.", _IGNORED)
    h, E, f = config.hidden_size, config.num_experts, config.moe_ffn_size
    check_sizes([
        layer_disagreement(bare, "layers.", "num_hidden_layers", config.num_layers),
        size_disagreement(f"vocab_size={config.vocab_size}", config.vocab_size, "vocabulary",
                          [("embed_tokens.weight", bare, 0)]),
        size_disagreement(f"hidden_size={h}", h, "hidden size",
                          [("embed_tokens.weight", bare, 1), ("norm.weight", bare, 0)]),
        size_disagreement(f"num_local_experts={E}", E, "number of experts",
                          carriers_matching(bare, r"layers\.\d+\.mlp\.router\.weight", 0)),
        size_disagreement(f"intermediate_size={f}", f, "expert width",
                          carriers_matching(bare, r"layers\.\d+\.mlp\.experts\.down_proj", 1)),
    ])
    shapes = logical_shapes(config)
    expected = {name.removeprefix("model."): (rows, *shapes[ours][1:])
                for ours, theirs in _attention_pairs(config) for name, rows in theirs
                if name != OUTPUT}
    check_state(bare, {**expected, **_fused_shapes(config)}, "Hugging Face state")
    check_output_layer(lm_head, config, shapes)


def from_hf_state(state: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The logical state of a GptOssForCausalLM state dict (or the bare
    model's keys); MXFP4 pairs are dequantized. With tied embeddings a
    stored lm_head.weight must equal the word embedding."""
    if any(_MXFP4.match(key) for key in state):
        state = _dequantized(state)
    check_hf_tensors(state, config)
    bare, lm_head = split_state(state, "model.", _IGNORED)
    full = {f"model.{name}": tensor.detach() for name, tensor in bare.items()}
    if lm_head is not None:
        full[OUTPUT] = lm_head.detach()
        if config.tied_output and not torch.equal(lm_head, bare["embed_tokens.weight"]):
            raise ConversionError("lm_head.weight differs from the word embedding "
                                  "(embed_tokens.weight) although tie_word_embeddings is true; "
                                  "set tie_word_embeddings to false in config.json to keep both")
    logical = {ours: torch.cat([full[name] for name, _ in theirs]).contiguous()
               for ours, theirs in _attention_pairs(config)}
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}.", f"layers.{i}."
        logical[ours + "attention.sinks"] = bare[theirs + "self_attn.sinks"].detach().clone()
        for kind in ("weight", "bias"):
            logical[ours + f"mlp.router.{kind}"] = bare[theirs + f"mlp.router.{kind}"].detach().clone()
        gate_up, gate_up_bias = bare[theirs + "mlp.experts.gate_up_proj"], \
            bare[theirs + "mlp.experts.gate_up_proj_bias"]
        down, down_bias = bare[theirs + "mlp.experts.down_proj"], \
            bare[theirs + "mlp.experts.down_proj_bias"]
        for e in range(config.num_experts):
            expert = f"{ours}mlp.experts.{e}."
            logical[expert + "dense_h_to_4h.weight"] = torch.cat(
                [gate_up[e][:, ::2].t(), gate_up[e][:, 1::2].t()]).contiguous()
            logical[expert + "dense_h_to_4h.bias"] = torch.cat(
                [gate_up_bias[e][::2], gate_up_bias[e][1::2]]).contiguous()
            logical[expert + "dense_4h_to_h.weight"] = down[e].t().contiguous()
            logical[expert + "dense_4h_to_h.bias"] = down_bias[e].clone()
    return with_stored_norm_scales(logical, config)


def _dequantized(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with each MXFP4 pair replaced by its dequantized tensor."""
    _unquantized_shapes(state)  # (the pairs fit together)
    out = {key: value for key, value in state.items() if not _MXFP4.match(key)}
    for key, value in state.items():
        match = _MXFP4.match(key)
        if match is not None and match.group(2) == "blocks":
            bias = state.get(match.group(1) + "_bias")
            out[match.group(1)] = dequantize_mxfp4(
                value, state[match.group(1) + "_scales"],
                bias.dtype if bias is not None else torch.float32)
    return out


# ------------------------------------------------------------------ the family

# gpt-oss as ptdp.interop.family.HFFamily, for the generic directory reader
# and writer (hf_directory.py); `load_state` reads the tensors itself:
# published checkpoints keep the experts in MXFP4 (uint8), which the generic
# reader refuses.
GPT_OSS = ModuleFamily(sys.modules[__name__], name="gpt-oss", classes=(HF_CLASS, "GptOssModel"),
                       model_type=MODEL_TYPE, obstacles=gpt_oss_obstacles, ignored=_IGNORED)
