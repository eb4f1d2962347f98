"""When a run stops before --train-iters: preemption signals, time limits,
--exit-interval, and divergence.

Every rank decides to stop at the same iteration boundary: each rank's local
view (a signal it received, a non-finite loss on the last stage, its own wall
clock) is combined by one small all-reduce (MAX) over the whole job after
every iteration, so all ranks save the same checkpoint and leave together.

Signals. A scheduler warns a job before killing it (SLURM: SIGTERM at the
time limit or on preemption, or a chosen signal earlier with --signal;
cloud schedulers: SIGTERM); a closed terminal sends SIGHUP. The first such
signal asks for a graceful stop; one that arrives later than
`REPEAT_WINDOW_SECONDS` after it stops the rank at once. Signals closer
together count as one request, because one request often reaches a rank
twice: directly (a scheduler signals every process of the job, a terminal
the whole process group) and forwarded by the launcher.

The handler's counting must work while the main thread is blocked inside a
collective (Python runs signal handlers only between bytecodes), so the
signals are read from a wake-up file descriptor by a small thread.

A request outlives the training loop, and Ctrl-C always stops at once:
ptdp.stop_requests holds the requests a process received or passed on (the
launcher's too) and what its last line says about them.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ptdp.config import signal_from_name
from ptdp.errors import DivergenceError
from ptdp.graceful_signals import GRACEFUL_SIGNALS
from ptdp import stop_requests
from ptdp.stop_requests import REPEAT_WINDOW_SECONDS, absorb_repeats_at_exit


class GracefulExit:
    """Counts the graceful-exit signals this process receives.

    `requested` holds the first signal's number (0: none). Install in the
    main thread; `close` at the end of the run restores the previous
    handlers unless a stop was requested (see the module's notes), and
    `uninstall` restores them in any case."""

    # Closed after a request and still counting; a new run in this process
    # (tests) uninstalls it first, so that handlers chain back correctly.
    _lingering: GracefulExit | None = None

    def __init__(self, names: tuple[str, ...], *, announce: bool):
        if GracefulExit._lingering is not None:
            GracefulExit._lingering.uninstall()
        self.requested = 0
        self._first_at = 0.0
        self._announce = announce
        self._signals = sorted({signal_from_name(name) for name in names})
        self._previous = {s: signal.signal(s, self._on_signal) for s in self._signals}
        read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._previous_wakeup = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        self._watcher = threading.Thread(target=self._watch, args=(read_fd,), daemon=True,
                                         name="ptdp-signals")
        self._watcher.start()

    def _on_signal(self, signum, frame) -> None:
        """The Python-level handler: the watcher thread does the counting."""

    def _watch(self, read_fd: int) -> None:
        with os.fdopen(read_fd, "rb", buffering=0) as pipe:
            while True:
                data = pipe.read(1)
                if not data:
                    return  # closed
                signum = data[0]
                if signum not in self._signals:
                    continue  # e.g. SIGINT, handled by Python as KeyboardInterrupt
                self._received(signum)

    def _received(self, signum: int) -> None:
        now = time.monotonic()
        name = signal.Signals(signum).name
        if not self.requested:
            self.requested, self._first_at = signum, now
            stop_requests.STOP_REQUESTS.note(signum)
            if self._announce:
                print(f"ptdp: {name} received: saving and stopping after the current iteration "
                      f"(send it again, 3 s or more later, to stop at once)", flush=True)
        elif now - self._first_at > REPEAT_WINDOW_SECONDS:
            print(f"ptdp: second {name}: stopping at once, without saving", file=sys.stderr,
                  flush=True)
            os._exit(128 + signum)

    def close(self) -> None:
        """The run is over. After a request the handlers stay, for the life
        of the process: it is leaving on that request, repeats of it within
        the window are still the same request, and a later signal still
        stops it at once."""
        if self.requested:
            GracefulExit._lingering = self
            absorb_repeats_at_exit(self._signals, self._first_at + REPEAT_WINDOW_SECONDS)
        else:
            self.uninstall()

    def uninstall(self) -> None:
        """Put the previous handlers back."""
        if GracefulExit._lingering is self:
            GracefulExit._lingering = None
        if self._write_fd < 0:
            return
        signal.set_wakeup_fd(self._previous_wakeup)
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        os.close(self._write_fd)  # ends the watcher
        self._write_fd = -1


@dataclass
class Verdict:
    """What the job agreed on after one iteration."""
    signal: int = 0            # a graceful-exit signal some rank received
    non_finite: bool = False   # loss or gradient norm is inf/nan (fp32/bf16 check)
    out_of_time: bool = False  # --exit-duration-in-mins would be passed by the next iteration
    # The iteration's loss on every rank (computed on the last stage only; inf
    # when not finite; None when no rank had one), for the loss-range watch.
    loss: float | None = None
    # The `memory` figures agree() was given, each its MAX over the ranks
    # (ptdp.train.peak_memory: the job's peak memory rides on this all-reduce).
    memory: tuple[float, ...] = ()

    @property
    def stop(self) -> bool:
        return bool(self.signal or self.out_of_time)


class StopConditions:
    """Decides, identically on every rank, whether the run goes on."""

    def __init__(self, train_config, device: torch.device, *, uses_loss_scaling: bool,
                 rank: int, is_logger: bool):
        self.tr, self.device = train_config, device
        self.check_non_finite = train_config.check_for_nan_in_loss_and_grad and not uses_loss_scaling
        self.uses_loss_scaling = uses_loss_scaling
        self.started = stop_requests.PROCESS_STARTED
        self.longest_iteration = 0.0  # seconds, evaluation included
        self.longest_save = 0.0
        self.consecutive_skipped = 0
        self.handler = None
        if train_config.exit_signal_handler and threading.current_thread() is threading.main_thread():
            self.handler = GracefulExit((*GRACEFUL_SIGNALS, train_config.exit_signal),
                                        announce=is_logger or rank == 0)

    def close(self) -> None:
        if self.handler is not None:
            self.handler.close()
            self.handler = None

    def agree(self, record: dict, memory: Sequence[float] = ()) -> Verdict:
        """After an iteration's step: combine every rank's view (collective);
        `memory`: numbers to take the MAX of over the ranks on the way."""
        loss, norm = record["loss"], record["grad_norm"]
        non_finite = self.check_non_finite and (
            (loss is not None and not math.isfinite(loss))
            or (norm is not None and not math.isfinite(norm)))
        out_of_time = False
        if self.tr.exit_duration_in_mins:
            # Stop while one more iteration and a save still fit in the limit
            # (the loop records whole iterations, evaluation included; this
            # one's step is all that is known after the first).
            iteration = max(self.longest_iteration, record["iteration_ms"] / 1e3)
            needed = time.monotonic() - self.started + iteration + self.longest_save
            out_of_time = needed > self.tr.exit_duration_in_mins * 60
        signum = self.handler.requested if self.handler is not None else 0
        own_loss = -math.inf if loss is None else loss if math.isfinite(loss) else math.inf
        view = torch.tensor([float(signum), float(non_finite), float(out_of_time), own_loss,
                             *memory], dtype=torch.float64, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(view, op=dist.ReduceOp.MAX)
        signum, non_finite, out_of_time, job_loss, *job_memory = view.tolist()
        signum, non_finite, out_of_time = int(signum), int(non_finite), int(out_of_time)
        return Verdict(signal=signum, non_finite=bool(non_finite), out_of_time=bool(out_of_time),
                       loss=None if job_loss == -math.inf else job_loss, memory=tuple(job_memory))

    def check_divergence(self, record: dict, verdict: Verdict, go_back: Callable[[], str]) -> None:
        """Raise DivergenceError when training can no longer make progress;
        `go_back()`, called only then, says which checkpoint to go back to
        (the loop's loss watch, loss_range.py)."""
        iteration = record["iteration"]
        if verdict.non_finite:
            kept = go_back()
            what = "loss" if record["loss"] is not None and not math.isfinite(record["loss"]) else None
            what = what or "gradient norm"
            raise DivergenceError(
                f"iteration {iteration}: the {what} is not finite; training has diverged (without "
                f"fp16's loss scale there is nothing to back off), so the run stops here and "
                f"{kept}. Lower --lr (now {self.tr.lr:g}), use --clip-grad, resume from an "
                f"earlier checkpoint, or pass --no-check-for-nan-in-loss-and-grad to run on")
        if self.uses_loss_scaling:
            self.consecutive_skipped = self.consecutive_skipped + 1 if record["skipped"] else 0
            limit = self.tr.max_consecutive_skipped_iterations
            if limit and self.consecutive_skipped >= limit:
                kept = go_back()
                raise DivergenceError(
                    f"iteration {iteration}: {self.consecutive_skipped} steps in a row were skipped "
                    f"for inf/nan gradients (loss scale now {record['loss_scale']:g}); the loss "
                    f"scale cannot recover, so the run stops here and {kept}. Lower --lr, use "
                    f"--bf16, resume from an earlier checkpoint, or raise "
                    f"--max-consecutive-skipped-iterations (0: never stop)")

    def stops_after(self, done: int, last: int, verdict: Verdict) -> str | None:
        """Why the run stops after iteration `done` before its `last`; None
        when it goes on (or `done` is its last)."""
        return self.exit_reason(done, verdict) if done < last else None

    def exit_reason(self, done: int, verdict: Verdict) -> str | None:
        """Why the run stops after iteration `done` although --train-iters is not reached."""
        if verdict.signal:
            return f"{signal.Signals(verdict.signal).name} received"
        if verdict.out_of_time:
            return (f"--exit-duration-in-mins {self.tr.exit_duration_in_mins:g} would be passed "
                    f"by another iteration")
        if self.tr.exit_interval and done % self.tr.exit_interval == 0:
            return f"--exit-interval {self.tr.exit_interval} reached"
        return None
