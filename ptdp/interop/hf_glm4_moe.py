"""Hugging Face GLM-4.5 (Glm4MoeForCausalLM, model_type glm4_moe) <-> ptdp.

GLM-4.5 is a DeepSeek-style mixture of experts with ordinary grouped-query
attention: Llama's decoder (RMSNorm, SwiGLU, rotary embeddings, the same
tensor names: hf_llama.py) with partial rotation, q/k/v biases, optional
q/k norms, first dense layers, then MoE layers whose router takes sigmoid
scores with a selection bias, and multi-token prediction layers after the
decoder. In ptdp's (Megatron-LM's) flags:

    config.json                                ptdp
    partial_rotary_factor p (default 0.5,      --rotary-percent p (the first int(d·p) values
      top level or in rope_parameters)         of each head turn, rotate-half pairs)
    attention_bias (q/k/v only; o_proj none)   --add-qkv-bias --disable-bias-linear
    use_qk_norm                                --qk-layernorm
    first_k_dense_replace K, intermediate_size --moe-layer-freq "([0]*K+[1]*(L-K))",
                                               --ffn-hidden-size (the dense layers' width)
    n_routed_experts, num_experts_per_tok,     --num-experts, --moe-router-topk,
      moe_intermediate_size                    --moe-ffn-hidden-size
    n_shared_experts N                         --moe-shared-expert-intermediate-size N·F (no gate)
    sigmoid scores + e_score_correction_bias   --moe-router-score-function sigmoid
      (transformers' noaux_tc router)          --moe-router-enable-expert-bias; each MoE layer's
                                               mlp.gate.e_score_correction_bias is its router's
                                               expert_bias (saved model state, fp32)
    n_group G, topk_group T                    --moe-router-num-groups G --moe-router-group-topk T
                                               (G = 1 or T = G: every group is kept, none given)
    routed_scaling_factor                      --moe-router-topk-scaling-factor (1.0: none)
    norm_topk_prob                             true with top-k > 1, false with top-1 (ptdp's
                                               sigmoid router, as Megatron-Core's, renormalises
                                               k > 1 weights and leaves a top-1 weight as is)
    num_nextn_predict_layers D                 --mtp-num-layers D (0: none); the MTP modules'
      (alias num_mtp_layers)                   tensors are layers L .. L+D-1 of the files
                                               (hf_mtp_names.py)

The load-balancing loss is none (--moe-router-load-balancing-type none: the
files do not say how GLM-4.5 was balanced beyond its expert bias), which
matters for training only. The tensors are the Llama layout (hf_llama.py)
plus, in each MoE layer, `mlp.gate.weight` (the router),
`mlp.gate.e_score_correction_bias`, `mlp.experts.{e}.gate_proj/up_proj/
down_proj` (what save_pretrained writes) and `mlp.shared_experts.*`, and
the MTP modules' (hf_mtp_names.py: read on import, written back on export
with copies of the word embedding and output layer as published files hold).
Anything else that changes what the model computes is refused, naming the
key. A directory transformers' save_pretrained wrote holds no MTP layers
(transformers drops them) while its config.json still counts them: it is
imported without MTP, with a note (`without_absent_mtp`), and export then
writes num_nextn_predict_layers 0, what the files hold. Files with some of
the MTP layers or tensors config.json counts are refused, naming what is
missing.
"""

from __future__ import annotations

import math
import re
import sys
from typing import Any, Mapping

import torch

from ptdp.config import ModelConfig
from ptdp.interop.hf_moe_config import with_overrides
from ptdp.interop.family import ModuleFamily
from ptdp.interop.hf_dense_families import (
    common_hf_fields,
    common_model_fields,
    llama_like_obstacles,
    positive_int,
)
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
from ptdp.interop.hf_llama import (
    NamePair,
    attention_name_pairs,
    check_output_layer,
    logical_from_checked,
    mlp_name_pairs,
)
from ptdp.interop.hf_mtp_names import (
    EMBEDDING,
    mtp_copies,
    mtp_layer_numbers,
    mtp_name_pairs,
    without_mtp_layers,
)
from ptdp.interop.logical import logical_shapes, with_plain_norm_scales, with_stored_norm_scales

