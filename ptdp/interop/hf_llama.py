"""Hugging Face's Llama-like dense checkpoints <-> ptdp logical weights.

LlamaForCausalLM, MistralForCausalLM (without a sliding window),
Qwen2ForCausalLM and Qwen3ForCausalLM are ptdp's GPT with RMSNorm, SwiGLU
and rotary embeddings (optionally grouped-query attention, heads wider than
h/a, an untied output layer, biases, q/k norms); what each family's
config.json says is hf_dense_families.py. Both sides use `nn.Linear`'s
[out, in] weights and the same rotary convention (rotate_half: dimensions i
and i + d/2 of a head form a pair), so conversion is renaming plus joining
or splitting rows:

* q_proj, k_proj and v_proj are the row blocks of our fused
  `query_key_value` ([queries of all heads; keys of all groups; values of
  all groups], head-major in each block), with no permutation; their
  biases likewise (Qwen2's, or all linear layers' in Llama);
* Qwen3's self_attn.q_norm / k_norm are our attention.q_layernorm / k_layernorm;
* gate_proj and up_proj are the two row blocks of our `dense_h_to_4h`;
* under --apply-layernorm-1p a norm's stored weight w is the scale 1 + w.

* `attention_name_pairs` / `mlp_name_pairs` / `name_map`: the name table.
  `attention_name_pairs` is everything but the MLPs (embedding, norms,
  attention, output layer), the part MoE families share.
* `hf_config_from_model_config` / `model_config_from_hf_config`: the model
  settings as a `config.json` dict and back; anything ptdp cannot represent
  is refused with a ConversionError naming the key, never adjusted.
* `to_hf_state` / `from_hf_state`: tensors under the ForCausalLM class's
  keys and back (`from_hf_state` also takes the bare model's keys).
  `check_hf_tensors` checks such a state's names and shapes (or only the
  shapes a file's header gives) against the config, config.json's sizes
  first. All three take another name table (`pairs`) for other families.
* `DENSE_HF_FAMILIES`: the families for the generic directory reader and
  writer (hf_directory.py: a directory that the family's `from_pretrained`
  reads, and reading one, sharded too).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch

from ptdp.config import ModelConfig
from ptdp.interop.hf_dense_families import (
    DENSE_FAMILIES,
    EXPORTED_FAMILIES,
    LLAMA,
    DenseFamily,
    common_model_fields,
    dense_family_obstacles,
    dense_hf_config,
    dense_model_fields,
    family_of_hf_config,
    family_of_model,
    family_of_model_type,
    llama_like_obstacles,
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
from ptdp.interop.logical import logical_shapes, with_plain_norm_scales, with_stored_norm_scales

ARCHITECTURE = LLAMA.hf_class
MODEL_TYPE = LLAMA.model_type
OUTPUT = "lm_head.weight"  # the one tensor outside the "model." prefix
# Buffers some checkpoints carry; they are recomputed from the config.
_IGNORED = re.compile(r"^(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq$")

# (ptdp logical name, ((Hugging Face name, rows), ...)): ours is their
# tensors' rows stacked in that order.
NamePair = tuple[str, tuple[tuple[str, int], ...]]


def attention_name_pairs(config: ModelConfig) -> list[NamePair]:
    """The name table of everything but the MLPs, under the ForCausalLM
    class's full names ("model.layers.{i}.self_attn.q_proj.weight", ...,
    "lm_head.weight" when the output layer is untied): the word embedding,
    each layer's two norms, its attention (q/k/v rows of
    `query_key_value`, o_proj, Qwen3's q/k norms, biases where the config
    has them) and the final norm. A family with other MLPs (MoE) adds its
    own pairs for `layers.{i}.mlp.*` to these."""
    shapes = logical_shapes(config)
    d = config.head_dim
    q, kv = config.num_attention_heads * d, config.query_groups * d
    pairs: list[NamePair] = []

    def add(ours: str, *theirs: tuple[str, int | None]) -> None:
        if ours in shapes:  # biases and q/k norms only where the config has them
            pairs.append((ours, tuple((name, rows or shapes[ours][0]) for name, rows in theirs)))

    add("embedding.word_embeddings.weight", ("model.embed_tokens.weight", None))
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        add(ours + "input_layernorm.weight", (theirs + "input_layernorm.weight", None))
        for kind in ("weight", "bias"):
            add(ours + f"attention.query_key_value.{kind}", (theirs + f"self_attn.q_proj.{kind}", q),
                (theirs + f"self_attn.k_proj.{kind}", kv), (theirs + f"self_attn.v_proj.{kind}", kv))
            add(ours + f"attention.dense.{kind}", (theirs + f"self_attn.o_proj.{kind}", None))
        for which in ("q", "k"):
            add(ours + f"attention.{which}_layernorm.weight",
                (theirs + f"self_attn.{which}_norm.weight", None))
        add(ours + "post_attention_layernorm.weight",
            (theirs + "post_attention_layernorm.weight", None))
    add("final_layernorm.weight", ("model.norm.weight", None))
    add("output_layer.weight", (OUTPUT, None))
    return pairs


def mlp_name_pairs(config: ModelConfig) -> list[NamePair]:
    """The name table of the dense MLPs (gate_proj and up_proj are the row
    blocks of `dense_h_to_4h`), for the layers whose MLP is dense."""
    shapes, f = logical_shapes(config), config.ffn_size
    pairs: list[NamePair] = []
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}.mlp.", f"model.layers.{i}.mlp."
        for kind in ("weight", "bias"):
            if ours + f"dense_h_to_4h.{kind}" in shapes:
                pairs.append((ours + f"dense_h_to_4h.{kind}", ((theirs + f"gate_proj.{kind}", f),
                                                               (theirs + f"up_proj.{kind}", f))))
                down = ours + f"dense_4h_to_h.{kind}"
                pairs.append((down, ((theirs + f"down_proj.{kind}", shapes[down][0]),)))
    return pairs


def name_map(config: ModelConfig) -> list[NamePair]:
    """The whole name table of a dense Llama-like model."""
    return attention_name_pairs(config) + mlp_name_pairs(config)


def _name_map(config: ModelConfig) -> list[NamePair]:
    """The old private form of `name_map` (bare names, no output layer),
    kept for callers written against it; use `name_map`."""
    return [(ours, tuple((name.removeprefix("model."), rows) for name, rows in theirs))
            for ours, theirs in name_map(config) if ours != "output_layer.weight"]


# ------------------------------------------------------------------ configs

def llama_obstacles(config: ModelConfig) -> list[str]:
    """The settings of `config` that keep it from being a Llama (empty: it is one)."""
    return dense_family_obstacles(config, LLAMA)


def dense_obstacles(config: ModelConfig) -> list[str]:
    """Empty when export can write `config` as a Llama, Qwen2 or Qwen3;
    else what keeps it from the closest, Llama (or Qwen2/Qwen3 when it has
    their biases or q/k norms)."""
    if family_of_model(config) is not None:
        return []
    if config.qk_layernorm:
        return dense_family_obstacles(config, family_of_model_type("qwen3"))
    if config.add_qkv_bias and not config.bias:
        return dense_family_obstacles(config, family_of_model_type("qwen2"))
    return llama_obstacles(config)


def _require_llama_like(config: ModelConfig) -> None:
    obstacles = llama_like_obstacles(config, windows=True)  # (the tensors have no window)
    if obstacles:
        raise ConversionError("this model is not a Llama: " + "; ".join(obstacles))


def hf_config_from_model_config(config: ModelConfig, *, bos_token_id: int | None = None,
                                eos_token_id: int | None = None) -> dict[str, Any]:
    """config.json for `config`, as LlamaForCausalLM, Qwen2ForCausalLM,
    Qwen3ForCausalLM or (windowed) MistralForCausalLM, whichever its settings
    are (hf_dense_families.py)."""
    family = family_of_model(config)
    if family is None:
        raise ConversionError("this model is not a Llama, Qwen2, Qwen3 or Mistral: "
                              + "; ".join(dense_obstacles(config)))
    return dense_hf_config(config, family, bos_token_id=bos_token_id, eos_token_id=eos_token_id)


def model_config_from_hf_config(hf: dict[str, Any], **overrides: Any) -> ModelConfig:
    """The ModelConfig of a Llama, Mistral, Qwen2 or Qwen3 `config.json`
    (by its model_type or architectures); refuses what ptdp cannot compute.

    seq_length is max_position_embeddings; `overrides` sets other
    ModelConfig fields (seq_length, make_vocab_size_divisible_by, ...) on
    the result.
    """
    problems: list[str] = []
    try:
        family = family_of_hf_config(hf)
    except ConversionError as error:
        problems.append(str(error))
        family = LLAMA
    fields = dense_model_fields(hf, family, problems)
    fields.update(common_model_fields(hf, problems, layer_types=family.window == "switch"))
    if problems:
        raise ConversionError(f"cannot convert this {family.name} config:\n"
                              + "\n".join(f"  - {p}" for p in problems))
    config = ModelConfig(**fields)
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise ConversionError(f"unknown ModelConfig field {key!r}")
        setattr(config, key, value)
    return config


# ------------------------------------------------------------------ tensors

def to_hf_state(logical: dict[str, torch.Tensor], config: ModelConfig,
                pairs: list[NamePair] | None = None) -> dict[str, torch.Tensor]:
    """The ForCausalLM class's state dict for a logical state (`pairs`: the
    name table, default `name_map(config)`). Every tensor is a new
    contiguous tensor; with a tied output layer `lm_head.weight` is a copy
    of the word embedding, so the result can go to `load_state_dict` or to
    safetensors as it is."""
    _require_llama_like(config)
    check_state(logical, logical_shapes(config), "ptdp logical state",
                padded_hint=config.vocab_size)
    logical = with_plain_norm_scales(logical, config)
    state = {}
    for ours, theirs in pairs if pairs is not None else name_map(config):
        pieces = logical[ours].detach().split([rows for _, rows in theirs])
        for (name, _), piece in zip(theirs, pieces):
            state[name] = piece.contiguous().clone()
    if config.tied_output:
        state[OUTPUT] = logical["embedding.word_embeddings.weight"].detach().contiguous().clone()
    return state


def check_hf_tensors(state: Mapping[str, Any], config: ModelConfig,
                     pairs: list[NamePair] | None = None) -> None:
    """Refuse a state (tensors, or the shapes the files' headers give) that
    does not fit `config`: first config.json's sizes against the tensors'
    (before the name table, which has an entry per layer of the config),
    then every name and shape. Keys may lack the "model." prefix (the bare
    model's); `pairs` is the name table, default `name_map(config)`."""
    _require_llama_like(config)
    check_llama_layout(state, config, name_map if pairs is None else lambda _: pairs)


def check_llama_layout(state: Mapping[str, Any], config: ModelConfig,
                       name_table: Callable[[ModelConfig], list[NamePair]], ignored=_IGNORED,
                       more_sizes: Iterable = ()) -> None:
    """check_hf_tensors for any family stored in the Llama-like layout
    (`model.` keys, self_attn.q/k/v_proj, mlp.gate/up/down_proj, an untied
    `lm_head.weight`): the sizes' disagreements (and `more_sizes`, the
    family's own) in one report, then every name of `name_table(config)`
    and its shape. The table is made after the sizes agree: it has an entry
    per layer config.json claims."""
    bare, lm_head = split_state(state, "model.", ignored)
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
        *[disagreement(bare) for disagreement in more_sizes],
        size_disagreement(f"num_key_value_heads={groups} with num_attention_heads={heads} "
                          f"(head_dim {d}, so {groups}·{d} key/value rows)",
                          groups * d, "key/value width",
                          carriers_matching(bare, r"layers\.\d+\.self_attn\.k_proj\.weight", 0)),
        size_disagreement(f"num_attention_heads={heads} with head_dim {d} ({heads}·{d} query "
                          f"rows)", heads * d, "query width",
                          carriers_matching(bare, r"layers\.\d+\.self_attn\.q_proj\.weight", 0)),
    ])
    shapes = logical_shapes(config)
    expected = {name.removeprefix("model."): (rows, *shapes[ours][1:])
                for ours, theirs in name_table(config) for name, rows in theirs if name != OUTPUT}
    check_state(bare, expected, "Hugging Face state")
    check_output_layer(lm_head, config, shapes)


