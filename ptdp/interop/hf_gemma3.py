"""Hugging Face's Gemma 3 text model (Gemma3ForCausalLM, model_type
"gemma3_text") <-> ptdp logical weights.

Gemma 3 is ptdp's GPT with these settings, each a flag of its own:

    Gemma 3 (config.json / module)              ptdp
    Gemma3RMSNorm, scale (1 + w)                --normalization RMSNorm --apply-layernorm-1p
    post_attention_layernorm,                   --sandwich-norm (attention_output_layernorm,
      post_feedforward_layernorm                  mlp_output_layernorm)
    hidden_activation gelu_pytorch_tanh         --geglu
    embeddings times √hidden_size               --scale-embeddings
    query_pre_attn_scalar q                     --softmax-scale q^-0.5
    q_norm / k_norm, head_dim                   --qk-layernorm, --kv-channels
    sliding_window W on 'sliding_attention'     --window-size W-1,0 --window-attn-skip-freq
      layers (layer_types)                        (N: every N-th layer full, or a 0/1 pattern)
    rope theta of full / sliding layers         --rotary-base / --rotary-base-local
    rope_type 'linear', factor F, on the full   --rotary-seq-len-interpolation-factor F
      layers (published checkpoints of 4B and     (only the global layers: those of
      up: 8)                                      --rotary-base-local are not scaled)

The tensors are Llama's names (hf_llama's name table) but for the norms:
Gemma's pre_feedforward_layernorm is ptdp's post_attention_layernorm (the
norm before the MLP), Gemma's post_attention_layernorm is ptdp's
attention_output_layernorm and post_feedforward_layernorm is
mlp_output_layernorm. Both store a norm's weight as w and scale by 1 + w,
so the norms are copied as they are (no with_plain_norm_scales).

Refused, with the key named: other rotary rescalings (rope_type other than
'default' and, on the full layers, 'linear'; 'linear' on the sliding
layers), logit soft-capping, biases, bidirectional attention, another
activation.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import replace
from typing import Any, Mapping

import torch

from ptdp.config import ModelConfig
from ptdp.interop.family import ModuleFamily
from ptdp.interop.hf_dense_families import (
    LINEAR_ROPE_TYPE,
    common_hf_fields,
    common_model_fields,
    linear_factor,
    linear_rope_scaling,
    llama_like_obstacles,
    positive_int,
)
from ptdp.interop.hf_files import (
    ConversionError,
    carriers_matching,
    check_state,
    size_disagreement,
)
from ptdp.interop.hf_llama import (
    _IGNORED,
    NamePair,
    attention_name_pairs,
    check_llama_layout,
    logical_from_checked,
    mlp_name_pairs,
)
from ptdp.interop.logical import logical_shapes

NAME = "Gemma 3"
ARCHITECTURE = "Gemma3ForCausalLM"
BARE_CLASS = "Gemma3TextModel"
MODEL_TYPE = "gemma3_text"
OUTPUT = "lm_head.weight"
ACTIVATION = "gelu_pytorch_tanh"  # GeGLU's gate: gelu, tanh approximation
FULL, SLIDING = "full_attention", "sliding_attention"
# Gemma3TextConfig's defaults for keys a config.json may leave out.
DEFAULTS = {"head_dim": 256, "num_key_value_heads": 4, "tie_word_embeddings": True,
            "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096,
            "hidden_activation": ACTIVATION}
DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}
# transformers' default layer pattern when config.json has no layer_types.
DEFAULT_PATTERN = 6
# Gemma's norms against ptdp's (per layer).
_NORMS = {"post_attention_layernorm": "pre_feedforward_layernorm",
          "attention_output_layernorm": "post_attention_layernorm",
          "mlp_output_layernorm": "post_feedforward_layernorm"}


# ------------------------------------------------------------------ ModelConfig -> Gemma 3

def gemma3_obstacles(config: ModelConfig) -> list[str]:
    """What keeps `config` from being a Gemma 3 text model (empty: it is one)."""
    # Llama-like refusals (other norms, positions, sinks, YaRN, ...) of the
    # model without Gemma's own pieces, which are checked here instead.
    plain = replace(config, geglu=False, swiglu=True, softmax_scale=None, scale_embeddings=False,
                    sandwich_norm=False, rotary_base_local=None,
                    rotary_seq_len_interpolation_factor=None)
    obstacles = llama_like_obstacles(plain, NAME, windows=True)
    needed = [(config.geglu and not config.swiglu, "--geglu (Gemma 3's MLP is GeGLU)"),
              (config.apply_layernorm_1p, "--apply-layernorm-1p (Gemma 3's norms scale by 1 + w)"),
              (config.sandwich_norm, "--sandwich-norm (Gemma 3 normalizes attention's and the "
                                     "MLP's outputs)"),
              (config.scale_embeddings, "--scale-embeddings (Gemma 3 scales its embeddings by "
                                        "√h)"),
              (config.qk_layernorm, "--qk-layernorm (Gemma 3 normalizes queries and keys)")]
    obstacles += [f"no {flag}" for present, flag in needed if not present]
    if config.use_rope_scaling:
        obstacles.append("--use-rope-scaling (ptdp writes Gemma 3 with plain rotary embeddings, "
                         "or linear interpolation on the full layers)")
    if config.rotary_seq_len_interpolation_factor is not None and any(config.windowed_layers) \
            and config.rotary_base_local is None:
        obstacles.append("--rotary-seq-len-interpolation-factor without --rotary-base-local (it "
                         "then scales the sliding-window layers too, and Gemma 3 interpolates "
                         "only its full layers: give --rotary-base-local)")
    if config.qkv_bias:
        obstacles.append(f"{'biases' if config.bias else '--add-qkv-bias'} (Gemma 3 as ptdp "
                         f"writes it has no biases)")
    if config.is_moe:
        obstacles.append(f"MoE layers (--num-experts {config.num_experts}; Gemma 3 is dense)")
    if any(config.windowed_layers) and config.window[1] != 0:
        obstacles.append(f"--window-size {config.window_size} (Gemma 3's windows are causal: R 0)")
    if config.softmax_scale is not None and _pre_attention_scalar(config) is None:
        obstacles.append(f"--softmax-scale {config.softmax_scale} (Gemma 3's is "
                         f"query_pre_attn_scalar^-0.5 for a whole number query_pre_attn_scalar)")
    return obstacles


def _pre_attention_scalar(config: ModelConfig) -> int | None:
    """query_pre_attn_scalar for the model's softmax scale (None: no whole
    number gives it)."""
    if config.softmax_scale is None:
        return config.head_dim  # ptdp's default scale, 1/√d
    scalar = round(config.softmax_scale ** -2)
    return scalar if scalar > 0 and math.isclose(scalar ** -0.5, config.softmax_scale,
                                                 rel_tol=1e-12) else None


def _require_gemma3(config: ModelConfig) -> None:
    obstacles = gemma3_obstacles(config)
    if obstacles:
        raise ConversionError(f"this model is not a {NAME}: " + "; ".join(obstacles))


def hf_config_from_model_config(config: ModelConfig, *, bos_token_id: int | None = None,
                                eos_token_id: int | None = None) -> dict[str, Any]:
    """Gemma3ForCausalLM's config.json for `config`, readable by transformers
    4 (rope_theta, rope_local_base_freq, rope_scaling of the full layers) and
    5 (rope_parameters per layer type)."""
    _require_gemma3(config)
    fields = common_hf_fields(config, ARCHITECTURE, MODEL_TYPE, bos_token_id=bos_token_id,
                              eos_token_id=eos_token_id)
    del fields["hidden_act"]  # Gemma 3's key is hidden_activation
    windowed = config.windowed_layers
    local = config.rotary_base if config.rotary_base_local is None else config.rotary_base_local
    full = {"rope_type": "default"}
    if config.rotary_seq_len_interpolation_factor is not None:
        full = linear_rope_scaling(config)
    fields.update(
        hidden_activation=ACTIVATION, attention_bias=False,
        query_pre_attn_scalar=_pre_attention_scalar(config),
        # unused without windowed layers, but transformers wants a number
        sliding_window=config.window[0] + 1 if any(windowed) else config.max_positions,
        layer_types=[SLIDING if w else FULL for w in windowed],
        rope_theta=config.rotary_base, rope_local_base_freq=local,
        rope_scaling=None if full["rope_type"] == "default" else dict(full),
        rope_parameters={FULL: {**full, "rope_theta": config.rotary_base},
                         SLIDING: {"rope_type": "default", "rope_theta": local}},
        attn_logit_softcapping=None, final_logit_softcapping=None,
        use_bidirectional_attention=False)
    every = _every_nth_full(windowed)
    if every is not None:  # transformers 4.50's only form of the pattern
        fields["sliding_window_pattern"] = every
    return fields


def _every_nth_full(windowed: list[bool]) -> int | None:
    """N when layer n (from 1) is full exactly when N divides it, else None."""
    for n in range(1, len(windowed) + 2):
        if windowed == [(i + 1) % n != 0 for i in range(len(windowed))]:
            return n
    return None


# ------------------------------------------------------------------ config.json -> ModelConfig

def model_config_from_hf_config(hf: dict[str, Any], **overrides: Any) -> ModelConfig:
    """The ModelConfig of a Gemma 3 text config.json; refuses what ptdp
    cannot compute, naming the key. `overrides` set other ModelConfig fields
    (apply_layernorm_1p is always on: Gemma's norms are 1 + w)."""
    problems: list[str] = []
    filled = {**DEFAULTS, **hf}
    activation = filled.pop("hidden_activation")
    if activation != ACTIVATION:
        problems.append(f"hidden_activation={activation!r} is not supported: ptdp's GeGLU gate "
                        f"is {ACTIVATION!r}")
    for key in ("attention_bias", "use_bidirectional_attention"):
        if filled.get(key):
            problems.append(f"{key}={filled[key]!r} is not supported: ptdp's Gemma 3 has "
                            + ("no biases" if key == "attention_bias" else "causal attention"))
    thetas, interpolation = _rope_settings(filled, problems)
    for key in ("hidden_act", "rope_theta", "rope_scaling", "rope_parameters",
                "rope_local_base_freq"):
        filled.pop(key, None)  # read above (hidden_act: Gemma 1's key, unused by Gemma 3)
    fields = common_model_fields(filled, problems, layer_types=True)
    scalar = filled["query_pre_attn_scalar"]
    if not isinstance(scalar, (int, float)) or isinstance(scalar, bool) or not scalar > 0:
        problems.append(f"query_pre_attn_scalar={scalar!r} must be a positive number")
    windows = _window_fields(filled, problems)
    if problems:
        raise ConversionError(f"cannot convert this {NAME} config:\n"
                              + "\n".join(f"  - {p}" for p in problems))
    fields.update(windows, swiglu=False, geglu=True, apply_layernorm_1p=True, sandwich_norm=True,
                  scale_embeddings=True, qk_layernorm=True, disable_bias_linear=True,
                  softmax_scale=float(scalar) ** -0.5, rotary_base=thetas[FULL],
                  rotary_base_local=thetas[SLIDING],
                  rotary_seq_len_interpolation_factor=interpolation)
    config = ModelConfig(**fields)
    # Gemma's norms store w and scale by 1 + w, as --apply-layernorm-1p: the
    # import's choice of it (for the other families' plain scales) is moot.
    overrides.pop("apply_layernorm_1p", None)
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise ConversionError(f"unknown ModelConfig field {key!r}")
        setattr(config, key, value)
    return config


def _rope_settings(hf: dict[str, Any],
                   problems: list[str]) -> tuple[dict[str, float], float | None]:
    """The rotary base of the full and the sliding layers, and the full
    layers' linear interpolation factor (None: none): transformers 5's
    `rope_parameters` per layer type, else transformers 4's rope_theta,
    rope_local_base_freq and `rope_scaling` (the full layers', as both
    read it; given with rope_parameters, the two must agree). Any other
    rescaling, and 'linear' on the sliding layers, is refused."""
    thetas = {FULL: hf.get("rope_theta", DEFAULT_THETA[FULL]),
              SLIDING: hf.get("rope_local_base_freq", DEFAULT_THETA[SLIDING])}
    scaling = hf.get("rope_scaling")
    settings = {"rope_scaling": scaling} if scaling is not None else {}
    parameters = hf.get("rope_parameters")
    if parameters is not None:
        if not isinstance(parameters, dict) or not set(parameters) <= {FULL, SLIDING}:
            problems.append(f"rope_parameters={parameters!r} must hold settings per layer type "
                            f"({FULL!r}, {SLIDING!r}), as Gemma 3's config writes them")
            return {FULL: 1.0, SLIDING: 1.0}, None
        settings.update({f"rope_parameters.{kind}": value for kind, value in parameters.items()})
    factors: dict[str, float | None] = {}  # the full layers' interpolation, per key
    for key, value in settings.items():
        if not isinstance(value, dict):
            problems.append(f"{key}={value!r} is not an object")
            continue
        kind = value.get("rope_type", value.get("type", "default"))
        full = key != f"rope_parameters.{SLIDING}"
        if kind == LINEAR_ROPE_TYPE and full:
            factors[key] = linear_factor(key, value, problems)
        elif kind == LINEAR_ROPE_TYPE:
            problems.append(f"{key} has rope_type 'linear' ({value}): ptdp interpolates only "
                            f"the full layers' positions (Gemma 3's sliding layers rotate "
                            f"unscaled); make the sliding layers' rope_type 'default'")
        elif kind != "default":
            problems.append(f"{key} has rope_type {kind!r} ({value}): ptdp computes Gemma 3 with "
                            f"plain rotary embeddings (rope_type 'default'), and linear "
                            f"interpolation ('linear') on the full layers, no other")
        elif full:
            factors[key] = None
        if value.get("partial_rotary_factor", 1.0) != 1.0:
            problems.append(f"{key} has partial_rotary_factor={value['partial_rotary_factor']!r}: "
                            f"ptdp's Gemma 3 rotates whole heads")
        if key.startswith("rope_parameters.") and "rope_theta" in value:
            thetas[key.removeprefix("rope_parameters.")] = value["rope_theta"]
    if len(set(factors.values())) > 1:
        problems.append(f"{' and '.join(f'{k} factor {v!r}' for k, v in factors.items())} "
                        f"disagree on the full layers' linear interpolation (transformers "
                        f"versions read different ones); make them equal")
    for kind, theta in thetas.items():
        if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not theta > 0 \
                or not math.isfinite(theta):
            problems.append(f"the rope_theta of the {kind} layers, {theta!r}, must be a positive "
                            f"number")
            thetas[kind] = 1.0
    factor = next((f for f in factors.values() if f is not None), None)
    return {kind: float(theta) for kind, theta in thetas.items()}, factor


def _window_fields(hf: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """--window-size and --window-attn-skip-freq from layer_types (or, as
    transformers, every sliding_window_pattern-th layer full) and
    sliding_window W: W keys, the query's own included, is (W - 1, 0)."""
    layers = hf.get("num_hidden_layers")
    types = hf.get("layer_types")
    if types is None and positive_int(layers):
        pattern = hf.get("sliding_window_pattern", DEFAULT_PATTERN)
        if not positive_int(pattern):
            problems.append(f"sliding_window_pattern={pattern!r} must be a positive integer")
            return {}
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    if not isinstance(types, list):
        return {}  # common_model_fields names a bad layer_types
    windowed = [kind == SLIDING for kind in types]
    if positive_int(layers) and len(windowed) != layers:
        problems.append(f"layer_types has {len(windowed)} entries for {layers} layers")
        return {}
    if not any(windowed):
        return {}
    width = hf["sliding_window"]
    if not positive_int(width):
        problems.append(f"sliding_window={width!r} must be a positive integer (the keys each "
                        f"query sees, its own included)")
        return {}
    every = _every_nth_full(windowed)
    return dict(window_size=f"{width - 1},0",
                window_attn_skip_freq=None if all(windowed) else every if every is not None
                else "[" + ",".join("1" if w else "0" for w in windowed) + "]")


# ------------------------------------------------------------------ tensors

def name_pairs(config: ModelConfig) -> list[NamePair]:
    """Gemma 3's name table: hf_llama's with the sandwich norms renamed and added."""
    pairs = []
    for ours, theirs in attention_name_pairs(config) + mlp_name_pairs(config):
        norm = re.fullmatch(r"layers\.(\d+)\.post_attention_layernorm\.weight", ours)
        if norm is not None:  # a layer's norms: Gemma's three and ptdp's are other names
            i = norm.group(1)
            for our_norm, their_norm in _NORMS.items():
                pairs.append((f"layers.{i}.{our_norm}.weight",
                              ((f"model.layers.{i}.{their_norm}.weight", config.hidden_size),)))
        else:
            pairs.append((ours, theirs))
    return pairs


def to_hf_state(logical: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Gemma3ForCausalLM's state dict for a logical state, each tensor a new
    contiguous one (a tied `lm_head.weight` a copy of the embedding). The
    norms' w is copied as it is: both sides scale by 1 + w."""
    _require_gemma3(config)
    check_state(logical, logical_shapes(config), "ptdp logical state",
                padded_hint=config.vocab_size)
    state = {}
    for ours, theirs in name_pairs(config):
        pieces = logical[ours].detach().split([rows for _, rows in theirs])
        for (name, _), piece in zip(theirs, pieces):
            state[name] = piece.contiguous().clone()
    if config.tied_output:
        state[OUTPUT] = logical["embedding.word_embeddings.weight"].detach().contiguous().clone()
    return state


def check_hf_tensors(state: Mapping[str, Any], config: ModelConfig) -> None:
    """Refuse a state (tensors, or the shapes the headers give) that does
    not fit `config`: config.json's sizes first (the head width too, from
    the q/k norms), then every name and shape. Keys come with "model." or bare."""
    _require_gemma3(config)
    d = config.head_dim

    def head_width(bare):
        return size_disagreement(f"head_dim={d}", d, "head width", carriers_matching(
            bare, r"layers\.\d+\.self_attn\.q_norm\.weight", 0))

    check_llama_layout(state, config, name_pairs, _IGNORED, [head_width])


def from_hf_state(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The logical state of a Gemma3ForCausalLM (or Gemma3TextModel) state
    dict; with tied embeddings a stored `lm_head.weight` must equal the
    word embedding."""
    check_hf_tensors(state, config)
    return logical_from_checked(state, config, name_pairs(config), _IGNORED)  # (norms as stored)


# ------------------------------------------------------------------ the family

# Gemma 3's text model as ptdp.interop.family.HFFamily, for the generic
# directory reader and writer (hf_directory.py).
GEMMA3 = ModuleFamily(sys.modules[__name__], name=NAME, classes=(ARCHITECTURE, BARE_CLASS),
                      model_type=MODEL_TYPE, obstacles=gemma3_obstacles, ignored=_IGNORED)
