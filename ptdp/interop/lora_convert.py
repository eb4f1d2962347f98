"""`ptdp convert` for LoRA adapters: merging them into their base, and (with
hf_peft.py) Hugging Face PEFT directories both ways.

    ptdp convert --merge-lora --load ADAPTERS [--pretrained-checkpoint BASE] --save MERGED
    ptdp convert --to-hf-peft DIR --load ADAPTERS [--pretrained-checkpoint BASE]
    ptdp convert --from-hf-peft DIR --pretrained-checkpoint BASE --save ADAPTERS

The base is --pretrained-checkpoint's, else the one the adapters record; its
seal must be the recorded one (ptdp.checkpoint.adapters). A merged
checkpoint is an ordinary model-only checkpoint, W + (α/R)·B A in each
adapted layer, with the adapters' tokenizer and carried Hugging Face
files: it trains, generates and exports like any.
"""

from __future__ import annotations

import dataclasses

from safetensors import SafetensorError

from ptdp.checkpoint.adapters import load_adapted_model
from ptdp.checkpoint.carry import checkpoint_hf_files
from ptdp.checkpoint.lock import SaveDirectoryInUse
from ptdp.checkpoint.store import CheckpointError, checkpoint_tokenizer, resolve, save_logical_model
from ptdp.config import ConfigError
from ptdp.config.lora import LoRAConfig
from ptdp.model.adapters import merged


def merge_lora(load: str, pretrained: str | None, save: str) -> int:
    from ptdp.interop.convert import _missing_directories, _remove_empty, _write_failed, \
        _write_failure

    try:
        config, weights, metadata, adapters = load_adapted_model(load, pretrained)
        if adapters is None:
            raise CheckpointError(f"--load {resolve(load)} holds a full model, not LoRA "
                                  f"adapters: there is nothing to merge")
        carried = checkpoint_hf_files(resolve(load), metadata)
        tokenizer = checkpoint_tokenizer(load)
    except CheckpointError as error:
        raise ConfigError([str(error)]) from None
    base = {name: tensor for name, tensor in weights.items() if name not in adapters}
    model = merged(base, adapters, config.model, config.lora)
    plain = dataclasses.replace(config, lora=LoRAConfig())
    made = _missing_directories(save)
    try:
        path = save_logical_model(save, plain, model, tokenizer_file=tokenizer, hf_files=carried)
    except (CheckpointError, SaveDirectoryInUse) as error:
        raise ConfigError([str(error)]) from None
    except (OSError, SafetensorError) as error:
        failure = _write_failure(error)
        if failure is None:
            raise
        _remove_empty(made)
        raise _write_failed("--save", save, "checkpoint", failure) from None
    lora = config.lora
    layers = len({name.rsplit(".", 1)[0] for name in adapters})
    print(f"wrote {path}: the base with {layers} adapters of rank {lora.lora_rank} merged "
          f"(W + {lora.lora_alpha:g}/{lora.lora_rank}·B A) from iteration "
          f"{metadata['iteration']} of {resolve(load)}; it loads as any checkpoint (--load, "
          f"--to-hf, ptdp generate)")
    return 0
