"""Hugging Face GPT-2 checkpoints <-> ptdp logical weights.

ptdp's GPT is GPT-2's architecture (pre-LayerNorm, learned positions, the
tanh GeLU that Hugging Face calls `gelu_new`, tied output layer, 1/√d
attention scaling), so conversion is renaming plus transposing: Hugging Face
keeps GPT-2's `Conv1D` layers, whose weights are [in, out], where ours are
`nn.Linear`'s [out, in]. The fused q/k/v projection has the same layout in
both ([q of all heads; k; v], head-major inside each), so it transposes
as a whole.

A *logical state* is what ptdp's layout-independent checkpoints hold: the
one-process model's parameter names with unsharded, unpadded shapes (the word
embedding is [vocab_size, h]; ptdp pads it per layout when loading).

* `hf_config_from_model_config` / `model_config_from_hf_config`: the model
  settings as a `config.json` dict (GPT2Config's fields) and back; anything
  ptdp cannot represent is refused with a ConversionError, never adjusted.
* `to_hf_state` / `from_hf_state`: tensors under GPT2LMHeadModel's keys and
  back. `from_hf_state` accepts GPT2LMHeadModel's `transformer.`-prefixed
  keys and GPT2Model's bare keys (the original `gpt2` checkpoints).
* `save_hf_directory` / `load_hf_directory`: a directory that
  `GPT2LMHeadModel.from_pretrained` reads (config.json + model.safetensors),
  and reading one (also sharded safetensors). No pickle: a directory that
  holds only `pytorch_model.bin` is refused.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from ptdp.config import ModelConfig

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
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


class ConversionError(ValueError):
    """A model or checkpoint that cannot be converted; says why and what to do."""


def _name_map(config: ModelConfig) -> list[tuple[str, str, bool]]:
    """(ptdp name, bare Hugging Face name, transposed) for every tensor."""
    names = list(_GLOBAL_MAP)
    for i in range(config.num_layers):
        names += [(f"layers.{i}.{ours}", f"h.{i}.{theirs}", t) for ours, theirs, t in _LAYER_MAP]
    return names


def logical_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every logical tensor's name and shape for `config`."""
    h, ffn = config.hidden_size, config.ffn_size
    shapes: dict[str, tuple[int, ...]] = {
        "embedding.word_embeddings.weight": (config.vocab_size, h),
        "embedding.position_embeddings.weight": (config.max_positions, h),
        "final_layernorm.weight": (h,),
        "final_layernorm.bias": (h,),
    }
    per_layer = {
        "input_layernorm.weight": (h,), "input_layernorm.bias": (h,),
        "attention.query_key_value.weight": (3 * h, h), "attention.query_key_value.bias": (3 * h,),
        "attention.dense.weight": (h, h), "attention.dense.bias": (h,),
        "post_attention_layernorm.weight": (h,), "post_attention_layernorm.bias": (h,),
        "mlp.dense_h_to_4h.weight": (ffn, h), "mlp.dense_h_to_4h.bias": (ffn,),
        "mlp.dense_4h_to_h.weight": (h, ffn), "mlp.dense_4h_to_h.bias": (h,),
    }
    for i in range(config.num_layers):
        shapes.update({f"layers.{i}.{name}": shape for name, shape in per_layer.items()})
    return shapes


# ------------------------------------------------------------------ configs

def hf_config_from_model_config(config: ModelConfig, *, eod_token_id: int | None = None) -> dict:
    """GPT2Config's fields for `config` (what `config.json` holds).

    `eod_token_id` becomes bos/eos_token_id; by default GPT-2's 50256 when the
    vocabulary is GPT-2's (50257 tokens), else none.
    """
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
        "layer_norm_epsilon": config.layernorm_epsilon,
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
    _check(logical, logical_shapes(config), "ptdp logical state",
           padded_hint=config.vocab_size)
    state = {}
    for ours, theirs, transposed in _name_map(config):
        tensor = logical[ours].detach()
        state[f"transformer.{theirs}"] = (tensor.t() if transposed else tensor).contiguous().clone()
    state["lm_head.weight"] = state["transformer.wte.weight"].clone()
    return state


