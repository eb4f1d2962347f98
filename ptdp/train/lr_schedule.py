"""The learning rate of each iteration: Megatron-LM's OptimizerParamScheduler.

Megatron-LM counts its schedule in samples ("steps"): an iteration advances
it by that iteration's global batch, so a batch-size ramp-up (see
ptdp.data.batches) moves it by less early on. Iteration-based settings
become samples by multiplying with the global batch B (--lr-warmup-iters 10
is 10·B steps); sample-based ones (--train-samples) are samples already.
--lr-warmup-fraction sets the warm-up to that fraction of the decay length.

The lengths and the formulas, and the order of their floating-point
operations, are Megatron-LM's, so the learning rates are the same numbers.
So is when each rate applies (Megatron-LM's train_step): an iteration steps
the optimizer with the scheduler's current rate, the one at its position
*before* the iteration (the first iteration: the rate at 0 samples, 0 under
a warm-up); then, unless the step was skipped (an fp16 overflow), the
scheduler advances by the iteration's samples (`increment`), and the rate
logged for the iteration is the one it holds then: the next iteration's.
The Trainer keeps the position (Megatron-LM's num_steps); a checkpoint
records it with the schedule (lr_resume.py).

Styles, after a linear warm-up from 0 to --lr (then, past the decay length,
--min-lr; except constant, which stays at --lr):
  constant             --lr
  linear, cosine       from --lr to --min-lr over the decay length
  inverse-square-root  --lr · sqrt(warm-up / steps), not below --min-lr
  WSD                  warm-up, stable at --lr, then over the last
                       --lr-wsd-decay-iters/-samples of the decay length an
                       annealing to --min-lr shaped by --lr-wsd-decay-style:
                       exponential, linear, cosine or minus_sqrt

--decoupled-lr / --decoupled-min-lr (Megatron-LM's param-group max_lr and
min_lr of the word embedding and the output layer): a second schedule of the
same shape, lengths and warm-up start, from --decoupled-lr to
--decoupled-min-lr (default --min-lr); see `decoupled_from_config`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ptdp.config import TrainConfig


@dataclass(frozen=True)
class LRSchedule:
    max_lr: float
    min_lr: float
    warmup_steps: float            # samples; fractional with --lr-warmup-fraction
    decay_steps: int               # samples
    style: str                     # --lr-decay-style
    wsd_decay_steps: int | None = None   # samples of WSD's annealing
    wsd_style: str = "exponential"
    init_lr: float = 0.0           # the rate the warm-up starts from (Megatron's --lr-warmup-init)
    iteration_samples: int | None = None  # iteration-based runs: B, the samples of an iteration

    @classmethod
    def from_config(cls, train: "TrainConfig", global_batch: int) -> "LRSchedule":
        """The schedule of a run whose (final) global batch is `global_batch`."""
        iteration_samples = None
        if train.train_samples is None:  # iteration-based: iterations × B
            iteration_samples = global_batch
            decay = (train.lr_decay_iters or train.train_iters) * global_batch
            warmup = train.lr_warmup_iters * global_batch
            wsd = (None if train.lr_wsd_decay_iters is None
                   else train.lr_wsd_decay_iters * global_batch)
        else:
            decay = train.lr_decay_samples or train.train_samples
            warmup = train.lr_warmup_samples
            wsd = train.lr_wsd_decay_samples
        if train.lr_warmup_fraction is not None:
            warmup = train.lr_warmup_fraction * decay
        return cls(max_lr=float(train.lr), min_lr=train.min_lr, warmup_steps=warmup,
                   decay_steps=decay, style=train.lr_decay_style, wsd_decay_steps=wsd,
                   wsd_style=train.lr_wsd_decay_style, init_lr=float(train.lr_warmup_init),
                   iteration_samples=iteration_samples)

    @classmethod
    def decoupled_from_config(cls, train: "TrainConfig", global_batch: int) -> "LRSchedule | None":
        """The schedule of the word embedding and the output layer under
        --decoupled-lr, None without it. Megatron-LM's scheduler drives every
        parameter group with one step count, warm-up start and shape; a
        group only brings its own max_lr and min_lr (--decoupled-min-lr,
        or --min-lr when it is not given)."""
        if train.decoupled_lr is None:
            return None
        min_lr = train.min_lr if train.decoupled_min_lr is None else train.decoupled_min_lr
        return dataclasses.replace(cls.from_config(train, global_batch),
                                   max_lr=float(train.decoupled_lr), min_lr=min_lr)

    def increment(self, global_batch: int) -> int:
        """How far an iteration of `global_batch` samples advances the
        schedule: its samples (Megatron-LM's increment), or B for an
        iteration-based run (the same but during ptdp's ramp-up of an
        iteration-based run, which Megatron-LM refuses: it counts iterations)."""
        return global_batch if self.iteration_samples is None else self.iteration_samples

    def position(self, iterations: int, consumed: int) -> int:
        """The schedule's position after `iterations` iterations that consumed
        `consumed` samples, none skipped: those samples, or iterations × B
        for an iteration-based run."""
        if self.iteration_samples is not None:
            return iterations * self.iteration_samples
        return consumed

    def lr_after(self, iterations: int, consumed: int) -> float:
        """The rate logged for the iteration after which `iterations` are done
        and `consumed` samples consumed, none skipped: the one the next
        iteration steps with (see the module's docstring)."""
        return self.lr(self.position(iterations, consumed))

    def lr(self, steps: int) -> float:
        """The learning rate after `steps` samples."""
        max_lr, min_lr = self.max_lr, self.min_lr
        if self.warmup_steps > 0 and steps <= self.warmup_steps:
            return self.init_lr + ((max_lr - self.init_lr) * float(steps) / float(self.warmup_steps))
        if self.style == "constant":
            return max_lr
        if steps > self.decay_steps:
            return min_lr
        if self.style == "inverse-square-root":
            warmup = max(self.warmup_steps, 1)
            lr = max_lr * warmup ** 0.5 / (max(steps, 1) ** 0.5)
            return max(min_lr, lr)
        decay_ratio = float(steps - self.warmup_steps) / float(self.decay_steps - self.warmup_steps)
        if self.style == "linear":
            coefficient = 1.0 - decay_ratio
        elif self.style == "cosine":
            coefficient = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        elif self.style == "WSD":
            coefficient = self._wsd_coefficient(steps)
        else:
            raise ValueError(f"unknown --lr-decay-style {self.style!r}")
        return min_lr + coefficient * (max_lr - min_lr)

    def _wsd_coefficient(self, steps: int) -> float:
        """1 while stable, then the annealing's share of (--lr - --min-lr)."""
        anneal_start = self.decay_steps - self.wsd_decay_steps
        if steps <= anneal_start:
            return 1.0
        ratio = float(steps - anneal_start) / float(self.wsd_decay_steps)
        if self.wsd_style == "linear":
            return 1.0 - ratio
        if self.wsd_style == "cosine":
            return 0.5 * (math.cos(math.pi * ratio) + 1.0)
        if self.wsd_style == "exponential":
            return (2.0 * math.pow(0.5, ratio)) - 1.0
        if self.wsd_style == "minus_sqrt":
            return 1.0 - math.sqrt(ratio)
        raise ValueError(f"unknown --lr-wsd-decay-style {self.wsd_style!r}")