NAME = "GLM-4.5"
HF_CLASS, BARE_CLASS, MODEL_TYPE = "Glm4MoeForCausalLM", "Glm4MoeModel", "glm4_moe"
OUTPUT = "lm_head.weight"
DEFAULT_PARTIAL_ROTARY = 0.5  # Glm4MoeConfig's, where config.json names none
# Buffers some checkpoints carry; they are recomputed from the config.
_IGNORED = re.compile(r"^(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq$")
_EXPERT_BIAS = "router.expert_bias"


# ------------------------------------------------------------------ config.json -> ModelConfig

def model_config_from_hf_config(hf: dict[str, Any], **overrides: Any) -> ModelConfig:
    """The ModelConfig of a GLM-4.5 config.json; refuses, naming the key,
    what ptdp cannot compute. `overrides` set other ModelConfig fields."""
    problems: list[str] = []
    factor = _partial_rotary_factor(hf, problems)
    # The sizes, heads, norm, rotary base and tying as every Llama-like
    # config.json gives them; the partial rotation is read above.
    plain = {key: value for key, value in hf.items() if key != "partial_rotary_factor"}
    if isinstance(hf.get("rope_parameters"), dict):
        plain["rope_parameters"] = {key: value for key, value in hf["rope_parameters"].items()
                                    if key != "partial_rotary_factor"}
    fields = common_model_fields(plain, problems)
    if fields.get("use_rope_scaling") or fields.get("rotary_seq_len_interpolation_factor"):
        problems.append("a rope_type other than 'default' is not supported for GLM-4.5: ptdp "
                        "reads its plain partial rotation only")
    if fields and factor is not None:
        head_dim = fields["kv_channels"] or fields["hidden_size"] // fields["num_attention_heads"]
        width = int(head_dim * factor)
        if width < 2 or width % 2:
            problems.append(f"partial_rotary_factor={factor!r} turns {width} of each head's "
                            f"{head_dim} values: rotary embeddings need an even number, 2 or more")
    fields.update(_attention_fields(hf, problems), **moe_fields(hf, problems))
    depth = mtp_depth(hf, problems)
    if problems:
        raise ConversionError(f"cannot convert this {NAME} config:\n"
                              + "\n".join(f"  - {p}" for p in problems))
    config = ModelConfig(**fields, rotary_percent=float(factor),
                         mtp_num_layers=depth if depth else None)
    return with_overrides(config, overrides, NAME)


def _partial_rotary_factor(hf: dict[str, Any], problems: list[str]) -> float | None:
    """The rotated share of each head: rope_parameters' partial_rotary_factor,
    else the top-level one, else 0.5 (transformers' reading); both given
    must agree."""
    given = {key: hf[key] for key in ("partial_rotary_factor",) if key in hf}
    if isinstance(hf.get("rope_parameters"), dict) and \
            "partial_rotary_factor" in hf["rope_parameters"]:
        given["rope_parameters.partial_rotary_factor"] = \
            hf["rope_parameters"]["partial_rotary_factor"]
    if len(set(map(repr, given.values()))) > 1:
        problems.append(f"{' and '.join(f'{k}={v!r}' for k, v in given.items())} disagree "
                        f"(transformers reads the one in rope_parameters); make them equal")
        return None
    factor = next(iter(given.values()), DEFAULT_PARTIAL_ROTARY)
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) \
            or not math.isfinite(factor) or not 0 < factor <= 1:
        problems.append(f"partial_rotary_factor={factor!r} must be a number in (0, 1]")
        return None
    return float(factor)


def boolean_key(hf: dict[str, Any], key: str, default: bool, problems: list[str]) -> bool:
    value = hf.get(key, default)
    if not isinstance(value, bool):
        problems.append(f"{key}={value!r} must be true or false")
        return default
    return value


