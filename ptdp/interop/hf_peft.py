"""ptdp's LoRA adapters <-> Hugging Face PEFT adapter directories.

A PEFT directory is `adapter_config.json` (a LoraConfig) and
`adapter_model.safetensors`, loaded with
`peft.PeftModel.from_pretrained(base_model, directory)` on the base model
ptdp's Hugging Face export writes. hf_peft_names.py says where each ptdp
layer sits and what PEFT names its tensors.

* `to_peft`: ptdp's adapter tensors (ptdp.model.adapters: `M.lora.A`
  [R, in], `M.lora.B` [out, R]) as PEFT's config and tensors. A fused
  matrix's adapter goes to each of its Hugging Face layers with the same
  A and that layer's rows of B (q/k/v_proj of `query_key_value`,
  gate/up_proj of `dense_h_to_4h`): the same W + (α/R)·B A. Routed
  experts go into the fused parameters' per-expert layout; shared expert
  adapters (--lora-share-expert-adapters) are written to every expert.
  `save_peft_directory` writes the directory.
* `from_peft`: a PEFT directory as ptdp's adapter tensors and LoRA
  settings, exactly: where q/k/v_proj (or gate/up_proj) have different A
  (trained in PEFT), the fused layer's A is theirs stacked along the rank
  ([A_q; A_k; A_v], rank 3r) with B block-diagonal; as ptdp has one rank,
  every other layer is padded with zero rows of A and columns of B to it,
  and α is set so that α/R is PEFT's α/r. Where they share A the rank
  stays r. Settings that change what the adapter computes, and tensors
  that do not fit the base model, are refused naming the key or tensor.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from ptdp.config import ModelConfig
from ptdp.config.lora import TARGET_NAMES, LoRAConfig
from ptdp.interop.family import HFFamily
from ptdp.interop.hf_files import (ConversionError, check_state, export_directory_problem,
                                   write_new_directory)
from ptdp.interop.hf_peft_names import (
    FUSED_EXPERTS,
    PEFT_PREFIX,
    experts_module,
    fused_module_names,
    fused_parameter,
    layer_pieces,
    shortest_targets,
    uses_parameter_targets,
)
from ptdp.interop.hf_peft_read import adapters_from_peft_state, read_peft_directory
from ptdp.model.adapters import adaptable_layers, adapted_layers, adapter_owner, adapter_shapes

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"


def _family(config: ModelConfig, family: HFFamily | None) -> HFFamily:
    from ptdp.interop.hf_directory import family_for_export
    return family if family is not None else family_for_export(config)


# ------------------------------------------------------------------ export

def _expert_tensors(adapters: dict[str, torch.Tensor], layers: list, lora: LoRAConfig
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """One fused parameter's LoRA (PEFT's layout, hf_peft_names) from the
    adapters of an MoE layer's experts, in expert order."""
    owners = [adapter_owner(layer, lora) for layer in layers]
    a = torch.cat([adapters[f"{owner}.A"] for owner in owners])                  # [E·R, in]
    b = torch.stack([adapters[f"{owner}.B"] for owner in owners], dim=2)          # [out, R, E]
    return a.contiguous().clone(), b.flatten(1).contiguous().clone()              # [out, R·E]


def _expert_groups(config: ModelConfig, lora: LoRAConfig) -> dict[tuple[int, str], list]:
    """(MoE layer, fused parameter) -> its experts' adapted layers; refuses
    a choice of some of a layer's experts, which PEFT's one adapter per
    fused parameter cannot express."""
    groups: dict[tuple[int, str], list] = defaultdict(list)
    for layer in adapted_layers(config, lora):
        if layer.expert is not None:
            groups[(layer.layer, fused_parameter(layer))].append(layer)
    for (i, parameter), layers in groups.items():
        if len(layers) != config.num_experts:
            raise ConversionError(
                f"--lora-target-modules adapts {len(layers)} of the {config.num_experts} routed "
                f"experts' {layers[0].target} in layer {i}; PEFT adapts a layer's experts as one "
                f"parameter ({experts_module(i)}.{parameter}), all of them or none: adapt every "
                f"expert of a layer, or none")
    return groups


