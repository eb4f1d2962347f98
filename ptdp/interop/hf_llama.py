"""Hugging Face Llama checkpoints <-> ptdp logical weights.

ptdp's GPT with RMSNorm, SwiGLU and rotary embeddings (optionally grouped-query
attention, an untied output layer and no linear biases) is Llama's
architecture. Both sides use `nn.Linear`'s [out, in] weights and the same
rotary convention (rotate_half: dimensions i and i + d/2 of a head form a
pair), so conversion is renaming plus joining or splitting rows:

* Llama's q_proj, k_proj and v_proj are the row blocks of our fused
  `query_key_value` ([queries of all heads; keys of all groups; values of
  all groups], head-major in each block), with no permutation;
* gate_proj and up_proj are the two row blocks of our `dense_h_to_4h`;
* under --apply-layernorm-1p a norm's stored weight w is Llama's scale 1 + w.

* `llama_obstacles`: the settings of a ModelConfig that Llama cannot express.
* `hf_config_from_model_config` / `model_config_from_hf_config`: the model
  settings as a `config.json` dict (LlamaConfig's fields) and back; anything
  ptdp cannot represent is refused with a ConversionError naming the key,
  never adjusted.
* `to_hf_state` / `from_hf_state`: tensors under LlamaForCausalLM's keys and
  back (`from_hf_state` also takes LlamaModel's bare keys).
  `check_hf_tensors` checks such a state's names and shapes (or only the
  shapes a file's header gives) against the config, config.json's sizes
  first.
* `save_hf_directory` / `load_hf_directory`: a directory that
  `LlamaForCausalLM.from_pretrained` reads, and reading one (sharded too;
  hf_weights.py).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Mapping

import torch

from ptdp.config import ModelConfig
from ptdp.interop.hf_files import (
    ConversionError,
    carriers_matching,
    check_sizes,
    check_state,
    layer_disagreement,
    read_hf_config,
    shape_of,
    size_disagreement,
    split_state,
    write_hf_directory,
)
from ptdp.interop.hf_weights import HFWeights
from ptdp.interop.logical import logical_shapes, with_plain_norm_scales, with_stored_norm_scales

ARCHITECTURE = "LlamaForCausalLM"
MODEL_TYPE = "llama"
# Hugging Face's two names for x·sigmoid(x), the gate of SwiGLU.
SILU_NAMES = ("silu", "swish")
# Rotary settings ptdp computes: plain frequencies θ^(-2i/d), no rescaling.
PLAIN_ROPE_TYPES = (None, "default")
# Keys of neighbouring architectures that change what the model computes; a
# Llama config.json should not have them, and ptdp computes none of them.
_FOREIGN = (("sliding_window", None, "attention limited to a sliding window"),
            ("use_sliding_window", False, "attention limited to a sliding window"),
            ("partial_rotary_factor", 1.0, "rotary embeddings on part of each head"),
            ("attn_logit_softcapping", None, "capped attention scores"),
            ("final_logit_softcapping", None, "capped output logits"))
# Buffers some checkpoints carry; they are recomputed from the config.
_IGNORED = re.compile(r"^(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq$")


def _name_map(config: ModelConfig) -> list[tuple[str, tuple[tuple[str, int], ...]]]:
    """(ptdp name, ((bare Hugging Face name, rows), ...)) for every logical
    tensor: ours is the Hugging Face tensors' rows stacked in that order."""
    shapes = logical_shapes(config)
    d, f = config.head_dim, config.ffn_size
    q, kv = config.num_attention_heads * d, config.query_groups * d
    names: list[tuple[str, tuple[tuple[str, int], ...]]] = []

    def add(ours: str, *theirs: tuple[str, int | None]) -> None:
        if ours in shapes:  # biases only where the config has them
            names.append((ours, tuple((name, rows or shapes[ours][0]) for name, rows in theirs)))

    add("embedding.word_embeddings.weight", ("embed_tokens.weight", None))
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}.", f"layers.{i}."
        add(ours + "input_layernorm.weight", (theirs + "input_layernorm.weight", None))
        for kind in ("weight", "bias"):
            add(ours + f"attention.query_key_value.{kind}", (theirs + f"self_attn.q_proj.{kind}", q),
                (theirs + f"self_attn.k_proj.{kind}", kv), (theirs + f"self_attn.v_proj.{kind}", kv))
            add(ours + f"attention.dense.{kind}", (theirs + f"self_attn.o_proj.{kind}", None))
            add(ours + f"mlp.dense_h_to_4h.{kind}", (theirs + f"mlp.gate_proj.{kind}", f),
                (theirs + f"mlp.up_proj.{kind}", f))
            add(ours + f"mlp.dense_4h_to_h.{kind}", (theirs + f"mlp.down_proj.{kind}", None))
        add(ours + "post_attention_layernorm.weight",
            (theirs + "post_attention_layernorm.weight", None))
    add("final_layernorm.weight", ("norm.weight", None))
    return names