def _attention_fields(hf: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """attention_bias (q/k/v only: GLM-4.5's o_proj has none) and use_qk_norm."""
    return dict(add_qkv_bias=boolean_key(hf, "attention_bias", False, problems),
                disable_bias_linear=True,
                qk_layernorm=boolean_key(hf, "use_qk_norm", False, problems))


def integer_key(hf: dict[str, Any], key: str, default: Any, problems: list[str],
             least: int = 1) -> int | None:
    value = hf.get(key, default)
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= least):
        problems.append(f"{key}={value!r} must be an integer of at least {least}")
        return None
    return value


def aliased_keys(hf: dict[str, Any], keys: tuple[str, str], default: Any,
             problems: list[str]) -> tuple[str, Any]:
    """(the key read, its value) of two names transformers reads as one
    setting (attribute_map); both given must agree."""
    given = {key: hf[key] for key in keys if hf.get(key) is not None}
    if len(set(map(repr, given.values()))) > 1:
        problems.append(f"{' and '.join(f'{k}={v!r}' for k, v in given.items())} disagree "
                        f"(transformers reads them as one setting); make them equal")
    key = next(iter(given), keys[0])
    return key, given.get(key, default)


# The MoE keys' defaults where config.json omits them (Glm4MoeConfig's).
GLM_MOE_DEFAULTS = dict(n_routed_experts=128, num_experts_per_tok=8, moe_intermediate_size=1408,
                        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=1.0,
                        n_group=1, topk_group=1)


def moe_fields(hf: dict[str, Any], problems: list[str], name: str = NAME,
               defaults: Mapping[str, Any] = GLM_MOE_DEFAULTS) -> dict[str, Any]:
    """The experts, the router and which layers are MoE, of a DeepSeek-style
    MoE config.json (GLM-4.5's and DeepSeek-V3's keys alike; `defaults`:
    the family's class defaults, `name` for the messages)."""
    experts_key, experts = aliased_keys(hf, ("n_routed_experts", "num_local_experts"),
                                        defaults["n_routed_experts"], problems)
    experts = integer_key({experts_key: experts}, experts_key, None, problems)
    topk = integer_key(hf, "num_experts_per_tok", defaults["num_experts_per_tok"], problems)
    width = integer_key(hf, "moe_intermediate_size", defaults["moe_intermediate_size"], problems)
    shared = integer_key(hf, "n_shared_experts", defaults["n_shared_experts"], problems)
    layers = hf.get("num_hidden_layers") if positive_int(hf.get("num_hidden_layers")) else None
    dense = integer_key(hf, "first_k_dense_replace", defaults["first_k_dense_replace"], problems,
                        least=0)
    if dense is not None and layers is not None and dense >= layers:
        problems.append(f"first_k_dense_replace={dense} leaves no MoE layer of the {layers}: "
                        f"ptdp reads {name} with MoE layers")
    for key, wanted in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if hf.get(key, wanted) != wanted:  # DeepSeek-V3's keys, should a file carry them
            problems.append(f"{key}={hf[key]!r} is not supported: {name}'s router is "
                            f"{key} {wanted!r}")
    renormalise = boolean_key(hf, "norm_topk_prob", True, problems)
    if topk is not None and topk > 1 and not renormalise:
        problems.append(f"norm_topk_prob=false with num_experts_per_tok={topk} is not supported: "
                        f"ptdp's sigmoid router (as Megatron-Core's) renormalises the top-k "
                        f"weights")
    if topk == 1 and renormalise:
        problems.append("norm_topk_prob=true with num_experts_per_tok=1 is not supported: "
                        "transformers then weighs each token's one expert 1, ptdp's sigmoid router "
                        "by its score; set norm_topk_prob to false")
    if experts and topk and topk > experts:
        problems.append(f"num_experts_per_tok {topk} exceeds the {experts} experts ({experts_key})")
    scale = hf.get("routed_scaling_factor", defaults["routed_scaling_factor"])
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) \
            or not math.isfinite(scale) or scale <= 0:
        problems.append(f"routed_scaling_factor={scale!r} must be a positive number")
        scale = 1.0
    fields = dict(num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=width,
                  moe_shared_expert_intermediate_size=shared * width if shared and width else None,
                  moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                  moe_router_topk_scaling_factor=None if scale == 1.0 else float(scale),
                  moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                  **group_fields(hf, experts, topk, problems, defaults))
    if layers is not None and dense is not None and dense < layers:
        fields["moe_layer_freq"] = 1 if dense == 0 else [0] * dense + [1] * (layers - dense)
    return fields


