"""Hugging Face DeepSeek-V3 (DeepseekV3ForCausalLM, model_type deepseek_v3) <-> ptdp.

DeepSeek-V3 is multi-latent attention (ptdp.model.mla) in a Llama-like
decoder (RMSNorm, SwiGLU), first dense layers then DeepSeek-style MoE
layers (GLM-4.5's: hf_glm4_moe.py, whose MoE and MTP mapping this module
shares), and multi-token prediction layers after the decoder. Moonlight's
config.json names the same class and model_type; Kimi K2's the same class
with model_type kimi_k2 (and an auto_map to DeepSeek's own code, which
computes the same), read alike.
In ptdp's (Megatron-LM's) flags:

    config.json                                ptdp
    (MLA)                                      --multi-latent-attention --qk-layernorm (the
                                               latent norms q_a_layernorm, kv_a_layernorm)
    q_lora_rank (null: a direct q_proj)        --q-lora-rank (unset)
    kv_lora_rank                               --kv-lora-rank
    qk_nope_head_dim, qk_rope_head_dim         --qk-head-dim, --qk-pos-emb-head-dim
    v_head_dim                                 --v-head-dim
    rope_interleave true (default)             ptdp's (Megatron-Core's) layout, as stored;
      false                                    the rotated rows are read into it (mla.py)
    rope_parameters (or rope_scaling +         --rope-type rope, or --rope-type yarn with
      rope_theta): default or yarn: factor,    --rotary-scaling-factor, --yarn-original-max-
      original_max_position_embeddings,        position-embeddings, --yarn-beta-fast/-slow,
      beta_fast, beta_slow, mscale,            --mscale, --mscale-all-dim (mscale_all_dim as
      mscale_all_dim, truncate,                is; --mscale giving transformers' attention
      attention_factor                         factor), --[no-]yarn-correction-range-round-to-int
    n_routed_experts, num_experts_per_tok,     as GLM-4.5 (hf_glm4_moe.py): --num-experts,
      moe_intermediate_size, n_shared_experts, --moe-router-topk, --moe-ffn-hidden-size,
      first_k_dense_replace, n_group,          --moe-shared-expert-intermediate-size N·F,
      topk_group, topk_method noaux_tc,        --moe-layer-freq ([0]*K+[1]*(L-K)), group-
      scoring_func sigmoid,                    limited sigmoid routing with the expert bias
      routed_scaling_factor, norm_topk_prob    (e_score_correction_bias), the scaling factor
    num_nextn_predict_layers D                 --mtp-num-layers D (hf_mtp_names.py)
      (alias num_mtp_layers)

--rotary-base is rope_theta, --disable-bias-linear always (attention_bias
true puts biases on q_a_proj, kv_a_proj_with_mqa and o_proj: refused, as
ptdp's MLA has none on its down projections). The training-only keys
(aux_loss_alpha, seq_aux, ep_size) change nothing computed and are left;
moe_layer_freq other than 1 (every layer after the dense ones MoE) is
refused. rms_norm_eps is --norm-epsilon; transformers (as DeepSeek's own
code) normalizes the MLA latents with eps 1e-6 whatever it says, so where
it is another (Moonlight's 1e-5) the import sets --mla-latent-norm-epsilon
1e-6, and export refuses latent norms of another epsilon.

The tensors: the Llama layout's embedding, norms, dense MLPs and lm_head;
per layer the MLA projections (ptdp.model.mla's docstring maps each name);
the MoE layers' router, expert bias, experts and shared experts and the MTP
modules' tensors as GLM-4.5's. Export writes rope_interleave true and the
rows as ptdp holds them. Anything else that changes what the model computes
is refused, naming the key.
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
from ptdp.interop.hf_dense_families import common_model_fields, llama_like_obstacles, positive_int
from ptdp.interop.hf_files import (
    ConversionError,
    carriers_matching,
    check_sizes,
    read_hf_config,
    size_disagreement,
    split_state,
)
from ptdp.interop.hf_glm4_moe import (
    boolean_key,
    check_names_and_shapes,
    deepseek_moe_obstacles,
    integer_key,
    moe_fields,
    moe_hf_fields,
    moe_mtp_hf_state,
    moe_mtp_logical,
    moe_name_pairs,
    moe_size_disagreements,
    mtp_depth,
    without_absent_mtp,
)
from ptdp.interop.hf_llama import NamePair, mlp_name_pairs
from ptdp.interop.hf_mtp_names import EMBEDDING, mtp_name_pairs
from ptdp.interop.logical import logical_shapes

NAME = "DeepSeek-V3"
HF_CLASS, BARE_CLASS, MODEL_TYPE = "DeepseekV3ForCausalLM", "DeepseekV3Model", "deepseek_v3"
KIMI_K2_MODEL_TYPE = "kimi_k2"
OUTPUT = "lm_head.weight"
_IGNORED = re.compile(r"^(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq$")
# DeepseekV3Config's defaults where config.json omits a key.
DEEPSEEK_MOE_DEFAULTS = dict(n_routed_experts=256, num_experts_per_tok=8,
                             moe_intermediate_size=2048, n_shared_experts=1,
                             first_k_dense_replace=3, routed_scaling_factor=2.5, n_group=8,
                             topk_group=4)
_MLA_DEFAULTS = dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                     qk_rope_head_dim=64, v_head_dim=128)
DEFAULT_THETA = 10000.0
LATENT_NORM_EPS = 1e-6  # transformers' (and DeepSeek's) latent norms, whatever rms_norm_eps says
# ptdp (ptdp.model.mla) <- transformers, under layers.i.attention. / model.layers.i.self_attn.
_MLA_NAMES = {"query_down.weight": "q_a_proj.weight",
              "query_latent_layernorm.weight": "q_a_layernorm.weight",
              "query_up.weight": "q_b_proj.weight", "query.weight": "q_proj.weight",
              "key_value_down.weight": "kv_a_proj_with_mqa.weight",
              "key_value_latent_layernorm.weight": "kv_a_layernorm.weight",
              "key_value_up.weight": "kv_b_proj.weight", "dense.weight": "o_proj.weight"}


# ------------------------------------------------------------------ config.json -> ModelConfig

def model_config_from_hf_config(hf: dict[str, Any], **overrides: Any) -> ModelConfig:
    """The ModelConfig of a DeepSeek-V3 config.json; refuses, naming the
    key, what ptdp cannot compute. `overrides` set other ModelConfig fields."""
    problems: list[str] = []
    # The sizes, norm, activation and tying as every Llama-like config.json
    # gives them. MLA's widths are its own keys: head_dim (transformers sets
    # it to qk_rope_head_dim) and the rotary keys are read here instead.
    rotary = ("head_dim", "rope_parameters", "rope_scaling", "rope_theta", "num_key_value_heads")
    plain = {key: value for key, value in hf.items() if key not in rotary}
    fields = common_model_fields({**plain, "head_dim": 2}, problems)
    fields.update(kv_channels=None, group_query_attention=False, num_query_groups=None)
    fields.update(_attention_fields(hf, problems), **_rope_fields(hf, problems),
                  **moe_fields(hf, problems, NAME, DEEPSEEK_MOE_DEFAULTS))
    depth = mtp_depth(hf, problems)
    if problems:
        raise ConversionError(f"cannot convert this {NAME} config:\n"
                              + "\n".join(f"  - {p}" for p in problems))
    config = ModelConfig(**fields, mtp_num_layers=depth if depth else None)
    return with_overrides(config, overrides, NAME)


def _attention_fields(hf: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """MLA's widths, and the keys ptdp's MLA has no counterpart for."""
    widths = {}
    for key, default in _MLA_DEFAULTS.items():
        if key == "q_lora_rank" and key in hf and hf[key] is None:
            widths[key] = None  # a direct query projection (q_proj)
        else:
            widths[key] = integer_key(hf, key, default, problems)
    rotated = widths["qk_rope_head_dim"]
    if rotated is not None and rotated % 2:
        problems.append(f"qk_rope_head_dim={rotated} must be even (the rotation turns pairs)")
    heads, groups = hf.get("num_attention_heads"), hf.get("num_key_value_heads")
    if groups is not None and groups != heads:
        problems.append(f"num_key_value_heads={groups!r} with num_attention_heads={heads!r} is "
                        f"not supported: MLA up-projects keys and values for every head (and "
                        f"transformers' DeepseekV3 computes nothing else); make them equal")
    if boolean_key(hf, "attention_bias", False, problems):
        problems.append("attention_bias=true is not supported: it puts biases on q_a_proj, "
                        "kv_a_proj_with_mqa and o_proj, and ptdp's MLA (as Megatron-Core's) "
                        "has none on its down projections")
    # transformers' latent norms take 1e-6 whatever rms_norm_eps (ptdp's
    # --norm-epsilon, read with the common keys) says: their own setting
    # where the two differ, none where they agree (DeepSeek-V3's files).
    latent_epsilon = None if hf.get("rms_norm_eps", LATENT_NORM_EPS) == LATENT_NORM_EPS \
        else LATENT_NORM_EPS
    interleaved = boolean_key(hf, "rope_interleave", True, problems)
    if not interleaved and hf.get("quantization_config") is not None:
        problems.append("rope_interleave=false with quantization_config is not supported: ptdp "
                        "reorders the rotated rows of plain weights only")
    freq = hf.get("moe_layer_freq", 1)
    if freq != 1:
        problems.append(f"moe_layer_freq={freq!r} is not supported: transformers' DeepseekV3 "
                        f"makes every layer after first_k_dense_replace an MoE layer (1)")
    return dict(multi_latent_attention=True, qk_layernorm=True, disable_bias_linear=True,
                mla_latent_norm_epsilon=latent_epsilon,
                q_lora_rank=widths["q_lora_rank"], kv_lora_rank=widths["kv_lora_rank"],
                qk_head_dim=widths["qk_nope_head_dim"], qk_pos_emb_head_dim=rotated,
                v_head_dim=widths["v_head_dim"])


def _rope_settings(hf: dict[str, Any], problems: list[str]) -> tuple[dict[str, Any], Any]:
    """(the rotary settings, θ) of `rope_parameters` (transformers 5) or the
    older `rope_scaling` + `rope_theta` (DeepSeek's published files); both
    given must agree."""
    given = {key: hf[key] for key in ("rope_parameters", "rope_scaling") if hf.get(key) is not None}
    for key, value in given.items():
        if not isinstance(value, dict):
            problems.append(f"{key}={value!r} is not an object")
            return {}, DEFAULT_THETA
    def without_theta(key: str) -> dict[str, Any]:
        return {k: v for k, v in given[key].items() if k != "rope_theta"}

    if len(given) == 2 and without_theta("rope_parameters") != without_theta("rope_scaling"):
        problems.append(f"rope_parameters={given['rope_parameters']!r} and rope_scaling="
                        f"{given['rope_scaling']!r} disagree; keep one")
    settings = dict(next(iter(given.values()), {}))
    thetas = {key: value for key, value in (("rope_parameters.rope_theta",
                                             settings.get("rope_theta")),
                                            ("rope_theta", hf.get("rope_theta")))
              if value is not None}
    if len(set(thetas.values())) > 1:
        problems.append(f"{' and '.join(f'{k}={v!r}' for k, v in thetas.items())} disagree; "
                        f"make them equal")
    theta = next(iter(thetas.values()), DEFAULT_THETA)
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not theta > 0:
        problems.append(f"rope_theta={theta!r} must be a positive number")
        theta = DEFAULT_THETA
    return settings, theta


def _rope_fields(hf: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """The rotation of MLA's rotated part: plain, or YaRN as transformers'
    _compute_yarn_parameters and yarn_apply_mscale read it."""
    settings, theta = _rope_settings(hf, problems)
    plain = dict(position_embedding_type="rope", rope_type="rope", rotary_base=float(theta))
    if settings.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append(f"partial_rotary_factor={settings['partial_rotary_factor']!r} is not "
                        f"supported: MLA turns all of its qk_rope_head_dim values")
    kind = settings.get("rope_type", settings.get("type", "default"))
    if kind == "default":
        return plain
    if kind != "yarn":
        problems.append(f"rope_type {kind!r} is not supported: ptdp's MLA turns its rotated part "
                        f"by plain rotary embeddings ('default') or 'yarn'")
        return plain
    original, factor = settings.get("original_max_position_embeddings"), settings.get("factor")
    if not positive_int(original):
        problems.append(f"rope_parameters.original_max_position_embeddings={original!r} must "
                        f"be a positive integer")
        return plain
    if factor is None and positive_int(hf.get("max_position_embeddings")):
        factor = hf["max_position_embeddings"] / original  # (as transformers infers it)
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not factor >= 1:
        problems.append(f"rope_parameters.factor={factor!r} must be a number of at least 1")
        return plain
    truncate = settings.get("truncate", True)
    if not isinstance(truncate, bool):
        problems.append(f"rope_parameters.truncate={truncate!r} must be true or false")
    scales = _mscales(settings, float(factor), problems)
    return dict(plain, position_embedding_type="yarn", rope_type="yarn",
                rotary_scaling_factor=float(factor), yarn_original_max_position_embeddings=original,
                yarn_beta_fast=float(settings.get("beta_fast") or 32.0),
                yarn_beta_slow=float(settings.get("beta_slow") or 1.0), mscale=scales[0],
                mscale_all_dim=scales[1], yarn_correction_range_round_to_int=bool(truncate))


def _mscales(settings: dict[str, Any], factor: float, problems: list[str]) -> tuple[float, float]:
    """(--mscale, --mscale-all-dim) computing what transformers does: its
    softmax scale takes mscale(f, mscale_all_dim)² (yarn_apply_mscale), as
    ptdp's MLA does, so --mscale-all-dim is mscale_all_dim; its cos/sin
    factor is attention_factor when given, else mscale(f, mscale) /
    mscale(f, mscale_all_dim) when both are non-zero, else mscale(f, 1), and
    ptdp's is mscale(f, --mscale) / mscale(f, --mscale-all-dim): --mscale
    is the one giving transformers' (mscale itself in DeepSeek's files)."""
    mscale, all_dim = settings.get("mscale"), settings.get("mscale_all_dim")
    wanted = settings.get("attention_factor")
    for key, value in (("mscale", mscale), ("mscale_all_dim", all_dim),
                       ("attention_factor", wanted)):
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                  or not math.isfinite(value) or value < 0):
            problems.append(f"rope_parameters.{key}={value!r} must be a non-negative number")
            return 1.0, 0.0
    all_dim = float(all_dim or 0.0)
    if wanted is None:
        if mscale and all_dim:
            return float(mscale), all_dim
        wanted = _mscale(factor, 1.0)
    target = wanted * _mscale(factor, all_dim)
    if factor == 1.0:
        if not math.isclose(target, 1.0, rel_tol=1e-9):
            problems.append(f"rope_parameters.attention_factor={wanted!r} with factor 1 is not "
                            f"supported: ptdp's YaRN leaves cos and sin as they are at factor 1")
        return 1.0, all_dim
    return (target - 1.0) / (0.1 * math.log(factor)), all_dim


def _mscale(factor: float, scale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0


# ------------------------------------------------------------------ ModelConfig -> config.json

def deepseek_v3_obstacles(config: ModelConfig) -> list[str]:
    """What keeps `config` from being a DeepseekV3ForCausalLM (empty: it is one)."""
    c = config
    # (YaRN, MLA and MTP are DeepSeek-V3's own, whatever the Llama-like check says of them)
    found = [o for o in llama_like_obstacles(c, NAME) if not o.startswith(
        ("--position-embedding", "--multi-latent-attention", "--mtp-num-layers"))]
    if not c.multi_latent_attention:
        return found + ["no --multi-latent-attention (DeepSeek-V3's attention is MLA)"]
    latent_setting = ("--mla-latent-norm-epsilon" if c.mla_latent_norm_epsilon is not None
                      else "--norm-epsilon's: no --mla-latent-norm-epsilon")
    named = [
        (not c.qk_layernorm, "no --qk-layernorm (DeepSeek-V3 normalizes its MLA latents)"),
        (c.bias, "linear biases (add --disable-bias-linear: DeepSeek-V3's MLA and MLPs have "
                 "none)"),
        (c.qk_layernorm and c.latent_norm_epsilon != LATENT_NORM_EPS,
         f"MLA latent norms of epsilon {c.latent_norm_epsilon:g} ({latent_setting}; "
         f"transformers' DeepSeek-V3 normalizes the latents with {LATENT_NORM_EPS:g} whatever "
         f"rms_norm_eps says: only a model trained with --mla-latent-norm-epsilon "
         f"{LATENT_NORM_EPS:g}, or --norm-epsilon {LATENT_NORM_EPS:g}, computes the same)"),
        (c.use_rope_scaling or c.rotary_seq_len_interpolation_factor is not None,
         "Llama 3.1's or linear rotary rescaling (DeepSeek-V3 takes plain rotary embeddings or "
         "YaRN)"),
    ]
    return found + [what for on, what in named if on] + deepseek_moe_obstacles(c, NAME)


def hf_config_from_model_config(config: ModelConfig, *, bos_token_id: int | None = None,
                                eos_token_id: int | None = None) -> dict[str, Any]:
    """DeepseekV3ForCausalLM's config.json for `config` (which must have no obstacles)."""
    obstacles = deepseek_v3_obstacles(config)
    if obstacles:
        raise ConversionError(f"this model is not a {NAME}: " + "; ".join(obstacles))
    c = config
    for name, token in (("bos", bos_token_id), ("eos", eos_token_id)):
        if token is not None and not 0 <= token < c.vocab_size:
            raise ConversionError(f"{name} token {token} is outside the vocabulary "
                                  f"(0..{c.vocab_size - 1})")
    rope: dict[str, Any] = {"rope_type": "default"}
    if c.yarn:
        factor = c.rotary_scaling_factor
        rope = {"rope_type": "yarn", "factor": factor,
                "original_max_position_embeddings": c.yarn_original_max_position_embeddings,
                "beta_fast": c.yarn_beta_fast, "beta_slow": c.yarn_beta_slow,
                "mscale": c.mscale, "mscale_all_dim": c.mscale_all_dim,
                "attention_factor": _mscale(factor, c.mscale) / _mscale(factor, c.mscale_all_dim),
                "truncate": c.yarn_correction_range_round_to_int}
    return {
        "architectures": [HF_CLASS], "model_type": MODEL_TYPE,
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.ffn_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_attention_heads,
        "q_lora_rank": c.q_lora_rank, "kv_lora_rank": c.kv_lora_rank,
        "qk_nope_head_dim": c.qk_head_dim, "qk_rope_head_dim": c.qk_pos_emb_head_dim,
        "v_head_dim": c.v_head_dim, "rope_interleave": True, "hidden_act": "silu",
        "max_position_embeddings": c.max_positions, "initializer_range": c.init_method_std,
        "rms_norm_eps": c.epsilon, "tie_word_embeddings": c.tied_output,
        "attention_bias": False, "attention_dropout": c.attention_dropout,
        "rope_parameters": {**rope, "rope_theta": c.rotary_base},
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", **moe_hf_fields(c),
        "use_cache": True, "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
        "pad_token_id": None,
    }


