"""A training run resumed from a checkpoint: what `--load` takes into the
trainer (its weights, optimizer state, random streams, through
ptdp.checkpoint.state) and what the loaded records mean to the run (the
learning-rate schedule, the loss watch, the lineage, a fine-tune's fresh
start), and the start-up line that says so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ptdp.checkpoint.adapters import (base_directory, base_identity, check_lora_fits,
                                     check_same_base, is_adapter_checkpoint, load_base_weights)
from ptdp.checkpoint.carry import hf_files_to_carry
from ptdp.checkpoint.integrity import OPTIMIZER_START, UNSEALED_NOTE, is_unsealed
from ptdp.checkpoint.retention import LINEAGE, Lineage, recorded_lineage
from ptdp.checkpoint.state import load_model_state, restore_rng
from ptdp.checkpoint.store import (FINETUNED_FROM, barrier, check_model_fits, read_metadata,
                                   resolve)
from ptdp.train import lr_resume
from ptdp.train.loss_range import LossRange
from ptdp.train.optimizer import LossScaler

def load_checkpoint(trainer, load: str | Path) -> dict[str, Any]:
    """Load into this rank's model, optimizer and random streams; returns the
    metadata (iteration, consumed_samples, ...). Every rank calls it.

    The weights are the fp32 main weights where the checkpoint saved them
    (the exact values), else the model's. What else is taken follows the
    run's settings, as Megatron-LM's load_checkpoint does:

    * --finetune: the weights only. The optimizer starts afresh (zero Adam
      moments, step count 0, the configured loss scale), the random streams
      are left as at a fresh run's start (below), and the trainer begins a
      lineage of its own (ptdp.checkpoint.retention): none of its checkpoints continues
      the loaded run's. The caller starts the run at iteration 0 with no
      sample consumed (Trainer's `start`), so the learning-rate schedule and
      the data order are a fresh run's too.
    * --no-load-optim: no optimizer state (as --finetune), and the
      learning-rate schedule starts again from its beginning at the loaded
      iteration (lr_resume.py): Megatron-LM keeps the scheduler's state
      with the optimizer's and skips both. The iteration, the consumed
      samples (so the data position and a batch ramp-up) and the lineage
      continue.
    * --no-load-rng: the random streams are left as building the model from
      --seed left them, a fresh run's at its start (as Megatron-LM leaves
      the states its initialisation left); the trainer is a new one.
    """
    tr = trainer.config.train
    take_optimizer = tr.load_optim and not tr.finetune
    take_rng = tr.load_rng and not tr.finetune
    directory = resolve(load)
    metadata = read_metadata(directory)
    check_model_fits(metadata, trainer.config.model, directory)
    state = trainer.training_state()
    if trainer.config.lora.enabled:
        _load_lora_base(trainer, directory, metadata)
    if trainer.config.lora.enabled and not is_adapter_checkpoint(metadata):
        has_optimizer = False  # the base itself (--finetune): the adapters start afresh
    else:
        has_optimizer = load_model_state(state, directory, metadata, take_optimizer)
    optimizer = trainer.optimizer
    if not tr.finetune and metadata.get("optimizer"):  # the run's count goes on
        trainer.skipped_iterations = int(metadata["optimizer"].get("skipped_iterations", 0))
    if has_optimizer:
        optimizer.steps = int(metadata["optimizer"]["steps"])
        optimizer.scaler.load_state_dict(metadata["optimizer"]["loss_scaler"])
        began = metadata["optimizer"].get(OPTIMIZER_START)  # None: a checkpoint before the record
        trainer.optimizer_start = None if began is None else tuple(began)
    else:
        _fresh_optimizer(optimizer)
        trainer.optimizer_start = (0 if tr.finetune else int(metadata["iteration"]),
                                   trainer.skipped_iterations)
    # Where the schedule stands, and whose it is (--no-load-optim: from its start).
    lr_resume.continue_schedule(trainer, metadata, directory)
    if take_rng:  # (else the streams stay as building the model from --seed left them)
        restore_rng(state, directory, metadata)
    # A fine-tune's loss is another run's: its window starts empty.
    trainer.loss_range = LossRange() if tr.finetune else LossRange.loaded(directory, metadata)
    if tr.finetune:
        trainer.checkpoint_lineage = Lineage.fresh()
        trainer.finetuned_from = {"checkpoint": str(directory.absolute()),
                                  "iteration": int(metadata["iteration"]),
                                  LINEAGE: recorded_lineage(directory, metadata)}
    else:
        trainer.checkpoint_lineage = Lineage.loaded(directory, metadata)
        trainer.finetuned_from = metadata.get(FINETUNED_FROM)
    if trainer.ctx.rank == 0:
        # read now: --keep-last may prune the loaded checkpoint
        state.carried_tokenizer = trainer.tokenizer_to_carry()
        trainer.carried_hf_files = hf_files_to_carry(state, directory, metadata)
    barrier(trainer.ctx)
    return metadata


def _load_lora_base(trainer, directory: Path, metadata: dict) -> None:
    """LoRA: the frozen base's weights, from --load itself where it is a full
    checkpoint (with --finetune: checked before launch), else from the base
    the adapters record or --pretrained-checkpoint, refused where its seal
    is not the recorded one. The base's identity goes into the run's saves."""
    tr = trainer.config.train
    if not is_adapter_checkpoint(metadata):
        base, base_metadata = directory, metadata
    else:
        check_lora_fits(metadata, trainer.config.lora, directory)
        base = base_directory(tr, metadata)
        base_metadata = read_metadata(base) if base is not None else None
        flag = "--pretrained-checkpoint" if tr.pretrained_checkpoint else "the recorded base"
        check_same_base(directory, metadata, base_identity(base, base_metadata, tr.seed), flag)
    if base is not None:
        load_base_weights(trainer.chunks, base, base_metadata, trainer.config.model,
                          trainer.buffer)
    trainer.lora_base = base_identity(base, base_metadata, tr.seed)


def _fresh_optimizer(optimizer) -> None:
    """Adam as before its first step: zero moments, step count 0 (so the bias
    correction starts again), the loss scale the settings give. The main
    weights are left: they are the loaded ones."""
    optimizer.exp_avg.zero_()
    optimizer.exp_avg_sq.zero_()
    optimizer.steps = 0
    optimizer.scaler = LossScaler.from_config(optimizer.config)


def load_summary(train, directory: Path, metadata: dict) -> str:
    """The start-up line saying what `--load` took (rank 0 prints it)."""
    iteration, consumed = int(metadata["iteration"]), int(metadata["consumed_samples"])
    if train.finetune:
        line = (f"ptdp: fine-tuning from {directory} (the weights of iteration {iteration}; "
                f"starting at iteration 0 with a fresh optimizer, learning-rate schedule and data "
                f"order, random streams from --seed {train.seed}, and checkpoints of a run of its "
                f"own)")
    else:
        line = (f"ptdp: resumed from {directory} after iteration {iteration} ({consumed:,} samples "
                f"consumed)")
        if not train.load_optim:
            line += ("; optimizer state not loaded (--no-load-optim): Adam's moments start at "
                     "zero and the learning-rate schedule starts again from its beginning")
        elif not any(name.startswith("optimizer/exp_avg/") for name in metadata["tensors"]):
            line += "; the checkpoint holds no optimizer state: Adam's moments start at zero"
        if not train.load_rng:
            line += (f"; random states not restored (--no-load-rng): the streams of --seed "
                     f"{train.seed}, as at a fresh run's start")
    if train.use_checkpoint_args:
        line += "; the model's settings are the checkpoint's (--use-checkpoint-args)"
    line += lr_resume.summary(train)
    if is_unsealed(metadata):
        line += f"\nptdp: note: {directory} was {UNSEALED_NOTE}"
    return line
