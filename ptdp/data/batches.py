"""How many samples each iteration takes, and how many iterations a run has.

Megatron-LM sizes an iteration's global batch by the number of samples
consumed before it, and so does ptdp. Without --rampup-batch-size it is
--global-batch-size throughout. With --rampup-batch-size START INCREMENT
SAMPLES it starts at START and grows by INCREMENT each time another
SAMPLES / ((B - START) / INCREMENT) samples have been consumed, until it is B;
after SAMPLES samples it is B (Megatron-LM's RampupBatchsizeNumMicroBatches-
Calculator, arithmetic included, so the sizes change at the same counts).

Because the size depends only on the consumed count, which a checkpoint
stores, a run resumed mid-ramp, under any layout, continues on the same ramp.

A ramp with --train-iters (which Megatron-LM refuses; its own 175B example
once did it) is the same ramp; the run is those iterations, whatever their
sizes.

A run's length is --train-iters, or with --train-samples the iterations
Megatron-LM counts for it (training.py's update_train_iters): with a constant
batch, the whole global batches that fit; with a ramp, every iteration that
starts within the ramp and within --train-samples, then the whole global
batches of B that fit in what is left. (The ramp's count may run one
iteration past --train-samples; Megatron-LM's does, and a run compared
iteration for iteration with Megatron-LM's must have its length.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ptdp.config import TrainConfig


class GlobalBatches:
    """The global batch of each iteration of one run at data-parallel size d."""

    def __init__(self, train: "TrainConfig", data_parallel_size: int):
        self.final = train.batch_size(data_parallel_size)   # B, after any ramp
        self.per_microbatch = train.micro_batch_size * data_parallel_size  # b·d
        self.train_samples = train.train_samples
        self.train_iters_given = train.train_iters
        self.ramp = tuple(train.rampup_batch_size) if train.rampup_batch_size else None
        if self.ramp is not None:
            start, increment, samples = self.ramp
            # A float, as Megatron-LM computes it: the sizes change where its do.
            self.samples_per_increment = samples / ((self.final - start) // increment)

    def size_at(self, consumed: int) -> int:
        """The global batch of an iteration that starts after `consumed` samples."""
        if self.ramp is None:
            return self.final
        start, increment, samples = self.ramp
        if consumed > samples:
            return self.final
        return start + int(consumed / self.samples_per_increment) * increment

    def microbatches_at(self, consumed: int) -> int:
        """m of that iteration: its global batch over b·d."""
        return self.size_at(consumed) // self.per_microbatch

    @property
    def train_iters(self) -> int:
        """The run's length in iterations (see the module's docstring)."""
        if self.train_samples is None:
            return self.train_iters_given
        if self.ramp is None:
            return self.train_samples // self.final
        iterations, consumed = 0, 0
        while consumed <= self.ramp[2] and consumed <= self.train_samples:
            consumed += self.size_at(consumed)
            iterations += 1
        if self.train_samples > consumed:
            iterations += (self.train_samples - consumed) // self.final
        return iterations

    def consumed_after(self, start_consumed: int, iterations: int) -> int:
        """Samples consumed after `iterations` more iterations from `start_consumed`."""
        if self.ramp is None:
            return start_consumed + iterations * self.final
        consumed = start_consumed
        for _ in range(iterations):
            consumed += self.size_at(consumed)
        return consumed


class ConsumedSamples:
    """Samples consumed before each iteration of a run that begins after
    iteration `start_iteration` with `start_consumed` samples consumed (a
    resumed run's checkpoint, or (0, 0)); remembered as they are computed."""

    def __init__(self, batches: GlobalBatches, start_iteration: int, start_consumed: int):
        self.batches = batches
        self.start_iteration = start_iteration
        self._before = [start_consumed]   # before start_iteration, start_iteration + 1, ...

    def before(self, iteration: int) -> int:
        """Samples consumed before 0-based `iteration` runs."""
        offset = iteration - self.start_iteration
        if self.batches.ramp is None:  # any iteration, also one before the start
            return self._before[0] + offset * self.batches.final
        if offset < 0:
            raise ValueError(f"iteration {iteration} is before this run's start "
                             f"({self.start_iteration}); on a ramp only later ones are known")
        while len(self._before) <= offset:
            last = self._before[-1]
            self._before.append(last + self.batches.size_at(last))
        return self._before[offset]
