"""`ptdp train`'s checks before launching that read the disk or the
machine (the settings' own checks are ptdp.config.validate's): --save,
--load and their checkpoints, the output paths, the reporting settings,
whether the model fits this machine's memory, and the free space a
checkpoint needs. Torch, the checkpoint code and the planner's memory
model are imported where they are used, so that the command line starts
without them."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

from ptdp.config import Config
from ptdp.config.base import is_count
from ptdp.output_paths import output_path_problems


def launch_problems(config: Config, env) -> list[str]:
    """Every problem these checks find, in the order they are reported:
    the checkpoint's, the reporting settings', the output paths', then the
    memory's (whose arithmetic needs a validated layout)."""
    return (_lora_problems(config) + _checkpoint_problems(config) + _reporting_problems(config)
            + _output_path_problems(config) + _memory_problems(config, env))


def _output_path_problems(config: Config) -> list[str]:
    """Every path the run writes, checked before launching (ptdp.output_paths),
    not at its first write (the loss curve's comes after the whole run).
    --save's own rules are `_save_directory_problems`'s; this adds what they
    leave to the shared check (a dangling link, a pseudo file system, a
    directory where no file can be created), once they pass."""
    tr, data = config.train, config.data
    problems = []
    if isinstance(tr.save, str) and not _save_directory_problems(tr.save):
        problems += output_path_problems("--save", tr.save, directory=True)
    for flag_name, path, directory, suffix in (
            ("--metrics-file", tr.metrics_file, False, None),
            ("--timeline", tr.timeline, False, ".png"),
            ("--loss-curve", tr.loss_curve, False, ".png"),
            ("--tensorboard-dir", tr.tensorboard_dir, True, None),
            ("--data-cache-path", data.data_cache_path, True, None)):
        if isinstance(path, str):
            problems += output_path_problems(flag_name, path, directory=directory, suffix=suffix)
    return problems


def resolve_reshard_after_forward(config: Config, env) -> list[str]:
    """ZeRO-3 under pipeline parallelism, --fsdp-reshard-after-forward not
    given: each stage keeps its gathered parameters through an iteration
    (one gather per layer, not two per microbatch: bench/reshard.py), unless
    by the memory model they would not fit and letting them go would; then
    it lets them go, and the note returned says so."""
    tr = config.train
    if tr.sharding_strategy != "optim_grads_params" or tr.fsdp_reshard_after_forward is not None \
            or config.parallel.pipeline_model_parallel_size == 1:
        return []
    tr.fsdp_reshard_after_forward = False
    if not _memory_problems(config, env):
        return []
    tr.fsdp_reshard_after_forward = True
    return ["ptdp: under pipeline parallelism ZeRO-3 keeps each stage's gathered parameters "
            "through an iteration by default, but by ptdp's memory model they would not fit "
            "here: each layer is let go after its forward and gathered again for its backward "
            "(--fsdp-reshard-after-forward)"]


def _memory_problems(config: Config, env) -> list[str]:
    """A model that cannot fit this machine's memory by the analytic model's
    estimate (ptdp.perf.fits), refused before its ranks allocate it."""
    from ptdp import device as devices
    from ptdp.perf.fits import memory_problems

    local = config.parallel.world_size if env is None else env.local_world_size
    try:
        kind = devices.resolve_kind(config.parallel.device, local)
    except RuntimeError:  # reported where the launch resolves it
        return []
    memory = None
    if kind == "cuda":
        import torch

        memory = devices.accelerator_shape(torch.device("cuda", 0 if env is None
                                                        else env.local_rank))[1]
    return memory_problems(config, kind=kind, local_processes=local, device_memory=memory)


def _reporting_problems(config: Config) -> list[str]:
    """--eval-*, --peak-tflops and --tensorboard-dir's package, before launching
    (the paths are `_output_path_problems`')."""
    tr, problems = config.train, []
    if not isinstance(tr.eval_interval, int) or tr.eval_interval < 0:
        problems.append(f"--eval-interval={tr.eval_interval!r} must be 0 (never) or a positive integer")
    if not is_count(tr.eval_iters, 0):
        problems.append(f"--eval-iters={tr.eval_iters!r} must be 0 (no evaluation) or a positive "
                        f"integer")
    if tr.peak_tflops is not None and not tr.peak_tflops > 0:
        problems.append(f"--peak-tflops={tr.peak_tflops!r} must be positive")
    if tr.tensorboard_dir:
        if importlib.util.find_spec("tensorboard") is None:
            problems.append("--tensorboard-dir needs the tensorboard package: pip install tensorboard")
    return problems


