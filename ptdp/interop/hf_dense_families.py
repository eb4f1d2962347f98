"""What the config.json of each Llama-like dense family says, read and written.

Llama, Mistral, Qwen2 and Qwen3 compute the same decoder (RMSNorm, SwiGLU,
rotary embeddings, grouped-query attention, optionally tied embeddings)
and store it under the same tensor names (hf_llama.py); they differ in a
few settings, which map onto ptdp's flags:

    family   biases                               q/k norms        window keys
    Llama    attention_bias = mlp_bias: all/none  -                (none allowed)
    Mistral  none                                 -                sliding_window null
    Qwen2    q, k, v only (--add-qkv-bias)        -                use_sliding_window false
    Qwen3    none (attention_bias false)          --qk-layernorm   use_sliding_window false

Every family reads `head_dim` (--kv-channels when it is not h/a), Llama
3.1's `rope_type: llama3` (--use-rope-scaling) and linear position
interpolation, `rope_type: linear` (--rotary-seq-len-interpolation-factor),
and writes them back. Anything else that
changes what the model computes is refused with the key named, never
adjusted. Export writes Llama, Qwen2 or Qwen3, whichever the checkpoint's
settings are (`family_of_model`); a Mistral without a sliding window is a
Llama and is written as one.

Other modules' families (MoE) reuse `llama_like_obstacles`,
`common_model_fields` and `common_hf_fields` and add their own keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ptdp.config import ModelConfig
from ptdp.interop.family import unwritten_settings
from ptdp.interop.hf_files import ConversionError
from ptdp.model.rotary import HIGH_FREQUENCY_FACTOR, LOW_FREQUENCY_FACTOR, ORIGINAL_CONTEXT

# Hugging Face's two names for x·sigmoid(x), the gate of SwiGLU.
SILU_NAMES = ("silu", "swish")
# Rotary settings ptdp computes: plain frequencies θ^(-2i/d), Llama 3.1's
# rescaling, and linear interpolation (every frequency divided by `factor`).
PLAIN_ROPE_TYPES = (None, "default")
LLAMA3_ROPE_TYPE = "llama3"
LINEAR_ROPE_TYPE = "linear"
# Llama 3.1's fixed parameters (ptdp/model/rotary.py), as config.json names them.
LLAMA3_FIXED = {"low_freq_factor": LOW_FREQUENCY_FACTOR, "high_freq_factor": HIGH_FREQUENCY_FACTOR,
                "original_max_position_embeddings": ORIGINAL_CONTEXT}
# Keys of neighbouring architectures that change what the model computes;
# ptdp computes none of them. (key, the value that means "off", what it is)
FOREIGN_KEYS = (("partial_rotary_factor", 1.0, "rotary embeddings on part of each head"),
                ("attn_logit_softcapping", None, "capped attention scores"),
                ("final_logit_softcapping", None, "capped output logits"))
_WINDOW = "attention limited to a sliding window"


@dataclass(frozen=True)
class DenseFamily:
    name: str            # as ptdp's messages say it
    hf_class: str        # ForCausalLM class: config.json's architectures, what export writes
    bare_class: str      # the class without the output layer (keys without "model.")
    model_type: str
    biases: str          # "llama" (attention_bias = mlp_bias), "qkv" (always), "qwen3", "none"
    qk_norm: bool        # q_norm / k_norm over each head (Qwen3)
    window: str          # how config.json turns the sliding window off: "absent", "null", "switch"


LLAMA = DenseFamily("Llama", "LlamaForCausalLM", "LlamaModel", "llama", "llama", False, "absent")
MISTRAL = DenseFamily("Mistral", "MistralForCausalLM", "MistralModel", "mistral", "none", False,
                      "null")
QWEN2 = DenseFamily("Qwen2", "Qwen2ForCausalLM", "Qwen2Model", "qwen2", "qkv", False, "switch")
QWEN3 = DenseFamily("Qwen3", "Qwen3ForCausalLM", "Qwen3Model", "qwen3", "qwen3", True, "switch")
DENSE_FAMILIES = (LLAMA, MISTRAL, QWEN2, QWEN3)
# The families export writes (a Mistral without a window is written as a Llama,
# so Mistral comes last).
EXPORTED_FAMILIES = (LLAMA, QWEN2, QWEN3, MISTRAL)


def family_of_hf_config(hf: dict[str, Any]) -> DenseFamily:
    """The family of a config.json: its model_type, else the class its
    `architectures` names, else Llama (as old files)."""
    model_type = hf.get("model_type")
    if model_type is None:
        classes = hf.get("architectures") or []
        for family in DENSE_FAMILIES:
            if classes and all(c in (family.hf_class, family.bare_class) for c in classes):
                return family
    return family_of_model_type(model_type)


def family_of_model_type(model_type: str | None) -> DenseFamily:
    """The family of config.json's model_type (None: Llama)."""
    for family in DENSE_FAMILIES:
        if model_type in (family.model_type, None):
            return family
    known = ", ".join(repr(f.model_type) for f in DENSE_FAMILIES)
    raise ConversionError(f"model_type {model_type!r} is not a dense family ptdp converts "
                          f"({known})")


