"""The distributed environment of one rank and joining the job's process group.

Below both the launcher (ptdp.launch, which starts and supervises the ranks)
and the training loop (ptdp.train.loop, which every rank runs): a rank needs
to know where it stands (`DistEnv`, from torchrun's or SLURM's variables,
`detect_env`, or from `launch_local`) and to join the default process group
(`init_process_group`), whoever started it.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from ptdp.errors import set_process_rank

LOOPBACK = "127.0.0.1"


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
    set_process_rank(env.rank)
    if env.source == "local":
        _collectives_over_loopback()
    if env.world_size == 1:
        store = dist.HashStore()
    else:
        # torchrun's agent on the first node already serves a store at
        # MASTER_ADDR:MASTER_PORT (it says so in TORCHELASTIC_USE_AGENT_STORE):
        # rank 0 joins it rather than fail to bind the port (which torch
        # forgives, but logs as an error).
        agent_store = (env.source == "torchrun"
                       and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True")
        store = dist.TCPStore(env.master_addr, env.master_port, env.world_size,
                              is_master=(env.source != "local" and env.rank == 0
                                         and not agent_store),
                              timeout=timeout, wait_for_workers=False)
    dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size,
                            timeout=timeout)


# ------------------------------------------------------------------ loopback only

def _loopback_interface() -> str | None:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):
        return None
    for name in ("lo", "lo0"):  # Linux, BSD and macOS
        if name in names:
            return name
    return None


def _collectives_over_loopback() -> None:
    """gloo and NCCL bind their sockets to the address the host name resolves
    to (or the first interface that is up), which is reachable from the
    network; every rank of a local job is on this machine, so loopback will do.
    Set for the life of the rank: each new process group reads it again."""
    name = _loopback_interface()
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name
        os.environ["NCCL_SOCKET_IFNAME"] = name
