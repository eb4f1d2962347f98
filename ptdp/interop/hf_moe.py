"""Hugging Face Mixtral, Qwen3-MoE and Qwen2-MoE checkpoints <-> ptdp logical weights.

The attention, norms, embeddings and the dense layers' MLPs are Llama's
(hf_llama's name table, plus Qwen3's q_norm / k_norm); the configs are
hf_moe_config.py's. An MoE layer's tensors:

    ptdp (logical)                         Hugging Face (published checkpoints, per expert)
    layers.i.mlp.router.weight [E, h]      mlp.gate.weight
    ...experts.e.dense_h_to_4h [2f, h]     mlp.experts.e.gate_proj rows, then up_proj rows
    ...experts.e.dense_4h_to_h [h, f]      mlp.experts.e.down_proj
    ...shared_expert.* (Qwen2-MoE)         mlp.shared_expert.gate_proj/up_proj/down_proj
    ...shared_expert_gate [1, h]           mlp.shared_expert_gate.weight

(Mixtral: block_sparse_moe.gate.weight and block_sparse_moe.experts.e.w1
(gate), w3 (up), w2 (down).)

Import also reads the fused layout transformers 5 keeps in memory (what a
state_dict() of its models gives, and what some tools save): under
`mlp.` for all three families, `experts.gate_up_proj` [E, 2f, h] (each
expert's gate rows, then its up rows, [out, in] like nn.Linear) and
`experts.down_proj` [E, h, f]. Export writes the per-expert layout, which
is what transformers' own save_pretrained writes and every version loads.

* `name_pairs`: hf_llama's name table with the MoE layers' pairs added.
* `to_hf_state` / `from_hf_state`, `check_hf_tensors`: as hf_llama's.
* `MOE_HF_FAMILIES`: the three families for the generic directory reader
  and writer (hf_directory.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from ptdp.config import ModelConfig
from ptdp.interop import hf_llama
from ptdp.interop.hf_files import (
    ConversionError,
    carriers_matching,
    check_sizes,
    shape_of,
    size_disagreement,
)
from ptdp.interop.hf_llama import NamePair, attention_name_pairs, mlp_name_pairs
from ptdp.interop.hf_moe_config import (
    FAMILIES,
    MIXTRAL,
    family_obstacles,
    family_of_model,
    hf_config_from_model_config,
    model_config_from_hf_config,
)

# Buffers some checkpoints carry; they are recomputed from the config.
_IGNORED = re.compile(r"^(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq$")
# The fused experts of transformers 5 (under mlp. in all three families).
_FUSED = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def _block(family: str, layer: int) -> str:
    """The full prefix of an MoE layer's tensors in the published layout."""
    return f"model.layers.{layer}.{'block_sparse_moe' if family == MIXTRAL else 'mlp'}."


def _expert_names(family: str) -> tuple[str, str, str]:
    """The gate, up and down projections' names of one expert."""
    return ("w1", "w3", "w2") if family == MIXTRAL else ("gate_proj", "up_proj", "down_proj")


def name_pairs(config: ModelConfig, family: str) -> list[NamePair]:
    """hf_llama's name table of the attention, norms, embeddings and dense
    MLPs, plus the MoE layers' in the published per-expert layout."""
    pairs = attention_name_pairs(config) + mlp_name_pairs(config)
    gate, up, down = _expert_names(family)
    h = config.hidden_size

    def mlp(ours: str, theirs: str, width: int, g: str, u: str, d: str) -> None:
        pairs.append((f"{ours}.dense_h_to_4h.weight",
                      ((f"{theirs}.{g}.weight", width), (f"{theirs}.{u}.weight", width))))
        pairs.append((f"{ours}.dense_4h_to_h.weight", ((f"{theirs}.{d}.weight", h),)))

    for i, is_moe in enumerate(config.moe_layer_pattern if config.is_moe else []):
        if not is_moe:
            continue
        ours, theirs = f"layers.{i}.mlp.", _block(family, i)
        pairs.append((ours + "router.weight", ((theirs + "gate.weight", config.num_experts),)))
        for e in range(config.num_experts):
            mlp(f"{ours}experts.{e}", f"{theirs}experts.{e}", config.moe_ffn_size, gate, up, down)
        if config.moe_shared_expert_intermediate_size:
            mlp(ours + "shared_expert", theirs + "shared_expert",
                config.moe_shared_expert_intermediate_size, "gate_proj", "up_proj", "down_proj")
            pairs.append((ours + "shared_expert_gate",
                          ((theirs + "shared_expert_gate.weight", 1),)))
    return pairs