# ------------------------------------------------------------------ ModelConfig -> family

def llama_like_obstacles(config: ModelConfig, family: str = "Llama",
                         windows: bool = False) -> list[str]:
    """The settings of `config` that no Llama-like decoder has (empty: it is
    one, dense or MoE): the norm, the MLP's gate, the positions, sinks;
    sliding windows unless the family has them (`windows`)."""
    obstacles = unwritten_settings(config, family)
    if not windows and any(config.windowed_layers):
        obstacles.append(f"--window-size ({family} attends to the whole sequence)")
    if config.normalization != "RMSNorm":
        obstacles.append(f"--normalization {config.normalization} ({family} has RMSNorm)")
    if not config.swiglu:
        obstacles.append(f"no --swiglu ({family}'s MLP is SwiGLU)")
    if not config.rope:
        obstacles.append(f"--position-embedding-type {config.position_embedding_type} ({family} "
                         f"has rotary embeddings)")
    # Rotary variants no exported family writes yet: an export would be a
    # different model, so they are named instead.
    if config.yarn:
        obstacles.append("--position-embedding-type yarn (ptdp does not export YaRN yet)")
    if config.rope and config.rotary_percent != 1.0:
        obstacles.append(f"--rotary-percent {config.rotary_percent:g} ({family} rotates the "
                         f"whole head)")
    if config.rotary_base_local is not None:
        obstacles.append(f"--rotary-base-local ({family} has one rotary base)")
    return obstacles


def dense_family_obstacles(config: ModelConfig, family: DenseFamily) -> list[str]:
    """What keeps `config` from being written as `family` (empty: it can be)."""
    obstacles = llama_like_obstacles(config, family.name, windows=family.window != "absent")
    windowed = config.windowed_layers
    if family.window == "null" and not all(windowed):
        obstacles.append(f"{'layers without' if any(windowed) else 'no'} --window-size ("
                         f"{family.name} windows every layer; ptdp writes one without a window "
                         f"as a Llama)")
    if config.is_moe:
        obstacles.append(f"MoE layers (--num-experts {config.num_experts}; {family.name} is dense)")
    if config.qk_layernorm and not family.qk_norm:
        obstacles.append(f"--qk-layernorm ({family.name} has no query/key norms)")
    if family.qk_norm and not config.qk_layernorm:
        obstacles.append(f"no --qk-layernorm ({family.name} normalizes queries and keys)")
    qkv_only = config.add_qkv_bias and not config.bias
    if family.biases == "llama" and qkv_only:
        obstacles.append(f"--add-qkv-bias with --disable-bias-linear ({family.name}'s biases are "
                         f"on all linear layers or none)")
    if family.biases == "qkv" and not qkv_only:
        obstacles.append(f"{'biases on every linear layer' if config.bias else 'no q/k/v biases'}"
                         f" ({family.name} has biases on q, k, v only: --add-qkv-bias "
                         f"--disable-bias-linear)")
    if family.biases in ("qwen3", "none") and config.qkv_bias:
        obstacles.append(f"{'biases' if config.bias else '--add-qkv-bias'} ({family.name} as ptdp "
                         f"writes it has no biases)")
    return obstacles


