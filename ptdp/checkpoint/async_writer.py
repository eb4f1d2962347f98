"""--async-save: checkpoints written in the background while training goes on.

Megatron-LM's flag (its torch_dist checkpoints only; here ptdp's own format,
under every layout). A save takes the same three steps as a synchronous one
(snapshot.save_checkpoint), with the middle one moved off the training
thread:

1. The snapshot, on every rank (collective, blocking): rank 0 clears a killed
   save's leftovers and makes `iter_N.partial/`; each rank copies what it
   writes (its share of the weights and optimizer state, its random states,
   on rank 0 the metadata: iteration, data position, schedules, lineage) to
   host memory. Training may change its own tensors from then on.
2. The writing, in a thread of each rank: its files into `iter_N.partial/`,
   each fsynced and its sha256 taken (file writes, fsync and hashing release
   the GIL, so training runs meanwhile).
3. The publication, once every rank's part is complete: at each iteration
   boundary every rank says whether its writer is done (one small all-reduce,
   only while a save is in flight), and when all are, rank 0 seals the
   metadata, renames `iter_N.partial` to `iter_N`, moves `latest` and prunes
   (--keep-last), exactly as a synchronous save does. `latest` therefore
   never names a checkpoint that is not complete and sealed.

One save is in flight at a time: a save waits for the previous one to be
published first. A stop (a graceful-exit signal, --exit-interval,
--exit-duration-in-mins), the end of training and a divergence stop (which
may point `latest` back at an earlier checkpoint) wait for the save in
flight, so the last line names a published checkpoint. A second signal, a
kill or a crash leaves at most `iter_N.partial`, which the next save
removes; `latest` stays on the previous complete checkpoint. A writer that
fails (a full disk) stops the run on every rank with one paragraph saying
what failed and what `latest` still names; the partial directory is removed.

The time training is blocked by each save, everything its main thread spends
on it (the snapshot copy, the per-iteration checks, the wait and the
publication), is in the one line printed when it is published, and the
metrics file's `save_blocked_ms` (ptdp.train.saves).
"""

from __future__ import annotations

import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from ptdp.checkpoint.retention import latest_name
from ptdp.checkpoint.snapshot import Snapshot, take_snapshot
from ptdp.checkpoint.state import TrainingState
from ptdp.errors import UserError, describe


class AsyncSaveError(UserError):
    """A background checkpoint write failed; nothing was published."""


class StateSource(Protocol):
    """What an AsyncSaver saves (the trainer): the training state after an iteration."""

    def training_state(self, iteration: int) -> TrainingState: ...


class _Writer(threading.Thread):
    """Writes one rank's snapshot; keeps the files' sha256, or the error."""

    def __init__(self, snapshot: Snapshot):
        # A daemon: a crash or a hard stop must not wait for it (it leaves
        # iter_N.partial, which the next save removes).
        super().__init__(name="ptdp-async-save", daemon=True)
        self.snapshot = snapshot
        self.digests: dict[str, str] = {}
        self.error: BaseException | None = None
        self.seconds = 0.0

    def run(self) -> None:
        started = time.monotonic()
        try:
            self.digests = self.snapshot.write(durable=True)
        except BaseException as error:  # noqa: BLE001 - reported on every rank by the next check
            self.error = error
        self.seconds = time.monotonic() - started


@dataclass
class _InFlight:
    snapshot: Snapshot
    state: TrainingState           # what was saved (its device, its loss watch)
    writer: _Writer
    started: float                 # time.monotonic() when the snapshot began
    size: int                      # bytes this rank copied to host memory
    blocked: float = 0.0           # seconds this rank's training thread spent on the save


