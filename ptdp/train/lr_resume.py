"""The learning-rate schedule a resumed run continues: Megatron-LM's
OptimizerParamScheduler.state_dict / load_state_dict.

A checkpoint records the schedule it was trained with, in samples as the
scheduler counts (peak and final rate, warm-up and where it starts, decay style and length,
WSD's annealing, --decoupled-lr's pair), and the scheduler's position
(`num_steps`: the samples of the steps taken, those skipped for an fp16
overflow left out), under metadata["lr_schedule"].

Resuming with the optimizer's state (not --finetune, not --no-load-optim,
which start the schedule afresh, as in Megatron-LM), the run continues at
the recorded position. A command line whose schedule differs from the
recorded one (a longer --train-iters that moves the decay's end, another
--lr) is refused before launch, naming each difference and Megatron-LM's
two ways out:

  --use-checkpoint-opt_param-scheduler  the checkpoint's schedule goes on,
                                        whatever the command line says
  --override-opt_param-scheduler        the command line's, from the samples
                                        consumed (the rate changes at once)

Without the check a resume silently re-derived the schedule from the new
settings: a run of 10 iterations decayed to --min-lr, resumed to 15, rose
again. Checkpoints written before the record (and imported models, which
hold no optimizer state) are not checked; their position is re-derived from
the iteration and the samples consumed, as before.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ptdp.plural import plural
from ptdp.checkpoint.integrity import CheckpointError
from ptdp.train.lr_schedule import LRSchedule

if TYPE_CHECKING:
    from ptdp.config import TrainConfig

RECORD = "lr_schedule"  # the metadata key
OVERRIDE = "--override-opt_param-scheduler"
USE_CHECKPOINT = "--use-checkpoint-opt_param-scheduler"

Schedules = tuple[LRSchedule, "LRSchedule | None"]  # (--lr's, --decoupled-lr's or None)


def record(trainer) -> dict[str, Any]:
    """What a checkpoint stores: the trainer's schedules and position."""
    decoupled = trainer.decoupled_lr_schedule
    return {"schedule": dataclasses.asdict(trainer.lr_schedule),
            "decoupled": (None if decoupled is None
                          else {"max_lr": decoupled.max_lr, "min_lr": decoupled.min_lr}),
            "num_steps": trainer.lr_steps}


def recorded(metadata: dict) -> tuple[Schedules, int] | None:
    """The checkpoint's (schedules, position); None for a checkpoint without the record."""
    held = metadata.get(RECORD)
    if not held:
        return None
    known = {f.name for f in dataclasses.fields(LRSchedule)}
    main = LRSchedule(**{k: v for k, v in held["schedule"].items() if k in known})
    decoupled = (None if held.get("decoupled") is None
                 else dataclasses.replace(main, **held["decoupled"]))
    return (main, decoupled), held["num_steps"]


def checks_schedule(train: "TrainConfig") -> bool:
    """Whether --load's schedule is compared with the command line's: it is
    loaded (not --finetune or --no-load-optim) and neither flag chose."""
    return bool(train.load) and not train.finetune and train.load_optim \
        and not train.override_opt_param_scheduler and not train.use_checkpoint_opt_param_scheduler


def schedule_problems(train: "TrainConfig", global_batch: int, metadata: dict,
                      directory: Path | str) -> list[str]:
    """The refusal of a resume whose schedule differs from the checkpoint's
    (one problem listing every difference), or none."""
    held = recorded(metadata)
    if not checks_schedule(train) or held is None:
        return []
    (saved, saved_decoupled), _ = held
    main = LRSchedule.from_config(train, global_batch)
    decoupled = LRSchedule.decoupled_from_config(train, global_batch)
    iterations = train.train_samples is None
    differences = []
    for label, view, is_length in _settings(iterations):
        theirs, ours = view(saved, saved_decoupled), view(main, decoupled)
        if theirs != ours:
            differences.append(f"{label}: checkpoint {_shown(theirs, is_length, saved)}, "
                               f"requested {_shown(ours, is_length, main)}")
    if not differences:
        return []
    return [f"--load {directory} holds a learning-rate schedule other than this command "
            f"line's:\n    " + "\n    ".join(differences)
            + f"\n  give the checkpoint's settings, or add {USE_CHECKPOINT} (continue the "
              f"checkpoint's schedule) or {OVERRIDE} (follow this command line's from the "
              f"samples consumed; the rate changes at once)"]


def continue_schedule(trainer, metadata: dict, directory: Path | str) -> None:
    """On load: where the trainer's schedule stands (trainer.lr_steps), and
    under --use-checkpoint-opt_param-scheduler the checkpoint's schedules."""
    train = trainer.config.train
    iteration, consumed = int(metadata["iteration"]), int(metadata["consumed_samples"])
    if train.finetune or not train.load_optim:  # the scheduler starts afresh
        trainer.lr_steps = 0
        return
    held = recorded(metadata)
    if held is None or train.override_opt_param_scheduler:
        # Megatron-LM's override puts the position at the samples consumed.
        trainer.lr_steps = trainer.lr_schedule.position(iteration, consumed)
        return
    problems = schedule_problems(train, trainer.global_batch, metadata, directory)
    if problems:  # (`ptdp train` refuses it before launch)
        raise CheckpointError(problems[0])
    schedules, trainer.lr_steps = held
    if train.use_checkpoint_opt_param_scheduler:
        trainer.lr_schedule, trainer.decoupled_lr_schedule = schedules


def summary(train: "TrainConfig") -> str:
    """The start-up line's note on a flag that chose the schedule ('' without one)."""
    if not train.load or train.finetune or not train.load_optim:
        return ""
    if train.use_checkpoint_opt_param_scheduler:
        return f"; the learning-rate schedule is the checkpoint's ({USE_CHECKPOINT})"
    if train.override_opt_param_scheduler:
        return (f"; the learning-rate schedule is this command line's, from the samples consumed "
                f"({OVERRIDE})")
    return ""


def _settings(iterations: bool) -> list[tuple[str, Callable, bool]]:
    """(label, view of (main, decoupled), whether a length in samples) for
    each compared setting, the labels naming the run's own flags."""
    unit, length = ("iters", "--train-iters") if iterations else ("samples", "--train-samples")

    def wsd(view):
        return lambda m, d: view(m) if m.style == "WSD" else None

    return [
        ("--lr", lambda m, d: m.max_lr, False),
        ("--min-lr", lambda m, d: m.min_lr, False),
        ("--lr-warmup-init", lambda m, d: m.init_lr, False),
        (f"warm-up (--lr-warmup-{unit} or --lr-warmup-fraction)", lambda m, d: m.warmup_steps, True),
        (f"decay length (--lr-decay-{unit}, default {length})", lambda m, d: m.decay_steps, True),
        ("--lr-decay-style", lambda m, d: m.style, False),
        (f"WSD annealing (--lr-wsd-decay-{unit})", wsd(lambda m: m.wsd_decay_steps), True),
        ("--lr-wsd-decay-style", wsd(lambda m: m.wsd_style), False),
        ("--decoupled-lr", lambda m, d: None if d is None else d.max_lr, False),
        ("--decoupled-min-lr", lambda m, d: None if d is None else d.min_lr, False),
    ]


def _shown(value: Any, is_length: bool, schedule: LRSchedule) -> str:
    if value is None:
        return "none"
    if not is_length:
        return str(value)
    whole = float(value).is_integer()
    shown = f"{int(value):,} samples" if whole else f"{value:g} samples"
    per = schedule.iteration_samples
    if per and whole and int(value) % per == 0:
        shown += f" ({plural(int(value) // per, 'iteration')} of {per})"
    return shown
