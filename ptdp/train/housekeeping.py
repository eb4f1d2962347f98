"""Garbage collection, the device memory cache and profiling around the
training iterations: Megatron-LM's --manual-gc, --empty-unused-memory-level
and --profile flags.

The training loop calls the hooks of one `Housekeeping` per rank:

    start_training()        before the first iteration of this run
    before_iteration(i)     before 0-based iteration i
    after_iteration(done)   after the step of iteration `done` (1-based)
    evaluation()            a context around each evaluation
    finish()                when training ends, normally or not

Iteration numbers follow Megatron-LM's loop, whose counter is the number of
iterations done: --profile-step-start S and --profile-step-end E profile
the iterations after S are done until E are done, the log lines' iterations
S+1 to E (E - S iterations).
"""

from __future__ import annotations

import contextlib
import gc
from pathlib import Path
from typing import Any, Iterator

import torch

from ptdp import device as devices
from ptdp.config import TrainConfig
from ptdp.errors import UserError
from ptdp.plural import plural


class HousekeepingError(UserError):
    """A profiling setting that cannot work in this job (checked on every
    rank before the model is built)."""


def profiled_ranks(tr: TrainConfig) -> list[int]:
    """--profile-ranks, 0 when not given (Megatron-LM's default before it
    switched to all ranks)."""
    return [0] if tr.profile_ranks is None else list(tr.profile_ranks)


def profiling_problems(tr: TrainConfig, world_size: int) -> list[str]:
    """What only the job itself knows: its size."""
    outside = [r for r in profiled_ranks(tr) if r >= world_size] if tr.profile else []
    if outside:
        ranks = "rank 0" if world_size == 1 else f"ranks 0 to {world_size - 1}"
        return [f"--profile-ranks {' '.join(map(str, outside))}: the job has "
                f"{plural(world_size, 'process')}, {ranks}; choose ranks among them"]
    return []


def records_nothing(tr: TrainConfig, device: torch.device) -> bool:
    """--profile without --use-pytorch-profiler off CUDA: Megatron-LM's nsys
    capture range has nothing to capture. A note, not a refusal: Megatron-LM's
    own example scripts give --profile alone, and on a GPU outside nsys it
    records nothing either."""
    return tr.profile and not tr.use_pytorch_profiler and device.type != "cuda"