def family_of_model(config: ModelConfig) -> DenseFamily | None:
    """The family export writes for `config`: Qwen3 with q/k norms, Qwen2
    with biases on q/k/v only, else Llama; None when none fits."""
    for family in EXPORTED_FAMILIES:
        if not dense_family_obstacles(config, family):
            return family
    return None


# ------------------------------------------------------------------ config.json -> ModelConfig

def common_model_fields(hf: dict[str, Any], problems: list[str],
                        layer_types: bool = False) -> dict[str, Any]:
    """ModelConfig fields every Llama-like config.json gives (sizes, heads,
    head width, norm, rotary embeddings, tying); what ptdp cannot compute is
    appended to `problems`, naming the key. `layer_types`: the family reads
    sliding layers from it (the caller's window_fields), else only full
    layers are taken."""
    sizes = {}
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                "intermediate_size", "max_position_embeddings"):
        sizes[key] = hf.get(key)
        if not positive_int(sizes[key]):
            problems.append(f"{key}={sizes[key]!r} must be a positive integer")
    h, heads = sizes["hidden_size"], sizes["num_attention_heads"]
    shapes_known = positive_int(h) and positive_int(heads)
    head_dim = hf.get("head_dim")
    if head_dim is None and shapes_known and h % heads:
        problems.append(f"hidden_size {h} is not divisible by num_attention_heads {heads} (and "
                        f"no head_dim is given)")
    elif head_dim is not None and not (positive_int(head_dim) and head_dim % 2 == 0):
        problems.append(f"head_dim={head_dim!r} must be a positive even integer (rotary "
                        f"embeddings turn pairs of a head's values)")
    groups = hf.get("num_key_value_heads")
    groups = heads if groups is None else groups
    if not positive_int(groups):
        problems.append(f"num_key_value_heads={groups!r} must be a positive integer")
    elif shapes_known and heads % groups:
        problems.append(f"num_key_value_heads {groups} does not divide num_attention_heads "
                        f"{heads}: each key/value head serves a whole number of query heads")
    activation = hf.get("hidden_act", "silu")
    if activation not in SILU_NAMES:
        problems.append(f"hidden_act={activation!r} is not supported: ptdp's SwiGLU gate is silu")
    for key, plain, what in FOREIGN_KEYS:
        if hf.get(key, plain) not in (plain, None):
            problems.append(f"{key}={hf[key]!r} is not supported: ptdp computes no {what}")
    types = hf.get("layer_types")
    allowed = ("full_attention", "sliding_attention") if layer_types else ("full_attention",)
    if types is not None and (not isinstance(types, list) or any(t not in allowed for t in types)):
        problems.append(f"layer_types={types!r} is not supported: " + (
            "each layer is 'full_attention' or 'sliding_attention'" if layer_types else
            "ptdp's layers all attend to the whole sequence ('full_attention')"))
    theta, scaling = rotary_settings(hf, problems)
    epsilon = hf.get("rms_norm_eps", 1e-6)
    if not isinstance(epsilon, (int, float)) or isinstance(epsilon, bool) or epsilon < 0:
        problems.append(f"rms_norm_eps={epsilon!r} must be a non-negative number")
        epsilon = 1e-6
    if problems:
        return {}
    gqa = groups != heads
    positions = sizes["max_position_embeddings"]
    return dict(
        num_layers=sizes["num_hidden_layers"], hidden_size=h, num_attention_heads=heads,
        ffn_hidden_size=sizes["intermediate_size"],
        kv_channels=head_dim if head_dim is not None and head_dim * heads != h else None,
        seq_length=positions, max_position_embeddings=positions, vocab_size=sizes["vocab_size"],
        hidden_dropout=0.0,  # these families have no dropout outside attention
        attention_dropout=float(hf.get("attention_dropout") or 0.0),
        init_method_std=float(hf.get("initializer_range", 0.02)),
        normalization="RMSNorm", norm_epsilon=float(epsilon), swiglu=True,
        position_embedding_type="rope", rotary_base=theta, **scaling,
        group_query_attention=gqa, num_query_groups=groups if gqa else None,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False))


