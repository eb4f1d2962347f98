"""LoRA checkpoints: the adapters (and their optimizer state) only, with the
identity of the base model they were trained on.

A run with --lora-rank saves an ordinary checkpoint (store.py's format,
resharded on load like any) whose tensors are the adapters' logical tensors
(ptdp.model.adapters.adapter_shapes) and whose configuration has the lora
section on; `metadata["lora_base"]` names the base: the checkpoint
directory it was loaded from, its iteration and its metadata's seal
(integrity.SEAL, the sha256 that changes with any of its records), or,
for adapters on a model drawn from --seed, that seed. Loading adapters
loads that base first, and refuses one whose seal (or seed) differs: the
adapters of one base mean nothing on another.

The base is any full checkpoint: a pretraining run's, a fine-tune's, an
imported Hugging Face model's. It is read like --load --finetune reads
weights (the fp32 main weights where saved) into the frozen parameters,
in the training precision.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from ptdp.checkpoint.errors import CheckpointError
from ptdp.checkpoint.integrity import SEAL
from ptdp.checkpoint.store import Reader, check_model_fits, read_metadata, resolve
from ptdp.config.lora import LoRAConfig
from ptdp.parallel.sharding import SHARD_ATTR, shard

LORA_BASE = "lora_base"


def saved_lora(metadata: dict) -> LoRAConfig:
    """The checkpoint's LoRA settings (off for a checkpoint of a full model,
    and for one written before adapters existed)."""
    known = {f.name for f in dataclasses.fields(LoRAConfig)}
    section = metadata.get("config", {}).get("lora") or {}
    return LoRAConfig(**{k: v for k, v in section.items() if k in known})


def is_adapter_checkpoint(metadata: dict) -> bool:
    return saved_lora(metadata).enabled


def base_identity(directory: Path | None, metadata: dict | None, seed: int) -> dict[str, Any]:
    """What an adapter checkpoint records of its base (None: drawn from `seed`)."""
    if directory is None or metadata is None:
        return {"checkpoint": None, "seed": seed}
    return {"checkpoint": str(Path(directory).absolute()), "iteration": int(metadata["iteration"]),
            SEAL: metadata.get(SEAL)}


def recorded_base(metadata: dict) -> dict[str, Any]:
    return metadata.get(LORA_BASE) or {}


def check_same_base(adapters: Path, adapter_metadata: dict, base: dict[str, Any],
                    base_flag: str) -> None:
    """Refuse adapters trained on another base than `base` (base_identity's)."""
    recorded = recorded_base(adapter_metadata)
    if recorded.get("checkpoint") is None and base.get("checkpoint") is None:
        if recorded.get("seed") == base.get("seed"):
            return
        raise CheckpointError(
            f"--load {adapters} holds adapters trained on a model drawn from --seed "
            f"{recorded.get('seed')}, but this run's base is drawn from --seed {base.get('seed')}: "
            f"give --seed {recorded.get('seed')}")
    if recorded.get("checkpoint") is None:
        raise CheckpointError(
            f"--load {adapters} holds adapters trained on a model drawn from --seed "
            f"{recorded.get('seed')} (no base checkpoint), but {base_flag} {base['checkpoint']} "
            f"gives a base checkpoint: leave {base_flag} out")
    if recorded.get(SEAL) != base.get(SEAL):
        given = base.get("checkpoint") or f"a model drawn from --seed {base.get('seed')}"
        raise CheckpointError(
            f"--load {adapters} holds adapters for another base model: they were trained on "
            f"{recorded.get('checkpoint')} (iteration {recorded.get('iteration')}, metadata seal "
            f"{str(recorded.get(SEAL))[:12]}…), but the base given is {given}"
            + (f" (seal {str(base.get(SEAL))[:12]}…)" if base.get(SEAL) else "")
            + "; give that base as --pretrained-checkpoint, or train new adapters on this one "
              "(leave --load out)")


def check_lora_fits(metadata: dict, lora: LoRAConfig, directory: Path) -> None:
    """The run's adapters must be the checkpoint's: rank, scale, targets, sharing."""
    saved = saved_lora(metadata)
    fields = ("lora_rank", "lora_alpha", "lora_target_modules", "lora_share_expert_adapters")
    differences = [f"--{name.replace('_', '-')}: checkpoint {getattr(saved, name)!r}, requested "
                   f"{getattr(lora, name)!r}" for name in fields
                   if getattr(saved, name) != getattr(lora, name)]
    if differences:
        raise CheckpointError(f"--load {directory} holds other adapters:\n    "
                              + "\n    ".join(differences)
                              + "\n  give the checkpoint's --lora-* settings (leaving them all "
                                "out takes them from it), or train new adapters (leave --load out)")


def base_directory(train, adapter_metadata: dict | None) -> Path | None:
    """Where a LoRA run's base comes from: --pretrained-checkpoint, else the
    base an adapter checkpoint in --load records (None: drawn from --seed)."""
    if train.pretrained_checkpoint:
        return resolve(train.pretrained_checkpoint)
    recorded = recorded_base(adapter_metadata or {}).get("checkpoint")
    return Path(recorded) if recorded else None


def load_base_weights(chunks, directory: Path, metadata: dict, model, buffer) -> None:
    """The frozen parameters (the base: every parameter outside the gradient
    buffer) and the model's state buffers from a full checkpoint, each
    logical tensor cut into this rank's shard, in the training precision
    (ZeRO-3: written whole, then sharded: `buffer.gathered`)."""
    from ptdp.checkpoint.state import named_parameters, named_state_buffers

    if is_adapter_checkpoint(metadata):
        raise CheckpointError(f"{directory} holds LoRA adapters, not a base model: give the "
                              f"base's checkpoint (the adapters' metadata.json names it under "
                              f"{LORA_BASE!r})")
    check_model_fits(metadata, model, directory)
    reader = Reader(directory, metadata)
    with torch.no_grad(), buffer.gathered(write_back=True):
        for name, param in named_parameters(chunks):
            if param.requires_grad:
                continue  # an adapter
            main = f"optimizer/main/{name}"
            logical = reader.get(main if reader.has(main) else f"model/{name}")
            spec = getattr(param, SHARD_ATTR, None)
            local = shard(logical, spec) if spec is not None else logical
            if tuple(local.shape) != tuple(param.shape):
                raise CheckpointError(f"{directory}: {name} has shape {tuple(logical.shape)}, "
                                      f"which does not fit this model")
            param.copy_(local.to(param.dtype))
        for name, tensor in named_state_buffers(chunks):
            if reader.has(f"model/{name}"):
                tensor.copy_(reader.get(f"model/{name}"))


def with_checkpoint_lora(config, explicit) -> Any:
    """--load of adapters with no --lora-* flag given: the run's LoRA
    settings are the checkpoint's (those given must equal them: check_lora_fits)."""
    load = config.train.load
    if not isinstance(load, str) or any(key.startswith("lora.") for key in explicit):
        return config
    try:
        metadata = read_metadata(resolve(load))
    except CheckpointError:
        return config  # (reported by the checkpoint checks)
    if not is_adapter_checkpoint(metadata):
        return config
    return dataclasses.replace(config, lora=saved_lora(metadata))


def adapters_base(load: str | Path, pretrained: str | Path | None
                  ) -> tuple[Path, dict, Path | None, dict | None]:
    """(the adapters' directory and metadata, their base's directory and
    metadata) for `load`, checked: the base is --pretrained-checkpoint's,
    else the recorded one, and its seal the recorded one. A full model's
    checkpoint has no base (None, None), and refuses a --pretrained-checkpoint."""
    directory = resolve(load)
    metadata = read_metadata(directory)
    if not is_adapter_checkpoint(metadata):
        if pretrained is not None:
            raise CheckpointError(f"--pretrained-checkpoint {pretrained} is the base of LoRA "
                                  f"adapters, but --load {directory} holds a full model: leave "
                                  f"--pretrained-checkpoint out")
        return directory, metadata, None, None
    recorded = recorded_base(metadata).get("checkpoint")
    base = resolve(pretrained) if pretrained is not None else Path(recorded) if recorded else None
    if base is None:
        raise CheckpointError(f"--load {directory} holds adapters trained on a model drawn from "
                              f"--seed {recorded_base(metadata).get('seed')}, with no base "
                              f"checkpoint to load: there is nothing to apply them to")
    try:
        base_metadata = read_metadata(base)
    except OSError as error:
        raise CheckpointError(f"--load {directory} holds adapters whose base, {base}, cannot be "
                              f"read ({error}): give the base as --pretrained-checkpoint BASE")
    seed = int(metadata["config"].get("train", {}).get("seed", 1234))
    check_same_base(directory, metadata, base_identity(base, base_metadata, seed),
                    "--pretrained-checkpoint" if pretrained is not None else "the recorded base")
    return directory, metadata, base, base_metadata


def check_adapter_base(load: str | Path, pretrained: str | Path | None) -> None:
    """load_adapted_model's checks, on the metadata alone (before any rank starts)."""
    adapters_base(load, pretrained)


def load_adapted_model(load: str | Path, pretrained: str | Path | None = None
                       ) -> tuple[Any, dict[str, torch.Tensor], dict, dict | None]:
    """For generation and conversion: (config, logical weights, metadata,
    the adapters' logical tensors or None). For adapters, the weights are
    their base's (adapters_base) and the config the adapted model's; a full
    model's are its own."""
    from ptdp.checkpoint.store import load_logical_model

    _, _, base, _ = adapters_base(load, pretrained)
    config, weights, metadata = load_logical_model(load)
    if base is None:
        return config, weights, metadata, None
    _, base_weights, _ = load_logical_model(base)
    return config, {**base_weights, **weights}, metadata, weights