# ------------------------------------------------------------------ configs

def llama_obstacles(config: ModelConfig) -> list[str]:
    """The settings of `config` that keep it from being a Llama (empty: it is one).
    Grouped-query attention, tying and biases are Llama options; biases
    are all on or all off in ptdp, as attention_bias = mlp_bias in Llama."""
    obstacles = []
    if config.normalization != "RMSNorm":
        obstacles.append(f"--normalization {config.normalization} (Llama has RMSNorm)")
    if not config.swiglu:
        obstacles.append("no --swiglu (Llama's MLP is SwiGLU)")
    if not config.rope:
        obstacles.append(f"--position-embedding-type {config.position_embedding_type} (Llama "
                         f"has rotary embeddings)")
    return obstacles


def _require_llama(config: ModelConfig) -> None:
    obstacles = llama_obstacles(config)
    if obstacles:
        raise ConversionError("this model is not a Llama: " + "; ".join(obstacles))


def hf_config_from_model_config(config: ModelConfig, *, bos_token_id: int | None = None,
                                eos_token_id: int | None = None) -> dict[str, Any]:
    """LlamaConfig's fields for `config` (what `config.json` holds).

    The rotary base is written both as transformers 5's `rope_parameters`
    and as the older top-level `rope_theta`, so either version reads it.
    Hidden dropout has no LlamaConfig field (it is a training setting and
    does not change the function the model computes), so it is left out.
    """
    _require_llama(config)
    for name, token in (("bos", bos_token_id), ("eos", eos_token_id)):
        if token is not None and not 0 <= token < config.vocab_size:
            raise ConversionError(f"{name} token {token} is outside the vocabulary "
                                  f"(0..{config.vocab_size - 1})")
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
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
        "attention_bias": config.bias,
        "mlp_bias": config.bias,
        "attention_dropout": config.attention_dropout,
        "rope_theta": config.rotary_base,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rotary_base},
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
    }


def model_config_from_hf_config(hf: dict[str, Any], **overrides: Any) -> ModelConfig:
    """The ModelConfig of a Llama `config.json`; refuses what ptdp cannot compute.

    seq_length is max_position_embeddings; `overrides` sets other
    ModelConfig fields (seq_length, make_vocab_size_divisible_by, ...) on
    the result.
    """
    problems: list[str] = []
    model_type = hf.get("model_type", MODEL_TYPE)
    if model_type != MODEL_TYPE:
        problems.append(f"model_type {model_type!r} is not {MODEL_TYPE!r}")
    sizes = {}
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                "intermediate_size", "max_position_embeddings"):
        sizes[key] = hf.get(key)
        if not _positive_int(sizes[key]):
            problems.append(f"{key}={sizes[key]!r} must be a positive integer")
    h, heads = sizes["hidden_size"], sizes["num_attention_heads"]
    shapes_known = _positive_int(h) and _positive_int(heads)
    if shapes_known and h % heads:
        problems.append(f"hidden_size {h} is not divisible by num_attention_heads {heads}")
    groups = hf.get("num_key_value_heads")
    groups = heads if groups is None else groups
    if not _positive_int(groups):
        problems.append(f"num_key_value_heads={groups!r} must be a positive integer")
    elif shapes_known and heads % groups:
        problems.append(f"num_key_value_heads {groups} does not divide num_attention_heads "
                        f"{heads}: each key/value head serves a whole number of query heads")
    head_dim = hf.get("head_dim")
    if shapes_known and head_dim is not None and head_dim != h // heads:
        problems.append(f"head_dim={head_dim!r} is not hidden_size/num_attention_heads = "
                        f"{h // heads}: ptdp's heads are hidden_size/num_attention_heads wide")
    activation = hf.get("hidden_act", "silu")
    if activation not in SILU_NAMES:
        problems.append(f"hidden_act={activation!r} is not supported: ptdp's SwiGLU gate is silu")
    attention_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    if attention_bias != mlp_bias:
        problems.append(f"attention_bias={attention_bias} differs from mlp_bias={mlp_bias}: ptdp "
                        f"has one switch for the biases of all linear layers "
                        f"(--disable-bias-linear); convert a model with both or neither")
    for key, plain, what in _FOREIGN:
        if hf.get(key, plain) not in (plain, None):
            problems.append(f"{key}={hf[key]!r} is not supported: ptdp computes no {what}")
    theta = _rotary_base(hf, problems)
    epsilon = hf.get("rms_norm_eps", 1e-6)
    if not isinstance(epsilon, (int, float)) or isinstance(epsilon, bool) or epsilon < 0:
        problems.append(f"rms_norm_eps={epsilon!r} must be a non-negative number")
    if problems:
        raise ConversionError("cannot convert this Llama config:\n"
                              + "\n".join(f"  - {p}" for p in problems))
    gqa = groups != heads
    positions = sizes["max_position_embeddings"]
    config = ModelConfig(
        num_layers=sizes["num_hidden_layers"], hidden_size=h, num_attention_heads=heads,
        ffn_hidden_size=sizes["intermediate_size"], seq_length=positions,
        max_position_embeddings=positions, vocab_size=sizes["vocab_size"],
        hidden_dropout=0.0,  # Llama has no dropout outside attention
        attention_dropout=float(hf.get("attention_dropout") or 0.0),
        init_method_std=float(hf.get("initializer_range", 0.02)),
        normalization="RMSNorm", norm_epsilon=float(epsilon), swiglu=True,
        position_embedding_type="rope", rotary_base=theta,
        group_query_attention=gqa, num_query_groups=groups if gqa else None,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        disable_bias_linear=not attention_bias)
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise ConversionError(f"unknown ModelConfig field {key!r}")
        setattr(config, key, value)
    return config