# ------------------------------------------------------------------ the layouts on import

def _published_layout(state: Mapping[str, Any], config: ModelConfig, family: str) -> dict[str, Any]:
    """`state` (tensors, or shapes from the files' headers; keys with or
    without "model.") in the published per-expert layout, under full
    names: transformers 5's fused experts split per expert, and Mixtral's
    in-memory `mlp.` names back under `block_sparse_moe.`."""
    E, f, h = config.num_experts, config.moe_ffn_size, config.hidden_size
    gate, up, down = _expert_names(family)
    out: dict[str, Any] = {}
    for key, value in state.items():
        name = key.removeprefix("model.")
        if key == "lm_head.weight" or _IGNORED.match(name):
            _put(out, key, value)
            continue
        fused = _FUSED.match(name)
        if fused is None:
            if family == MIXTRAL:
                name = re.sub(r"^(layers\.\d+\.)mlp\.", r"\1block_sparse_moe.", name)
            _put(out, "model." + name, value)
            continue
        layer, kind = int(fused.group(1)), fused.group(2)
        block = _block(family, layer)
        expected = (E, 2 * f, h) if kind == "gate_up_proj" else (E, h, f)
        if shape_of(value) != expected:
            what = "2·expert width, hidden" if kind == "gate_up_proj" else "hidden, expert width"
            raise ConversionError(f"{key}: {shape_of(value)}, expected {expected} ([experts, "
                                  f"{what}])")
        for e in range(E):
            if kind == "down_proj":
                _put(out, f"{block}experts.{e}.{down}.weight", _rows(value, e, 0, h))
            else:
                _put(out, f"{block}experts.{e}.{gate}.weight", _rows(value, e, 0, f))
                _put(out, f"{block}experts.{e}.{up}.weight", _rows(value, e, f, 2 * f))
    return out


def _put(state: dict[str, Any], name: str, value: Any) -> None:
    if name in state:
        raise ConversionError(f"{name!r} appears twice (with and without 'model.', in the "
                              f"per-expert and the fused layout, or under mlp. and "
                              f"block_sparse_moe.)")
    state[name] = value


def _rows(value: Any, expert: int, start: int, stop: int) -> Any:
    """Expert `expert`'s rows start:stop of a fused [E, rows, columns] tensor (or its shape)."""
    if isinstance(value, torch.Tensor):
        return value[expert, start:stop]
    return (stop - start, shape_of(value)[2])


def _expert_disagreements(state: Mapping[str, Any], config: ModelConfig, family: str) -> None:
    """config.json's expert count and width against the tensors', before
    the name table (which has an entry per expert) is built."""
    bare = {key.removeprefix("model."): value for key, value in state.items()}
    block = r"layers\.\d+\.(?:mlp|block_sparse_moe)\."
    gate = _expert_names(family)[0]
    experts_key = "num_local_experts" if family == MIXTRAL else "num_experts"
    width_key = "intermediate_size" if family == MIXTRAL else "moe_intermediate_size"
    check_sizes([
        size_disagreement(f"{experts_key}={config.num_experts}", config.num_experts,
                          "number of experts",
                          [*carriers_matching(bare, block + r"gate\.weight", 0),
                           *carriers_matching(bare, block + r"experts\.gate_up_proj", 0)]),
        size_disagreement(f"{width_key}={config.moe_ffn_size}", config.moe_ffn_size,
                          "expert width",
                          [*carriers_matching(bare, block + rf"experts\.\d+\.{gate}\.weight", 0),
                           *carriers_matching(bare, block + r"experts\.down_proj", 2)]),
    ])


