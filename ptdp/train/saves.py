"""The training loop's checkpoints: when a run saves (synchronously, or in
the background under --async-save: ptdp.checkpoint.async_writer), the
newest checkpoint it can name, and the time saves blocked training (the
metrics file's `save_blocked_ms`)."""

from __future__ import annotations

import time
from pathlib import Path

from ptdp.checkpoint.async_writer import AsyncSaver


class RunSaves:
    """The training loop's checkpoints, synchronous or --async-save: the
    newest one this run can name, the time saves blocked training, what the
    run's last save may take (for --exit-duration-in-mins), and the waits a
    stop needs. Every rank calls each method at the same point."""

    def __init__(self, trainer, stopping, *, is_logger: bool, loaded: Path | None):
        tr = trainer.config.train
        self.trainer, self.stopping, self.is_logger, self.save_dir = \
            trainer, stopping, is_logger, tr.save
        # (a fine-tune's loaded checkpoint is another run's, not one of its own)
        self.newest: str | None = None if loaded is None else str(loaded)
        self.unreported = 0.0  # seconds saves blocked training since the last record
        self.saver = (AsyncSaver(trainer, tr.save, keep_last=tr.keep_last,
                                 announce=trainer.ctx.rank == 0)
                      if tr.save and tr.async_save else None)

    def due(self, done: int, stopping: bool) -> bool:
        """Whether the run saves after iteration `done`: with --save, at its
        last iteration, at a stop (`stopping`) and every --save-interval."""
        tr = self.trainer.config.train
        return bool(tr.save) and (done == self.trainer.train_iters or stopping
                                  or bool(tr.save_interval and done % tr.save_interval == 0))

    def at_boundary(self) -> dict[str, float]:
        """After an iteration's step: publish an asynchronous save whose
        writers are all done; the record's `save_blocked_ms` (the seconds
        saves blocked training since the previous record), if any."""
        if self.saver is not None and self.saver.in_flight is not None:
            self._published(self._timed(self.saver.poll))
            self._tell_stopping()
        blocked, self.unreported = self.unreported, 0.0
        return {"save_blocked_ms": blocked * 1e3} if blocked else {}

    def save(self, iteration: int, *, last: bool) -> None:
        """Checkpoint after `iteration`; `last`: the run stops after it, so
        an asynchronous save is waited for."""
        if self.saver is None:
            took = self._timed(lambda: self.trainer.save(self.save_dir, iteration))
            self.newest = str(took[0])
            self.stopping.longest_save = max(self.stopping.longest_save, took[1])
            if self.is_logger:
                print(f"ptdp: saved checkpoint {self.newest} (training was blocked "
                      f"{took[1]:.3f} s)", flush=True)
            return
        self._published(self._timed(lambda: self.saver.save(iteration))[0])
        if last:
            self.settle()
        self._tell_stopping()

    def settle(self) -> str | None:
        """Wait for the save in flight (a stop, a divergence's way back);
        the newest checkpoint, published."""
        if self.saver is not None:
            self._published(self._timed(self.saver.wait)[0])
        return self.newest

    def _tell_stopping(self) -> None:
        """What a stop's save may take under --async-save: waiting for the
        save in flight, then a whole save (the longest yet, or the one in
        flight so far)."""
        flight = self.saver.in_flight
        so_far = 0.0 if flight is None else time.monotonic() - flight.started
        whole = max(self.saver.longest, so_far)
        self.stopping.longest_save = whole + (0.0 if flight is None else whole - so_far)

    def _timed(self, call) -> tuple:
        began = time.monotonic()
        try:
            result = call()
        finally:
            took = time.monotonic() - began
            self.unreported += took
        return result, took

    def _published(self, directory: Path | None) -> None:
        if directory is not None:
            self.newest = str(directory)
