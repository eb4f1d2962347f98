"""The multi-token prediction (MTP) layers' names in published DeepSeek-V3 /
GLM-4.5 checkpoints <-> ptdp's MTP parameters (ptdp.model.mtp).

transformers builds no MTP layers (it drops their tensors on load, so a
directory its save_pretrained wrote has none: hf_glm4_moe.without_absent_mtp
imports that without MTP), but the published files keep them after the last
decoder layer: with L decoder layers and D MTP modules, module k = 0 .. D-1
is `model.layers.{L + k}.`, a whole decoder layer of the family
(self_attn.*, mlp.*, input_layernorm, post_attention_layernorm) plus

    published (model.layers.{L+k}.)   ptdp (mtp.layers.{k}.)
    enorm.weight                      enorm.weight        the next token's embedding's norm
    hnorm.weight                      hnorm.weight        the previous hidden state's norm
    eh_proj.weight [h, 2h]            eh_proj.weight      columns [embedding | hidden], unchanged
    shared_head.norm.weight           final_layernorm.weight
    (the decoder layer's tensors)     transformer_layer.* (named as the decoder's layers.{i}.*)

and often `embed_tokens.weight` and `shared_head.head.weight`, copies of
the model's word embedding and output layer, which ptdp's MTP modules share
instead of keeping their own (`mtp_copies`): import checks they equal the
model's own, export writes them.

A family states its decoder layers' name table; `mtp_name_pairs` derives
the MTP modules' from its last layer's entries (ptdp builds each MTP
module's layer as the model's last layer: dense or MoE alike).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

# (ptdp logical name, ((Hugging Face name, rows), ...)), as hf_llama's NamePair.
NamePair = tuple[str, tuple[tuple[str, int], ...]]
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
# The MTP module's own tensors besides its decoder layer: published -> ptdp suffix.
_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
        "eh_proj.weight": "eh_proj.weight", "shared_head.norm.weight": "final_layernorm.weight"}
# The copies of the model's tensors a published MTP module may carry.
_COPIES = ("embed_tokens.weight", "shared_head.head.weight")
_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")


def hf_prefix(num_layers: int, k: int) -> str:
    """Module k's (0-based) full published prefix, after L = `num_layers` decoder layers."""
    return f"model.layers.{num_layers + k}."


def mtp_name_pairs(pairs: list[NamePair], num_layers: int, depth: int,
                   hidden_size: int) -> list[NamePair]:
    """The name table of `depth` MTP modules, from a family's table `pairs`
    of the decoder (ptdp `layers.{i}.*` <-> published `model.layers.{i}.*`):
    module k's layer is the last layer's entries renamed, plus enorm,
    hnorm, eh_proj and the final norm (one tensor each, unchanged; h rows:
    `hidden_size`)."""
    last_ours, last_theirs = f"layers.{num_layers - 1}.", f"model.layers.{num_layers - 1}."
    layer = [(ours, theirs) for ours, theirs in pairs if ours.startswith(last_ours)]
    out: list[NamePair] = []
    for k in range(depth):
        ours_prefix, theirs_prefix = f"mtp.layers.{k}.", hf_prefix(num_layers, k)
        for theirs, ours in _OWN.items():
            out.append((ours_prefix + ours, ((theirs_prefix + theirs, hidden_size),)))
        for ours, theirs in layer:
            renamed = tuple((theirs_prefix + name.removeprefix(last_theirs), rows)
                            for name, rows in theirs)
            out.append((ours_prefix + "transformer_layer." + ours.removeprefix(last_ours),
                        renamed))
    return out


def mtp_copies(num_layers: int, depth: int, tied_output: bool) -> dict[str, str]:
    """The published copies each MTP module may carry -> the logical tensor
    they copy (the output layer's is the word embedding when tied)."""
    output = EMBEDDING if tied_output else OUTPUT_LAYER
    return {hf_prefix(num_layers, k) + name: (EMBEDDING if name == "embed_tokens.weight"
                                              else output)
            for k in range(depth) for name in _COPIES}


def mtp_layer_numbers(state: Mapping[str, Any], num_layers: int) -> list[int]:
    """The layer numbers >= L that a state's keys (with or without
    `model.`) name, sorted: its MTP modules' (L + k)."""
    found = {int(match.group(1)) for match in map(_LAYER.match, state) if match}
    return sorted(n for n in found if n >= num_layers)


def without_mtp_layers(state: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """`state` without the keys of layers >= L (the MTP modules')."""
    return {key: value for key, value in state.items()
            if not ((match := _LAYER.match(key)) and int(match.group(1)) >= num_layers)}
