"""Hugging Face GPT-2 checkpoints <-> ptdp logical weights.

ptdp's GPT with its default settings is GPT-2's architecture (pre-LayerNorm, learned positions, the
tanh GeLU that Hugging Face calls `gelu_new`, tied output layer, 1/√d
attention scaling), so conversion is renaming plus transposing: Hugging Face
keeps GPT-2's `Conv1D` layers, whose weights are [in, out], where ours are
`nn.Linear`'s [out, in]. The fused q/k/v projection has the same layout in
both ([q of all heads; k; v], head-major inside each), so it transposes
as a whole. Under --apply-layernorm-1p the norms' stored weights w are
written as the scale 1 + w, which Hugging Face holds, and read back as scale - 1.

The logical state (ptdp.interop.logical) is the one-process model's
unsharded, unpadded tensors, as checkpoints hold them.

* `gpt2_obstacles`: the settings of a ModelConfig that GPT-2 cannot express
  (the Llama family's options); export refuses them.
* `hf_config_from_model_config` / `model_config_from_hf_config`: the model
  settings as a `config.json` dict (GPT2Config's fields) and back; anything
  ptdp cannot represent is refused with a ConversionError, never adjusted.
* `to_hf_state` / `from_hf_state`: tensors under GPT2LMHeadModel's keys and
  back. `from_hf_state` accepts GPT2LMHeadModel's `transformer.`-prefixed
  keys and GPT2Model's bare keys (the original `gpt2` checkpoints).
  `check_hf_tensors` checks such a state's names and shapes (or only the
  shapes a file's header gives) against the config, config.json's sizes
  first.
* `GPT2`: the family for the generic directory reader and writer
  (hf_directory.py: a directory that `GPT2LMHeadModel.from_pretrained`
  reads, and reading one, sharded too; no pickle).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from ptdp.config import ModelConfig
from ptdp.interop.family import unwritten_settings
from ptdp.interop.hf_files import (
    ConversionError,
    carriers_matching,
    check_sizes,
    check_state,
    layer_disagreement,
    size_disagreement,
    split_state,
)
from ptdp.interop.logical import logical_shapes, with_plain_norm_scales, with_stored_norm_scales

__all__ = ["GPT2", "ConversionError", "check_hf_tensors", "from_hf_state", "gpt2_obstacles",
           "hf_config_from_model_config", "logical_shapes", "model_config_from_hf_config",
           "to_hf_state"]

# Hugging Face's names for the tanh approximation of GeLU that ptdp computes.
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")
# GPT-2's <|endoftext|>, the bos/eos token of a model with GPT-2's vocabulary.
GPT2_EOD = 50256
GPT2_VOCAB = 50257

# Per transformer layer: (ptdp suffix, Hugging Face suffix, transposed).
_LAYER_MAP = (
    ("input_layernorm.weight", "ln_1.weight", False),
    ("input_layernorm.bias", "ln_1.bias", False),
    ("attention.query_key_value.weight", "attn.c_attn.weight", True),
    ("attention.query_key_value.bias", "attn.c_attn.bias", False),
    ("attention.dense.weight", "attn.c_proj.weight", True),
    ("attention.dense.bias", "attn.c_proj.bias", False),
    ("post_attention_layernorm.weight", "ln_2.weight", False),
    ("post_attention_layernorm.bias", "ln_2.bias", False),
    ("mlp.dense_h_to_4h.weight", "mlp.c_fc.weight", True),
    ("mlp.dense_h_to_4h.bias", "mlp.c_fc.bias", False),
    ("mlp.dense_4h_to_h.weight", "mlp.c_proj.weight", True),
    ("mlp.dense_4h_to_h.bias", "mlp.c_proj.bias", False),
)
_GLOBAL_MAP = (
    ("embedding.word_embeddings.weight", "wte.weight", False),
    ("embedding.position_embeddings.weight", "wpe.weight", False),
    ("final_layernorm.weight", "ln_f.weight", False),
    ("final_layernorm.bias", "ln_f.bias", False),
)
# Non-parameter buffers that older GPT-2 checkpoints carry (the causal mask).
_IGNORED = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")


def _name_map(config: ModelConfig) -> list[tuple[str, str, bool]]:
    """(ptdp name, bare Hugging Face name, transposed) for every tensor."""
    names = list(_GLOBAL_MAP)
    for i in range(config.num_layers):
        names += [(f"layers.{i}.{ours}", f"h.{i}.{theirs}", t) for ours, theirs, t in _LAYER_MAP]
    return names


# ------------------------------------------------------------------ configs

def gpt2_obstacles(config: ModelConfig) -> list[str]:
    """The settings of `config` that keep it from being a GPT-2 (empty: it is one)."""
    obstacles = []
    if config.normalization != "LayerNorm":
        obstacles.append(f"--normalization {config.normalization} (GPT-2 has LayerNorm)")
    if config.swiglu:
        obstacles.append("--swiglu (GPT-2's MLP is GeLU)")
    if config.rope:
        obstacles.append("--position-embedding-type rope (GPT-2 learns absolute positions)")
    if config.query_groups != config.num_attention_heads:
        obstacles.append(f"--num-query-groups {config.query_groups} (GPT-2 has a key/value head "
                         f"per attention head)")
    if not config.tied_output:
        obstacles.append("--untie-embeddings-and-output-weights (GPT-2 ties them)")
    if not config.bias:
        obstacles.append("--disable-bias-linear (GPT-2's linear layers have biases)")
    if config.qk_layernorm:
        obstacles.append("--qk-layernorm (GPT-2 has no query/key norms)")
    if config.is_moe:
        obstacles.append(f"--num-experts {config.num_experts} (GPT-2's layers have one MLP each)")
    if config.head_dim * config.num_attention_heads != config.hidden_size:
        obstacles.append(f"--kv-channels {config.kv_channels} (GPT-2's heads are hidden/heads = "
                         f"{config.hidden_size // config.num_attention_heads} wide)")
    if any(config.windowed_layers):
        obstacles.append("--window-size (GPT-2 attends to the whole sequence)")
    return obstacles + unwritten_settings(config, "GPT-2")


def _require_gpt2(config: ModelConfig) -> None:
    obstacles = gpt2_obstacles(config)
    if obstacles:
        raise ConversionError("this model is not a GPT-2: " + "; ".join(obstacles))


def hf_config_from_model_config(config: ModelConfig, *, eod_token_id: int | None = None) -> dict:
    """GPT2Config's fields for `config` (what `config.json` holds).

    `eod_token_id` becomes bos/eos_token_id; by default GPT-2's 50256 when the
    vocabulary is GPT-2's (50257 tokens), else none.
    """
    _require_gpt2(config)
    if eod_token_id is None and config.vocab_size == GPT2_VOCAB:
        eod_token_id = GPT2_EOD
    if eod_token_id is not None and not 0 <= eod_token_id < config.vocab_size:
        raise ConversionError(f"eod token {eod_token_id} is outside the vocabulary "
                              f"(0..{config.vocab_size - 1})")
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.max_positions,
        "n_ctx": config.max_positions,
        "n_embd": config.hidden_size,
        "n_layer": config.num_layers,
        "n_head": config.num_attention_heads,
        "n_inner": config.ffn_hidden_size,
        "activation_function": "gelu_new",
        "resid_pdrop": config.hidden_dropout,
        "embd_pdrop": config.hidden_dropout,
        "attn_pdrop": config.attention_dropout,
        "layer_norm_epsilon": config.epsilon,
        "initializer_range": config.init_method_std,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "add_cross_attention": False,
        "tie_word_embeddings": True,
        "bos_token_id": eod_token_id,
        "eos_token_id": eod_token_id,
    }


def model_config_from_hf_config(hf: dict[str, Any], **overrides: Any) -> ModelConfig:
    """The ModelConfig of a GPT-2 `config.json`; refuses what ptdp cannot compute.

    seq_length is n_positions; `overrides` sets other ModelConfig fields
    (seq_length, make_vocab_size_divisible_by, ...) on the result.
    """
    problems: list[str] = []

    def get(key: str, default: Any = None) -> Any:
        return hf.get(key, default)

    model_type = get("model_type", "gpt2")
    if model_type != "gpt2":
        problems.append(f"model_type {model_type!r} is not 'gpt2'")
    activation = get("activation_function", "gelu_new")
    if activation not in TANH_GELUS:
        problems.append(f"activation_function {activation!r} is not supported: ptdp computes the "
                        f"tanh GeLU ({' or '.join(TANH_GELUS)})")
    for key, supported in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                           ("reorder_and_upcast_attn", False), ("add_cross_attention", False),
                           ("tie_word_embeddings", True)):
        if bool(get(key, supported)) != supported:
            what = "untied input and output embeddings" if key == "tie_word_embeddings" else \
                f"{key}={get(key)!r}"
            problems.append(f"{what} is not supported (ptdp needs {key}={supported})")
    required = {"n_embd": None, "n_layer": None, "n_head": None, "vocab_size": None}
    for key in required:
        value = get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.append(f"{key}={value!r} must be a positive integer")
        required[key] = value
    positions = get("n_positions", get("n_ctx"))
    if not isinstance(positions, int) or positions < 1:
        problems.append(f"n_positions={positions!r} must be a positive integer")
    n_inner = get("n_inner")
    if n_inner is not None and (not isinstance(n_inner, int) or n_inner < 1):
        problems.append(f"n_inner={n_inner!r} must be a positive integer or null (4·n_embd)")
    resid, embd = get("resid_pdrop", 0.1), get("embd_pdrop", 0.1)
    if resid != embd:
        problems.append(f"resid_pdrop {resid} differs from embd_pdrop {embd}: ptdp applies one "
                        f"dropout (--hidden-dropout) to both; make them equal in config.json")
    h, heads = required["n_embd"], required["n_head"]
    if isinstance(h, int) and isinstance(heads, int) and heads > 0 and h % heads:
        problems.append(f"n_embd {h} is not divisible by n_head {heads}")
    if problems:
        raise ConversionError("cannot convert this GPT-2 config:\n"
                              + "\n".join(f"  - {p}" for p in problems))
    config = ModelConfig(
        num_layers=required["n_layer"], hidden_size=h, num_attention_heads=heads,
        ffn_hidden_size=n_inner, seq_length=positions, max_position_embeddings=positions,
        vocab_size=required["vocab_size"], hidden_dropout=float(resid),
        attention_dropout=float(get("attn_pdrop", 0.1)),
        init_method_std=float(get("initializer_range", 0.02)),
        layernorm_epsilon=float(get("layer_norm_epsilon", 1e-5)))
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise ConversionError(f"unknown ModelConfig field {key!r}")
        setattr(config, key, value)
    return config


# ------------------------------------------------------------------ tensors

def to_hf_state(logical: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel's state dict for a logical state. Every tensor is a new
    contiguous tensor; `lm_head.weight` is a copy of the word embedding (tied),
    so the result can go to `load_state_dict` or to safetensors as it is."""
    _require_gpt2(config)
    check_state(logical, logical_shapes(config), "ptdp logical state",
                padded_hint=config.vocab_size)
    logical = with_plain_norm_scales(logical, config)
    state = {}
    for ours, theirs, transposed in _name_map(config):
        tensor = logical[ours].detach()
        state[f"transformer.{theirs}"] = (tensor.t() if transposed else tensor).contiguous().clone()
    state["lm_head.weight"] = state["transformer.wte.weight"].clone()
    return state