# ------------------------------------------------------------------ tensors

def to_hf_state(logical: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The family's ForCausalLM state dict (per-expert layout) for a
    logical state, as hf_llama.to_hf_state."""
    return hf_llama.to_hf_state(logical, config, name_pairs(config, family_of_model(config)))


def check_hf_tensors(state: Mapping[str, Any], config: ModelConfig,
                     family: str | None = None) -> dict[str, Any]:
    """Refuse a state (tensors, or the shapes the headers give) that does
    not fit `config`, config.json's sizes first; returns it in the
    published layout. `family`: config.json's (default: the one `config`
    exports as)."""
    family = family or family_of_model(config)
    _expert_disagreements(state, config, family)
    published = _published_layout(state, config, family)
    hf_llama.check_hf_tensors(published, config, name_pairs(config, family))
    return published


def from_hf_state(state: Mapping[str, torch.Tensor], config: ModelConfig,
                  family: str | None = None) -> dict[str, torch.Tensor]:
    """The logical state of a family's state dict: ForCausalLM's
    `model.`-prefixed keys or the bare model's, the per-expert or the
    fused expert layout; otherwise as hf_llama.from_hf_state."""
    family = family or family_of_model(config)
    published = check_hf_tensors(state, config, family)
    return hf_llama.from_hf_state(published, config, name_pairs(config, family))


# ------------------------------------------------------------------ the families

@dataclass(frozen=True)
class MoEHFFamily:
    """Mixtral, Qwen3-MoE or Qwen2-MoE (`name`) as
    ptdp.interop.family.HFFamily: the functions above and
    hf_moe_config.py's, for the generic directory reader and writer
    (hf_directory.py)."""
    name: str
    exported = True
    prefix = "model."
    ignored = _IGNORED

    @property
    def classes(self) -> tuple[str, ...]:
        hf_class = FAMILIES[self.name][0]
        return (hf_class, hf_class.removesuffix("ForCausalLM") + "Model")

    @property
    def model_type(self) -> str:
        return FAMILIES[self.name][1]

    def obstacles(self, config: ModelConfig) -> list[str]:
        return family_obstacles(config)[self.name]

    def hf_config(self, config: ModelConfig, *, bos_token_id: int | None = None,
                  eos_token_id: int | None = None) -> dict[str, Any]:
        """This family's config.json (the three exclude each other: one
        without obstacles is the one family_of_model names)."""
        obstacles = self.obstacles(config)
        if obstacles:
            raise ConversionError(f"this model is not a {self.name}: " + "; ".join(obstacles))
        return hf_config_from_model_config(config, bos_token_id=bos_token_id,
                                           eos_token_id=eos_token_id)

    def model_config(self, hf_config: dict[str, Any], **overrides: Any) -> ModelConfig:
        return model_config_from_hf_config(hf_config, **overrides)

    def to_hf_state(self, logical: dict[str, torch.Tensor],
                    config: ModelConfig) -> dict[str, torch.Tensor]:
        return to_hf_state(logical, config)

    def check_hf_tensors(self, state: Mapping[str, Any], config: ModelConfig) -> None:
        check_hf_tensors(state, config, self.name)

    def from_hf_state(self, state: dict[str, torch.Tensor],
                      config: ModelConfig) -> dict[str, torch.Tensor]:
        return from_hf_state(state, config, self.name)


# Mixtral, Qwen3-MoE, Qwen2-MoE: the order export tries them in.
MOE_HF_FAMILIES = tuple(MoEHFFamily(name) for name in FAMILIES)