def group_fields(hf: dict[str, Any], experts: int | None, topk: int | None,
                 problems: list[str], defaults: Mapping[str, Any] = GLM_MOE_DEFAULTS
                 ) -> dict[str, Any]:
    """n_group and topk_group as group-limited routing. transformers scores a
    group by its best two (biased) scores, ptdp (as Megatron-Core) by its
    best top-k / topk_group: the same groups only where that is 2, or
    where every group is kept (G = 1 or T = G: then no groups are set)."""
    groups = integer_key(hf, "n_group", defaults["n_group"], problems)
    chosen = integer_key(hf, "topk_group", defaults["topk_group"], problems)
    if groups is None or chosen is None:
        return {}
    if chosen > groups:
        problems.append(f"topk_group={chosen} exceeds n_group={groups}")
        return {}
    if experts and experts % groups:
        problems.append(f"n_group={groups} does not divide the {experts} experts into equal groups")
        return {}
    if chosen == groups:
        return {}
    if topk and topk != 2 * chosen:
        problems.append(f"n_group={groups}, topk_group={chosen} with num_experts_per_tok={topk} is "
                        f"not supported: transformers scores each group by its best 2 experts, "
                        f"ptdp (as Megatron-Core) by its best num_experts_per_tok / topk_group "
                        f"({topk / chosen:g}); they agree when num_experts_per_tok = 2·topk_group")
    return dict(moe_router_num_groups=groups, moe_router_group_topk=chosen)


def mtp_depth(hf: dict[str, Any], problems: list[str]) -> int:
    """num_nextn_predict_layers (alias num_mtp_layers; transformers' default 1)."""
    key, depth = aliased_keys(hf, ("num_nextn_predict_layers", "num_mtp_layers"), 1, problems)
    return integer_key({key: depth}, key, None, problems, least=0) or 0


# ------------------------------------------------------------------ ModelConfig -> config.json

def glm4_moe_obstacles(config: ModelConfig) -> list[str]:
    """What keeps `config` from being a Glm4MoeForCausalLM (empty: it is one)."""
    c = config
    # (partial rotation and MTP are GLM-4.5's own, whatever the Llama-like check says of them)
    found = [o for o in llama_like_obstacles(c, NAME)
             if not o.startswith(("--rotary-percent", "--mtp-num-layers",
                                  "--multi-latent-attention"))]
    if c.use_rope_scaling or c.rotary_seq_len_interpolation_factor is not None:
        found.append("rotary rescaling (ptdp writes GLM-4.5's plain rotary embeddings only)")
    if c.multi_latent_attention:
        found.append("--multi-latent-attention (GLM-4.5 has grouped-query attention; "
                     "DeepSeek-V3 has MLA)")
    if c.bias:
        found.append("linear biases (add --disable-bias-linear: GLM-4.5's biases are on q, k "
                     "and v only, --add-qkv-bias)")
    return found + deepseek_moe_obstacles(c, NAME)


