"""Starting the processes of a job and keeping watch over them.

Three ways in, one code path inside (`run_worker`):
- torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT are set;
- SLURM (srun with more than one task): SLURM_PROCID, SLURM_NTASKS,
  SLURM_LOCALID; the master address is MASTER_ADDR or the launch node;
- neither: `launch_local` starts the processes on this machine itself and
  supervises them. If one fails, all others are stopped within seconds and
  the failing rank's error is printed; a collective timeout bounds any wait,
  so a lost peer never hangs a job for ever.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

LOOPBACK = "127.0.0.1"
STOP_GRACE_SECONDS = 3.0


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str  # "torchrun" | "slurm" | "local"


def _int(environ: dict, name: str) -> int:
    try:
        return int(environ[name])
    except (KeyError, ValueError):
        raise RuntimeError(f"environment variable {name}={environ.get(name)!r} is missing or not an "
                           f"integer") from None


def detect_env(environ: dict | None = None) -> DistEnv | None:
    """The launcher's environment, or None when ptdp must start the processes."""
    environ = dict(os.environ if environ is None else environ)
    if "RANK" in environ and "WORLD_SIZE" in environ:
        world = _int(environ, "WORLD_SIZE")
        return DistEnv(rank=_int(environ, "RANK"), world_size=world,
                       local_rank=int(environ.get("LOCAL_RANK", 0)),
                       local_world_size=int(environ.get("LOCAL_WORLD_SIZE", world)),
                       master_addr=environ.get("MASTER_ADDR", LOOPBACK),
                       master_port=int(environ.get("MASTER_PORT", 29500)), source="torchrun")
    if "SLURM_PROCID" in environ and int(environ.get("SLURM_NTASKS", "1")) > 1:
        world = _int(environ, "SLURM_NTASKS")
        per_node = environ.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
        master = environ.get("MASTER_ADDR") or environ.get("SLURM_LAUNCH_NODE_IPADDR")
        if not master:
            raise RuntimeError("under SLURM set MASTER_ADDR to the first node's address "
                               "(SLURM_LAUNCH_NODE_IPADDR is not set)")
        return DistEnv(rank=_int(environ, "SLURM_PROCID"), world_size=world,
                       local_rank=_int(environ, "SLURM_LOCALID"),
                       local_world_size=int(per_node) if per_node.isdigit() else world,
                       master_addr=master, master_port=int(environ.get("MASTER_PORT", 29500)),
                       source="slurm")
    return None


def init_process_group(env: DistEnv, backend: str, timeout: timedelta) -> None:
    """Join the job's default process group; every collective fails after `timeout`."""
    if env.world_size == 1:
        store = dist.HashStore()
    else:
        store = dist.TCPStore(env.master_addr, env.master_port, env.world_size,
                              is_master=(env.source != "local" and env.rank == 0),
                              timeout=timeout, wait_for_workers=False)
    dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size,
                            timeout=timeout)


def _die_with_parent() -> None:
    """Linux: have the kernel stop this process if its supervisor dies, so
    that killing `ptdp train` never leaves ranks behind."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _local_worker(env: DistEnv, entry: Callable[[DistEnv, Any], Any], payload: Any,
                  errors: multiprocessing.connection.Connection) -> None:
    _die_with_parent()
    try:
        entry(env, payload)
    except BaseException as error:  # noqa: BLE001 - reported to the supervisor, then exit 1
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        try:
            errors.send(text)
        finally:
            sys.stderr.flush()
            os._exit(1)
    finally:
        errors.close()


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class LocalJobFailed(RuntimeError):
    def __init__(self, rank: int, exit_code: int | None, error: str | None):
        self.rank, self.exit_code, self.error = rank, exit_code, error
        super().__init__(f"rank {rank} failed ({_describe_exit(exit_code)})"
                         + (f":\n{error.rstrip()}" if error else ""))


def launch_local(world_size: int, entry: Callable[[DistEnv, Any], Any], payload: Any) -> None:
    """Run `entry(env, payload)` in `world_size` new local processes and wait.

    Raises LocalJobFailed for the first rank that fails, after every other
    rank has been stopped (SIGTERM, then SIGKILL after a grace period).
    """
    import torch.distributed as dist

    # The supervisor hosts the rendezvous store on a free port it picks
    # itself, so concurrent jobs on one machine never collide on a port.
    store = dist.TCPStore(LOOPBACK, 0, world_size, is_master=True, wait_for_workers=False)
    context = mp.get_context("spawn")
    processes, error_pipes = [], []
    try:
        for rank in range(world_size):
            env = DistEnv(rank=rank, world_size=world_size, local_rank=rank,
                          local_world_size=world_size, master_addr=LOOPBACK,
                          master_port=store.port, source="local")
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(target=_local_worker, args=(env, entry, payload, sender),
                                      name=f"ptdp-rank{rank}")
            process.start()
            sender.close()
            processes.append(process)
            error_pipes.append(receiver)
        _supervise(processes, error_pipes)
    finally:
        _stop_all(processes)
        del store


def _read_error(pipe: multiprocessing.connection.Connection) -> str | None:
    try:
        return pipe.recv() if pipe.poll(0.5) else None
    except (EOFError, OSError):
        return None


def _supervise(processes: list, error_pipes: list) -> None:
    running = {p.sentinel: rank for rank, p in enumerate(processes)}
    while running:
        for sentinel in multiprocessing.connection.wait(list(running)):
            rank = running.pop(sentinel)
            process = processes[rank]
            process.join()
            if process.exitcode != 0:
                error = _read_error(error_pipes[rank])
                _stop_all(processes)
                raise LocalJobFailed(rank, process.exitcode, error)


def _stop_all(processes: list) -> None:
    alive = [p for p in processes if p.is_alive()]
    for p in alive:
        p.terminate()
    deadline_each = STOP_GRACE_SECONDS
    for p in alive:
        p.join(deadline_each)
        if p.is_alive():
            p.kill()
            p.join()
        deadline_each = 0.1