def to_peft(adapters: dict[str, torch.Tensor], model_cfg: ModelConfig, lora: LoRAConfig,
            family: HFFamily | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """PEFT's adapter_config.json (a dict) and adapter tensors (their
    names in adapter_model.safetensors) for ptdp's adapter tensors, which
    `lora` and `model_cfg` describe (ptdp.model.adapters.adapter_shapes).
    `family`: the base model's Hugging Face family, by default the one
    ptdp's export writes (hf_directory.family_for_export).

    PEFT cannot drop out the input of a fused-experts or parameter adapter
    (lora.ParamWrapper refuses any lora_dropout), so where those are
    written lora_dropout is 0: a training setting, which changes nothing
    the adapters compute."""
    family = _family(model_cfg, family)
    if not lora.enabled:
        raise ConversionError("no adapters to convert: --lora-rank is 0")
    check_state(adapters, adapter_shapes(model_cfg, lora), "the LoRA adapter tensors")
    pieces = layer_pieces(model_cfg, family)
    parameter_targets = uses_parameter_targets(family)
    tensors: dict[str, torch.Tensor] = {}
    modules, parameters = [], []

    def put(module: str, a: torch.Tensor, b: torch.Tensor) -> None:
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b

    for layer in adapted_layers(model_cfg, lora):
        if layer.expert is not None:
            continue
        owner = adapter_owner(layer, lora)
        a, b = adapters[f"{owner}.A"], adapters[f"{owner}.B"]
        for piece in pieces[layer.name]:
            # (clones, not detached: the map stays differentiable, which the tests use)
            put(piece.module, a.contiguous().clone(),
                b[piece.start:piece.start + piece.rows].contiguous().clone())
            in_mlp = ".mlp." in piece.module
            (parameters if parameter_targets and in_mlp else modules).append(piece.module)
    by_layer: dict[int, list[str]] = defaultdict(list)
    groups = _expert_groups(model_cfg, lora)
    for (i, parameter) in groups:
        by_layer[i].append(parameter)
    for i, adapted in by_layer.items():
        for parameter, module in fused_module_names(i, adapted).items():
            put(module, *_expert_tensors(adapters, groups[(i, parameter)], lora))
            parameters.append(f"{experts_module(i)}.{parameter}")
    return _peft_config(model_cfg, lora, pieces, modules, parameters), tensors


def _peft_config(model_cfg: ModelConfig, lora: LoRAConfig, pieces: dict, modules: list[str],
                 parameters: list[str]) -> dict[str, Any]:
    """adapter_config.json's LoraConfig for these targets: names as short
    as they can be while they pick exactly these layers."""
    every_module = [piece.module for layer in adaptable_layers(model_cfg)
                    if layer.expert is None for piece in pieces[layer.name]]
    every_parameter = [f"{experts_module(i)}.{name}"
                       for i, is_moe in enumerate(model_cfg.moe_layer_pattern
                                                  if model_cfg.is_moe else [])
                       if is_moe for name, _ in FUSED_EXPERTS]
    # A 2-D parameter's target keeps its module's name: "weight" alone would pick every weight.
    weights = [f"{module}.weight" for module in parameters if module not in every_parameter]
    fused = [name for name in parameters if name in every_parameter]
    target_parameters = (shortest_targets(fused, every_parameter, 3)
                         + shortest_targets(weights, [f"{m}.weight" for m in every_module], 2))
    alpha: float | int = int(lora.lora_alpha) if float(lora.lora_alpha).is_integer() \
        else lora.lora_alpha
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None,
        "r": lora.lora_rank, "lora_alpha": alpha,
        "lora_dropout": 0.0 if target_parameters else lora.lora_dropout,
        "target_modules": shortest_targets(modules, every_module, 1),
        "target_parameters": target_parameters or None,
        "bias": "none", "lora_bias": False, "use_rslora": False, "use_dora": False,
        "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True,
        "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None,
        "layers_to_transform": None, "layers_pattern": None,
    }


