"""A training run's state as its checkpoints write and read it.

The trainer hands one `TrainingState` down at each save and load (DESIGN.md:
one typed training state is what checkpoints read and write): this rank's
model chunks, the flat buffer the optimizer's tensors follow, the optimizer,
where the run stands (iteration, consumed samples, where it and its
optimizer state began, iterations skipped), its lineage (retention.py), its
loss watch, the records training keeps in the metadata under keys of its
own, and what it carries from a loaded checkpoint (tokenizer, Hugging Face
files). Nothing in ptdp.checkpoint reads the trainer itself.

Loading fills the model's weights, the optimizer's moments and main weights
(`load_model_state`) and the random streams (`restore_rng`) of the state's
objects in place; what the other records mean to a resumed run (the
learning-rate schedule, the loss watch, a fine-tune's fresh start) is
training's to decide (ptdp.train.resume).
"""

from __future__ import annotations

import base64
import dataclasses
import json
from pathlib import Path
from typing import Any, Protocol, Sequence

import torch

from ptdp.checkpoint.errors import CheckpointError
from ptdp.checkpoint.integrity import verify_file
from ptdp.checkpoint.layout import layout_record, rng_file
from ptdp.checkpoint.retention import Lineage
from ptdp.checkpoint.store import OPTIMIZER_KINDS, Reader
from ptdp.config import Config
from ptdp.parallel.data_parallel import GradBuffer
from ptdp.parallel.sharding import SHARD_ATTR, shard
from ptdp.parallel.topology import ParallelContext


class AdamState(Protocol):
    """The optimizer's tensors a checkpoint holds, in the flat buffer's
    coordinates (this rank's part of each bucket under the distributed
    optimizer), its step count and its loss scaler."""

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    main: torch.Tensor   # the fp32 main weights (the buffer's own data where it is fp32)
    steps: int
    scaler: Any          # state_dict() / load_state_dict()


class LossWatch(Protocol):
    """Which checkpoint is known good (a save never prunes it): told of each
    save as it is taken."""

    good: Path | None

    def saved(self, checkpoint: Path) -> None: ...


@dataclasses.dataclass
class TrainingState:
    """One rank's training state, as a save writes it and a load fills it."""

    ctx: ParallelContext
    config: Config
    chunks: Sequence[torch.nn.Module]   # this rank's model chunks (their random streams: chunks[0].rng)
    num_chunks: int
    buffer: GradBuffer                  # the flat parameters; each one's segment in the optimizer's tensors
    optimizer: AdamState
    device: torch.device
    # Where the run stands at a save: the iterations done and samples consumed.
    iteration: int = 0
    consumed_samples: int = 0
    # (iteration, consumed samples) the run began after; (iteration, skipped
    # iterations) where its optimizer state began (None: unknown, an older
    # checkpoint's); the iterations skipped for an inf/nan gradient.
    run_start: tuple[int, int] = (0, 0)
    optimizer_start: tuple[int, int] | None = None
    skipped_iterations: int = 0
    lineage: Lineage | None = None
    loss_watch: LossWatch | None = None
    # Training's own records, stored in the metadata under their keys as given
    # (the learning-rate schedule's, the loss watch's).
    records: dict[str, Any] = dataclasses.field(default_factory=dict)
    finetuned_from: dict | None = None           # FINETUNED_FROM's record
    carried_tokenizer: bytes | None = None       # rank 0: the tokenizer.json carried
    carried_hf_files: dict[str, bytes] | None = None   # rank 0: carry.hf_files_to_carry
    lora_base: dict | None = None                # LoRA: the base's identity (adapters.py)


# ------------------------------------------------------------------ the model's tensors

def named_parameters(chunks: Sequence[torch.nn.Module]):
    """(logical name, parameter) of every parameter of this rank, once each
    (under zbv rank 0's two chunks share the tied word embedding)."""
    seen: set[int] = set()
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if id(param) not in seen:
                seen.add(id(param))
                yield name, param


def named_state_buffers(chunks: Sequence[torch.nn.Module]):
    """(name, tensor) of the model's saved state that is not a parameter:
    the MoE routers' expert biases (replicated on every tensor rank)."""
    for chunk in chunks:
        parameters = {name for name, _ in chunk.named_parameters()}
        for name, tensor in chunk.state_dict(keep_vars=True).items():
            if name not in parameters:
                yield name, tensor


# ------------------------------------------------------------------ loading