def dense_model_fields(hf: dict[str, Any], family: DenseFamily, problems: list[str],
                       windows: bool = True) -> dict[str, Any]:
    """The family's own keys: its biases, q/k norms and sliding window
    (`windows`: read; else refused, as for the MoE families whose
    attention is this family's)."""
    fields: dict[str, Any] = dict(qk_layernorm=family.qk_norm, disable_bias_linear=True)
    attention_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    if family.biases == "llama":
        if attention_bias != mlp_bias:
            problems.append(f"attention_bias={attention_bias} differs from mlp_bias={mlp_bias}: "
                            f"ptdp has biases on all linear layers or (--add-qkv-bias) on q/k/v "
                            f"only; convert a model with both or neither")
        fields["disable_bias_linear"] = not attention_bias
    elif family.biases == "qkv":
        fields["add_qkv_bias"] = True
    elif family.biases == "qwen3" and attention_bias:
        problems.append("attention_bias=True is not supported: Qwen3's o_proj then has a bias "
                        "and its MLP none, while ptdp has biases on all linear layers or "
                        "(--add-qkv-bias) on q/k/v only")
    if family.window == "absent":
        for key, off in (("sliding_window", None), ("use_sliding_window", False)):
            if hf.get(key, off) not in (off, None):
                problems.append(f"{key}={hf[key]!r} is not supported: ptdp computes no {_WINDOW}")
    elif not windows and family.window == "null" and hf.get("sliding_window") is not None:
        problems.append(f"sliding_window={hf['sliding_window']!r} is not supported here: ptdp "
                        f"reads no {_WINDOW} for this model")
    elif not windows and family.window == "switch" and hf.get("use_sliding_window", False):
        problems.append(f"use_sliding_window={hf['use_sliding_window']!r} is not supported here: "
                        f"ptdp reads no {_WINDOW} for this model (sliding_window "
                        f"{hf.get('sliding_window')!r} counts only with use_sliding_window true)")
    elif windows:
        fields.update(window_fields(hf, family, problems))
    return fields


def window_fields(hf: dict[str, Any], family: DenseFamily, problems: list[str]) -> dict[str, Any]:
    """--window-size and --window-attn-skip-freq from a family's window keys,
    as transformers reads them: Mistral windows every layer by
    `sliding_window` W (not null); Qwen2/Qwen3 only with `use_sliding_window`,
    the layers `layer_types` names 'sliding_attention' (by default those
    from `max_window_layers` on). W keys, the query's own included, is
    ptdp's window (W - 1, 0)."""
    width, layers = hf.get("sliding_window"), hf.get("num_hidden_layers")
    if family.window == "null":
        windowed = None if width is None else [True] * (layers or 0)
    elif not hf.get("use_sliding_window", False) or width is None:
        windowed = None
    elif isinstance(hf.get("layer_types"), list):
        windowed = [kind == "sliding_attention" for kind in hf["layer_types"]]
    else:
        first = hf.get("max_window_layers", 28)  # (transformers' default for Qwen2 and Qwen3)
        windowed = [i >= first for i in range(layers or 0)]
    if not windowed or not any(windowed):
        return {}
    if not positive_int(width):
        problems.append(f"sliding_window={width!r} must be a positive integer (the keys each "
                        f"query sees, its own included)")
        return {}
    if positive_int(layers) and len(windowed) != layers:
        problems.append(f"layer_types has {len(windowed)} entries for {layers} layers")
        return {}
    return dict(window_size=f"{width - 1},0", window_attn_skip_freq=None if all(windowed) else
                "[" + ",".join("1" if w else "0" for w in windowed) + "]")