def deepseek_moe_obstacles(config: ModelConfig, name: str) -> list[str]:
    """What keeps `config`'s MLPs from being a DeepSeek-style MoE's (GLM-4.5's
    and DeepSeek-V3's: first dense layers, then sigmoid-routed experts with
    a shared expert); `name` for the messages."""
    c = config
    if not c.is_moe:
        return [f"no --num-experts ({name}'s layers after the first dense ones are MoE)"]
    shared = c.moe_shared_expert_intermediate_size
    pattern = c.moe_layer_pattern
    first_moe = pattern.index(True)
    groups, chosen = c.moe_router_num_groups, c.moe_router_group_topk
    named = [
        (c.moe_router_score_function != "sigmoid",
         f"--moe-router-score-function {c.moe_router_score_function} ({name}'s router takes "
         f"sigmoid scores)"),
        (not shared, f"no --moe-shared-expert-intermediate-size ({name}'s MoE layers have a "
                     f"shared expert)"),
        (bool(shared) and shared % c.moe_ffn_size != 0,
         f"--moe-shared-expert-intermediate-size {shared} is not a multiple of the experts' "
         f"width {c.moe_ffn_size} ({name} has n_shared_experts experts of that width)"),
        (c.moe_shared_expert_gate, f"--moe-shared-expert-gate ({name}'s shared expert has no "
                                   f"gate)"),
        (not all(pattern[first_moe:]), f"dense layers after an MoE layer in --moe-layer-freq "
                                       f"({name}'s dense layers are the first ones)"),
        (groups is not None and chosen != groups and c.moe_router_topk != 2 * chosen,
         "group-limited routing with --moe-router-topk other than 2 × --moe-router-group-topk "
         "(transformers scores each group by its best 2 experts)"),
        (c.moe_expert_capacity_factor is not None,
         f"--moe-expert-capacity-factor ({name}'s MoE layers drop no tokens)"),
    ]
    return [what for on, what in named if on]


def moe_hf_fields(config: ModelConfig) -> dict[str, Any]:
    """config.json's MoE and MTP keys (GLM-4.5's and DeepSeek-V3's alike) of
    a model with no deepseek_moe_obstacles."""
    c = config
    grouped = c.moe_router_num_groups is not None
    return dict(
        n_routed_experts=c.num_experts, num_experts_per_tok=c.moe_router_topk,
        moe_intermediate_size=c.moe_ffn_size,
        n_shared_experts=c.moe_shared_expert_intermediate_size // c.moe_ffn_size,
        routed_scaling_factor=float(c.moe_router_topk_scaling_factor or 1.0),
        n_group=c.moe_router_num_groups if grouped else 1,
        topk_group=c.moe_router_group_topk if grouped else 1,
        first_k_dense_replace=c.moe_layer_pattern.index(True),
        norm_topk_prob=c.moe_router_topk > 1, num_nextn_predict_layers=c.mtp_depth,
        output_router_logits=False)


def hf_config_from_model_config(config: ModelConfig, *, bos_token_id: int | None = None,
                                eos_token_id: int | None = None) -> dict[str, Any]:
    """Glm4MoeForCausalLM's config.json for `config` (which must have no obstacles)."""
    obstacles = glm4_moe_obstacles(config)
    if obstacles:
        raise ConversionError(f"this model is not a {NAME}: " + "; ".join(obstacles))
    c = config
    hf = common_hf_fields(c, HF_CLASS, MODEL_TYPE, bos_token_id=bos_token_id,
                          eos_token_id=eos_token_id)
    factor = float(c.rotary_percent)
    hf["rope_parameters"] = {**hf["rope_parameters"], "partial_rotary_factor": factor}
    hf.update(
        partial_rotary_factor=factor,  # (where transformers 4 and other readers look)
        attention_bias=c.qkv_bias, use_qk_norm=c.qk_layernorm, **moe_hf_fields(c))
    return hf


# ------------------------------------------------------------------ tensors

def name_pairs(config: ModelConfig) -> list[NamePair]:
    """hf_llama's name table of the attention, norms, embeddings and dense
    MLPs, the MoE layers' (router, its selection bias, experts, shared
    experts), then the MTP modules' (hf_mtp_names.py)."""
    pairs = attention_name_pairs(config) + mlp_name_pairs(config) + moe_name_pairs(config)
    return pairs + mtp_name_pairs(pairs, config.num_layers, config.mtp_depth, config.hidden_size)


