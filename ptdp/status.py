"""What a slow phase tells the user while it runs.

A phase that can take seconds (tokenizing a corpus, building a dataset's
sample index, loading a checkpoint) says what it is doing as it starts and
how long it took as it ends, on stderr, so a long start-up never looks like
a hang. Long phases with a known amount of work also report how far they
are: on a terminal a progress bar redraws in place (rich, where the caller
has one), elsewhere (logs under SLURM, files) `Periodic` prints a plain
line every few seconds instead, which a log keeps readable.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Iterator, TextIO


@contextlib.contextmanager
def phase(what: str, *, stream: TextIO | None = None) -> Iterator[None]:
    """Prints "ptdp: WHAT ..." now and "ptdp: WHAT: done in N s" at the end."""
    out = stream if stream is not None else sys.stderr
    print(f"ptdp: {what} ...", file=out, flush=True)
    started = time.perf_counter()
    yield
    print(f"ptdp: {what}: done in {time.perf_counter() - started:.1f} s", file=out, flush=True)


class Periodic:
    """Plain progress lines, at most one every `interval` seconds:
    "ptdp: WHAT: DONE/TOTAL UNIT (P %)"."""

    def __init__(self, what: str, total: int, unit: str, *, interval: float = 10.0,
                 stream: TextIO | None = None):
        self.what, self.total, self.unit, self.interval = what, total, unit, interval
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self._last = time.perf_counter()

    def advance(self, amount: int) -> None:
        self.done += amount
        now = time.perf_counter()
        if now - self._last >= self.interval:
            self._last = now
            share = f" ({self.done / self.total:.0%})" if self.total else ""
            print(f"ptdp: {self.what}: {self.done:,}/{self.total:,} {self.unit}{share}",
                  file=self.stream, flush=True)