def rotary_settings(hf: dict[str, Any],
                    problems: list[str]) -> tuple[float, dict[str, Any]]:
    """(θ, the ModelConfig fields of its rescaling: Llama 3.1's or linear
    interpolation, or none) from `rope_parameters` (transformers 5) or the
    older top-level `rope_theta` + `rope_scaling`, whichever the file has;
    both must agree. Any other rescaling is refused."""
    thetas: dict[str, Any] = {}
    factors: dict[str, tuple[str, float | None] | None] = {}
    for key in ("rope_scaling", "rope_parameters"):
        settings = hf.get(key)
        if settings is None:
            continue
        if not isinstance(settings, dict):
            problems.append(f"{key}={settings!r} is not an object")
            continue
        if any(isinstance(value, dict) for value in settings.values()):
            problems.append(f"{key}={settings!r} holds settings per layer type: ptdp's layers "
                            f"share one rotary embedding")
            continue
        kind = settings.get("rope_type", settings.get("type"))
        if kind == LLAMA3_ROPE_TYPE:
            factors[key] = (kind, _llama3_factor(key, settings, hf, problems))
        elif kind == LINEAR_ROPE_TYPE:
            factors[key] = (kind, linear_factor(key, settings, problems))
        elif kind in PLAIN_ROPE_TYPES:
            factors[key] = None
        else:
            problems.append(f"{key} has rope_type {kind!r} ({settings}): ptdp computes plain "
                            f"rotary embeddings (rope_type 'default'), Llama 3.1's rescaling "
                            f"(rope_type 'llama3') and linear interpolation (rope_type "
                            f"'linear'), no other")
        factor = settings.get("partial_rotary_factor", 1.0)
        if factor != 1.0:
            problems.append(f"{key} has partial_rotary_factor={factor!r}: ptdp rotates whole heads")
        if "rope_theta" in settings:
            thetas[f"{key}.rope_theta"] = settings["rope_theta"]
    if "rope_theta" in hf:
        thetas["rope_theta"] = hf["rope_theta"]
    for found, what in ((thetas, "rope_theta"), (factors, "rope_type/factor")):
        if len(set(found.values())) > 1:
            problems.append(f"{' and '.join(f'{k}={v!r}' for k, v in found.items())} disagree "
                            f"(transformers versions read different ones); make the {what} equal")
    values = set(thetas.values())
    theta = values.pop() if len(values) == 1 else 10000.0
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not theta > 0 \
            or not math.isfinite(theta):
        problems.append(f"rope_theta={theta!r} must be a positive number")
        theta = 10000.0
    kind, factor = next((f for f in factors.values() if f is not None and f[1] is not None),
                        (None, None))
    if kind == LLAMA3_ROPE_TYPE:
        return float(theta), {"use_rope_scaling": True, "rope_scaling_factor": factor}
    if kind == LINEAR_ROPE_TYPE:
        return float(theta), {"rotary_seq_len_interpolation_factor": factor}
    return float(theta), {}


def linear_factor(key: str, settings: dict[str, Any], problems: list[str]) -> float | None:
    """rope_type 'linear''s `factor` F (positions divided by F), a positive
    number, as --rotary-seq-len-interpolation-factor takes it."""
    factor = settings.get("factor")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) \
            or not math.isfinite(factor) or factor <= 0:
        problems.append(f"{key}.factor={factor!r} must be a positive number (rope_type 'linear' "
                        f"divides the positions by it)")
        return None
    return float(factor)