# ------------------------------------------------------------------ tensors

def _attention_name_pairs(config: ModelConfig) -> list[NamePair]:
    """The embedding, each layer's norms and MLA projections, the final norm
    and the output layer (what config has of them)."""
    shapes = logical_shapes(config)
    pairs: list[NamePair] = []

    def add(ours: str, theirs: str) -> None:
        if ours in shapes:
            pairs.append((ours, ((theirs, shapes[ours][0]),)))

    add(EMBEDDING, "model.embed_tokens.weight")
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        add(ours + "input_layernorm.weight", theirs + "input_layernorm.weight")
        for mine, name in _MLA_NAMES.items():
            add(f"{ours}attention.{mine}", f"{theirs}self_attn.{name}")
        add(ours + "post_attention_layernorm.weight", theirs + "post_attention_layernorm.weight")
    add("final_layernorm.weight", "model.norm.weight")
    add("output_layer.weight", OUTPUT)
    return pairs


def name_pairs(config: ModelConfig) -> list[NamePair]:
    """The attention's, norms', embeddings' and dense MLPs' name table, the
    MoE layers' (hf_glm4_moe.moe_name_pairs), then the MTP modules'."""
    pairs = _attention_name_pairs(config) + mlp_name_pairs(config) + moe_name_pairs(config)
    return pairs + mtp_name_pairs(pairs, config.num_layers, config.mtp_depth, config.hidden_size)


