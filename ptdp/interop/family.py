"""The adapter contract between the one Hugging Face directory reader and
writer (hf_directory.py) and each model family it converts.

What every family shares is hf_directory.py's: config.json, the weights as
`model.safetensors` or as shards listed in `model.safetensors.index.json`
(hf_weights.py: headers first, then floating-point, finite data), the
atomic write of a new directory, the directory named in a refusal. What
differs between GPT-2, the Llama-like dense families and the MoE families
is the family's, behind `HFFamily`; adding a family is one object that
provides it, entered in hf_directory.HF_FAMILIES.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Mapping, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from ptdp.config import ModelConfig


@runtime_checkable
class HFFamily(Protocol):
    """One Hugging Face model family ptdp converts, as the generic
    directory reader and writer use it.

    Which directories it claims (the registry picks the first family whose
    `classes` hold every name of config.json's `architectures` and whose
    `model_type` is config.json's, a missing one matching any):

    * `name`: as messages say it ("GPT-2", "Qwen3-MoE").
    * `classes`: config.json's `architectures` it reads, the ForCausalLM
      (LMHead) class first, which export writes and the advice for a
      pickle-only directory names; then the bare model's class, whose keys
      lack `prefix`.
    * `model_type`: config.json's.
    * `exported`: whether export may write this family; False for one that
      imports only (a Mistral without a sliding window is written as Llama).
      Export writes the first exported family with no `obstacles`.

    The settings, both ways; anything ptdp cannot represent is a
    ConversionError (naming the config key or the flag), never adjusted:

    * `obstacles(config)`: what keeps a ModelConfig from this family (empty:
      export can write it).
    * `hf_config(config, *, bos_token_id, eos_token_id)`: config.json's
      fields for a ModelConfig that has no obstacles (a family with one
      special token, GPT-2, writes the eos id for both). The writer adds
      torch_dtype and the source's token ids; the keys are written sorted.
    * `model_config(hf_config, **overrides)`: the ModelConfig of a
      config.json; `overrides` set other ModelConfig fields on it
      (seq_length, apply_layernorm_1p, ...), an unknown one refused.

    The tensors. A *logical state* (logical.py) is the one-process model's
    tensors under ptdp's names with TP-free, unpadded shapes
    (ptdp.model.shapes.logical_shapes), norm weights as the model stores
    them (scale - 1 under --apply-layernorm-1p); the family converts the
    norms to the plain scales Hugging Face keeps, splits and joins fused
    tensors (GPT-2's c_attn is our query_key_value transposed; Llama's
    q/k/v_proj and gate/up_proj are row blocks of our fused
    query_key_value and dense_h_to_4h; experts per expert or fused), and
    handles the output layer:

    * `to_hf_state(logical, config)`: the ForCausalLM class's state dict,
      every tensor a new contiguous one; with tied embeddings
      `lm_head.weight` is a copy of the word embedding, which the writer
      leaves out of the file, as Hugging Face does.
    * `check_hf_tensors(state, config)`: refuse a state that does not fit
      the config, its values tensors or only shapes (the files' headers,
      checked before any data is read): config.json's sizes against the
      tensors' first (before a table with an entry per layer is built), then
      every name and shape. Keys come with `prefix` or bare.
    * `from_hf_state(state, config)`: the logical state of such a state
      dict; with tied embeddings a stored `lm_head.weight` must equal the
      word embedding.
    * `prefix`: the base model's key prefix in the ForCausalLM class
      ("transformer.", "model.").
    * `ignored`: buffers some checkpoints carry that are recomputed from the
      config (causal masks, rotary inv_freq), matched against keys without
      `prefix`; the reader does not read them.
    """

    name: str
    classes: tuple[str, ...]
    model_type: str
    exported: bool
    prefix: str
    ignored: re.Pattern[str]

    def obstacles(self, config: ModelConfig) -> list[str]: ...

    def hf_config(self, config: ModelConfig, *, bos_token_id: int | None = None,
                  eos_token_id: int | None = None) -> dict[str, Any]: ...

    def model_config(self, hf_config: dict[str, Any], **overrides: Any) -> ModelConfig: ...

    def to_hf_state(self, logical: dict[str, torch.Tensor],
                    config: ModelConfig) -> dict[str, torch.Tensor]: ...

    def check_hf_tensors(self, state: Mapping[str, Any], config: ModelConfig) -> None: ...

    def from_hf_state(self, state: dict[str, torch.Tensor],
                      config: ModelConfig) -> dict[str, torch.Tensor]: ...


def unwritten_settings(config: "ModelConfig", family: str) -> list[str]:
    """The settings of `config` that the Llama-like and GPT-2 families do not
    compute (the Gemma 3 and gpt-oss pieces, sinks, MLA, MTP): written as `family` the
    model would be another one, so export names them instead. (Gemma 3's
    own family writes its pieces: hf_gemma3.py.)"""
    named = [(config.geglu, "--geglu"), (config.quick_geglu, "--quick-geglu"),
             (config.glu_linear_offset != 0.0,
              f"--glu-linear-offset {config.glu_linear_offset:g}"),
             (config.activation_func_clamp_value is not None, "--activation-func-clamp-value"),
             (config.softmax_scale is not None, f"--softmax-scale {config.softmax_scale}"),
             (config.scale_embeddings, "--scale-embeddings"),
             (config.sandwich_norm, "--sandwich-norm"),
             (config.has_sinks, f"--softmax-type {config.softmax_type}"),
             # DeepSeek-V3's and GLM-4.5's own families write these
             (config.multi_latent_attention, "--multi-latent-attention"),
             (config.mtp_depth > 0, f"--mtp-num-layers {config.mtp_depth}")]
    return [f"{flag} ({family} as ptdp writes it has no such setting)" for on, flag in named if on]


class ModuleFamily:
    """An HFFamily whose operations are a family module's own functions of
    the contract's names (`hf_config_from_model_config`,
    `model_config_from_hf_config`, `to_hf_state`, `check_hf_tensors`,
    `from_hf_state`, and `load_state` where the module reads its tensors
    itself), so a new family module states only what is its own."""

    def __init__(self, module: Any, *, name: str, classes: tuple[str, ...], model_type: str,
                 obstacles, ignored: "re.Pattern[str]", prefix: str = "model.",
                 exported: bool = True):
        self.module, self.name, self.classes, self.model_type = module, name, classes, model_type
        self.exported, self.prefix, self.ignored = exported, prefix, ignored
        self._obstacles = obstacles
        if hasattr(module, "load_state"):  # (hf_directory asks for it by getattr)
            self.load_state = module.load_state

    def obstacles(self, config: "ModelConfig") -> list[str]:
        return self._obstacles(config)

    def hf_config(self, config: "ModelConfig", *, bos_token_id: int | None = None,
                  eos_token_id: int | None = None) -> dict[str, Any]:
        return self.module.hf_config_from_model_config(config, bos_token_id=bos_token_id,
                                                       eos_token_id=eos_token_id)

    def model_config(self, hf_config: dict[str, Any], **overrides: Any) -> "ModelConfig":
        return self.module.model_config_from_hf_config(hf_config, **overrides)

    def to_hf_state(self, logical: dict, config: "ModelConfig") -> dict:
        return self.module.to_hf_state(logical, config)

    def check_hf_tensors(self, state: Mapping[str, Any], config: "ModelConfig") -> None:
        self.module.check_hf_tensors(state, config)

    def from_hf_state(self, state: dict, config: "ModelConfig") -> dict:
        return self.module.from_hf_state(state, config)
