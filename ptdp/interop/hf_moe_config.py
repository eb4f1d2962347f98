"""Hugging Face Mixtral, Qwen3-MoE and Qwen2-MoE configs <-> ptdp's ModelConfig.

The three families are the dense families' attention (hf_dense_families.py:
Mixtral's is Mistral's, Qwen3-MoE's Qwen3's with its q/k norms, Qwen2-MoE's
Qwen2's with q/k/v biases) with a mixture of experts in place of some or
all MLPs. What maps onto ptdp's (Megatron-Core's) MoE settings:

* the router: Hugging Face takes a softmax over all experts, then the top
  k. Mixtral always renormalises the k probabilities, which equals ptdp's
  default (top-k of the logits, then a softmax over those k); Qwen does so
  only with `norm_topk_prob` true, and without it the probabilities stay
  unnormalised: --moe-router-pre-softmax.
* which layers are MoE: Qwen's `decoder_sparse_step` and `mlp_only_layers`
  become --moe-layer-freq's explicit pattern (HF's step N makes layers
  N-1, 2N-1, ... sparse, ptdp's int N layers 0, N, ...: the pattern says
  which without that difference). Mixtral's layers are all MoE. Qwen's
  `intermediate_size` is the dense layers' width (--ffn-hidden-size),
  `moe_intermediate_size` the experts' (--moe-ffn-hidden-size); Mixtral's
  `intermediate_size` is the experts'.
* Qwen2-MoE's shared expert and its sigmoid gate: --moe-shared-expert-
  intermediate-size and --moe-shared-expert-gate; `qkv_bias`: --add-qkv-bias.
* `router_aux_loss_coef`: --moe-aux-loss-coeff with the aux_loss type. The
  value is carried as it is, but the two losses are scaled differently
  (docs/generation-and-export.md); it matters for training only.

Anything else that changes what the model computes (sliding windows,
Mixtral's router jitter, biases on the attention's output, rope scaling
other than Llama 3.1's and linear interpolation) is refused with the config
key named.
"""

from __future__ import annotations

import math
from typing import Any

from ptdp.config import ModelConfig
from ptdp.config.moe import moe_problems
from ptdp.interop.hf_dense_families import (
    MISTRAL,
    QWEN2,
    QWEN3,
    common_hf_fields,
    common_model_fields,
    dense_model_fields,
    llama_like_obstacles,
    positive_int,
)
from ptdp.interop.hf_files import ConversionError

MIXTRAL, QWEN3_MOE, QWEN2_MOE = "Mixtral", "Qwen3-MoE", "Qwen2-MoE"
# family -> (Hugging Face class, model_type)
FAMILIES = {MIXTRAL: ("MixtralForCausalLM", "mixtral"),
            QWEN3_MOE: ("Qwen3MoeForCausalLM", "qwen3_moe"),
            QWEN2_MOE: ("Qwen2MoeForCausalLM", "qwen2_moe")}
# The dense family whose attention (biases, q/k norms, sliding-window keys) each has.
_ATTENTION_OF = {MIXTRAL: MISTRAL, QWEN3_MOE: QWEN3, QWEN2_MOE: QWEN2}


def family_of_model_type(model_type: Any) -> str:
    for family, (_, known) in FAMILIES.items():
        if model_type == known:
            return family
    raise ConversionError(f"model_type {model_type!r} is not an MoE family ptdp converts "
                          f"({', '.join(repr(t) for _, t in FAMILIES.values())})")


# ------------------------------------------------------------------ export: which family

def _common_obstacles(config: ModelConfig) -> list[str]:
    """What no Hugging Face MoE family of these three can express."""
    c = config
    found = llama_like_obstacles(c, "Mixtral/Qwen-MoE")
    if not c.is_moe:
        found.append("no --num-experts (the model is dense)")
    if c.bias:
        found.append("linear biases (add --disable-bias-linear: the MLPs, the router and the "
                     "attention's output have none)")
    if not c.is_moe:
        return found
    if c.moe_router_score_function != "softmax":
        found.append(f"--moe-router-score-function {c.moe_router_score_function} (the routers "
                     f"take a softmax)")
    if c.moe_router_topk_scaling_factor is not None:
        found.append("--moe-router-topk-scaling-factor")
    if c.moe_router_num_groups is not None or c.moe_router_group_topk is not None:
        found.append("group-limited routing (--moe-router-num-groups)")
    if c.moe_router_enable_expert_bias:
        found.append("--moe-router-enable-expert-bias")
    if c.moe_expert_capacity_factor is not None:
        found.append("--moe-expert-capacity-factor (Hugging Face's MoE layers drop no tokens)")
    return found


