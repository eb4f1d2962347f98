"""Reading a PEFT adapter directory for hf_peft.from_peft: its
adapter_config.json checked for what ptdp's adapters cannot compute, its
tensors' names and shapes checked against the base model (before any data
is read), and each ptdp layer's A and B assembled from its Hugging Face
layers' (hf_peft_names.py says where they sit).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from ptdp.config import ModelConfig
from ptdp.interop.family import HFFamily
from ptdp.interop.hf_files import ConversionError, abbreviate
from ptdp.interop.hf_peft_names import (
    FUSED_EXPERTS,
    PEFT_PREFIX,
    experts_module,
    fused_module_names,
    layer_pieces,
    matches_target,
)
from ptdp.model.adapters import adaptable_layers
from ptdp.model.shapes import logical_shapes

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
_SUFFIXES = {".lora_A.weight": "A", ".lora_B.weight": "B"}

# adapter_config.json keys whose non-default values make PEFT compute
# something ptdp's W + (α/R)·B A does not, and what they mean.
_UNSUPPORTED = (
    ("use_dora", "DoRA's magnitude vectors"),
    ("use_rslora", "rank-stabilized scaling α/√r"),
    ("rank_pattern", "a rank per layer"),
    ("alpha_pattern", "an α per layer"),
    ("modules_to_save", "whole trained copies of modules"),
    ("layers_to_transform", "adapters on some layers' indices"),
    ("layers_pattern", "adapters on some layers' indices"),
    ("fan_in_fan_out", "[in, out] (Conv1D) weights"),
    ("lora_bias", "a trained bias in lora_B"),
    ("trainable_token_indices", "trained rows of the embedding"),
    ("layer_replication", "replicated layers"),
    ("use_qalora", "QALoRA's pooled inputs"),
    ("velora_config", "VeLoRA"),
    ("kasa_config", "KaSA"),
    ("use_bdlora", "block-diagonal LoRA"),
)


def _config_problems(peft: dict[str, Any]) -> list[str]:
    problems = []
    if peft.get("peft_type") != "LORA":
        problems.append(f"peft_type is {peft.get('peft_type')!r}: ptdp reads LoRA adapters only")
    for key, meaning in _UNSUPPORTED:
        if peft.get(key):
            problems.append(f"{key} is {peft[key]!r} ({meaning}), which ptdp's adapters do not "
                            f"compute")
    if peft.get("bias", "none") != "none":
        problems.append(f"bias is {peft['bias']!r} (trained biases of the base layers), which "
                        f"ptdp's adapters do not compute; only \"none\" converts")
    r, alpha = peft.get("r"), peft.get("lora_alpha")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        problems.append(f"r is {r!r}, not a rank (a whole number ≥ 1)")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        problems.append(f"lora_alpha is {alpha!r}, not a positive number")
    dropout = peft.get("lora_dropout") or 0
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        problems.append(f"lora_dropout is {dropout!r}, not a probability in [0, 1)")
    return problems


def read_peft_directory(directory: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(adapter_config.json as a dict, {name: safetensors slice}) of a
    PEFT directory; refuses a config ptdp cannot compute, naming its keys.
    The tensors are not read yet: the slices give their shapes."""
    from safetensors import safe_open

    directory = Path(directory)
    config_path, weights_path = directory / ADAPTER_CONFIG_NAME, directory / ADAPTER_WEIGHTS_NAME
    if not config_path.is_file():
        raise ConversionError(f"{directory} has no {ADAPTER_CONFIG_NAME}: it is not a PEFT "
                              f"adapter directory (save_pretrained of a PeftModel writes one)")
    try:
        peft = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ConversionError(f"{config_path} is not valid JSON: {e}") from None
    if not isinstance(peft, dict):
        raise ConversionError(f"{config_path} does not hold a JSON object")
    problems = _config_problems(peft)
    if problems:
        raise ConversionError(f"{config_path} describes an adapter ptdp cannot convert: "
                              f"{'; '.join(problems)}. ptdp converts plain LoRA (W + (α/r)·B A "
                              f"on linear layers); merge this adapter into the base model in "
                              f"PEFT (merge_and_unload) and import that model instead")
    if not weights_path.is_file():
        other = " (it has adapter_model.bin: save it with safe_serialization)" \
            if (directory / "adapter_model.bin").exists() else ""
        raise ConversionError(f"{directory} has no {ADAPTER_WEIGHTS_NAME}{other}")
    handle = safe_open(str(weights_path), framework="pt")
    return peft, {name: handle.get_slice(name) for name in handle.keys()}


