"""The requests to save and stop that a process received or passed on, and
what its last line says about them (ptdp.train.stopping counts the signals
in a rank; the local launcher, ptdp.launch, passes them on to its ranks).
Below both: the launcher imports nothing of training.

One request often reaches a rank twice: directly (a scheduler signals every
process of the job, a terminal the whole process group) and forwarded by the
launcher. Signals closer together than `REPEAT_WINDOW_SECONDS` count as one
request; a later one stops at once.

A request outlives the training loop: a rank that saved and is on its way
out keeps counting, because the same request may still be arriving by its
other way; with the default action back it would kill a rank that had
saved, and the job would end as a failure. Python itself puts the default
actions back as it shuts down, before torch's teardown, which takes a
while: `absorb_repeats_at_exit` ignores the signals from there on while the
window is open. `ptdp train`'s launcher keeps the window after its ranks
leave for the same reason.

Ctrl-C always stops at once. After a graceful request it may cut the save
short, so `STOP_REQUESTS` remembers the first request and what `--save`'s
`latest` named then, and the last line says what was saved since.
"""

from __future__ import annotations

import atexit
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from ptdp.plural import plural

REPEAT_WINDOW_SECONDS = 3.0
# --exit-duration-in-mins counts from here: a scheduler's time limit runs
# from the job's start, set-up included (this module is imported as a rank
# process starts, and by `ptdp train` before its checks).
PROCESS_STARTED = time.monotonic()
# The file in a --save directory that names its newest checkpoint (the
# checkpoint format's pointer, ptdp.checkpoint.retention.LATEST, which
# tests/test_stop_reports.py holds equal): read here directly, so that the
# launcher needs nothing from training.
LATEST = "latest"


def latest_name(save: Path) -> str | None:
    """What `save`'s `latest` names (None: nothing, or no such file)."""
    try:
        return (save / LATEST).read_text().strip()
    except OSError:
        return None


@dataclass(frozen=True)
class StopRequest:
    """The first graceful-exit signal a process received or passed on."""
    signal: int
    latest_then: str | None  # what --save's `latest` named then (None: nothing, or no --save)


