"""How many processes a local launch may start on this machine.

`ptdp train` without torchrun or SLURM starts t·c·p·d rank processes here.
Before anything is forked the count is held against the machine, and a
layout it cannot carry is refused in one paragraph with the estimate:

- memory: each CPU rank costs RANK_MEMORY_BYTES before its model (the
  model's own share is ptdp.perf.fits'); more ranks than the machine's
  memory (physical or its cgroup limit, plus swap) holds is refused;
- cores: more than PROCESSES_PER_CORE ranks per core is refused, since each
  then waits for the others nearly all the time (a start-up alone takes
  minutes).

Below both, oversubscription stays allowed, with a note: eight ranks on two
cores check a layout's equivalence (the tests and the README do).
`--allow-oversubscribe` starts the processes anyway. Under torchrun or SLURM
their launcher decides how many processes a machine runs: nothing is
checked here. GPU ranks are one per GPU, which choosing the device checks.
"""

from __future__ import annotations

import os
import sys

from ptdp.plural import plural

# A forked CPU rank's own memory before its model: Python, torch and gloo.
# Measured: a rank of a 2-layer model forked from the server (Linux) has
# 50 MB of private memory (Private_Dirty in /proc/PID/smaps_rollup, d=4),
# the ~150 MB of torch it shares with the server aside; at d=1024 issue 38
# measured about 83 GB in all, 81 MB a rank (gloo's connections grow with
# the job). A spawned rank (other systems) is a fresh interpreter: 195 MB
# resident measured, its shared libraries counted in full.
FORKED_RANK_MEMORY_BYTES = 80 * 2**20
SPAWNED_RANK_MEMORY_BYTES = 200 * 2**20
# Ranks per CPU core beyond which a local launch is refused (unless
# --allow-oversubscribe): 32 on a 2-core machine, where 8 is common.
PROCESSES_PER_CORE = 16


def rank_memory_bytes() -> int:
    """What one CPU rank of a local launch costs before its model."""
    forked = sys.platform.startswith("linux")  # ptdp.launch forks CPU ranks there only
    return FORKED_RANK_MEMORY_BYTES if forked else SPAWNED_RANK_MEMORY_BYTES


def local_process_problems(par, env, *, cores: int | None = None,
                           memory: int | None = None) -> list[str]:
    """The refusal (one paragraph) when the local launch of layout `par` (a
    ParallelConfig) would start more CPU ranks than this machine carries;
    [] under torchrun or SLURM (`env` not None), for GPU ranks, or with
    --allow-oversubscribe. `cores`, `memory`: the machine's (default: this
    one's CPU cores; its memory and swap, ptdp.perf.fits.host_memory_bytes)."""
    from ptdp.device import resolve_kind
    from ptdp.perf.fits import gib, host_memory_bytes

    world = par.world_size
    if env is not None or world <= 1 or getattr(par, "allow_oversubscribe", False):
        return []
    try:
        if resolve_kind(par.device, world) != "cpu":
            return []
    except RuntimeError:  # reported where the launch resolves the device
        return []
    cores = cores if cores is not None else (os.cpu_count() or 1)
    memory = memory if memory is not None else host_memory_bytes()
    each = rank_memory_bytes()
    reasons = []
    if memory and world * each > memory:
        reasons.append(f"the processes alone would need about {gib(world * each)} "
                       f"({each // 2**20} MiB each for Python, torch and gloo, before the model)")
    if world > PROCESSES_PER_CORE * cores:
        reasons.append(f"that is more than {PROCESSES_PER_CORE} per core ({PROCESSES_PER_CORE * cores:,} "
                       f"here), where each waits for the others nearly all the time")
    if not reasons:
        return []
    layout = (f"t={par.tensor_model_parallel_size} × c={par.context_parallel_size} × "
              f"p={par.pipeline_model_parallel_size} × d={par.dp}")
    machine = f"{plural(cores, 'CPU core')}" + (f" and {gib(memory)} of memory" if memory else "")
    return [f"the layout {layout} starts {plural(world, 'process')} on this machine, which has "
            f"{machine}: "
            f"{'; and '.join(reasons)}. Start fewer (a smaller -d, -t, -p or "
            f"--context-parallel-size), spread the job over several machines with torchrun or "
            f"SLURM, or pass --allow-oversubscribe to start them anyway"]