def check_hf_tensors(state: Mapping[str, Any], config: ModelConfig) -> None:
    """Refuse a GPT-2 state (tensors, or the shapes the files' headers give)
    that does not fit `config`: first config.json's sizes against the
    tensors' (before the name table, which has an entry per layer of the
    config), then every name and shape."""
    _require_gpt2(config)
    bare, _ = split_state(state, "transformer.", _IGNORED)
    h, ffn = config.hidden_size, config.ffn_size
    n_inner = f"n_inner={config.ffn_hidden_size}" if config.ffn_hidden_size is not None else \
        f"n_inner=None (4·n_embd = {ffn})"

    check_sizes([
        layer_disagreement(bare, "h.", "n_layer", config.num_layers),
        size_disagreement(f"vocab_size={config.vocab_size}", config.vocab_size, "vocabulary",
                          [("wte.weight", bare, 0)]),
        size_disagreement(f"n_embd={h}", h, "hidden size",
                          [("wte.weight", bare, 1), ("ln_f.weight", bare, 0),
                           *carriers_matching(bare, r"h\.\d+\.ln_1\.weight", 0)]),
        size_disagreement(f"n_positions={config.max_positions}", config.max_positions,
                          "number of positions", [("wpe.weight", bare, 0)]),
        size_disagreement(n_inner, ffn, "MLP width",
                          carriers_matching(bare, r"h\.\d+\.mlp\.c_fc\.weight", 1)),
    ])
    shapes = logical_shapes(config)
    expected = {}
    for ours, theirs, transposed in _name_map(config):
        shape = shapes[ours]
        expected[theirs] = (shape[1], shape[0]) if transposed else shape
    check_state(bare, expected, "GPT-2 state")