def save_peft_directory(directory: str | Path, adapters: dict[str, torch.Tensor],
                        model_cfg: ModelConfig, lora: LoRAConfig,
                        family: HFFamily | None = None) -> None:
    """Write `adapter_config.json` and `adapter_model.safetensors` (to_peft)
    into a new directory, through a temporary sibling renamed into place
    (a failed write leaves nothing); an existing non-empty one is refused."""
    from safetensors.torch import save_file

    adapter_config, tensors = to_peft(adapters, model_cfg, lora, family)
    directory = Path(directory)
    problem = export_directory_problem(directory)
    if problem:
        raise ConversionError(problem)

    def write(partial: Path) -> None:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()},
                  str(partial / ADAPTER_WEIGHTS_NAME), metadata={"format": "pt"})
        with open(partial / ADAPTER_CONFIG_NAME, "w") as f:
            json.dump(adapter_config, f, indent=2, sort_keys=True)
            f.write("\n")

    write_new_directory(directory, write)


# ------------------------------------------------------------------ import

def from_peft(directory: str | Path, model_cfg: ModelConfig, family: HFFamily | None = None
              ) -> tuple[dict[str, torch.Tensor], LoRAConfig]:
    """ptdp's adapter tensors and LoRA settings for a PEFT adapter
    directory on the base model `model_cfg` (its Hugging Face `family`, by
    default the one ptdp's export writes). The settings' target_modules
    pick exactly the adapted layers (TARGET_NAMES for a kind adapted
    everywhere, Megatron-Core's full names otherwise); routed experts with
    one adapter for all (as --lora-share-expert-adapters writes them) come
    back shared."""
    family = _family(model_cfg, family)
    peft_config, state = read_peft_directory(directory)
    try:
        layers, rank, share = adapters_from_peft_state(state, peft_config, model_cfg, family)
    except ConversionError as error:
        raise ConversionError(f"{directory}: {error}") from None
    lora = LoRAConfig(lora_rank=rank, lora_alpha=peft_config["lora_alpha"] * rank
                      / peft_config["r"], lora_dropout=float(peft_config.get("lora_dropout") or 0),
                      lora_target_modules=_ptdp_targets(model_cfg, set(layers)),
                      lora_share_expert_adapters=share)
    if not math.isfinite(lora.lora_alpha):
        raise ConversionError(f"{directory}: lora_alpha {peft_config['lora_alpha']!r} is not a "
                              f"finite number")
    adapters: dict[str, torch.Tensor] = {}
    for layer in adapted_layers(model_cfg, lora):
        a, b = layers[layer.name]
        owner = adapter_owner(layer, lora)
        adapters[f"{owner}.A"], adapters[f"{owner}.B"] = _padded(a, b, rank)
    return adapters, lora


def _padded(a: torch.Tensor, b: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A and B with zero rows of A and columns of B up to `rank`: the same B A."""
    extra = rank - a.shape[0]
    if extra == 0:
        return a.contiguous(), b.contiguous()
    return (torch.cat([a, a.new_zeros(extra, a.shape[1])]),
            torch.cat([b, b.new_zeros(b.shape[0], extra)], dim=1))


def _ptdp_targets(model_cfg: ModelConfig, chosen: set[str]) -> list[str]:
    """--lora-target-modules that pick exactly the layers named `chosen`:
    a Megatron-Bridge name where every layer of that kind is chosen, the
    layers' full Megatron-Core names where some are."""
    targets: list[str] = []
    for kind in TARGET_NAMES:
        layers = [layer for layer in adaptable_layers(model_cfg) if layer.target == kind]
        picked = [layer for layer in layers if layer.name in chosen]
        if picked and len(picked) == len(layers):
            targets.append(kind)
        else:
            targets.extend(layer.megatron_name for layer in picked)
    return targets