def _rotary_base(hf: dict[str, Any], problems: list[str]) -> float:
    """θ from `rope_parameters` (transformers 5) or the older top-level
    `rope_theta` + `rope_scaling`, whichever the file has. Any rescaling of
    the frequencies is refused."""
    found: dict[str, float] = {}
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
        if kind not in PLAIN_ROPE_TYPES:
            problems.append(f"{key} has rope_type {kind!r} ({settings}): ptdp computes plain "
                            f"rotary embeddings (rope_type 'default'), without rescaled "
                            f"frequencies")
        factor = settings.get("partial_rotary_factor", 1.0)
        if factor != 1.0:
            problems.append(f"{key} has partial_rotary_factor={factor!r}: ptdp rotates whole heads")
        if "rope_theta" in settings:
            found[f"{key}.rope_theta"] = settings["rope_theta"]
    if "rope_theta" in hf:
        found["rope_theta"] = hf["rope_theta"]
    values = set(found.values())
    if len(values) > 1:
        problems.append(f"{' and '.join(f'{k}={v!r}' for k, v in found.items())} disagree "
                        f"(transformers versions read different ones); make them equal")
    theta = values.pop() if len(values) == 1 else 10000.0
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not theta > 0 \
            or not math.isfinite(theta):
        problems.append(f"rope_theta={theta!r} must be a positive number")
        return 10000.0
    return float(theta)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


# ------------------------------------------------------------------ tensors