def check_output_layer(lm_head, config: ModelConfig, shapes: dict) -> None:
    """An untied model's `lm_head.weight` is there and has the output
    layer's shape (`shapes`: logical_shapes(config))."""
    if not config.tied_output:
        if lm_head is None:
            raise ConversionError("lm_head.weight is missing and tie_word_embeddings is false: "
                                  "the output layer's weights are not in this checkpoint")
        if shape_of(lm_head) != shapes["output_layer.weight"]:
            raise ConversionError(f"lm_head.weight: {shape_of(lm_head)}, expected "
                                  f"{shapes['output_layer.weight']}")


def from_hf_state(state: dict[str, torch.Tensor], config: ModelConfig,
                  pairs: list[NamePair] | None = None) -> dict[str, torch.Tensor]:
    """The logical state of a state dict (the ForCausalLM class's
    `model.`-prefixed keys, or the bare model's keys with an untied
    `lm_head.weight` beside them). Rotary `inv_freq` buffers of older
    checkpoints are ignored; with tied embeddings an `lm_head.weight` must
    equal the word embedding. `pairs`: the name table, default `name_map(config)`."""
    check_hf_tensors(state, config, pairs)
    logical = logical_from_checked(state, config, pairs if pairs is not None else name_map(config))
    return with_stored_norm_scales(logical, config)