def load_model_state(state: TrainingState, directory: Path, metadata: dict,
                     take_optimizer: bool) -> bool:
    """This rank's weights (the fp32 main weights where the checkpoint saved
    them: the exact values, else the model's), its state buffers and, with
    `take_optimizer` and where the checkpoint holds them, Adam's moments,
    each logical tensor cut into this rank's shard. Returns whether the
    moments were loaded."""
    reader = Reader(directory, metadata)
    ctx, buffer, optimizer = state.ctx, state.buffer, state.optimizer
    segments = {id(s.param): s for s in buffer.segments}
    trained = [(name, param) for name, param in named_parameters(state.chunks)
               if id(param) in segments]  # (LoRA: the adapters; the base is frozen)
    first = trained[0][0] if trained else None
    has_optimizer = take_optimizer and reader.has(f"optimizer/exp_avg/{first}")
    flats = {kind: torch.zeros(buffer.numel, dtype=torch.float32, device=buffer.param_data.device)
             for kind in OPTIMIZER_KINDS}
    with torch.no_grad(), buffer.gathered(write_back=True):  # (ZeRO-3: written whole, re-sharded)
        for name, param in trained:
            spec = getattr(param, SHARD_ATTR, None)
            segment = segments[id(param)]
            # The fp32 main weights, where saved, are the exact values.
            main_name = f"optimizer/main/{name}"
            weights = reader.get(main_name if reader.has(main_name) else f"model/{name}")
            local = _local(weights, spec, param.shape, name, directory)
            param.copy_(local.to(param.dtype))
            flats["main"][segment.start:segment.end].copy_(local.reshape(-1))
            if has_optimizer:
                for kind in ("exp_avg", "exp_avg_sq"):
                    moment = _local(reader.get(f"optimizer/{kind}/{name}"), spec, param.shape,
                                    name, directory)
                    flats[kind][segment.start:segment.end].copy_(moment.reshape(-1))
        for name, tensor in named_state_buffers(state.chunks):  # (absent: a fresh start's value)
            if reader.has(f"model/{name}"):
                tensor.copy_(reader.get(f"model/{name}"))
        kinds = OPTIMIZER_KINDS if has_optimizer else ("main",)
        for kind in kinds:
            target = getattr(optimizer, kind)
            if kind == "main" and target.data_ptr() == buffer.param_data.data_ptr():
                continue  # fp32 without sharding: the main weights are the model's
            target.copy_(_owned(flats[kind], buffer, ctx))
    return has_optimizer


def _local(logical: torch.Tensor, spec, shape: torch.Size, name: str, directory: Path) -> torch.Tensor:
    local = shard(logical, spec) if spec is not None else logical
    if tuple(local.shape) != tuple(shape):
        raise CheckpointError(f"{directory}: {name} has shape {tuple(logical.shape)}, which does "
                              f"not fit this model (this rank's piece is {tuple(shape)})")
    return local


def _owned(full: torch.Tensor, buffer, ctx) -> torch.Tensor:
    """The inverse of snapshot._full_flat: this rank's part in the optimizer's coordinates."""
    if not buffer.shard:
        return full
    return torch.cat([full[slice(*buffer.owned_range(bucket))] for bucket in buffer.buckets])


# ------------------------------------------------------------------ random states

def rng_state(state: TrainingState) -> dict[str, str]:
    """This rank's random states, as its rng/ file holds them."""
    states = state.chunks[0].rng.get_states()
    states["cpu"] = torch.get_rng_state()
    return {name: base64.b64encode(value.cpu().numpy().tobytes()).decode() for name, value in
            states.items()}


def restore_rng(state: TrainingState, directory: Path, metadata: dict) -> None:
    """This rank's random streams as saved, under the same layout; under
    another, a fresh, reproducible seed (--seed + the checkpoint's iteration)."""
    file = rng_file(state.ctx)  # (another c: another layout, so reseeded)
    same_layout = metadata.get("layout") == layout_record(state)
    rng = state.chunks[0].rng
    if same_layout and file in metadata["files"]:
        verify_file(directory, file, metadata)
        saved = json.loads((directory / file).read_text())
        states = {name: torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
                  for name, text in saved.items()}
        torch.set_rng_state(states.pop("cpu"))
        rng.set_states(states)
    else:
        # No counterpart for this rank's streams: a fresh, reproducible seed.
        seed = state.config.train.seed + int(metadata["iteration"])
        rng.seed(seed, state.ctx)
        torch.manual_seed(seed)
