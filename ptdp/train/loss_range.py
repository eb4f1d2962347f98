"""Which checkpoints are good: the training loss's normal range.

A step can ruin the weights while its own loss and gradient norm stay
finite (a learning rate far too high): the damage shows only in the next
iteration's loss, computed with the new weights, and by then a checkpoint of
them may be saved and an older good one pruned. So a checkpoint counts as
good only once the iteration after it (whose loss is the first measure of
its weights) had a loss in the run's normal range:

    in range  <=>  finite and  loss <= median + max(median, 1)

where median is that of the last 20 in-range losses (the first loss of a run
is in range if finite). The limit is twice the median, and at least one nat
above it, so the noise of small losses is never a spike; a loss out of range
does not join the window, so a run that stays out never makes that its
normal. The watch is the same on every rank (the loss is all-reduced with
the stop verdict) and travels in each checkpoint's metadata, so a resumed
run goes on with its window.

What follows from it:
* `--keep-last K` keeps the K newest checkpoints and also the newest one
  known good while any newer one is not (so at most K + 1);
* the divergence error names the newest good checkpoint, and `latest` is
  pointed back at it, so resuming with `--load SAVE` starts from weights
  that trained normally (the later checkpoints stay, and move to abandoned/
  when the resumed run saves over their iterations);
* a warning says when the loss leaves its range and when it returns, and a
  checkpoint saved out of range says so when it is loaded.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

WINDOW = 20
MIN_JUMP = 1.0  # nats: smaller jumps are never out of range
RECORD = "loss_range"  # the metadata key


class LossRange:
    def __init__(self, recent: list[float] | None = None, left_at: int | None = None,
                 good: Path | None = None):
        self.recent = list(recent or [])[-WINDOW:]  # in-range losses, oldest first
        self.left_at = left_at      # the iteration whose loss left the range; None: in range
        self.left_with: float | None = None
        self.good = good            # the newest checkpoint known good
        self.pending: Path | None = None  # the newest checkpoint, until its next iteration

    def limit(self) -> float | None:
        if not self.recent:
            return None
        median = statistics.median(self.recent)
        return median + max(median, MIN_JUMP)

    def observe(self, iteration: int, loss: float | None) -> str | None:
        """Iteration `iteration`'s loss (the job's; None: not computed);
        returns a line to print when the loss leaves or re-enters its range."""
        if loss is None:
            return None
        limit = self.limit()
        in_range = math.isfinite(loss) and (limit is None or loss <= limit)
        line = None
        if in_range:
            if self.pending is not None:
                self.good = self.pending
            if self.left_at is not None:
                line = (f"ptdp: iteration {iteration}: the loss {loss:.4g} is back within its "
                        f"normal range (left at iteration {self.left_at})")
            self.left_at = None
            self.recent = (self.recent + [loss])[-WINDOW:]
        else:
            if self.left_at is None:
                self.left_at, self.left_with = iteration, loss
                line = (f"ptdp: warning: iteration {iteration}: the loss {loss:.4g} left its normal "
                        f"range ({self.describe_limit()}); {self.kept()}")
        self.pending = None
        return line

    def saved(self, checkpoint: Path) -> None:
        self.pending = Path(checkpoint)

    def describe_limit(self) -> str:
        limit = self.limit()
        if limit is None:
            return "the loss is not finite"
        return (f"above {limit:.4g}: the median of the last {len(self.recent)} in-range losses, "
                f"{statistics.median(self.recent):.4g}, plus the larger of itself and {MIN_JUMP:g}")

    def kept(self) -> str:
        if self.good is None:
            return "no checkpoint is known good yet (one is, once the iteration after it stays in range)"
        return f"the newest checkpoint known good is {self.good} (--keep-last never removes it)"

    def after_divergence(self, newest: Path | None, latest_moved: bool) -> str:
        """The divergence error's clause on which checkpoint to go back to."""
        if newest is None:
            return "nothing was saved"
        if self.good is None:
            since = f" since iteration {self.left_at}" if self.left_at is not None else ""
            return (f"no checkpoint is known good: the loss has been outside its normal range{since}, "
                    f"and {newest} (the newest) holds weights trained since (start again from an "
                    f"earlier checkpoint or the beginning)")
        if self.good == Path(newest):
            return (f"the newest checkpoint, {newest}, is good (the loss after it was in its normal "
                    f"range) and untouched")
        moved = "; `latest` now names it" if latest_moved else ""
        return (f"the newest checkpoint known good is {self.good} (the loss after it was in its "
                f"normal range; it left that range at iteration {self.left_at}){moved}, and the "
                f"checkpoints saved after it, up to {newest}, hold weights trained since")

    # ------------------------------------------------------------ in checkpoints

    def record(self) -> dict:
        """What a checkpoint saved now records (the good one by name: it is
        in the same directory, wherever that is moved)."""
        return {"recent": self.recent, "left_at": self.left_at,
                "good": None if self.good is None else self.good.name}

    @classmethod
    def loaded(cls, directory: Path, metadata: dict) -> "LossRange":
        """The watch a run resumed from `directory` goes on with; that
        checkpoint awaits its first iteration. Checkpoints without the record
        start an empty window."""
        record = metadata.get(RECORD)
        if not isinstance(record, dict):
            watch = cls()
        else:
            recent = [x for x in record.get("recent") or [] if isinstance(x, (int, float))
                      and math.isfinite(x)]
            left_at = record.get("left_at") if isinstance(record.get("left_at"), int) else None
            good = record.get("good")
            good_path = directory.parent / good if isinstance(good, str) and good.startswith(
                "iter_") and "/" not in good else None
            watch = cls(recent, left_at, good_path if good_path and good_path.is_dir() else None)
        watch.pending = directory
        return watch

    def load_warning(self, directory: Path) -> str | None:
        if self.left_at is None:
            return None
        return (f"ptdp: warning: {directory} was saved while the training loss was outside its "
                f"normal range (since iteration {self.left_at}); "
                + (f"the newest checkpoint known good then was {self.good}" if self.good else
                   "no checkpoint was known good then"))