class StopRequests:
    """The first graceful-exit signal this process received (a rank, or
    `ptdp train` running one process) or passed on to its ranks (the local
    launcher), with what `--save`'s `latest` named when it came: a Ctrl-C
    during the stop it asked for reports what was saved since."""

    def __init__(self) -> None:
        self.first: StopRequest | None = None
        self._save: str | None = None
        self._training = False                 # new_run was called: a `ptdp train` run
        self._latest_at_start: str | None = None
        self._start_up: tuple[int, int | None] | None = None

    def new_run(self, save: str | None) -> None:
        """A run begins (a request an earlier run in this process saw is
        forgotten); `save`: its --save directory (None: none), whose
        checkpoints a Ctrl-C report names."""
        self.first, self._save, self._training, self._start_up = None, save, True, None
        self._latest_at_start = self._latest()

    def note_start_up(self, processes: int, started: int | None) -> None:
        """The local launcher, on Ctrl-C: its `processes` ranks were still
        starting (`started` of them had; None: not known)."""
        self._start_up = (processes, started)

    def note(self, signum: int) -> None:
        if self.first is None:
            self.first = StopRequest(signum, self._latest())

    def _latest(self) -> str | None:
        return latest_name(Path(self._save)) if self._save else None

    def interrupted(self) -> str:
        """The last line after Ctrl-C: without a graceful request before it,
        "interrupted by the user" and, for a training run, what it saved (if
        its ranks were still starting, nothing); after one, whether the
        checkpoint it asked for was written (the stop was cut short, so it
        may not have been) and what the newest checkpoint is."""
        if self.first is None:
            return self._interrupted_by_the_user()
        name = signal.Signals(self.first.signal).name
        head = f"ptdp: interrupted (Ctrl-C) during the graceful stop {name} asked for"
        if not self._save:
            return f"{head}; no --save given, so nothing was saved"
        latest = self._latest()
        if latest is not None and latest != self.first.latest_then:
            return (f"{head}: {Path(self._save) / latest} was saved after the {name}; resume "
                    f"with --load {self._save}")
        if latest is None:
            return f"{head}: nothing was saved, and {self._save} holds no checkpoint"
        return (f"{head}: nothing was saved after the {name}; the newest checkpoint is "
                f"{Path(self._save) / latest}, from before it (resume with --load {self._save})")

    def newest_checkpoint(self) -> str:
        """"; the newest checkpoint is SAVE/iter_N (resume with --load SAVE)",
        or "" without --save or a checkpoint in it: the end of a report of
        a job that stopped without saving."""
        latest = self._latest()
        if latest is None:
            return ""
        return (f"; the newest checkpoint is {Path(self._save) / latest} (resume with --load "
                f"{self._save})")

    def stopped_while_starting(self, signum: int, who: str) -> str:
        """The local launcher's report when `who` (ranks) died of signal
        `signum` by its default action: before the training loop's handler
        was in place, while starting (or after a run that had ended).
        What is on disk is named: a resumed run's checkpoint from before, or
        one this run saved."""
        name = signal.Signals(signum).name
        latest = self._latest()
        if latest is not None and latest != self._latest_at_start:
            return (f"{name} came before the ranks could take it as a request to save and stop: "
                    f"{who} stopped at once; the newest checkpoint is "
                    f"{Path(self._save) / latest}, saved by this run (resume with --load "
                    f"{self._save})")
        text = (f"{name} came while the ranks were starting, before they could take it as a "
                f"request to save and stop: {who} stopped at once, so nothing was saved")
        if latest is not None:
            text += (f"; the newest checkpoint is {Path(self._save) / latest}, from before this "
                     f"run (resume with --load {self._save})")
        return text

    def stopped_at_once(self, signum: int, who: str) -> str:
        """The local launcher's report when `who` (ranks) stopped at once on
        a second signal `signum`, more than REPEAT_WINDOW_SECONDS after the
        first request: what was saved since that request, and the newest
        checkpoint on disk."""
        name = signal.Signals(signum).name
        first = self.first
        head = (f"a second {name} came more than {REPEAT_WINDOW_SECONDS:g} s after the first "
                f"request{'' if first is None else f' ({signal.Signals(first.signal).name})'} "
                f"and stopped {who} at once, without saving")
        if not self._save:
            return f"{head}; no --save given, so nothing was saved"
        latest = self._latest()
        if latest is None:
            return f"{head}; {self._save} holds no checkpoint"
        newest = Path(self._save) / latest
        before = first.latest_then if first is not None else self._latest_at_start
        if latest != before:
            return (f"{head}; the newest checkpoint is {newest}, saved by this run before that "
                    f"second signal (resume with --load {self._save})")
        return (f"{head}; the newest checkpoint is {newest}, from before the first request "
                f"(resume with --load {self._save})")


    def _interrupted_by_the_user(self) -> str:
        head = "ptdp: interrupted by the user (Ctrl-C)"
        if self._start_up is not None:
            processes, started = self._start_up
            head += (f" while {plural(processes, 'process')} "
                     f"{'was' if processes == 1 else 'were'} starting") + (
                "" if started is None else f" ({started} had started)" if started
                else " (none had started yet)")
            return f"{head}; nothing was saved" if self._training else head
        if not self._training:
            return head
        if not self._save:
            return f"{head}; no --save given, so nothing was saved"
        latest = self._latest()
        if latest is None:
            return f"{head}; nothing was saved, and {self._save} holds no checkpoint"
        newest = Path(self._save) / latest
        if latest != self._latest_at_start:
            return (f"{head}; the newest checkpoint is {newest}, saved by this run (resume with "
                    f"--load {self._save})")
        return (f"{head}; this run saved nothing; the newest checkpoint is {newest}, from "
                f"before it (resume with --load {self._save})")


# This process's: signal handlers are the process's too.
STOP_REQUESTS = StopRequests()


def absorb_repeats_at_exit(signals, until: float) -> None:
    """When this process exits, ignore `signals` if a request's window is
    still open then (it ends at `until`, time.monotonic()). Python puts the
    default actions back for its shutdown, before the modules' teardown; a
    repeat of the request arriving then would kill a process that did all it
    was asked. Runs before the exit handlers registered earlier (LIFO)."""
    def ignore() -> None:
        if time.monotonic() < until:
            for signum in signals:
                signal.signal(signum, signal.SIG_IGN)

    atexit.register(ignore)