# ------------------------------------------------------------------ names and shapes

def _where(peft: dict[str, Any], model_cfg: ModelConfig, family: HFFamily
           ) -> dict[str, tuple[str, Any]]:
    """Module name in the file -> ("piece", (ptdp layer name, Piece)) or
    ("fused", (MoE layer, fused parameter))."""
    where: dict[str, tuple[str, Any]] = {}
    for layer_name, pieces in layer_pieces(model_cfg, family).items():
        for piece in pieces:
            where[piece.module] = ("piece", (layer_name, piece))
    for i, is_moe in enumerate(model_cfg.moe_layer_pattern if model_cfg.is_moe else []):
        if is_moe:
            targeted = [name for name, _ in FUSED_EXPERTS if matches_target(
                f"{experts_module(i)}.{name}", peft.get("target_parameters"))]
            for name, module in fused_module_names(i, targeted).items():
                where[module] = ("fused", (i, name))
    return where


def _expected_shapes(where: dict[str, tuple[str, Any]], r: int, model_cfg: ModelConfig
                     ) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Module -> the shapes of its lora_A and lora_B."""
    shapes = logical_shapes(model_cfg)
    expected = {}
    for module, (kind, what) in where.items():
        if kind == "piece":
            layer_name, piece = what
            columns = shapes[f"{layer_name}.weight"][1]
            expected[module] = ((r, columns), (piece.rows, r))
        else:
            i, parameter = what
            matrix = dict(FUSED_EXPERTS)[parameter]
            rows, columns = shapes[f"layers.{i}.mlp.experts.0.{matrix}.weight"]
            E = model_cfg.num_experts
            expected[module] = ((E * r, columns), (rows, r * E))
    return expected


def _check_names_and_shapes(state: dict[str, Any], where: dict, expected: dict,
                            model_cfg: ModelConfig, family: HFFamily) -> dict[str, dict[str, Any]]:
    """module -> {"A": slice, "B": slice}; refuses a tensor that has no
    place in the base model or the wrong shape, and a lone A or B."""
    modules: dict[str, dict[str, Any]] = defaultdict(dict)
    misplaced = []
    for key, value in state.items():
        suffix = next((s for s in _SUFFIXES if key.endswith(s)), None)
        module = key.removeprefix(PEFT_PREFIX).removesuffix(suffix or "")
        if suffix is None or not key.startswith(PEFT_PREFIX) or module not in where:
            misplaced.append(key)
            continue
        modules[module][_SUFFIXES[suffix]] = value
    if misplaced:
        example = next(iter(where))
        raise ConversionError(
            f"adapter_model.safetensors holds {', '.join(abbreviate(sorted(misplaced), 4))}, "
            f"which has no place among the adapters ptdp trains on this {family.name} model "
            f"({model_cfg.num_layers} layers, hidden {model_cfg.hidden_size}): ptdp adapts the "
            f"attention's and MLPs' linear layers (LoRA tensors like "
            f"{PEFT_PREFIX}{example}.lora_A.weight), not the embedding, the output layer "
            f"(lm_head) or the router. Is it an adapter of another model? Leave such modules out "
            f"of the adapter's target_modules")
    for module, pair in sorted(modules.items()):
        for which, shape in zip("AB", expected[module]):
            key = f"{PEFT_PREFIX}{module}.lora_{which}.weight"
            if which not in pair:
                raise ConversionError(f"{key} is missing beside its lora_{'BA'[which == 'B']}: "
                                      f"a LoRA adapter needs both")
            found = tuple(pair[which].get_shape())
            if found != shape:
                raise ConversionError(
                    f"{key} has shape {found}, expected {shape} on this {family.name} model "
                    f"(hidden {model_cfg.hidden_size}, {model_cfg.num_layers} layers) with "
                    f"adapter_config.json's r: it is another model's adapter, or r is not the "
                    f"rank of its tensors")
    return modules


# ------------------------------------------------------------------ tensors

def _tensor(value: Any, key: str) -> torch.Tensor:
    tensor = value[:] if not isinstance(value, torch.Tensor) else value
    if not tensor.is_floating_point() or not bool(torch.isfinite(tensor).all()):
        raise ConversionError(f"{key} must hold finite floating-point numbers "
                              f"({'not finite' if tensor.is_floating_point() else tensor.dtype})")
    return tensor


def _fused_pieces(a: torch.Tensor, b: torch.Tensor, experts: int
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each expert's (A, B) of a fused parameter's LoRA (hf_peft_names:
    A's rows expert-major, B's columns expert-minor)."""
    r = a.shape[0] // experts
    b = b.reshape(b.shape[0], r, experts)
    return [(a[e * r:(e + 1) * r], b[:, :, e]) for e in range(experts)]


