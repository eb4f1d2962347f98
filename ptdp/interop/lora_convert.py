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

from ptdp.checkpoint.adapters import check_adapter_base, load_adapted_model
from ptdp.checkpoint.carry import checkpoint_hf_files
from ptdp.checkpoint.store import CheckpointError, checkpoint_tokenizer, load_logical_model, resolve
from ptdp.config import ConfigError
from ptdp.config.lora import LoRAConfig
from ptdp.interop.convert import save_checkpoint
from ptdp.model.adapters import merged


def merge_lora(load: str, pretrained: str | None, save: str) -> int:
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
    path = save_checkpoint(save, plain, model, tokenizer_file=tokenizer, hf_files=carried)
    lora = config.lora
    layers = len({name.rsplit(".", 1)[0] for name in adapters})
    print(f"wrote {path}: the base with {layers} adapters of rank {lora.lora_rank} merged "
          f"(W + {lora.lora_alpha:g}/{lora.lora_rank}·B A) from iteration "
          f"{metadata['iteration']} of {resolve(load)}; it loads as any checkpoint (--load, "
          f"--to-hf, ptdp generate)")
    return 0


def export_peft(load: str, pretrained: str | None, directory: str) -> int:
    """The adapters of `load` as a PEFT directory for the base --to-hf
    exports (their base is checked, not read: PEFT files hold adapters only)."""
    from ptdp.interop.hf_peft import save_peft_directory

    try:
        check_adapter_base(load, pretrained)
        config, adapters, metadata = load_logical_model(load)
        if not config.lora.enabled:
            raise CheckpointError(f"--load {resolve(load)} holds a full model, not LoRA "
                                  f"adapters: export it with --to-hf DIR")
    except CheckpointError as error:
        raise ConfigError([str(error)]) from None
    save_peft_directory(directory, adapters, config.model, config.lora)
    lora = config.lora
    print(f"wrote {directory}: {len(adapters) // 2} LoRA adapters of rank {lora.lora_rank} "
          f"(alpha {lora.lora_alpha:g}) from iteration {metadata['iteration']} of "
          f"{resolve(load)}; load them with peft.PeftModel.from_pretrained(base, "
          f"{directory!r}) on the base model exported with --to-hf")
    return 0


def import_peft(directory: str, pretrained: str, save: str) -> int:
    """A PEFT LoRA directory as ptdp adapters on the base `pretrained`:
    an adapter checkpoint (no optimizer state) that --load resumes
    training from, and that generate and --merge-lora take."""
    from ptdp.checkpoint.adapters import LORA_BASE, base_identity
    from ptdp.checkpoint.store import read_metadata
    from ptdp.config import Config
    from ptdp.interop.hf_peft import from_peft
    from ptdp.model.adapters import adapter_problems

    try:
        base = resolve(pretrained)
        base_metadata = read_metadata(base)
        config = Config.from_dict(base_metadata["config"])
        if config.lora.enabled:
            raise CheckpointError(f"--pretrained-checkpoint {base} holds LoRA adapters, not a "
                                  f"base model: give the base's checkpoint")
        carried = checkpoint_hf_files(base, base_metadata)
        tokenizer = checkpoint_tokenizer(base)
    except CheckpointError as error:
        raise ConfigError([str(error)]) from None
    adapters, lora = from_peft(directory, config.model)
    problems = adapter_problems(config.model, lora)
    if problems:
        raise ConfigError([f"{directory}: {problem}" for problem in problems])
    adapted = dataclasses.replace(config, lora=lora)
    path = save_checkpoint(save, adapted, {name: t.float() for name, t in adapters.items()},
                           tokenizer_file=tokenizer, hf_files=carried,
                           records={LORA_BASE: base_identity(base, base_metadata,
                                                             config.train.seed)})
    print(f"wrote {path}: {len(adapters) // 2} LoRA adapters of rank {lora.lora_rank} (alpha "
          f"{lora.lora_alpha:g}) on the base {base}; train on with --load {save} (their "
          f"--lora-* settings and base come from it), or generate and --merge-lora with it")
    return 0
