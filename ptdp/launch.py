"""Starting the processes of a job and keeping watch over them.

Three ways in, one code path inside (the entry function, `ptdp.train.loop.worker`):
- torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT are set;
- SLURM (srun with more than one task): SLURM_PROCID, SLURM_NTASKS,
  SLURM_LOCALID; the master address is MASTER_ADDR or the launch node
  (ptdp.distributed.detect_env reads these);
- neither: `launch_local` starts the processes on this machine itself and
  supervises them. If one fails, all others are stopped within seconds and
  the error of the rank where the failure began is reported (not the echoes
  in its peers, which lose their connection to it); a collective timeout
  bounds any wait, so a lost or stopped peer never hangs a job for ever.
  A local job listens on the loopback interface only.

Ctrl-C (SIGINT, which a terminal sends to the launcher and every rank) is
the launcher's to handle: a rank starts with it ignored, so that the ranks
still importing torch print no KeyboardInterrupt traceback each, and takes
it (at once, without saving) only once it runs ptdp's code. The launcher
then stops every rank and `ptdp train` says it was interrupted and what was
saved, never that a rank failed: the ranks it stopped did not fail. While
the ranks start (minutes, with many processes on few cores), the launcher
says every PROGRESS_SECONDS how many have.

No rank outlives its job. A local rank watches a pipe whose other end only
the launcher holds (`_watch_launcher`): when `ptdp train` ends however it
ends, SIGKILL included, the pipe reads end-of-file and the rank takes that
as SIGTERM, the graceful-exit handler's "save and stop" (before the handler
is installed, SIGTERM ends the rank at once); one that has not left
ORPHAN_SECONDS later exits without saving, so --save's lock is free for a
requeued job. A pipe, not the kernel's parent-death signal: a forked rank's
parent is the fork server, not the launcher, and the pipe works on macOS
too. A worker under torchrun asks the kernel for SIGTERM when its parent
(torchrun's agent) dies; one that starts after its parent already died
stops at once.

Local ranks on the CPU are forked, on Linux, from a server process that
imported torch and ptdp once (multiprocessing's forkserver; a rank's parent
is that server), not each started afresh: eight ranks on two cores used to
spend seconds importing the same modules eight times. On GPUs, and on other
systems, every rank is a fresh interpreter (spawn). The server (and
multiprocessing's resource tracker) starts with the job's signals blocked:
a signal to the whole process group (`timeout`, `kill -TERM -PGID`, a
container's stop) is the ranks' and the launcher's to act on, and a server
that died of it took the ranks' exit statuses with it (every rank then
"failed (exit code 255)"). It exits once the launcher and every rank it
forked are gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch.distributed as dist

from ptdp import stop_requests
from ptdp.distributed import LOOPBACK, DistEnv
from ptdp.errors import RankFailure, print_user_error
from ptdp.plural import plural

# A rank with a graceful-exit handler outlives SIGTERM: SIGKILL after this.
STOP_GRACE_SECONDS = 3.0
# After the first failure, how long to wait for the other ranks' reports: the
# rank where it began often reports after the peers that lost it.
COLLECT_SECONDS = 5.0
# After Ctrl-C, how long the ranks (which got it too) have to leave by
# themselves before SIGKILL: a Ctrl-C stops at once, without saving.
INTERRUPT_GRACE_SECONDS = 1.0
# While the ranks start, a line this often says how many have.
PROGRESS_SECONDS = 10.0
# What a rank sends its launcher as it starts running ptdp's code (torch
# imported), before anything else it sends.
STARTED = "started"
# A rank whose launcher is gone saves and stops (SIGTERM); if it has not left
# this long after (a long iteration, a peer that does not answer), it exits
# without saving: a requeued job must find --save's lock free.
ORPHAN_SECONDS = 30.0


# ------------------------------------------------------------------ loopback only

def _loopback_store(world_size: int) -> dist.TCPStore:
    """The rendezvous store of a local job, listening on loopback only.

    Given a host name, TCPStore still listens on every interface (it binds
    the wildcard address); given a listening socket, it serves on that one
    (`master_listen_fd`, in every torch this project supports). A free port
    picked by the kernel keeps concurrent jobs on one machine apart."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((LOOPBACK, 0))
        listener.listen(max(128, world_size))
        store = dist.TCPStore(LOOPBACK, listener.getsockname()[1], world_size, is_master=True,
                              wait_for_workers=False, master_listen_fd=listener.fileno())
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns the socket now and closes it
    return store