def to_hf_state(logical: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM's state dict for a logical state. Every tensor is a
    new contiguous tensor; with a tied output layer `lm_head.weight` is a
    copy of the word embedding, so the result can go to `load_state_dict`
    or to safetensors as it is."""
    _require_llama(config)
    check_state(logical, logical_shapes(config), "ptdp logical state",
                padded_hint=config.vocab_size)
    logical = with_plain_norm_scales(logical, config)
    state = {}
    for ours, theirs in _name_map(config):
        pieces = logical[ours].detach().split([rows for _, rows in theirs])
        for (name, _), piece in zip(theirs, pieces):
            state[f"model.{name}"] = piece.contiguous().clone()
    output = logical["embedding.word_embeddings.weight" if config.tied_output
                     else "output_layer.weight"]
    state["lm_head.weight"] = output.detach().contiguous().clone()
    return state


def check_hf_tensors(state: Mapping[str, Any], config: ModelConfig) -> None:
    """Refuse a Llama state (tensors, or the shapes the files' headers give)
    that does not fit `config`: first config.json's sizes against the
    tensors' (before the name table, which has an entry per layer of the
    config), then every name and shape."""
    _require_llama(config)
    bare, lm_head = split_state(state, "model.", _IGNORED)
    h, d = config.hidden_size, config.head_dim
    heads, groups = config.num_attention_heads, config.query_groups

    check_sizes([
        layer_disagreement(bare, "layers.", "num_hidden_layers", config.num_layers),
        size_disagreement(f"vocab_size={config.vocab_size}", config.vocab_size, "vocabulary",
                          [("embed_tokens.weight", bare, 0)]),
        size_disagreement(f"hidden_size={h}", h, "hidden size",
                          [("embed_tokens.weight", bare, 1), ("norm.weight", bare, 0),
                           *carriers_matching(bare, r"layers\.\d+\.input_layernorm\.weight", 0)]),
        size_disagreement(f"intermediate_size={config.ffn_size}", config.ffn_size, "MLP width",
                          carriers_matching(bare, r"layers\.\d+\.mlp\.gate_proj\.weight", 0)),
        size_disagreement(f"num_key_value_heads={groups} with num_attention_heads={heads} "
                          f"(head_dim {d}, so {groups}·{d} key/value rows)",
                          groups * d, "key/value width",
                          carriers_matching(bare, r"layers\.\d+\.self_attn\.k_proj\.weight", 0)),
    ])
    shapes = logical_shapes(config)
    expected = {name: (rows, *shapes[ours][1:])
                for ours, theirs in _name_map(config) for name, rows in theirs}
    check_state(bare, expected, "Llama state")
    if not config.tied_output:
        if lm_head is None:
            raise ConversionError("lm_head.weight is missing and tie_word_embeddings is false: "
                                  "the output layer's weights are not in this checkpoint")
        if shape_of(lm_head) != shapes["output_layer.weight"]:
            raise ConversionError(f"lm_head.weight: {shape_of(lm_head)}, expected "
                                  f"{shapes['output_layer.weight']}")


def from_hf_state(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The logical state of a Llama state dict (LlamaForCausalLM's
    `model.`-prefixed keys, or LlamaModel's bare keys with an untied
    `lm_head.weight` beside them). Rotary `inv_freq` buffers of older
    checkpoints are ignored; with tied embeddings an `lm_head.weight` must
    equal the word embedding."""
    check_hf_tensors(state, config)
    bare, lm_head = split_state(state, "model.", _IGNORED)
    embedding = bare["embed_tokens.weight"]
    if config.tied_output and lm_head is not None and (
            lm_head.shape != embedding.shape or not torch.equal(lm_head, embedding)):
        raise ConversionError("lm_head.weight differs from the word embedding "
                              "(embed_tokens.weight) although tie_word_embeddings is true; set "
                              "tie_word_embeddings to false in config.json to keep both")
    logical = {ours: torch.cat([bare[name].detach() for name, _ in theirs]).contiguous()
               for ours, theirs in _name_map(config)}
    if not config.tied_output:
        logical["output_layer.weight"] = lm_head.detach().contiguous()
    return with_stored_norm_scales(logical, config)


# ------------------------------------------------------------------ directories

def save_hf_directory(directory: str | Path, logical: dict[str, torch.Tensor],
                      config: ModelConfig, *, bos_token_id: int | None = None,
                      eos_token_id: int | None = None,
                      tokenizer_files: Mapping[str, bytes] | None = None) -> None:
    """Write `config.json` and `model.safetensors` (and the tokenizer files
    when given) that `LlamaForCausalLM.from_pretrained(directory)` loads. A
    tied `lm_head.weight` is left out, as Hugging Face does. Refuses an
    existing non-empty directory."""
    hf_config = hf_config_from_model_config(config, bos_token_id=bos_token_id,
                                            eos_token_id=eos_token_id)
    state = to_hf_state(logical, config)
    if config.tied_output:
        del state["lm_head.weight"]
    write_hf_directory(directory, hf_config, state, tokenizer_files=tokenizer_files)


def load_hf_directory(directory: str | Path, **overrides: Any
                      ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(ModelConfig, logical state) of a Hugging Face Llama directory:
    `config.json` plus `model.safetensors` or sharded safetensors with
    `model.safetensors.index.json`. config.json is checked against the
    tensors' names and shapes before any data is read; the tensors the
    model uses must be floating point and finite. `overrides` go to
    model_config_from_hf_config."""
    config = model_config_from_hf_config(read_hf_config(directory), **overrides)
    weights = HFWeights(directory, ARCHITECTURE)
    try:
        check_hf_tensors(weights.shapes, config)
        state = weights.load(key for key in weights.tensors
                             if not _IGNORED.match(key.removeprefix("model.")))
        return config, from_hf_state(state, config)
    except ConversionError as e:
        raise ConversionError(f"{directory}: {e}") from None