def _checkpoint_problems(config: Config) -> list[str]:
    """--save/--load/--save-interval/--keep-last, checked before launching."""
    from ptdp.checkpoint.store import CheckpointError, check_model_fits, read_metadata, resolve

    tr, problems = config.train, []
    for flag_name, value in (("--save-interval", tr.save_interval), ("--keep-last", tr.keep_last)):
        if value is not None and (not isinstance(value, int) or value < 1):
            problems.append(f"{flag_name}={value!r} must be a positive integer")
        elif value is not None and not tr.save:
            problems.append(f"{flag_name} needs --save DIR")
    if tr.save:
        from ptdp.checkpoint.store import save_inside_a_checkpoint
        from ptdp.checkpoint.lock import problem as save_in_use

        problems.extend(_save_directory_problems(tr.save))
        problems.extend(p for p in (save_inside_a_checkpoint(tr.save), save_in_use(tr.save)) if p)
    if tr.load:
        from ptdp.checkpoint.store import nothing_to_train
        from ptdp.train.lr_resume import schedule_problems

        try:
            directory = resolve(tr.load)
            metadata = read_metadata(directory)
            check_model_fits(metadata, config.model, directory)
            problems.extend(_adapter_checkpoint_problems(config, directory, metadata))
            if nothing_to_train(config) is None:  # (a finished run resumed: said, a success)
                problems.extend(schedule_problems(tr, tr.batch_size(config.parallel.dp),
                                                  metadata, directory))
        except CheckpointError as error:
            problems.append(str(error))
    return problems


def _lora_problems(config: Config) -> list[str]:
    """--lora-*: the targets against this model and layout (a name that
    matches nothing, a rank larger than a layer, an expert split the
    adapters do not support) and, where no --load gives the base, whether
    --pretrained-checkpoint's checkpoint is a base model."""
    from ptdp.model.adapters import adapter_problems

    par = config.parallel
    return adapter_problems(config.model, config.lora,
                            tensor_parallel=par.tensor_model_parallel_size,
                            expert_parallel=par.expert_model_parallel_size,
                            expert_tensor_parallel=par.expert_tensor_size)


def _adapter_checkpoint_problems(config: Config, directory, metadata: dict) -> list[str]:
    """--load's checkpoint against the run's LoRA settings: adapters need
    --lora-rank (or none of the --lora-* flags), a full model under LoRA is
    the base only with --finetune (--pretrained-checkpoint's way), and the
    adapters' base must still be there when --pretrained-checkpoint does not
    name it."""
    from ptdp.checkpoint.adapters import (base_directory, base_identity, check_lora_fits,
                                          check_same_base, is_adapter_checkpoint, recorded_base)
    from ptdp.checkpoint.store import CheckpointError, read_metadata

    tr, lora = config.train, config.lora
    adapters = is_adapter_checkpoint(metadata)
    if adapters and not lora.enabled:
        return [f"--load {directory} holds LoRA adapters, but --lora-rank is 0: leave every "
                f"--lora-* flag out to take the checkpoint's settings, or give them"]
    if lora.enabled and not adapters and not tr.finetune:
        return [f"--load {directory} holds a full model, not LoRA adapters: to train adapters "
                f"on it, give it as --pretrained-checkpoint {tr.load} (or --load it with "
                f"--finetune)"]
    if not adapters:
        return []
    check_lora_fits(metadata, lora, directory)
    base = base_directory(tr, metadata)
    base_metadata = None
    if base is not None:
        try:
            base_metadata = read_metadata(base)
        except (CheckpointError, OSError) as error:
            if tr.pretrained_checkpoint:
                raise
            return [f"--load {directory} holds adapters whose base, {base} (iteration "
                    f"{recorded_base(metadata).get('iteration')}), cannot be read ({error}): give "
                    f"the base as --pretrained-checkpoint BASE"]
    flag = "--pretrained-checkpoint" if tr.pretrained_checkpoint else "the recorded base"
    check_same_base(directory, metadata, base_identity(base, base_metadata, tr.seed), flag)
    return []


def _save_directory_problems(save: str) -> list[str]:
    """--save must be a directory this user can create or write into."""
    path = Path(save).absolute()
    if path.exists() and not path.is_dir():
        return [f"--save {save} is a file; give a directory"]
    existing = path
    while not existing.exists():  # the nearest ancestor that exists
        existing = existing.parent
    if not existing.is_dir():
        return [f"--save {save}: {existing} is a file, so the directory cannot be created under it; "
                f"choose another path"]
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == path else f"cannot be created ({existing} is not writable)"
        return [f"--save {save} {what} by this user; choose a directory you can write to"]
    return []


def checkpoint_bytes(config: Config) -> int:
    """What one checkpoint takes on disk: every logical weight in its
    training precision, the two Adam moments in fp32 and, with --bf16 or
    --fp16, the fp32 main weights."""
    from ptdp.perf.analytic.counts import parameter_count

    tr = config.train
    mixed = tr.bf16 or tr.fp16
    return parameter_count(config.model) * ((2 if mixed else 4) + 8 + (4 if mixed else 0))


def warn_about_free_space(config: Config) -> None:
    """A checkpoint that cannot fit fails hours later; say so now (a warning:
    other files may be removed by then, and the estimate is approximate)."""
    if not config.train.save:
        return
    existing = Path(config.train.save).absolute()
    while not existing.exists():
        existing = existing.parent
    needed, free = checkpoint_bytes(config), shutil.disk_usage(existing).free
    if free < needed:
        print(f"ptdp: warning: --save {config.train.save} has {_size(free)} free, but one "
              f"checkpoint of this model takes about {_size(needed)}; free space or choose "
              f"another --save before the first save", file=sys.stderr, flush=True)


def _size(count: float) -> str:
    """Bytes for people: 4.9 KiB, 3.0 GiB."""
    units, index = ("bytes", "KiB", "MiB", "GiB"), 0
    while count >= 1024 and index < len(units) - 1:
        count, index = count / 1024, index + 1
    return f"{count:.0f} bytes" if index == 0 else f"{count:.1f} {units[index]}"