def moe_name_pairs(config: ModelConfig) -> list[NamePair]:
    """The MoE layers' name table, as GLM-4.5's and DeepSeek-V3's files name
    them: the router, its selection bias, each expert and the shared experts."""
    pairs: list[NamePair] = []
    E, h = config.num_experts, config.hidden_size
    shared = config.moe_shared_expert_intermediate_size

    def mlp(ours: str, theirs: str, width: int) -> None:
        pairs.append((f"{ours}.dense_h_to_4h.weight",
                      ((f"{theirs}.gate_proj.weight", width), (f"{theirs}.up_proj.weight", width))))
        pairs.append((f"{ours}.dense_4h_to_h.weight", ((f"{theirs}.down_proj.weight", h),)))

    for i, is_moe in enumerate(config.moe_layer_pattern):
        if not is_moe:
            continue
        ours, theirs = f"layers.{i}.mlp.", f"model.layers.{i}.mlp."
        pairs.append((ours + "router.weight", ((theirs + "gate.weight", E),)))
        pairs.append((ours + _EXPERT_BIAS, ((theirs + "gate.e_score_correction_bias", E),)))
        for e in range(E):
            mlp(f"{ours}experts.{e}", f"{theirs}experts.{e}", config.moe_ffn_size)
        if shared:
            mlp(ours + "shared_expert", theirs + "shared_experts", shared)
    return pairs


def shapes_with_expert_bias(config: ModelConfig, pairs: list[NamePair]
                            ) -> dict[str, tuple[int, ...]]:
    """logical_shapes with every MoE router's expert bias (saved model
    state: ptdp.model.shapes.state_shapes), which these families always
    have (`pairs`: the family's name table)."""
    biases = {ours: (config.num_experts,) for ours, _ in pairs if ours.endswith(_EXPERT_BIAS)}
    return {**logical_shapes(config), **biases}