# ------------------------------------------------------------------ the rank process

PR_SET_PDEATHSIG = 1  # linux/prctl.h
# What a rank gets when what started it dies (a local rank's launcher, a
# worker's torchrun agent). SIGTERM, not SIGKILL: a rank with the
# graceful-exit handler saves a checkpoint at the next iteration boundary and
# exits (all ranks agree on the stop, so a job on several nodes saves too);
# nobody waits for it any more, but the save is the work it keeps, and the
# collective timeout bounds it. Before the handler is installed, and with
# --no-exit-signal-handler, SIGTERM ends the rank at once.
PARENT_DEATH_SIGNAL = signal.SIGTERM


def _ask_for_parent_death_signal() -> bool:
    """Linux: have the kernel send PARENT_DEATH_SIGNAL to this process when
    the thread that started it ends. False where that cannot be asked."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(parent: int) -> bool:
    """Get PARENT_DEATH_SIGNAL when process `parent` (this one's parent when
    it started) dies. False when it already had: then the request came too
    late to fire (this process was handed to another parent first), and the
    caller must stop by itself. (Process 1 may be a legitimate parent: a
    launcher that is a container's first process.)"""
    if not _ask_for_parent_death_signal():
        return True  # not Linux: nothing to check either
    return os.getppid() == parent


def follow_torchrun_agent(parent: int) -> bool:
    """In a worker that torchrun's agent started (it sets TORCHELASTIC_RUN_ID):
    PARENT_DEATH_SIGNAL when the agent dies, so that no worker trains on as
    an orphan after its agent is killed (SIGKILL leaves the agent no time to
    stop them). `parent`: this process's parent as early as it was read
    (`ptdp.cli.main` reads it first). False when the agent had already died:
    the worker must stop. (A worker whose agent died even before `parent` was
    read is not noticed: it fails at the rendezvous, or its collectives time
    out.)"""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return True
    return die_with_parent(parent)


def _signals_a_job_may_get() -> frozenset[int]:
    """Every signal that asks a run to save and stop or that a user or a
    scheduler may send the whole process group: each that --exit-signal
    accepts (SIGTERM, SIGHUP, SIGUSR1, SIGUSR2, SIGQUIT, SIGALRM...) and
    Ctrl-C's SIGINT."""
    from ptdp.config.signals import exit_signal_problem

    usable = {s for s in signal.Signals if exit_signal_problem(s.name) is None}
    return frozenset({*usable, signal.SIGINT} - {signal.SIGCONT})


def _watch_launcher(lifeline: multiprocessing.connection.Connection, rank: int,
                    launcher: int) -> None:
    """A rank's daemon thread: waits for the end of `lifeline`, whose sending
    end only the launcher holds; at its end the launcher is gone. Then this
    rank saves and stops as on SIGTERM, or, ORPHAN_SECONDS later, exits."""
    try:
        lifeline.recv_bytes()  # nothing is ever sent: returns at the end
    except (EOFError, OSError):
        pass
    with contextlib.suppress(OSError, ValueError):  # (its stderr may have gone with it)
        print(f"ptdp: rank {rank}: the launcher (process {launcher}) is gone: saving and "
              f"stopping as on {PARENT_DEATH_SIGNAL.name}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), PARENT_DEATH_SIGNAL)
    time.sleep(ORPHAN_SECONDS)
    os._exit(128 + int(PARENT_DEATH_SIGNAL))


# What a rank that received SIGINT by itself (not a terminal's Ctrl-C, which
# the launcher handles) reports: it stops at once, without saving.
INTERRUPTED_ALONE = ("interrupted by SIGINT sent to this rank alone (a Ctrl-C in the terminal "
                     "goes to every process, and the launcher handles it): it stopped at once, "
                     "without saving, and the job with it")


def _local_worker(env: DistEnv, entry: Callable[[DistEnv, Any], Any], payload: Any,
                  reports: multiprocessing.connection.Connection,
                  lifeline: multiprocessing.connection.Connection, launcher: int,
                  environ: dict[str, str]) -> None:
    threading.Thread(target=_watch_launcher, args=(lifeline, env.rank, launcher), daemon=True,
                     name="ptdp-launcher-watch").start()
    if os.environ != environ:  # a fork server keeps the environment it started with
        os.environ.clear()
        os.environ.update(environ)
    # Started with Ctrl-C ignored and the job's signals held back (see
    # `_start_rank` and `_start_rank_server`): from here on Ctrl-C stops this
    # rank at once, as in a process of its own, and the others act by their
    # defaults until the training loop's handler takes them.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _signals_a_job_may_get())
        reports.send(STARTED)
        entry(env, payload)
    except BaseException as error:  # noqa: BLE001 - reported to the supervisor, then exit 1
        if isinstance(error, SystemExit) and error.code in (None, 0):
            return
        report = RankFailure.from_exception(env.rank, error)
        if isinstance(error, KeyboardInterrupt) and not report.lost_peer:
            report = dataclasses.replace(report, user_error=True, message=INTERRUPTED_ALONE)
        try:
            reports.send(report)
        finally:
            sys.stderr.flush()
            os._exit(1)
    finally:
        reports.close()


# ------------------------------------------------------------------ the report

def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            return f"killed by signal {-code}"
        if name == "SIGBUS":  # what reading a memory-mapped file that was cut short does
            return ("killed by SIGBUS: most likely a memory-mapped file was cut short while it was "
                    "read (a --data-path .bin/.idx, or a dataset index in the data cache); check "
                    "that no other job rewrote them, then resume with --load")
        return f"killed by {name}"
    if 128 < code < 128 + signal.NSIG:  # how a process that stops itself on a signal exits
        with contextlib.suppress(ValueError):
            return f"exit code {code} = 128 + {signal.Signals(code - 128).name}"
    return f"exit code {code}"


class LocalJobFailed(RuntimeError):
    """A local job failed; `rank` is where the failure began.

    `error`: that rank's traceback (None when it died without one: killed by
    a signal); `message`: its cause in a sentence; `user_error`: a problem the
    user can fix, shown without the traceback; `unresponsive`: the rank
    stopped responding and the others gave up waiting for it; `stopped`: not
    a failure of a rank but what ended the job (a stop request that came too
    early for the ranks to save)."""

    def __init__(self, rank: int, exit_code: int | None, error: str | None, *,
                 message: str | None = None, user_error: bool = False,
                 unresponsive: str | None = None, stopped: str | None = None):
        self.rank, self.exit_code, self.error = rank, exit_code, error
        self.message, self.user_error = message, user_error
        self.unresponsive = unresponsive is not None
        self.stopped = stopped is not None
        if user_error:
            text = f"rank {rank}: {message}"
        elif unresponsive is not None or stopped is not None:
            text = unresponsive or stopped
        else:
            text = (f"rank {rank} failed ({_describe_exit(exit_code)})"
                    + (f":\n{error.rstrip()}" if error else ""))
        super().__init__(text)

    @classmethod
    def from_report(cls, report: RankFailure, exit_code: int | None) -> LocalJobFailed:
        return cls(report.rank, 1 if exit_code is None else exit_code, report.traceback,
                   message=report.message, user_error=report.user_error)

    def report(self, stream=None) -> None:
        """Print it for the user: a user error as one paragraph (its traceback
        to a file), anything else with the traceback; the cause comes last."""
        stream = stream if stream is not None else sys.stderr
        if self.user_error:
            print_user_error(self.rank, self.message or "", self.error or "", stream)
        else:
            print(f"ptdp: error: {self}", file=stream, flush=True)


# ------------------------------------------------------------------ launching

# What a training or generating rank imports: forked ready from a server
# that imported it once (CPU jobs).
CPU_RANK_MODULES = ("ptdp.train.loop", "ptdp.generate")


def launch_local(world_size: int, entry: Callable[[DistEnv, Any], Any], payload: Any, *,
                 forward_signals: tuple[int, ...] = (), preload: tuple[str, ...] = ()) -> None:
    """Run `entry(env, payload)` in `world_size` new local processes and wait.

    Raises LocalJobFailed for the rank where a failure began, after every
    other rank has been stopped (SIGTERM, then SIGKILL after a grace period).
    Each of `forward_signals` that this process receives meanwhile is sent
    on to every rank (the ranks' graceful-exit signals): ranks that then
    exit 0 make a normal return. Call from the main thread when forwarding.
    `preload`: modules to import once in a fork server that forks the ranks
    (CPU jobs only: a process that forks must not have touched CUDA); empty,
    every rank is a fresh interpreter.
    """
    store = _loopback_store(world_size)
    ranks: _Ranks | None = None
    processes: list = []
    report_pipes: list = []
    ended: set[int] = set()
    # Each rank watches the receiving end; this process alone holds the other.
    lifeline, lifeline_end = mp.Pipe(duplex=False)
    try:
        with _forwarding(forward_signals, processes, ended) as pass_on_late:
            context = _rank_context(preload)  # (a request meanwhile: forwarded once ranks start)
            for rank in range(world_size):
                env = DistEnv(rank=rank, world_size=world_size, local_rank=rank,
                              local_world_size=world_size, master_addr=LOOPBACK,
                              master_port=store.port, source="local")
                receiver, sender = context.Pipe(duplex=False)
                process = context.Process(target=_local_worker,
                                          args=(env, entry, payload, sender, lifeline,
                                                os.getpid(), dict(os.environ)),
                                          name=f"ptdp-rank{rank}")
                try:
                    _start_rank(process, processes)
                finally:
                    sender.close()
                report_pipes.append(receiver)
                pass_on_late(process)
            ranks = _Ranks(processes, report_pipes, ended, forward_signals)
            _supervise(ranks)
    except KeyboardInterrupt:
        # Ctrl-C: no verdict, the ranks stopped here did not fail. The
        # report (stop_requests.StopRequests.interrupted) says whether they were
        # still starting.
        if ranks is None or ranks.starting:
            stop_requests.STOP_REQUESTS.note_start_up(
                world_size, None if ranks is None else len(ranks.started))
        _stop_all(processes, interrupted=True)
        raise
    except (EOFError, OSError) as error:
        # Starting a rank failed: the fork server gone (SIGKILL), no more
        # processes or memory. Said in a sentence, not as multiprocessing's
        # traceback; a stop request that came meanwhile is what it was.
        if ranks is not None:
            raise
        raise _not_started(max(0, len(processes) - 1), world_size, error) from None
    finally:
        _stop_all(processes)
        for pipe in report_pipes:
            pipe.close()
        lifeline_end.close()
        lifeline.close()
        del store


def _not_started(rank: int, world_size: int, error: BaseException) -> LocalJobFailed:
    requests = stop_requests.STOP_REQUESTS
    if requests.first is not None:
        return LocalJobFailed(rank, None, None, stopped=requests.stopped_while_starting(
            requests.first.signal, f"the {plural(world_size, 'process')}"))
    cause = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return LocalJobFailed(rank, None, None, stopped=(
        f"rank {rank} of {world_size} could not be started ({cause}): the process that forks the "
        f"ranks ended, or this machine ran out of processes or memory; the ranks already started "
        f"were stopped, and nothing was saved"))


def _rank_context(preload: tuple[str, ...]):
    # Linux only: on macOS a process that forks without exec after loading
    # the system's frameworks (torch does) may crash in the child, which is
    # why Python spawns there by default.
    if preload and sys.platform.startswith("linux") and "forkserver" in mp.get_all_start_methods():
        context = mp.get_context("forkserver")
        # (Read when the server starts: the first job of this process.)
        context.set_forkserver_preload(list(preload))
        _start_rank_server()
        return context
    return mp.get_context("spawn")


def _start_rank_server() -> None:
    """Start the fork server (and multiprocessing's resource tracker, which
    it starts first) unless running, with every signal a job may get held
    back: a process inherits its blocked signals, and Python's servers never
    unblock them, so a signal to the whole process group passes them by
    (see the module's notes). Signals that arrive here meanwhile are
    delivered once the mask is back. The ranks it forks unblock them."""
    from multiprocessing import forkserver, resource_tracker

    held = _signals_a_job_may_get()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        resource_tracker.ensure_running()  # (which unblocks SIGINT and SIGTERM on its way out)
        signal.pthread_sigmask(signal.SIG_BLOCK, held)
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _start_rank(process, processes: list) -> None:
    """Start a rank's process with SIGINT ignored (it takes Ctrl-C once it
    runs ptdp's code, `_local_worker`): an ignored signal stays ignored
    across exec, so Python installs no KeyboardInterrupt handler, and a
    rank importing torch does not die of Ctrl-C with a traceback. Here
    SIGINT is held back meanwhile, not lost: a Ctrl-C during the start
    arrives after it, with the process in `processes` to be stopped."""
    processes.append(process)  # (not started yet: not alive, no pid, nothing to stop)
    if threading.current_thread() is not threading.main_thread():
        process.start()  # (signal handlers are the main thread's to change)
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        process.start()
    finally:
        signal.signal(signal.SIGINT, handler if handler is not None else signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


@contextlib.contextmanager
def _forwarding(signals: tuple[int, ...], processes: list,
                ended: set[int]) -> Iterator[Callable[[Any], None]]:
    """While inside, each of `signals` is sent on to every rank not `ended`.
    Yields `pass_on_late(process)`, which sends a rank started after the
    first request that request (it would otherwise never hear of it).

    The handler only sends signals: it must not reap processes (is_alive
    would), which the supervising loop does. On the way out, a request's
    window (stop_requests.REPEAT_WINDOW_SECONDS from the first signal forwarded)
    outlives the job: see `_RepeatsAbsorbed`."""
    first: list[float] = []  # when the first signal was forwarded

    def send(process, signum: int) -> None:
        if process.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signum)

    def forward(signum, frame) -> None:
        if not first:
            first.append(time.monotonic())
            stop_requests.STOP_REQUESTS.note(signum)
        for rank, process in enumerate(list(processes)):
            if rank not in ended:
                send(process, signum)

    def pass_on_late(process) -> None:
        requested = stop_requests.STOP_REQUESTS.first
        if first and requested is not None:
            send(process, requested.signal)

    previous = {signum: signal.signal(signum, forward) for signum in signals}
    try:
        yield pass_on_late
    finally:
        until = first[0] + stop_requests.REPEAT_WINDOW_SECONDS if first else 0.0
        for signum, handler in previous.items():
            handler = handler if handler is not None else signal.SIG_DFL
            signal.signal(signum, _RepeatsAbsorbed(handler, until)
                          if time.monotonic() < until else handler)
        if time.monotonic() < until:
            stop_requests.absorb_repeats_at_exit(tuple(previous), until)


class _RepeatsAbsorbed:
    """The launcher's handler once its ranks saved and left on a request:
    a repeat arriving within the request's window (a scheduler's or a
    terminal's copy to every process of the job, which may come after a
    quick save) is the same request, which must not kill `ptdp train` and
    turn a clean stop into a failure. After the window the previous handler
    is back, and takes that signal."""

    def __init__(self, previous, until: float):
        self.previous, self.until = previous, until

    def __call__(self, signum, frame) -> None:
        if time.monotonic() < self.until:
            return
        signal.signal(signum, self.previous)
        if callable(self.previous):
            self.previous(signum, frame)
        elif self.previous == signal.SIG_DFL:
            os.kill(os.getpid(), signum)  # its default action, now that it is back


# ------------------------------------------------------------------ supervising

class _Ranks:
    """What the supervisor knows of its ranks: exits and failure reports, as
    they arrive."""

    def __init__(self, processes: list, report_pipes: list, ended: set[int],
                 job_signals: tuple[int, ...] = ()):
        self.processes = processes
        self.job_signals = job_signals                # those the ranks take as a stop request
        self.running = {p.sentinel: rank for rank, p in enumerate(processes)}
        self.open_pipes = {pipe: rank for rank, pipe in enumerate(report_pipes)}
        self.ended = ended                            # shared with the signal forwarder
        self.exits: dict[int, tuple[int, float]] = {}  # rank: (exit code, when seen)
        self.reports: dict[int, RankFailure] = {}
        self.started: set[int] = set()                 # ranks that sent STARTED

    @property
    def starting(self) -> bool:
        """Whether a rank has yet to start (neither started nor ended)."""
        return len(self.started | set(self.exits)) < len(self.processes)

    @property
    def failed(self) -> bool:
        return bool(self.reports) or any(code != 0 for code, _ in self.exits.values())

    def wait(self, timeout: float | None) -> None:
        """Take in whatever arrives within `timeout` seconds (None: until something does)."""
        ready = multiprocessing.connection.wait([*self.running, *self.open_pipes], timeout)
        for item in ready:
            if item in self.open_pipes:
                self._read(item)
        for item in ready:
            if item in self.running:
                self._ended(self.running.pop(item))

    def _read(self, pipe) -> None:
        rank = self.open_pipes[pipe]
        try:
            report = pipe.recv()
        except Exception:  # noqa: BLE001 - closed (the rank ended) or a garbled report
            del self.open_pipes[pipe]
            return
        if report == STARTED:
            self.started.add(rank)
        else:
            self.reports[rank] = report

    def _ended(self, rank: int) -> None:
        self.ended.add(rank)  # before reaping: the pid stays the rank's until then
        process = self.processes[rank]
        process.join()
        self.exits[rank] = (process.exitcode, time.time())
        pipe = next((p for p, r in self.open_pipes.items() if r == rank), None)
        while process.exitcode != 0 and rank not in self.reports and pipe in self.open_pipes \
                and pipe.poll(0.5):  # sent just before it exited (after STARTED, perhaps)
            self._read(pipe)

    def verdict(self) -> LocalJobFailed:
        """The failure that is not a consequence of another: the earliest
        root cause; failing that, the rank the others gave up waiting for.
        Ranks that a stop request ended did not fail: killed by the request
        the launcher passed on before their handler for it was in place
        (while starting), or stopped at once by a second request (exit code
        128 + the signal, the handler's)."""
        requested = stop_requests.STOP_REQUESTS.first
        killed = {rank for rank, (code, _) in self.exits.items()
                  if requested is not None and code == -requested.signal
                  and rank not in self.reports}
        at_once = {rank: code - 128 for rank, (code, _) in self.exits.items()
                   if code - 128 in self.job_signals and rank not in self.reports}
        causes = [(report.time, LocalJobFailed.from_report(_with_newest(report),
                                                           self._exit_code(rank)))
                  for rank, report in self.reports.items() if not report.lost_peer]
        causes += [(seen, LocalJobFailed(rank, code, None))  # killed: no report
                   for rank, (code, seen) in self.exits.items()
                   if code != 0 and rank not in self.reports and rank not in killed
                   and rank not in at_once]
        if causes:
            return min(causes, key=lambda cause: cause[0])[1]
        if at_once:
            return self._stopped_at_once(at_once)
        if killed:
            return self._stopped_on_request(sorted(killed), requested.signal)
        silent = sorted(rank for rank in self.running.values() if rank not in self.reports)
        first = min(self.reports.values(), key=lambda report: report.time)
        if silent:
            return self._unresponsive(silent, first)
        return LocalJobFailed.from_report(first, self._exit_code(first.rank))

    def _who(self, ranks: list[int]) -> str:
        if len(ranks) == 1:
            return f"rank {ranks[0]}"
        return "every rank" if len(ranks) == len(self.processes) else f"{len(ranks)} ranks"

    def _stopped_on_request(self, stopped: list[int], signum: int) -> LocalJobFailed:
        text = stop_requests.STOP_REQUESTS.stopped_while_starting(signum, self._who(stopped))
        return LocalJobFailed(stopped[0], self._exit_code(stopped[0]), None, stopped=text)

    def _stopped_at_once(self, at_once: dict[int, int]) -> LocalJobFailed:
        ranks = sorted(at_once)
        text = stop_requests.STOP_REQUESTS.stopped_at_once(at_once[ranks[0]], self._who(ranks))
        return LocalJobFailed(ranks[0], self._exit_code(ranks[0]), None, stopped=text)

    def _exit_code(self, rank: int) -> int | None:
        return self.exits[rank][0] if rank in self.exits else None

    def _unresponsive(self, silent: list[int], witness: RankFailure) -> LocalJobFailed:
        stopped = [rank for rank in silent if _is_stopped(self.processes[rank].pid)]
        suspects = stopped or silent
        who = (f"rank {suspects[0]}" if len(suspects) == 1
               else "ranks " + ", ".join(map(str, suspects)))
        state = (": its process is stopped (state T: SIGSTOP, or a debugger)" if len(stopped) == 1
                 else ": their processes are stopped (state T: SIGSTOP, or a debugger)" if stopped
                 else "")
        text = (f"{who} stopped responding{state}; the other ranks gave up waiting "
                f"(rank {witness.rank}: {witness.message})")
        return LocalJobFailed(suspects[0], None, witness.traceback, unresponsive=text)


def _with_newest(report: RankFailure) -> RankFailure:
    """A rank interrupted by itself: its report names the newest checkpoint."""
    if report.message != INTERRUPTED_ALONE:
        return report
    return dataclasses.replace(report, message=report.message
                               + stop_requests.STOP_REQUESTS.newest_checkpoint())


def _is_stopped(pid: int | None) -> bool:
    """Linux: whether the process is stopped (SIGSTOP, or held by a debugger)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat.rsplit(")", 1)[-1].split()  # the name in parentheses may hold spaces
    return bool(fields) and fields[0] in ("T", "t")


def _supervise(ranks: _Ranks) -> None:
    """Return when every rank exited 0; raise LocalJobFailed on a failure.
    While ranks are starting, say every PROGRESS_SECONDS how many have."""
    began = time.monotonic()
    said = began + PROGRESS_SECONDS  # when the next line is due
    while ranks.running and not ranks.failed:
        if not ranks.starting:
            ranks.wait(None)
            continue
        ranks.wait(max(0.0, said - time.monotonic()))
        if ranks.starting and time.monotonic() >= said:
            # On stderr: stdout is what the command makes (generate's text).
            print(starting_line(len(ranks.processes), len(ranks.started),
                                time.monotonic() - began), file=sys.stderr, flush=True)
            said = time.monotonic() + PROGRESS_SECONDS
    if not ranks.failed:
        return
    deadline = time.monotonic() + COLLECT_SECONDS
    while ranks.running and (left := deadline - time.monotonic()) > 0:
        ranks.wait(left)
    raise ranks.verdict()


def starting_line(world_size: int, started: int, seconds: float) -> str:
    """The line that shows a long start-up is not a hang."""
    return (f"ptdp: waiting for {plural(world_size, 'process')} to start ({started} started, "
            f"{seconds:.0f} s so far)")


def _stop_all(processes: list, *, interrupted: bool = False) -> None:
    """SIGTERM, then SIGKILL for whatever outlives the grace period: a rank
    whose graceful-exit handler takes SIGTERM as "save at the next
    iteration", which a broken job never reaches. After Ctrl-C (`interrupted`),
    which the ranks got too, or should have: a short grace to leave by
    themselves, then SIGKILL, no SIGTERM, whose handler would announce a
    save (a Ctrl-C stops at once, without saving)."""
    alive = [p for p in processes if p.is_alive()]
    if not interrupted:
        for p in alive:
            p.terminate()
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGCONT)  # a stopped process acts on SIGTERM once continued
    grace = INTERRUPT_GRACE_SECONDS if interrupted else STOP_GRACE_SECONDS
    deadline = time.monotonic() + grace
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
