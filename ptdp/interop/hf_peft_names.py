"""Where ptdp's adapted layers sit in a Hugging Face model under PEFT, and
the names PEFT gives their LoRA tensors (hf_peft.py converts the tensors).

The base model's name tables (hf_llama.name_map, hf_moe.name_pairs) say
which rows of each fused ptdp matrix every Hugging Face linear layer is:
q_proj, k_proj and v_proj are row blocks of `query_key_value`, gate_proj
and up_proj of `dense_h_to_4h`. A ptdp layer's adapter reaches PEFT as one
LoRA per such layer, named after the module:

    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight   [rows, r]

transformers 5 keeps an MoE layer's routed experts as two 3-D parameters
of one module, `mlp.experts.gate_up_proj` [E, 2f, h] (each expert's gate
rows, then its up rows) and `mlp.experts.down_proj` [E, h, f]. PEFT adapts
them through `target_parameters` (lora.ParamWrapper): one wrapper per
parameter, nested in the order the module registers them (gate_up_proj
innermost), so with both adapted gate_up_proj's LoRA is
`mlp.experts.base_layer.lora_A.weight` and down_proj's
`mlp.experts.lora_A.weight`. Each expert has its own rank-r pair:

    lora_A.weight [E·r, in]: expert e's A is rows e·r to (e+1)·r;
    lora_B.weight [out, r·E]: expert e's B is columns e, E + e, 2E + e, ...
    (ParamWrapper.get_delta_weight reshapes it to [out, r, E]).

Before transformers 5 the experts were linear layers of their own
(`mlp.experts.3.gate_proj`, Mixtral's `block_sparse_moe.experts.3.w1`);
adapters saved then are read too (the base name tables have those names).

Why the MLPs of Qwen2-MoE and Qwen3-MoE go through `target_parameters` as
`…gate_proj.weight`: for those model types PEFT (on transformers 5) turns
a target_modules entry named gate_proj, up_proj or down_proj into the
routed experts' fused parameters, so a dense layer's or the shared
expert's MLP named in target_modules would be taken for the experts. A
2-D parameter wrapped by ParamWrapper computes what lora.Linear does, and
its tensors have the same names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

from ptdp.config import ModelConfig
from ptdp.interop.family import HFFamily
from ptdp.interop.hf_files import ConversionError
from ptdp.interop.hf_llama import DenseHFFamily, NamePair, name_map
from ptdp.interop.hf_moe import MoEHFFamily, name_pairs
from ptdp.model.adapters import AdaptableLayer, adaptable_layers

PEFT_PREFIX = "base_model.model."  # PeftModel's prefix of the base model's names
# The fused experts' parameters, in the order their module registers them
# (which is the order PEFT nests its wrappers in, innermost first), and the
# ptdp matrix each one is per expert.
FUSED_EXPERTS = (("gate_up_proj", "dense_h_to_4h"), ("down_proj", "dense_4h_to_h"))
_FUSED_OF = {ours: theirs for theirs, ours in FUSED_EXPERTS}


@dataclass(frozen=True)
class Piece:
    """One Hugging Face linear layer (`module`, as named in the base
    model) that is the rows `start` to `start + rows` of a ptdp layer."""
    module: str
    start: int
    rows: int


def base_name_table(config: ModelConfig,
                    family: HFFamily) -> dict[str, tuple[tuple[str, int], ...]]:
    """ptdp logical name -> ((Hugging Face tensor name, rows), ...) of the
    family's base model (hf_llama's, hf_moe's or hf_gemma3's table); refuses a family
    whose layers PEFT adapts in another form (GPT-2's Conv1D)."""
    pairs: list[NamePair]
    if isinstance(family, DenseHFFamily):
        pairs = name_map(config)
    elif isinstance(family, MoEHFFamily):
        pairs = name_pairs(config, family.name)
    elif family.name == "Gemma 3":   # Llama's attention and MLP names
        from ptdp.interop.hf_gemma3 import name_pairs as gemma3_name_pairs
        pairs = gemma3_name_pairs(config)
    elif family.name == "GPT-2":
        raise ConversionError(
            f"PEFT adapters convert for the Llama-like, MoE and Gemma 3 families only, not "
            f"{family.name}: "
            f"its attention and MLP are Conv1D layers ([in, out]), which PEFT adapts with "
            f"fan_in_fan_out; convert such a model's adapters merged into its weights instead")
    else:
        raise ConversionError(
            f"PEFT adapters convert for the Llama-like, MoE and Gemma 3 families only, not yet for "
            f"{family.name}: convert its adapters merged into its weights instead "
            f"(ptdp convert --merge-lora, then --to-hf)")
    return dict(pairs)


def layer_pieces(config: ModelConfig, family: HFFamily) -> dict[str, list[Piece]]:
    """Every adaptable ptdp layer (by its name, `layers.3.attention.
    query_key_value`) -> the Hugging Face linear layers its rows are, in
    the base model's published layout (routed experts per expert, as
    adapters before transformers 5 have them)."""
    table = base_name_table(config, family)
    found = {}
    for layer in adaptable_layers(config):
        start, pieces = 0, []
        for name, rows in table[f"{layer.name}.weight"]:
            pieces.append(Piece(name.removesuffix(".weight"), start, rows))
            start += rows
        found[layer.name] = pieces
    return found


def uses_parameter_targets(family: HFFamily) -> bool:
    """Whether the family's dense MLPs and shared experts are adapted
    through target_parameters (the module docstring says why)."""
    return isinstance(family, MoEHFFamily) and family.model_type in ("qwen2_moe", "qwen3_moe")


def experts_module(layer: int) -> str:
    """The module holding an MoE layer's fused experts (transformers 5)."""
    return f"model.layers.{layer}.mlp.experts"


def fused_module_names(layer: int, adapted: Iterable[str]) -> dict[str, str]:
    """Fused parameter (gate_up_proj, down_proj) -> the module name its
    LoRA tensors have, for those of `adapted` on MoE layer `layer`: the
    outermost wrapper is the experts module's own name, each one inside it
    one `.base_layer` deeper."""
    adapted = [name for name, _ in FUSED_EXPERTS if name in set(adapted)]
    module = experts_module(layer)
    return {name: module + ".base_layer" * (len(adapted) - 1 - depth)
            for depth, name in enumerate(adapted)}


def fused_parameter(layer: AdaptableLayer) -> str:
    """The fused parameter a routed expert's ptdp matrix is a slice of."""
    return _FUSED_OF[layer.name.rsplit(".", 1)[1]]


def shortest_targets(chosen: Iterable[str], candidates: Iterable[str],
                     leaf_parts: int) -> list[str]:
    """PEFT target names (it matches a name equal to the target or ending
    in "." + target) that pick exactly `chosen` among `candidates`: the
    last `leaf_parts` dotted parts of a chosen name (`q_proj`) where they
    pick no candidate outside `chosen` (every q_proj is adapted), else the
    full name."""
    chosen, candidates = sorted(set(chosen)), set(candidates)
    targets: list[str] = []
    for name in chosen:
        suffix = ".".join(name.split(".")[-leaf_parts:])
        picked = {c for c in candidates if c == suffix or c.endswith("." + suffix)}
        target = suffix if picked <= set(chosen) else name
        if target not in targets:
            targets.append(target)
    return targets


def matches_target(name: str, targets: Iterable[str] | str | None) -> bool:
    """Whether PEFT's target list (or regular expression) picks `name`."""
    if not targets:
        return False
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == target or name.endswith("." + target) for target in targets)