class AsyncSaver:
    """Every rank holds one; every rank calls `save`, `poll` and `wait` at
    the same points (each may run a collective)."""

    def __init__(self, source: StateSource, save: str | Path, *, keep_last: int | None = None,
                 announce: bool = True):
        self.source, self.save_dir, self.keep_last = source, Path(save), keep_last
        self.announce = announce  # print each published save's line (rank 0 only prints)
        self.in_flight: _InFlight | None = None
        self.newest: Path | None = None   # the newest checkpoint this run published
        self.longest = 0.0                # the longest save, snapshot to publication (seconds)

    def save(self, iteration: int) -> Path | None:
        """After iteration `iteration`: wait for the save in flight, copy the
        snapshot and start writing it in the background. Returns the
        directory of the save waited for (None: none was in flight)."""
        previous = self.wait()
        started = time.monotonic()
        state = self.source.training_state(iteration)
        snapshot = take_snapshot(state, self.save_dir, keep_last=self.keep_last)
        size = sum(t.numel() * t.element_size() for t in snapshot.tensors.values())
        writer = _Writer(snapshot)
        writer.start()
        self.in_flight = _InFlight(snapshot, state, writer, started, size)
        self._spent(self.in_flight, started)
        return previous

    def poll(self) -> Path | None:
        """At an iteration boundary: publish the save in flight if every
        rank's writer is done (returns its directory), else nothing."""
        flight, began = self.in_flight, time.monotonic()
        if flight is None:
            return None
        if not self._everyone_done(flight.writer.is_alive(), flight.state.device):
            self._spent(flight, began)
            return None
        return self._publish(flight, began)

    def wait(self) -> Path | None:
        """Block until the save in flight is written and published (every
        rank returns after the publication); its directory, or None when
        none was in flight."""
        flight, began = self.in_flight, time.monotonic()
        if flight is None:
            return None
        flight.writer.join()
        published = self._publish(flight, began)
        _barrier()
        return published

    # ------------------------------------------------------------ helpers

    @staticmethod
    def _spent(flight: _InFlight, began: float) -> None:
        flight.blocked += time.monotonic() - began

    @staticmethod
    def _everyone_done(writing: bool, device: torch.device) -> bool:
        """Whether no rank's writer is still writing (one all-reduce)."""
        if not _distributed():
            return not writing
        busy = torch.tensor([float(writing)], device=device)
        dist.all_reduce(busy)
        return busy.item() == 0

    def _publish(self, flight: _InFlight, began: float) -> Path:
        """Every writer is done: if any failed, every rank raises the same
        paragraph (rank 0 removes the partial directory); else rank 0
        publishes and prints the save's line."""
        self.in_flight = None
        writer = flight.writer
        mine = (None if writer.error is None else describe(writer.error), writer.digests)
        reports = [mine]
        if _distributed():
            reports = [None] * dist.get_world_size()
            dist.all_gather_object(reports, mine)
        rank = dist.get_rank() if _distributed() else 0
        failed = [(r, text) for r, (text, _) in enumerate(reports) if text is not None]
        if failed:
            raise self._failure(flight.snapshot, failed, rank) from writer.error
        if rank == 0:
            digests = {name: digest for _, files in reports for name, digest in files.items()}
            try:
                flight.snapshot.publish(keep=flight.state.loss_watch.good, digests=digests)
            except OSError as error:  # a full disk as the metadata is written, say
                raise self._failure(flight.snapshot, [(0, describe(error))], rank) from error
        self._spent(flight, began)
        self.newest = flight.snapshot.final
        took = time.monotonic() - flight.started
        self.longest = max(self.longest, took)
        if rank == 0 and self.announce:
            print(f"ptdp: saved checkpoint {self.newest} (--async-save: training was blocked "
                  f"{flight.blocked:.3f} s by this save, copying {flight.size / 1e6:.1f} MB to "
                  f"host memory, checking and publishing included; rank 0 wrote its part in the "
                  f"background in {writer.seconds:.2f} s; published {took:.2f} s after the "
                  f"snapshot)", flush=True)
        return self.newest

    def _failure(self, snapshot: Snapshot, failed: list[tuple[int, str]],
                 rank: int) -> AsyncSaveError:
        """The paragraph every rank raises; rank 0 removes what was written."""
        if rank == 0:
            shutil.rmtree(snapshot.partial, ignore_errors=True)
        latest = latest_name(self.save_dir)
        where = "; ".join(f"rank {r}: {text}" for r, text in failed)
        kept = (f"`latest` still names {self.save_dir / latest}, the newest complete checkpoint "
                f"(resume with --load {self.save_dir})" if latest else
                f"{self.save_dir} holds no complete checkpoint yet")
        return AsyncSaveError(
            f"writing checkpoint {snapshot.final} in the background (--async-save) failed "
            f"({where}); `latest` was not moved to it and its partial directory was removed: "
            f"{kept}. Free space or fix the permissions of --save {self.save_dir} and run again")


def _distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def _barrier() -> None:
    if _distributed():
        dist.barrier()