def to_hf_state(logical: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """DeepseekV3ForCausalLM's state dict for a logical state (rope_interleave
    true: the rows as ptdp holds them), MTP modules included with their
    copies of the word embedding and output layer; a model trained without
    --moe-router-enable-expert-bias has a zero e_score_correction_bias."""
    obstacles = deepseek_v3_obstacles(config)
    if obstacles:
        raise ConversionError(f"this model is not a {NAME}: " + "; ".join(obstacles))
    return moe_mtp_hf_state(logical, config, name_pairs(config))


def check_hf_tensors(state: Mapping[str, Any], config: ModelConfig) -> None:
    """Refuse a state (tensors or the headers' shapes) that does not fit
    `config`: config.json's sizes first (layers, MTP modules, widths,
    counts, MLA's widths), then every name and shape; a directory without
    any of the MTP layers config.json counts (transformers' save_pretrained
    drops them) makes `config` the model without MTP, with a note
    (hf_glm4_moe.without_absent_mtp)."""
    bare, lm_head = split_state(state, "model.", _IGNORED)
    without_absent_mtp(bare, config, NAME)
    heads, nope = config.num_attention_heads, config.qk_head_dim
    rotated = config.qk_pos_emb_head_dim
    query = "q_proj" if config.q_lora_rank is None else "q_b_proj"

    def rows(name: str) -> list:
        return carriers_matching(bare, rf"layers\.\d+\.self_attn\.{name}\.weight", 0)

    check_sizes(moe_size_disagreements(bare, config) + [
        size_disagreement(f"q_lora_rank={config.q_lora_rank}", config.q_lora_rank,
                          "query latent width", rows("q_a_proj"))
        if config.q_lora_rank is not None else None,
        size_disagreement(f"kv_lora_rank={config.kv_lora_rank} + qk_rope_head_dim={rotated}",
                          config.kv_lora_rank + rotated, "key/value latent width",
                          rows("kv_a_proj_with_mqa")),
        size_disagreement(f"num_attention_heads={heads} × (qk_nope_head_dim={nope} + "
                          f"qk_rope_head_dim={rotated})", heads * (nope + rotated),
                          "query width", rows(query)),
        size_disagreement(f"num_attention_heads={heads} × (qk_nope_head_dim={nope} + "
                          f"v_head_dim={config.v_head_dim})", heads * (nope + config.v_head_dim),
                          "key/value up-projection width", rows("kv_b_proj")),
    ])
    check_names_and_shapes(bare, lm_head, config, name_pairs(config))


def from_hf_state(state: Mapping[str, torch.Tensor],
                  config: ModelConfig) -> dict[str, torch.Tensor]:
    """The logical state of a DeepseekV3ForCausalLM state dict with
    rope_interleave true (load_state reorders a false one's), its MTP
    modules' included (their copies of the embedding and output layer must
    equal the model's own); the expert biases come as fp32."""
    check_hf_tensors(state, config)
    return moe_mtp_logical(state, config, name_pairs(config), _IGNORED)


def load_state(weights: Any) -> dict[str, torch.Tensor]:
    """The tensors of an HFWeights (hf_weights.py) the model uses; where its
    config.json says rope_interleave false, the rotated rows in ptdp's
    (rope_interleave true) order."""
    state = weights.load(key for key in weights.tensors
                         if not _IGNORED.match(key.removeprefix("model.")))
    hf = read_hf_config(weights.directory)
    if hf.get("rope_interleave", True) is False:
        state = interleaved_rotary_rows(state, hf)
    return state


def interleaved_rotary_rows(state: Mapping[str, torch.Tensor],
                            hf: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """A rope_interleave false state's rotated rows in rope_interleave true
    order (ptdp.model.mla): of each head's last qk_rope_head_dim rows of
    q_b_proj (or q_proj), and of kv_a_proj_with_mqa's last ones, row 2i is
    the stored row i and row 2i + 1 the stored row i + d_r/2."""
    rotated = hf.get("qk_rope_head_dim", _MLA_DEFAULTS["qk_rope_head_dim"])
    nope = hf.get("qk_nope_head_dim", _MLA_DEFAULTS["qk_nope_head_dim"])
    half = torch.arange(rotated // 2)
    order = torch.stack([half, half + rotated // 2], dim=-1).flatten()
    out = dict(state)
    for name, tensor in state.items():
        if name.endswith(("self_attn.q_b_proj.weight", "self_attn.q_proj.weight")):
            heads = tensor.view(-1, nope + rotated, tensor.shape[-1])
            out[name] = torch.cat([heads[:, :nope], heads[:, nope:][:, order]], dim=1) \
                .reshape(tensor.shape)
        elif name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
            latent = tensor.shape[0] - rotated
            out[name] = torch.cat([tensor[:latent], tensor[latent:][order]])
    return out


# DeepSeek-V3 as ptdp.interop.family.HFFamily, for the generic directory
# reader and writer (hf_directory.py).
DEEPSEEK_V3 = ModuleFamily(sys.modules[__name__], name=NAME, classes=(HF_CLASS, BARE_CLASS),
                           model_type=MODEL_TYPE, obstacles=deepseek_v3_obstacles,
                           ignored=_IGNORED)
# Kimi K2's config.json names DeepseekV3ForCausalLM with its own model_type
# (its auto_map points at DeepSeek's code, which computes the same).
DEEPSEEK_V3.other_model_types = (KIMI_K2_MODEL_TYPE,)