def from_hf_state(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The logical state of a GPT-2 state dict (GPT2LMHeadModel's
    `transformer.`-prefixed keys or GPT2Model's bare keys). The causal-mask
    buffers of older checkpoints are ignored; an `lm_head.weight` must equal
    the word embedding (ptdp ties them)."""
    check_hf_tensors(state, config)
    bare, lm_head = split_state(state, "transformer.", _IGNORED)
    if lm_head is not None:
        wte = bare["wte.weight"]
        if lm_head.shape != wte.shape or not torch.equal(lm_head, wte):
            raise ConversionError("lm_head.weight differs from the word embedding (wte.weight): "
                                  "ptdp ties the output layer to the word embedding and cannot "
                                  "represent an untied GPT-2")
    logical = {}
    for ours, theirs, transposed in _name_map(config):
        tensor = bare[theirs].detach()
        logical[ours] = (tensor.t() if transposed else tensor).contiguous()
    return with_stored_norm_scales(logical, config)


# ------------------------------------------------------------------ the family

class GPT2HFFamily:
    """GPT-2 as ptdp.interop.family.HFFamily: the functions above, for the
    generic directory reader and writer (hf_directory.py)."""
    name = "GPT-2"
    classes = ("GPT2LMHeadModel", "GPT2Model")
    model_type = "gpt2"
    exported = True
    prefix = "transformer."
    ignored = _IGNORED

    def obstacles(self, config: ModelConfig) -> list[str]:
        return gpt2_obstacles(config)

    def hf_config(self, config: ModelConfig, *, bos_token_id: int | None = None,
                  eos_token_id: int | None = None) -> dict[str, Any]:
        """GPT-2 has one token that begins and ends a text: the eos id is both."""
        return hf_config_from_model_config(config, eod_token_id=eos_token_id)

    def model_config(self, hf_config: dict[str, Any], **overrides: Any) -> ModelConfig:
        return model_config_from_hf_config(hf_config, **overrides)

    def to_hf_state(self, logical: dict[str, torch.Tensor],
                    config: ModelConfig) -> dict[str, torch.Tensor]:
        return to_hf_state(logical, config)

    def check_hf_tensors(self, state: Mapping[str, Any], config: ModelConfig) -> None:
        check_hf_tensors(state, config)

    def from_hf_state(self, state: dict[str, torch.Tensor],
                      config: ModelConfig) -> dict[str, torch.Tensor]:
        return from_hf_state(state, config)


GPT2 = GPT2HFFamily()