class Housekeeping:
    """One rank's garbage collection, memory cache release and profiler."""

    def __init__(self, tr: TrainConfig, device: torch.device, *, rank: int, world_size: int,
                 start_iteration: int = 0):
        problems = profiling_problems(tr, world_size)
        if problems:
            raise HousekeepingError("; ".join(problems))
        self.tr, self.device, self.rank = tr, device, rank
        self.profiles = tr.profile and rank in profiled_ranks(tr)
        if self.profiles and records_nothing(tr, device):
            print(f"ptdp: rank {rank}: --profile without --use-pytorch-profiler opens a CUDA "
                  f"capture range for nsys; on {device.type} nothing is profiled (add "
                  f"--use-pytorch-profiler and --tensorboard-dir DIR for a trace)", flush=True)
            self.profiles = False
        self.start_iteration = start_iteration
        self._profiler: Any = None       # the torch.profiler.profile, while it runs
        self._nsys_open = False          # cudaProfilerStart called, not yet stopped
        self._profile_done = False
        self._gc_was_enabled = gc.isenabled()

    # -------------------------------------------------------------- training

    def start_training(self) -> None:
        """--manual-gc: automatic collection off for the run, after one full
        collection of what building the model left behind (Megatron-LM)."""
        if self.tr.manual_gc:
            gc.disable()
            gc.collect()

    def before_iteration(self, iteration: int) -> None:
        """Open the profiled range before 0-based `iteration`."""
        if not self.profiles or self._profile_done:
            return
        tr = self.tr
        if tr.use_pytorch_profiler:
            # One warm-up iteration before the range when the run has one,
            # as Megatron-LM's schedule: the profiler's own start-up cost
            # stays out of the recorded iterations.
            warmup = 1 if tr.profile_step_start >= 1 + self.start_iteration else 0
            if self._profiler is None and iteration == tr.profile_step_start - warmup:
                self._profiler = self._pytorch_profiler(warmup)
                self._profiler.start()
        elif iteration == tr.profile_step_start and not self._nsys_open:
            devices.cuda_profiler_start()
            self._nsys_open = True

    def after_iteration(self, done: int) -> None:
        """After the step of iteration `done` (1-based): close the profiled
        range at --profile-step-end, collect every --manual-gc-interval
        iterations, release cached device memory (level >= 1)."""
        if self._profiler is not None:
            self._profiler.step()
            if done == self.tr.profile_step_end:
                self._stop_profiling(done)
        elif self._nsys_open and done == self.tr.profile_step_end:
            self._stop_profiling(done)
        if self.tr.manual_gc and self.tr.manual_gc_interval and done % self.tr.manual_gc_interval == 0:
            gc.collect()
        if self.tr.empty_unused_memory_level >= 1:
            devices.release_cached_memory(self.device)

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[None]:
        """Around an evaluation: a full collection before it, and one of the
        youngest generation (what the evaluation made) after it, unless
        --no-manual-gc-eval; cached device memory released after it at
        --empty-unused-memory-level 2."""
        collect = self.tr.manual_gc and self.tr.manual_gc_eval
        if collect:
            gc.collect()
        yield
        if collect:
            gc.collect(generation=0)
        if self.tr.empty_unused_memory_level >= 2:
            devices.release_cached_memory(self.device)

    def finish(self, done: int | None = None) -> None:
        """Training ended after `done` iterations (None: unknown, an error):
        close a profiled range still open, turn automatic collection back on."""
        if self._profiler is not None or self._nsys_open:
            self._stop_profiling(done, early=True)
        elif self.profiles and not self._profile_done and done is not None:
            print(f"ptdp: rank {self.rank}: nothing profiled: the run ended after iteration {done}, "
                  f"before --profile-step-start {self.tr.profile_step_start} was reached"
                  if done <= self.tr.profile_step_start else
                  f"ptdp: rank {self.rank}: nothing profiled: the run started after iteration "
                  f"{self.start_iteration}, past --profile-step-start {self.tr.profile_step_start}",
                  flush=True)
        if self.tr.manual_gc and self._gc_was_enabled:
            gc.enable()

    # -------------------------------------------------------------- profiling

    def _pytorch_profiler(self, warmup: int):
        """A profiler over the range, writing its trace under --tensorboard-dir
        (TensorBoard's profiler plugin reads it there) as rank<R>.*.pt.trace.json."""
        tr = self.tr
        return torch.profiler.profile(
            schedule=torch.profiler.schedule(wait=0, warmup=warmup,
                                             active=tr.profile_step_end - tr.profile_step_start,
                                             repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(
                str(tr.tensorboard_dir), worker_name=f"rank{self.rank}"))

    def _stop_profiling(self, done: int | None, early: bool = False) -> None:
        tr = self.tr
        first = tr.profile_step_start + 1
        last = done if early and done is not None else tr.profile_step_end
        if self._profiler is not None:
            self._profiler.stop()  # writes the trace when the range ended early
            self._profiler = None
            where = f"a trace in {Path(tr.tensorboard_dir)}"
        else:
            devices.cuda_profiler_stop()
            self._nsys_open = False
            where = "the nsys capture range"
        self._profile_done = True
        if early:
            print(f"ptdp: rank {self.rank}: training ended before --profile-step-end "
                  f"{tr.profile_step_end}; profiled iterations {first} to {last} into {where}",
                  flush=True)
        else:
            print(f"ptdp: rank {self.rank}: profiled iterations {first} to {last} into {where}",
                  flush=True)