def _llama3_factor(key: str, settings: dict[str, Any], hf: dict[str, Any],
                   problems: list[str]) -> float | None:
    """Llama 3.1's `factor`, after checking the three parameters ptdp (as
    Megatron-LM) fixes at Meta's values."""
    factor = settings.get("factor")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) \
            or not math.isfinite(factor) or factor < 1:
        problems.append(f"{key}.factor={factor!r} must be a number of at least 1")
        factor = None
    for name, fixed in LLAMA3_FIXED.items():
        # transformers falls back to max_position_embeddings for the original context
        value = settings.get(name, hf.get("max_position_embeddings")
                             if name == "original_max_position_embeddings" else None)
        if value != fixed:
            problems.append(f"{key}.{name}={value!r} is not supported: ptdp computes Llama 3.1's "
                            f"rescaling with {name} {fixed:g} (Megatron-LM fixes it)")
    return None if factor is None else float(factor)


def positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


# ------------------------------------------------------------------ ModelConfig -> config.json

def rope_fields(config: ModelConfig) -> dict[str, Any]:
    """The rotary settings in both forms: transformers 5's `rope_parameters`
    and the older top-level `rope_theta` + `rope_scaling`, so either reads them."""
    scaling = None
    if config.use_rope_scaling:
        scaling = {"rope_type": LLAMA3_ROPE_TYPE, "factor": float(config.rope_scaling_factor),
                   **{name: value for name, value in LLAMA3_FIXED.items()}}
    elif config.rotary_seq_len_interpolation_factor is not None:
        scaling = linear_rope_scaling(config)
    parameters = dict(scaling or {"rope_type": "default"}, rope_theta=config.rotary_base)
    return {"rope_theta": config.rotary_base, "rope_scaling": scaling,
            "rope_parameters": parameters}


def linear_rope_scaling(config: ModelConfig) -> dict[str, Any]:
    """rope_type 'linear' for --rotary-seq-len-interpolation-factor."""
    return {"rope_type": LINEAR_ROPE_TYPE,
            "factor": float(config.rotary_seq_len_interpolation_factor)}


def common_hf_fields(config: ModelConfig, hf_class: str, model_type: str, *,
                     bos_token_id: int | None, eos_token_id: int | None) -> dict[str, Any]:
    """The config.json fields every Llama-like family shares. Hidden dropout
    has no field (it is a training setting and does not change the
    function the model computes), so it is left out."""
    for name, token in (("bos", bos_token_id), ("eos", eos_token_id)):
        if token is not None and not 0 <= token < config.vocab_size:
            raise ConversionError(f"{name} token {token} is outside the vocabulary "
                                  f"(0..{config.vocab_size - 1})")
    return {
        "architectures": [hf_class],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.query_groups,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_positions,
        "initializer_range": config.init_method_std,
        "rms_norm_eps": config.epsilon,
        "tie_word_embeddings": config.tied_output,
        "attention_dropout": config.attention_dropout,
        **rope_fields(config),
        "use_cache": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
    }


def _family_fields(config: ModelConfig, family: DenseFamily) -> dict[str, Any]:
    if family.biases == "llama":
        return {"attention_bias": config.bias, "mlp_bias": config.bias, "pretraining_tp": 1}
    windowed = config.windowed_layers
    width = config.window[0] + 1 if any(windowed) else None
    if family.window == "null":  # Mistral: every layer windowed (dense_family_obstacles)
        return {"sliding_window": width}
    window = {"use_sliding_window": width is not None, "sliding_window": width,
              "max_window_layers": next((i for i, w in enumerate(windowed) if w),
                                        config.num_layers)}
    if width is not None:  # which layers, whatever the pattern
        window["layer_types"] = ["sliding_attention" if w else "full_attention" for w in windowed]
    return {**({"attention_bias": False} if family.biases == "qwen3" else {}), **window}


def dense_hf_config(config: ModelConfig, family: DenseFamily, *, bos_token_id: int | None = None,
                    eos_token_id: int | None = None) -> dict[str, Any]:
    """`family`'s config.json for `config` (which must fit it)."""
    return {**common_hf_fields(config, family.hf_class, family.model_type,
                               bos_token_id=bos_token_id, eos_token_id=eos_token_id),
            **_family_fields(config, family)}