def _joined(rows: int, pieces: list[tuple[int, torch.Tensor, torch.Tensor]]
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """One ptdp layer's (A, B) from its Hugging Face layers' (start row,
    A, B): their common A with their B's rows where they share one
    (rows no piece covers get zeros), else their A's stacked along the
    rank with B block-diagonal."""
    a0 = pieces[0][1]
    shared = all(torch.equal(a, a0) for _, a, _ in pieces)
    rank = a0.shape[0] * (1 if shared else len(pieces))
    b_out = a0.new_zeros(rows, rank)
    for n, (start, a, b) in enumerate(pieces):
        columns = slice(0, rank) if shared else slice(n * a0.shape[0], (n + 1) * a0.shape[0])
        b_out[start:start + b.shape[0], columns] = b
    a_out = a0 if shared else torch.cat([a for _, a, _ in pieces])
    return a_out.contiguous(), b_out


def adapters_from_peft_state(state: dict[str, Any], peft: dict[str, Any], model_cfg: ModelConfig,
                             family: HFFamily
                             ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], int, bool]:
    """(ptdp layer name -> its (A, B), unpadded; the rank ptdp needs, the
    largest; whether every MoE layer's routed experts share one adapter)
    of a PEFT state (tensors or safetensors slices) whose config
    read_peft_directory accepted."""
    where = _where(peft, model_cfg, family)
    modules = _check_names_and_shapes(state, where, _expected_shapes(where, peft["r"], model_cfg),
                                      model_cfg, family)
    if not modules:
        raise ConversionError("adapter_model.safetensors holds no LoRA tensors")
    shapes = logical_shapes(model_cfg)
    gathered: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = defaultdict(list)
    for module, pair in sorted(modules.items()):
        a = _tensor(pair["A"], f"{PEFT_PREFIX}{module}.lora_A.weight")
        b = _tensor(pair["B"], f"{PEFT_PREFIX}{module}.lora_B.weight")
        kind, what = where[module]
        if kind == "piece":
            layer_name, piece = what
            gathered[layer_name].append((piece.start, a, b))
            continue
        i, parameter = what
        matrix = dict(FUSED_EXPERTS)[parameter]
        for e, (a_e, b_e) in enumerate(_fused_pieces(a, b, model_cfg.num_experts)):
            gathered[f"layers.{i}.mlp.experts.{e}.{matrix}"].append((0, a_e, b_e))
    layers = {}
    for name, pieces in gathered.items():
        starts = [start for start, _, _ in pieces]
        if len(set(starts)) != len(starts):
            raise ConversionError(f"the adapter holds {name}'s rows twice (an expert both per "
                                  f"expert and in the fused experts' parameters)")
        layers[name] = _joined(shapes[f"{name}.weight"][0], sorted(pieces, key=lambda p: p[0]))
    rank = max(a.shape[0] for a, _ in layers.values())
    return layers, rank, _experts_shared(layers, model_cfg)


def _experts_shared(layers: dict[str, tuple[torch.Tensor, torch.Tensor]],
                    model_cfg: ModelConfig) -> bool:
    """Whether the adapted routed experts of every MoE layer and matrix
    have one adapter (all adapted, all equal), as a ptdp export of
    --lora-share-expert-adapters writes them."""
    groups: dict[tuple[int, str], list[str]] = defaultdict(list)
    for layer in adaptable_layers(model_cfg):
        if layer.expert is not None:
            groups[(layer.layer, layer.target)].append(layer.name)
    adapted = [names for names in groups.values() if any(name in layers for name in names)]
    if not adapted or model_cfg.num_experts < 2:
        return False
    for names in adapted:
        if not all(name in layers for name in names):
            return False
        a0, b0 = layers[names[0]]
        if not all(torch.equal(layers[n][0], a0) and torch.equal(layers[n][1], b0) for n in names):
            return False
    return True
