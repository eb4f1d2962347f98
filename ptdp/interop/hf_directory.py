"""Hugging Face model directories, read and written for every family alike.

A directory is `config.json` plus the weights as `model.safetensors`, or as
shards listed in `model.safetensors.index.json` (hf_weights.py); a
tokenizer's files may sit beside them. What differs between families is
each family's (the contract: family.py's HFFamily); HF_FAMILIES is the
table of them, and picks one each way:

* import: the first family whose `classes` hold every name of
  config.json's `architectures` and whose `model_type` is config.json's
  (a config.json that names neither is the oldest GPT-2's);
* export: the first exported family with no obstacles to the model's
  settings: GPT-2 for the defaults; for RMSNorm + SwiGLU + rotary
  embeddings Llama, Qwen2 with --add-qkv-bias and no other biases, Qwen3
  with --qk-layernorm, Mistral with a window on every layer (without one
  it is a Llama: the same architecture); for an MoE model Mixtral,
  Qwen3-MoE with --qk-layernorm, Qwen2-MoE with a gated shared expert;
  Gemma 3 for its pieces (hf_gemma3.py); gpt-oss for quick-GeGLU experts
  with learnable sinks (hf_gpt_oss.py); GLM-4.5 for sigmoid routing with
  an expert bias and a shared expert, its MTP modules included
  (hf_glm4_moe.py); DeepSeek-V3 for the same MoE with multi-latent
  attention (hf_deepseek_v3.py).

The bare models (GPT2Model, LlamaModel, ...) are read too: their keys lack
the family's prefix. Weights stored as block-scaled FP8 (DeepSeek-V3's
format, quantization_config quant_method "fp8") are dequantized on import
for every family (fp8_blocks.py); the families see the plain tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from ptdp.config import ModelConfig
from ptdp.interop.family import HFFamily
from ptdp.interop.fp8_blocks import METHOD as FP8_METHOD
from ptdp.interop.fp8_blocks import fp8_block, fp8_shapes, load_fp8_state
from ptdp.interop.hf_files import ConversionError, read_hf_config, write_hf_directory
from ptdp.interop.hf_deepseek_v3 import DEEPSEEK_V3
from ptdp.interop.hf_gemma3 import GEMMA3
from ptdp.interop.hf_glm4_moe import GLM4_MOE
from ptdp.interop.hf_gpt2 import GPT2
from ptdp.interop.hf_gpt_oss import GPT_OSS
from ptdp.interop.hf_llama import DENSE_HF_FAMILIES
from ptdp.interop.hf_moe import MOE_HF_FAMILIES
from ptdp.interop.hf_weights import HFWeights

# The families, in the order export tries them. Another family is one more
# entry: HF_FAMILIES[family.name] = family.
HF_FAMILIES: dict[str, HFFamily] = {
    family.name: family for family in (GPT2, *DENSE_HF_FAMILIES, *MOE_HF_FAMILIES, GEMMA3, GPT_OSS,
                                       GLM4_MOE, DEEPSEEK_V3)}
# The tensor a ForCausalLM class keeps outside its base model; a tied one
# is a copy of the word embedding, left out of the files.
OUTPUT = "lm_head.weight"


def family_for_import(hf_config: dict[str, Any], source: str | Path) -> HFFamily:
    """The family of config.json's `architectures` and `model_type`; a
    config with neither is GPT-2's oldest form. `source` names the
    directory in the refusal of any other."""
    classes = hf_config.get("architectures") or []
    model_type = hf_config.get("model_type")
    if not isinstance(classes, list):
        classes = [classes]
    if not classes and model_type is None:
        return GPT2  # the oldest GPT-2 config.json names neither
    for family in HF_FAMILIES.values():
        # (a family may read other model_types of its class: `other_model_types`)
        known = (family.model_type, *getattr(family, "other_model_types", ()), None)
        if all(c in family.classes for c in classes) and model_type in known:
            return family
    supported = "; ".join(f"{' or '.join(family.classes)} (model_type {family.model_type!r})"
                          for family in HF_FAMILIES.values())
    raise ConversionError(f"{source}: architectures {classes} with model_type {model_type!r} is "
                          f"not an architecture ptdp converts; supported: {supported}")


def family_for_export(model: ModelConfig) -> HFFamily:
    """The family export writes for a ModelConfig: the first whose class can
    express it; refuses a model none fits, listing what keeps it from each."""
    obstacles = {name: family.obstacles(model) for name, family in HF_FAMILIES.items()
                 if family.exported}
    fitting = [name for name, found in obstacles.items() if not found]
    if fitting:
        return HF_FAMILIES[fitting[0]]
    raise ConversionError(
        f"this checkpoint's model fits none of the Hugging Face classes ptdp writes "
        f"({', '.join(obstacles)}):\n" + "\n".join(f"  - not {name}: {'; '.join(found)}"
                                                   for name, found in obstacles.items()))


def save_hf_directory(directory: str | Path, logical: dict[str, torch.Tensor],
                      config: ModelConfig, *, bos_token_id: int | None = None,
                      eos_token_id: int | None = None,
                      tokenizer_files: Mapping[str, bytes] | None = None,
                      token_ids: Mapping[str, Any] | None = None) -> None:
    """Write `config.json` and `model.safetensors` (and the tokenizer files
    when given) that the family's `from_pretrained(directory)` loads, as
    the family export picks for `config` (family_for_export); `token_ids`:
    config.json's bos/eos/pad ids as the source had them, which replace the
    written ones. A tied `lm_head.weight` is left out, as Hugging Face
    does. Refuses an existing non-empty directory."""
    family = family_for_export(config)
    hf_config = family.hf_config(config, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    state = family.to_hf_state(logical, config)
    if config.tied_output:
        del state[OUTPUT]
    write_hf_directory(directory, hf_config, state, tokenizer_files=tokenizer_files,
                       token_ids=token_ids)


def load_hf_directory(directory: str | Path, **overrides: Any
                      ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(ModelConfig, logical state) of a Hugging Face directory of any
    family (family_for_import): `config.json` plus `model.safetensors` or
    sharded safetensors with `model.safetensors.index.json`. config.json is
    checked against the tensors' names and shapes before any data is read;
    the tensors the model uses must be floating point and finite, or
    block-scaled FP8 (quantization_config quant_method "fp8", any family:
    fp8_blocks.py), dequantized into config.json's dtype.
    `overrides` go to the family's model_config."""
    hf_config = read_hf_config(directory)
    family = family_for_import(hf_config, directory)
    config = family.model_config(hf_config, **overrides)
    quantization = _fp8_quantization(hf_config, family, directory)
    weights = HFWeights(directory, family.classes[0])
    try:
        family.check_hf_tensors(weights.shapes if quantization is None
                                else fp8_shapes(weights, quantization), config)
        used = [key for key in weights.tensors
                if not family.ignored.match(key.removeprefix(family.prefix))]
        # A family whose published files hold another quantized format
        # (gpt-oss's MXFP4 experts) reads them itself, dequantized.
        own_loader = getattr(family, "load_state", None)
        if quantization is not None:
            state = load_fp8_state(weights, quantization, used, _stored_dtype(hf_config))
        else:
            state = own_loader(weights) if own_loader is not None else weights.load(used)
        return config, family.from_hf_state(state, config)
    except ConversionError as e:
        raise ConversionError(f"{directory}: {e}") from None


def _fp8_quantization(hf_config: dict[str, Any], family: HFFamily,
                      source: str | Path) -> dict[str, Any] | None:
    """config.json's quantization_config where the weights are read as
    block-scaled FP8 (fp8_blocks.py), which any family's may be; None where
    there is none, or the family reads its own format (gpt-oss's MXFP4,
    which its model_config checked). Any other format is refused here,
    before the files are opened."""
    quantization = hf_config.get("quantization_config")
    if quantization is None:
        return None
    is_fp8 = isinstance(quantization, dict) and quantization.get("quant_method") == FP8_METHOD
    if not is_fp8 and getattr(family, "load_state", None) is not None:
        return None
    try:
        fp8_block(quantization)
    except ConversionError as e:
        raise ConversionError(f"{source}: {e}") from None
    return quantization


def _stored_dtype(hf_config: dict[str, Any]) -> torch.dtype:
    """The dtype config.json says the model's weights are in (`dtype`, or
    transformers 4's `torch_dtype`): what FP8 weights dequantize into, so
    they match the tensors stored plain; bf16 where it names none."""
    named = hf_config.get("dtype", hf_config.get("torch_dtype"))
    return {"float32": torch.float32, "float16": torch.float16}.get(named, torch.bfloat16)