def family_obstacles(config: ModelConfig) -> dict[str, list[str]]:
    """For each family, what keeps `config` from being one (empty: it is)."""
    c = config
    common = _common_obstacles(c)
    shared = bool(c.is_moe and c.moe_shared_expert_intermediate_size)
    dense_layers = bool(c.is_moe and not all(c.moe_layer_pattern))
    mixtral, qwen3, qwen2 = list(common), list(common), list(common)
    if shared:
        mixtral.append("--moe-shared-expert-intermediate-size (Mixtral has no shared expert)")
        qwen3.append("--moe-shared-expert-intermediate-size (Qwen3-MoE has no shared expert)")
    if shared and not c.moe_shared_expert_gate:
        qwen2.append("no --moe-shared-expert-gate (Qwen2-MoE's shared expert has a sigmoid gate)")
    if c.is_moe and not shared:
        qwen2.append("no --moe-shared-expert-intermediate-size (Qwen2-MoE has a shared expert)")
    if dense_layers:
        mixtral.append("dense layers in --moe-layer-freq (every Mixtral layer is MoE)")
    if c.is_moe and c.moe_router_pre_softmax:
        mixtral.append("--moe-router-pre-softmax (Mixtral renormalises the top-k probabilities)")
    if c.qk_layernorm:
        mixtral.append("--qk-layernorm (Mixtral has no q/k norms)")
        qwen2.append("--qk-layernorm (Qwen2-MoE has no q/k norms)")
    else:
        qwen3.append("no --qk-layernorm (Qwen3-MoE normalises queries and keys)")
    if c.add_qkv_bias and not c.bias:  # (biases everywhere are a common obstacle)
        mixtral.append("--add-qkv-bias (Mixtral's attention has no biases)")
        qwen3.append("--add-qkv-bias (Qwen3-MoE's attention biases include the output "
                     "projection's)")
    return {MIXTRAL: mixtral, QWEN3_MOE: qwen3, QWEN2_MOE: qwen2}


def family_of_model(config: ModelConfig) -> str:
    """The family `config` is exported as: Qwen2-MoE with a shared expert,
    Qwen3-MoE with q/k norms, else Mixtral (first in that order that fits)."""
    obstacles = family_obstacles(config)
    for family in (QWEN2_MOE, QWEN3_MOE, MIXTRAL):
        if not obstacles[family]:
            return family
    raise ConversionError("this model is none of Mixtral, Qwen3-MoE and Qwen2-MoE:\n" + "\n".join(
        f"  - not {family}: {'; '.join(found)}" for family, found in obstacles.items()))


def hf_config_from_model_config(config: ModelConfig, *, bos_token_id: int | None = None,
                                eos_token_id: int | None = None) -> dict[str, Any]:
    """The config.json fields of `config`'s family (family_of_model)."""
    family = family_of_model(config)
    c = config
    hf_class, model_type = FAMILIES[family]
    hf = common_hf_fields(c, hf_class, model_type, bos_token_id=bos_token_id,
                          eos_token_id=eos_token_id)
    hf.update(num_experts_per_tok=c.moe_router_topk,
              router_aux_loss_coef=float(c.moe_aux_loss_coeff or 0.0),
              output_router_logits=False, sliding_window=None)
    if family == MIXTRAL:
        hf.update(intermediate_size=c.moe_ffn_size, num_local_experts=c.num_experts,
                  router_jitter_noise=0.0)
        return hf
    dense = [i for i, is_moe in enumerate(c.moe_layer_pattern) if not is_moe]
    hf.update(num_experts=c.num_experts, moe_intermediate_size=c.moe_ffn_size,
              norm_topk_prob=not c.moe_router_pre_softmax, decoder_sparse_step=1,
              mlp_only_layers=dense, use_sliding_window=False, max_window_layers=c.num_layers)
    if family == QWEN3_MOE:
        hf.update(attention_bias=False)
    else:
        hf.update(qkv_bias=c.qkv_bias,
                  shared_expert_intermediate_size=c.moe_shared_expert_intermediate_size)
    return hf


# ------------------------------------------------------------------ import