def to_hf_state(logical: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Glm4MoeForCausalLM's state dict for a logical state, MTP modules
    included with their copies of the word embedding and output layer (a
    tied lm_head.weight as a copy of the word embedding, which the writer
    leaves out). A model trained without --moe-router-enable-expert-bias
    has a zero e_score_correction_bias: the same routing."""
    obstacles = glm4_moe_obstacles(config)
    if obstacles:
        raise ConversionError(f"this model is not a {NAME}: " + "; ".join(obstacles))
    return moe_mtp_hf_state(logical, config, name_pairs(config))


def moe_mtp_hf_state(logical: dict[str, torch.Tensor], config: ModelConfig,
                     pairs: list[NamePair]) -> dict[str, torch.Tensor]:
    """The state dict `pairs` (a DeepSeek-style MoE family's name table)
    names for a logical state, with the MTP modules' copies and zero expert
    biases where the model has none (to_hf_state's)."""
    shapes = shapes_with_expert_bias(config, pairs)
    if not config.moe_router_enable_expert_bias:
        logical = {**{name: torch.zeros(shape) for name, shape in shapes.items()
                      if name.endswith(_EXPERT_BIAS)}, **logical}
    check_state(logical, shapes, "ptdp logical state", padded_hint=config.vocab_size)
    logical = with_plain_norm_scales(logical, config)
    state = {}
    for ours, theirs in pairs:
        for (name, _), piece in zip(theirs, logical[ours].detach().split(
                [rows for _, rows in theirs])):
            state[name] = piece.contiguous().clone()
    if config.tied_output:
        state[OUTPUT] = logical[EMBEDDING].detach().contiguous().clone()
    for name, source in mtp_copies(config.num_layers, config.mtp_depth,
                                   config.tied_output).items():
        state[name] = logical[source].detach().contiguous().clone()
    return state


def without_absent_mtp(bare: Mapping[str, Any], config: ModelConfig, name: str) -> None:
    """Where config.json counts MTP modules (num_nextn_predict_layers D > 0)
    and the files (`bare`: the model's keys without `model.`) hold no layer
    after the decoder's, as transformers' save_pretrained writes them (it
    builds no MTP layers and drops their tensors): `config` becomes the
    model the files hold, without MTP, which the import saves, said in a
    note. (The reader passes the ModelConfig it built from config.json to
    the checks and returns that one: this is where the files are known.)
    Some of the D layers, or a layer short of some tensors, is left to the
    checks, which refuse it naming what is missing."""
    L, D = config.num_layers, config.mtp_depth
    if not D or mtp_layer_numbers(bare, L):
        return
    config.mtp_num_layers = None
    modules = " to ".join(dict.fromkeys((f"model.layers.{L}.*", f"model.layers.{L + D - 1}.*")))
    print(f"note: this {name} directory's config.json says num_nextn_predict_layers={D}, but its "
          f"files hold no multi-token prediction layers ({modules}; transformers' "
          f"save_pretrained drops them): imported without MTP (--mtp-num-layers 0), so training "
          f"goes on without the MTP loss and an export writes num_nextn_predict_layers 0. To "
          f"keep MTP, add the original checkpoint's {modules} tensors to these files (their "
          f"embed_tokens and shared_head.head may be left out: copies of the model's own) and "
          f"import again", flush=True)


def mtp_disagreement(found: list[int], config: ModelConfig) -> str | None:
    """config.json's MTP depth against the layers the files hold after the
    decoder's (none at all, for D > 0, is without_absent_mtp's)."""
    L, D = config.num_layers, config.mtp_depth
    if found == list(range(L, L + D)):
        return None
    held = (f"{len(found)} (layers.{found[0]} to layers.{found[-1]})" if found else "none")
    return (f"num_nextn_predict_layers={D} with num_hidden_layers={L}, but of the layers after "
            f"the decoder's (the MTP modules', layers.{L} on) the tensors hold {held}: give "
            f"the files every MTP layer config.json counts, or none of them")


def moe_size_disagreements(bare: Mapping[str, Any], config: ModelConfig) -> list[str | None]:
    """config.json's sizes against a DeepSeek-style MoE state's (the bare
    model's keys): the decoder's layers, the MTP modules', the vocabulary,
    hidden size, dense MLP and expert widths and the number of experts."""
    h, E = config.hidden_size, config.num_experts
    main = without_mtp_layers(bare, config.num_layers)
    return [
        layer_disagreement(main, "layers.", "num_hidden_layers", config.num_layers),
        mtp_disagreement(mtp_layer_numbers(bare, config.num_layers), config),
        size_disagreement(f"vocab_size={config.vocab_size}", config.vocab_size, "vocabulary",
                          [("embed_tokens.weight", bare, 0)]),
        size_disagreement(f"hidden_size={h}", h, "hidden size",
                          [("embed_tokens.weight", bare, 1), ("norm.weight", bare, 0),
                           *carriers_matching(main, r"layers\.\d+\.input_layernorm\.weight", 0)]),
        size_disagreement(f"intermediate_size={config.ffn_size}", config.ffn_size, "MLP width",
                          carriers_matching(main, r"layers\.\d+\.mlp\.gate_proj\.weight", 0)),
        size_disagreement(f"n_routed_experts={E}", E, "number of experts",
                          carriers_matching(main, r"layers\.\d+\.mlp\.gate\.weight", 0)),
        size_disagreement(f"moe_intermediate_size={config.moe_ffn_size}", config.moe_ffn_size,
                          "expert width", carriers_matching(
                              main, r"layers\.\d+\.mlp\.experts\.\d+\.gate_proj\.weight", 0)),
    ]


def check_hf_tensors(state: Mapping[str, Any], config: ModelConfig) -> None:
    """Refuse a state (tensors or the headers' shapes) that does not fit
    `config`: config.json's sizes first (the decoder's layers, the MTP
    modules', widths and counts), then every name and shape. The MTP
    modules' copies of the embedding and output layer may be there or not;
    all of the modules may be absent (without_absent_mtp: then `config`
    is made the model without them)."""
    bare, lm_head = split_state(state, "model.", _IGNORED)
    without_absent_mtp(bare, config, NAME)
    d, heads, groups = config.head_dim, config.num_attention_heads, config.query_groups
    main = without_mtp_layers(bare, config.num_layers)
    check_sizes(moe_size_disagreements(bare, config) + [
        size_disagreement(f"num_key_value_heads={groups} (head_dim {d})", groups * d,
                          "key/value width",
                          carriers_matching(main, r"layers\.\d+\.self_attn\.k_proj\.weight", 0)),
        size_disagreement(f"num_attention_heads={heads} (head_dim {d})", heads * d,
                          "query width",
                          carriers_matching(main, r"layers\.\d+\.self_attn\.q_proj\.weight", 0)),
    ])
    check_names_and_shapes(bare, lm_head, config, name_pairs(config))


def check_names_and_shapes(bare: Mapping[str, Any], lm_head: Any, config: ModelConfig,
                           pairs: list[NamePair]) -> None:
    """Every tensor `pairs` names is there with its shape and no other
    (besides the MTP modules' copies of the embedding and output layer,
    checked for shape); `bare`: the model's keys without `model.`."""
    shapes = shapes_with_expert_bias(config, pairs)
    h = config.hidden_size
    expected = {name.removeprefix("model."): (rows, *shapes[ours][1:])
                for ours, theirs in pairs for name, rows in theirs if name != OUTPUT}
    copies = [name.removeprefix("model.") for name in mtp_copies(
        config.num_layers, config.mtp_depth, config.tied_output)]
    for name in copies:
        if name in bare and shape_of(bare[name]) != (config.vocab_size, h):
            raise ConversionError(f"{name}: {shape_of(bare[name])}, expected "
                                  f"{(config.vocab_size, h)} (a copy of the model's "
                                  f"{'word embedding' if 'embed' in name else 'output layer'})")
    check_state({k: v for k, v in bare.items() if k not in copies}, expected, "Hugging Face state")
    check_output_layer(lm_head, config, shapes)


def from_hf_state(state: Mapping[str, torch.Tensor],
                  config: ModelConfig) -> dict[str, torch.Tensor]:
    """The logical state of a Glm4MoeForCausalLM state dict (or the bare
    model's keys), its MTP modules' included; their copies of the word
    embedding and output layer, where present, must equal the model's own
    (ptdp's MTP modules share them). The expert biases come as fp32."""
    check_hf_tensors(state, config)
    return moe_mtp_logical(state, config, name_pairs(config), _IGNORED)


def moe_mtp_logical(state: Mapping[str, torch.Tensor], config: ModelConfig,
                    pairs: list[NamePair], ignored: re.Pattern[str]) -> dict[str, torch.Tensor]:
    """The logical state `pairs` names of a checked state (from_hf_state's):
    the MTP modules' copies checked against the model's own and dropped,
    the expert biases as fp32, the norms' weights as ptdp stores them."""
    bare, lm_head = split_state(state, "model.", ignored)
    own = {EMBEDDING: ("embed_tokens.weight", bare["embed_tokens.weight"]),
           "output_layer.weight": (OUTPUT, lm_head)}
    for name, source in mtp_copies(config.num_layers, config.mtp_depth,
                                   config.tied_output).items():
        stored = bare.pop(name.removeprefix("model."), None)
        own_name, own_tensor = own[source]
        if stored is not None and not torch.equal(stored, own_tensor):
            raise ConversionError(f"{name} differs from the model's {own_name}: ptdp's MTP "
                                  f"modules share the model's word embedding and output layer "
                                  f"and keep no copy of their own")
    full = {f"model.{name}": tensor for name, tensor in bare.items()}
    if lm_head is not None:
        full[OUTPUT] = lm_head
    logical = logical_from_checked(full, config, pairs, ignored)
    for name in logical:
        if name.endswith(_EXPERT_BIAS):  # model state the router keeps in fp32
            logical[name] = logical[name].float()
    return with_stored_norm_scales(logical, config)


# GLM-4.5 as ptdp.interop.family.HFFamily, for the generic directory reader
# and writer (hf_directory.py).
GLM4_MOE = ModuleFamily(sys.modules[__name__], name=NAME, classes=(HF_CLASS, BARE_CLASS),
                        model_type=MODEL_TYPE, obstacles=glm4_moe_obstacles, ignored=_IGNORED)