def logical_from_checked(state: dict[str, torch.Tensor], config: ModelConfig,
                         pairs: list[NamePair], ignored=_IGNORED) -> dict[str, torch.Tensor]:
    """The logical tensors `pairs` names, from a state dict whose tensors a
    family's check_hf_tensors has passed (the Llama-like layout: `model.`
    keys and `lm_head.weight`); with tied embeddings an `lm_head.weight`
    must equal the word embedding. The norms' weights as stored."""
    bare, lm_head = split_state(state, "model.", ignored)
    full = {f"model.{name}": tensor for name, tensor in bare.items()}
    embedding = bare["embed_tokens.weight"]
    if lm_head is not None:
        full[OUTPUT] = lm_head
    if config.tied_output and lm_head is not None and (
            lm_head.shape != embedding.shape or not torch.equal(lm_head, embedding)):
        raise ConversionError("lm_head.weight differs from the word embedding "
                              "(embed_tokens.weight) although tie_word_embeddings is true; set "
                              "tie_word_embeddings to false in config.json to keep both")
    return {ours: torch.cat([full[name].detach() for name, _ in theirs]).contiguous()
            for ours, theirs in pairs}


# ------------------------------------------------------------------ the families

@dataclass(frozen=True)
class DenseHFFamily:
    """A Llama-like dense family (hf_dense_families.py) as
    ptdp.interop.family.HFFamily: the functions above, for the generic
    directory reader and writer (hf_directory.py). They share the name
    table; config.json says which family a directory is."""
    family: DenseFamily
    prefix = "model."
    ignored = _IGNORED

    @property
    def name(self) -> str:
        return self.family.name

    @property
    def classes(self) -> tuple[str, ...]:
        return (self.family.hf_class, self.family.bare_class)

    @property
    def model_type(self) -> str:
        return self.family.model_type

    @property
    def exported(self) -> bool:
        return self.family in EXPORTED_FAMILIES

    def obstacles(self, config: ModelConfig) -> list[str]:
        return dense_family_obstacles(config, self.family)

    def hf_config(self, config: ModelConfig, *, bos_token_id: int | None = None,
                  eos_token_id: int | None = None) -> dict[str, Any]:
        obstacles = self.obstacles(config)
        if obstacles:
            raise ConversionError(f"this model is not a {self.name}: " + "; ".join(obstacles))
        return dense_hf_config(config, self.family, bos_token_id=bos_token_id,
                               eos_token_id=eos_token_id)

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


# Llama, Mistral, Qwen2, Qwen3: the order export tries them in.
DENSE_HF_FAMILIES = tuple(DenseHFFamily(family) for family in DENSE_FAMILIES)