def model_config_from_hf_config(hf: dict[str, Any], **overrides: Any) -> ModelConfig:
    """The ModelConfig of a Mixtral / Qwen3-MoE / Qwen2-MoE config.json;
    refuses, naming the key, what ptdp cannot compute. The attention,
    norms and rotary settings are read as the dense families' (Mistral's,
    Qwen3's, Qwen2's); `overrides` set other ModelConfig fields."""
    family = family_of_model_type(hf.get("model_type"))
    problems: list[str] = []
    fields = dense_model_fields(hf, _ATTENTION_OF[family], problems, windows=False)
    fields.update(common_model_fields(hf, problems))

    def integer(key: str) -> Any:
        value = hf.get(key)
        if not positive_int(value):
            problems.append(f"{key}={value!r} must be a positive integer")
            return None
        return value

    experts_key = _experts_key(hf, family, problems)
    experts, topk = integer(experts_key), integer("num_experts_per_tok")
    layers = hf.get("num_hidden_layers") if positive_int(hf.get("num_hidden_layers")) else None
    renormalise = True
    if family == MIXTRAL:
        width, pattern = integer("intermediate_size"), [1] * (layers or 0)
        jitter = hf.get("router_jitter_noise", 0.0)
        if jitter not in (0, None):
            problems.append(f"router_jitter_noise={jitter!r} is not supported: ptdp's router "
                            f"has no input jitter; set it to 0.0")
    else:
        width = integer("moe_intermediate_size")
        renormalise = hf.get("norm_topk_prob", False)
        if not isinstance(renormalise, bool):
            problems.append(f"norm_topk_prob={renormalise!r} must be true or false")
        pattern = _sparse_pattern(hf, layers, problems)
    if family == QWEN2_MOE:
        qkv_bias = hf.get("qkv_bias", True)
        if not isinstance(qkv_bias, bool):
            problems.append(f"qkv_bias={qkv_bias!r} must be true or false")
        shared = integer("shared_expert_intermediate_size")
        fields.update(add_qkv_bias=bool(qkv_bias), moe_shared_expert_gate=True,
                      moe_shared_expert_intermediate_size=shared)
    coefficient = hf.get("router_aux_loss_coef", 0.001)
    if not isinstance(coefficient, (int, float)) or isinstance(coefficient, bool) \
            or not math.isfinite(coefficient) or coefficient < 0:
        problems.append(f"router_aux_loss_coef={coefficient!r} must be a non-negative number")
    if experts and topk and topk > experts:
        problems.append(f"num_experts_per_tok {topk} exceeds the {experts} experts "
                        f"({experts_key})")
    if topk == 1 and renormalise is True:
        problems.append(
            "num_experts_per_tok=1 with renormalised top-k probabilities "
            f"({'Mixtral' if family == MIXTRAL else 'norm_topk_prob=true'}): each token's one "
            "expert weighs 1 and the router learns nothing; ptdp, as Megatron-LM, refuses top-1 "
            "routing without --moe-router-pre-softmax")
    if problems:
        raise ConversionError(f"cannot convert this {family} config:\n"
                              + "\n".join(f"  - {p}" for p in problems))
    if family != MIXTRAL:  # the dense layers' width; Mixtral's intermediate_size is the experts'
        fields["ffn_hidden_size"] = hf["intermediate_size"]
    config = ModelConfig(
        **fields, num_experts=experts, moe_ffn_hidden_size=width, moe_router_topk=topk,
        moe_router_pre_softmax=not renormalise, moe_layer_freq=1 if all(pattern) else pattern,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=float(coefficient))
    return with_overrides(config, overrides, family)


def _experts_key(hf: dict[str, Any], family: str, problems: list[str]) -> str:
    """The key that holds the number of experts: Mixtral's num_local_experts
    and Qwen's num_experts are aliases of each other in transformers 5's
    Mixtral and Qwen3-MoE configs (which save num_local_experts); Qwen2-MoE
    knows num_experts only."""
    if family == QWEN2_MOE:
        return "num_experts"
    given = {key: hf[key] for key in ("num_local_experts", "num_experts")
             if hf.get(key) is not None}
    if len(set(map(repr, given.values()))) > 1:
        problems.append(f"num_local_experts={given['num_local_experts']!r} and num_experts="
                        f"{given['num_experts']!r} disagree (transformers reads them as one "
                        f"setting); make them equal")
    return next(iter(given), "num_local_experts" if family == MIXTRAL else "num_experts")


def _sparse_pattern(hf: dict[str, Any], layers: int | None, problems: list[str]) -> list[int]:
    """Qwen's sparse layers, as transformers decides them: layer i is MoE
    unless listed in mlp_only_layers, when (i + 1) is a multiple of
    decoder_sparse_step."""
    step = hf.get("decoder_sparse_step", 1)
    only = hf.get("mlp_only_layers") or []
    if not (isinstance(step, int) and not isinstance(step, bool) and step >= 1):
        problems.append(f"decoder_sparse_step={step!r} must be a positive integer")
        return []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                             for i in only):
        problems.append(f"mlp_only_layers={only!r} must be a list of layer numbers")
        return []
    if layers is None:
        return []
    outside = [i for i in only if not 0 <= i < layers]
    if outside:
        problems.append(f"mlp_only_layers={only!r} names layers outside 0..{layers - 1}")
    pattern = [int(i not in only and (i + 1) % step == 0) for i in range(layers)]
    if not any(pattern):
        problems.append(f"decoder_sparse_step={step} and mlp_only_layers={only!r} leave no MoE "
                        f"layer: convert the model as a dense one")
    return pattern


def with_overrides(config: ModelConfig, overrides: dict[str, Any], family: str) -> ModelConfig:
    """An MoE family's config with the caller's `overrides` set, refused
    where a Megatron-LM check the config.json keys do not name fails."""
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise ConversionError(f"unknown ModelConfig field {key!r}")
        setattr(config, key, value)
    left = moe_problems(config)
    if left:
        raise ConversionError(f"cannot convert this {family} config: " + "; ".join(left))
    return config