def from_hf_state(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The logical state of a GPT-2 state dict (GPT2LMHeadModel's
    `transformer.`-prefixed keys or GPT2Model's bare keys). The causal-mask
    buffers of older checkpoints are ignored; an `lm_head.weight` must equal
    the word embedding (ptdp ties them)."""
    bare: dict[str, torch.Tensor] = {}
    lm_head = None
    for key, tensor in state.items():
        if key == "lm_head.weight":
            lm_head = tensor
            continue
        name = key[len("transformer."):] if key.startswith("transformer.") else key
        if _IGNORED.match(name):
            continue
        if name in bare:
            raise ConversionError(f"{name!r} appears twice (with and without 'transformer.')")
        bare[name] = tensor
    shapes = logical_shapes(config)
    expected = {}
    for ours, theirs, transposed in _name_map(config):
        shape = shapes[ours]
        expected[theirs] = (shape[1], shape[0]) if transposed else shape
    _check(bare, expected, "GPT-2 state")
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
    return logical


def _check(state: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], what: str,
           padded_hint: int | None = None) -> None:
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = [f"{name}: {tuple(state[name].shape)}, expected {shape}"
             for name, shape in expected.items()
             if name in state and tuple(state[name].shape) != tuple(shape)]
    problems = []
    if missing:
        problems.append(f"missing: {', '.join(_abbreviate(missing))}")
    if unexpected:
        problems.append(f"unexpected: {', '.join(_abbreviate(unexpected))}")
    if wrong:
        problems.append("wrong shape: " + "; ".join(_abbreviate(wrong)))
    if problems:
        message = f"{what} does not match the model config:\n" + "\n".join(
            f"  - {p}" for p in problems)
        if padded_hint is not None and any(w.startswith("embedding.word_embeddings") for w in wrong):
            message += (f"\n  (the word embedding must be the logical, unpadded tensor with "
                        f"{padded_hint} rows)")
        raise ConversionError(message)


def _abbreviate(items: list[str], limit: int = 8) -> list[str]:
    return items if len(items) <= limit else items[:limit] + [f"... ({len(items) - limit} more)"]


# ------------------------------------------------------------------ directories

def save_hf_directory(directory: str | Path, logical: dict[str, torch.Tensor],
                      config: ModelConfig, *, eod_token_id: int | None = None) -> None:
    """Write `config.json` and `model.safetensors` that
    `GPT2LMHeadModel.from_pretrained(directory)` loads. The tied
    `lm_head.weight` is left out, as Hugging Face does. Written into a
    temporary sibling directory and renamed into place; refuses an existing
    non-empty directory."""
    from safetensors.torch import save_file

    directory = Path(directory)
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise ConversionError(f"{directory} exists and is not an empty directory: choose a new one")
    hf_config = hf_config_from_model_config(config, eod_token_id=eod_token_id)
    state = to_hf_state(logical, config)
    del state["lm_head.weight"]
    dtypes = {t.dtype for t in state.values()}
    if len(dtypes) == 1:
        hf_config["torch_dtype"] = str(dtypes.pop()).removeprefix("torch.")
    directory.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{directory.name}.partial-", dir=directory.parent))
    try:
        save_file({k: v.cpu() for k, v in state.items()}, str(partial / WEIGHTS_NAME),
                  metadata={"format": "pt"})
        with open(partial / CONFIG_NAME, "w") as f:
            json.dump(hf_config, f, indent=2, sort_keys=True)
            f.write("\n")
        if directory.exists():
            directory.rmdir()  # empty, checked above
        os.rename(partial, directory)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def load_hf_directory(directory: str | Path, **overrides: Any
                      ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(ModelConfig, logical state) of a Hugging Face GPT-2 directory:
    `config.json` plus `model.safetensors` or sharded safetensors with
    `model.safetensors.index.json`. `overrides` go to
    model_config_from_hf_config."""
    from safetensors.torch import load_file

    directory = Path(directory)
    if not directory.is_dir():
        raise ConversionError(f"{directory} is not a directory")
    config_path = directory / CONFIG_NAME
    if not config_path.is_file():
        raise ConversionError(f"{directory} has no {CONFIG_NAME}")
    try:
        hf_config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConversionError(f"{config_path} is not valid JSON: {e}") from None
    if not isinstance(hf_config, dict):
        raise ConversionError(f"{config_path} does not hold a JSON object")
    config = model_config_from_hf_config(hf_config, **overrides)

    files = _weight_files(directory)
    state: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            part = load_file(str(path))
        except Exception as e:  # safetensors raises its own error types
            raise ConversionError(f"cannot read {path}: {e}") from None
        for key in part.keys() & state.keys():
            raise ConversionError(f"{key!r} is in more than one weight file ({path.name})")
        state.update(part)
    try:
        return config, from_hf_state(state, config)
    except ConversionError as e:
        raise ConversionError(f"{directory}: {e}") from None


def _weight_files(directory: Path) -> list[Path]:
    single, index = directory / WEIGHTS_NAME, directory / WEIGHTS_INDEX_NAME
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ConversionError(f"{index} is not a valid safetensors index: {e!r}") from None
        paths = []
        for name in names:
            path = directory / name
            if Path(name).name != name or not name.endswith(".safetensors"):
                raise ConversionError(f"{index} names {name!r}, not a .safetensors file in "
                                      f"{directory}")
            if not path.is_file():
                raise ConversionError(f"{index} names {name}, which is missing from {directory}")
            paths.append(path)
        return paths
    pickled = [p.name for p in sorted(directory.glob("pytorch_model*.bin"))]
    if pickled:
        raise ConversionError(
            f"{directory} holds only {', '.join(pickled)} (pickle, which can run code when "
            f"loaded): ptdp reads safetensors only. Convert it where you trust the file, e.g. "
            f"GPT2LMHeadModel.from_pretrained(dir).save_pretrained(new_dir) "
            f"(safe_serialization is the default), then use new_dir")
    raise ConversionError(f"{directory} has neither {WEIGHTS_NAME} nor {WEIGHTS_INDEX_NAME}")
