"""Run a function on N local gloo processes and collect each rank's result.

Process start-up (importing torch) dominates on a small machine, so a pool of
N processes is started once and reused by every test that needs N ranks; on
Linux its processes fork from ptdp's own fork server (as a CPU job's ranks
do), which imported torch and ptdp once, instead of each importing them. A
test function must be importable (defined at module level); it receives its
rank first, then the arguments given to `run`. If any rank raises or the call
times out, the pool is torn down (its collectives may be out of step) and the
next `run` starts a fresh one.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from multiprocessing.connection import wait
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

# Hang guards only, generous for a loaded 2-core machine: a call takes
# seconds, and a rank waits in a collective for a slower peer at most that long.
CALL_TIMEOUT_SECONDS = 900.0
COLLECTIVE_TIMEOUT = timedelta(seconds=600)


def _context():
    """Where the pools' processes come from: ptdp's fork server on Linux,
    started as `ptdp train` starts it (ptdp.launch), with this module
    imported too; elsewhere fresh interpreters (spawn)."""
    from ptdp.launch import CPU_RANK_MODULES, _rank_context

    return _rank_context((*CPU_RANK_MODULES, __name__))


def _serve(rank: int, world_size: int, port: int, conn, environ: dict[str, str]) -> None:
    # As a process of its own would start: this test session's environment
    # (a fork server keeps the one it started with), no signal held back
    # (the server holds a job's signals back), Ctrl-C a KeyboardInterrupt.
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                          timeout=COLLECTIVE_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=COLLECTIVE_TIMEOUT)
    # Each call builds its layout's process groups; they are released after
    # it, or their communicator threads would pile up in these long-lived
    # workers and keep waking (hundreds of threads by the end of a session).
    from ptdp.parallel.topology import ParallelContext

    built: list = []
    build = ParallelContext.build.__func__

    def build_and_remember(cls, *args, **kwargs):
        ctx = build(cls, *args, **kwargs)
        if ctx is not None:
            built.append(ctx)
        return ctx

    ParallelContext.build = classmethod(build_and_remember)
    while True:
        message = conn.recv()
        if message is None:
            break
        fn, args, kwargs = message
        try:
            conn.send(("ok", fn(rank, *args, **kwargs)))
        except BaseException as error:  # noqa: BLE001 - reported to the test
            conn.send(("error", "".join(traceback.format_exception(
                type(error), error, error.__traceback__))))
        finally:
            dist.barrier()  # every rank is done with the groups before any releases them
            while built:
                built.pop().destroy()
    dist.destroy_process_group()


class RankFailure(AssertionError):
    pass


class ProcessPool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self.store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True,
                                   wait_for_workers=False)
        context = _context()
        self.conns, self.processes = [], []
        for rank in range(world_size):
            parent, child = context.Pipe()
            process = context.Process(target=_serve, args=(rank, world_size, self.store.port, child,
                                                           dict(os.environ)), daemon=True)
            process.start()
            self.conns.append(parent)
            self.processes.append(process)

    def run(self, fn: Callable, *args: Any, timeout: float = CALL_TIMEOUT_SECONDS,
            **kwargs: Any) -> list[Any]:
        for conn in self.conns:
            conn.send((fn, args, kwargs))
        results: list[Any] = [None] * self.world_size
        errors: list[str] = []
        pending = {conn: rank for rank, conn in enumerate(self.conns)}
        deadline = time.monotonic() + timeout
        while pending and not errors:
            ready = wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                errors.extend(f"rank {rank}: no answer within {timeout} s" for rank in pending.values())
                break
            for conn in ready:
                rank = pending.pop(conn)
                try:
                    status, value = conn.recv()
                except EOFError:
                    status, value = "error", "the process died"
                if status == "error":
                    # The other ranks may be stuck in a collective with this one:
                    # stop waiting for them.
                    errors.append(f"rank {rank}:\n{value}")
                results[rank] = value
        if errors:
            self.close()
            raise RankFailure("\n".join(errors))
        return results

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    def ask_to_stop(self) -> None:
        """Tell every rank to leave its loop (it then ends its process group)."""
        for conn, process in zip(self.conns, self.processes):
            try:
                if process.is_alive():
                    conn.send(None)
            except (BrokenPipeError, OSError):
                pass

    def close(self, deadline: float | None = None) -> None:
        """Stop the ranks: all of them asked at once, then joined until
        `deadline` (time.monotonic(); default 2 s from now) together, not 2 s
        each; a rank still alive then is killed."""
        self.ask_to_stop()
        deadline = time.monotonic() + 2 if deadline is None else deadline
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join()
        self.processes = []


class Pools:
    """One live pool per world size, created on first use."""

    def __init__(self):
        self.pools: dict[int, ProcessPool] = {}

    def __call__(self, world_size: int) -> ProcessPool:
        pool = self.pools.get(world_size)
        if pool is None or not pool.processes or not pool.alive:
            pool = self.pools[world_size] = ProcessPool(world_size)
        return pool

    def close(self) -> None:
        # Every pool's ranks stop at once: their process groups end in parallel.
        for pool in self.pools.values():
            pool.ask_to_stop()
        deadline = time.monotonic() + 2
        for pool in self.pools.values():
            pool.close(deadline)
