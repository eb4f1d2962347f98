"""Whether a training run can fit this machine's memory, by the analytic
memory model (ptdp.perf.analytic.memory.memory_per_rank), before any process starts.

A run whose estimate exceeds what the machine has would only fail in a
rank's first large allocation (a 1.28 TB embedding), or be killed by the
kernel, after seconds or minutes of start-up. The estimate counts weights,
gradients, optimizer state and the activations the schedule keeps; it
leaves out transient working memory, so it is below what a run really
takes, and a refusal means the run cannot fit:

- on the CPU all of this machine's ranks share its memory: the sum of
  their estimates is compared with its physical memory (capped by the
  process's cgroup limit, where it has one) plus swap;
- on GPUs each rank has its own: the estimate of the rank that needs the
  most is compared with one GPU's memory.

Full recomputation is estimated as one layer per checkpointed group (what
`ptdp plan` prices): groups of k layers keep k − 1 fewer layer inputs, but
rebuild k layers' activations at once in the backward, so the estimate
stays below the peak; `--recompute-method block` keeps more than the
estimate. Nothing here imports torch: the caller gives the device's memory.

The estimate is of the run's sharding strategy (TrainConfig.sharding_strategy;
ptdp.perf.analytic.sharding), and where the model state dominates the
advice names the weakest stronger strategy `ptdp train` runs under which the
estimate fits, as its flags (--use-distributed-optimizer, or
--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from ptdp.config import Config
from ptdp.perf.layout import (SHARDING_STRATEGIES, Layout, LoRAWork, Workload,
                              trained_strategies)


def layout_of(config: Config) -> Layout:
    """The perf model's Layout of a training run's settings."""
    model, par, tr = config.model, config.parallel, config.train
    v = par.virtual_stages(model.num_layers)
    return Layout(t=par.tensor_model_parallel_size, p=par.pipeline_model_parallel_size,
                  d=par.dp, b=tr.micro_batch_size, v=v, recompute=model.recompute_granularity,
                  sharding=tr.sharding_strategy,
                  reshard_after_forward=tr.reshard_after_forward(par.pipeline_model_parallel_size),
                  scatter_gather=par.scatter_gather_tensors_in_pipeline,
                  schedule=par.pipeline_schedule, sequence_parallel=par.sequence_parallel,
                  split=par.layer_split, c=par.context_parallel_size, cp_comm=par.cp_comm_type)


def workload_of(config: Config) -> Workload:
    tr = config.train
    precision = "bf16" if tr.bf16 else "fp16" if tr.fp16 else "fp32"
    return Workload(config.model, tr.batch_size(config.parallel.dp), precision,
                    LoRAWork.of(getattr(config, "lora", None)),
                    main_grads_bytes=2 if tr.main_grads_dtype == "bf16" else 4)


@dataclass(frozen=True)
class Estimate:
    per_rank: tuple[dict[str, int], ...]   # memory_per_rank: one dict per pipeline rank

    @property
    def largest(self) -> dict[str, int]:
        return max(self.per_rank, key=lambda memory: memory["total"])

    @property
    def smallest(self) -> int:
        return min(memory["total"] for memory in self.per_rank)


def estimate(config: Config, kernels: str) -> Estimate | None:
    """The memory model's figures for the run; None for settings it does not
    model (a check that cannot estimate must not stop a run)."""
    from ptdp.perf.analytic.memory import memory_per_rank

    try:
        return Estimate(tuple(memory_per_rank(workload_of(config), layout_of(config),
                                              kernels=kernels,
                                              bucket_size=config.train.ddp_bucket_size)))
    except (ValueError, KeyError, ZeroDivisionError):
        return None


def host_memory_bytes() -> int | None:
    """What this machine's processes can use: physical memory, or the
    process's cgroup limit where lower, plus swap. None where unknown."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    if physical <= 0:
        return None
    limit = _cgroup_memory_limit()
    if limit is not None:
        physical = min(physical, limit)
    return physical + _swap_bytes()


def _swap_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("SwapTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _cgroup_memory_limit() -> int | None:
    """This process's cgroup memory limit in bytes (cgroup v2's memory.max,
    v1's memory.limit_in_bytes); None without one."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    root = Path("/sys/fs/cgroup")
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, group = parts
        if hierarchy == "0" and controllers == "":
            candidate = root / group.lstrip("/") / "memory.max"
        elif "memory" in controllers.split(","):
            candidate = root / "memory" / group.lstrip("/") / "memory.limit_in_bytes"
        else:
            continue
        try:
            text = candidate.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:   # v1 writes "no limit" as ~2^63
            return int(text)
    return None


def gib(count: float) -> str:
    return f"{count / 2**30:,.1f} GiB"


def memory_problems(config: Config, *, kind: str, local_processes: int,
                    device_memory: int | None = None, host_memory: int | None = None) -> list[str]:
    """A refusal (one message) when the run's estimate cannot fit. `kind`:
    "cpu" or "cuda"; `local_processes`: the ranks this machine runs (all
    t·p·d for a local launch); `device_memory`: one GPU's bytes (cuda);
    `host_memory`: the machine's (cpu; default `host_memory_bytes()`)."""
    if kind == "cuda":
        if not device_memory:
            return []
        found = estimate(config, "cuda")
        if found is None or found.largest["total"] <= device_memory:
            return []
        largest = found.largest
        fits = _fits_check(config, "cuda", lambda e: e.largest["total"] <= device_memory)
        return [f"the model does not fit one GPU: by ptdp's memory model its largest rank needs "
                f"{gib(largest['total'])} ({_parts(largest)}), but a GPU here has "
                f"{gib(device_memory)}; {_advice(config, largest, cpu=False, fits=fits)}"]
    available = host_memory if host_memory is not None else host_memory_bytes()
    if not available:
        return []
    found = estimate(config, "cpu")
    if found is None:
        return []
    needed, which = _host_bytes(config, found, local_processes)
    if needed <= available:
        return []
    largest = found.largest
    if local_processes == 1:
        need = f"its one process needs {gib(needed)} ({_parts(largest)})"
    else:
        need = (f"{which} {local_processes} local processes need {gib(needed)} in all, the "
                f"largest rank {gib(largest['total'])} ({_parts(largest)})")
    fits = _fits_check(config, "cpu",
                       lambda e: _host_bytes(config, e, local_processes)[0] <= available)
    return [f"the model does not fit this machine's memory: by ptdp's memory model {need}, but "
            f"the machine has {gib(available)} (memory and swap); "
            f"{_advice(config, largest, cpu=True, fits=fits)}"]


def _host_bytes(config: Config, found: Estimate, local_processes: int) -> tuple[int, str]:
    """What this machine's processes need in all by `found`, and how sure
    that is ("its", or "at least its" for a share of a larger job)."""
    par = config.parallel
    if local_processes == par.world_size:   # every rank here: t·c·d copies of each pipeline rank
        return (par.tensor_model_parallel_size * par.context_parallel_size * par.dp
                * sum(m["total"] for m in found.per_rank)), "its"
    # a share of a larger job: which stages are here is not known, count the smallest
    return local_processes * found.smallest, "at least its"


def _fits_check(config: Config, kernels: str, fits):
    """strategy -> whether the run fits under that sharding strategy (the
    estimate's test `fits`), None where it cannot be estimated."""
    def check(strategy: str) -> bool | None:
        found = estimate(_with_sharding(config, strategy), kernels)
        return None if found is None else fits(found)
    return check


def _with_sharding(config: Config, strategy: str) -> Config:
    """`config` under another sharding strategy (ptdp train's flags for it)."""
    train = dataclasses.replace(config.train, use_distributed_optimizer=strategy == "optim",
                                use_megatron_fsdp=strategy not in ("no_shard", "optim"),
                                data_parallel_sharding_strategy=strategy)
    return dataclasses.replace(config, train=train)


def _parts(memory: dict[str, int]) -> str:
    return ", ".join(f"{name} {gib(memory[name])}"
                     for name in ("weights", "gradients", "optimizer", "activations"))


def _sharding_advice(config: Config, fits) -> tuple[str, bool] | None:
    """The weakest sharding strategy stronger than the run's that `ptdp
    train` runs and under which it fits, as its flags (and True); else the
    strongest such, as one that shrinks the state (and False); None where
    there is none (d·c = 1, or the run shards all it can)."""
    if config.parallel.dp * config.parallel.context_parallel_size < 2:
        return None
    strategies = trained_strategies()
    current = config.train.sharding_strategy
    stronger = [name for name in strategies
                if SHARDING_STRATEGIES.index(name) > SHARDING_STRATEGIES.index(current)]
    for strategy in stronger:
        if fits(strategy):
            return (" ".join(Layout(sharding=strategy).sharding_flags())
                    + f" (shards {_SHARDED_WORDS[strategy]} over the data-parallel ranks; "
                    "by the memory model the run then fits)"), True
    if stronger:
        strategy = stronger[-1]
        return (" ".join(Layout(sharding=strategy).sharding_flags())
                + f" (shards {_SHARDED_WORDS[strategy]} over the data-parallel ranks)"), False
    return None


_SHARDED_WORDS = {"optim": "the optimizer state", "optim_grads": "gradients and optimizer state",
                  "optim_grads_params": "parameters, gradients and optimizer state"}


def _advice(config: Config, largest: dict[str, int], *, cpu: bool, fits=None) -> str:
    """What to change, chosen by the part that dominates (state or
    activations). `fits(strategy)`: whether the run fits under that sharding
    strategy (the check names the weakest that does; None: not checked)."""
    model, tr = config.model, config.train
    state = largest["weights"] + largest["gradients"] + largest["optimizer"]
    shrink = ("use a smaller model (--num-layers, --hidden-size, --vocab-size"
              + (", --seq-length" if largest["activations"] > state else "") + ")")
    split = ("or run on more machines or GPUs with more pipeline or tensor-parallel ranks "
             "(-p, -t), which split the model" if cpu else
             "or more pipeline or tensor-parallel ranks (-p, -t), which split the model")
    more = []
    sharding, fitting = _sharding_advice(config, fits or (lambda strategy: False)) or (None, False)
    if fitting:
        more.append(sharding)   # what fits first: the least change
    if largest["activations"] > state:
        if model.recompute_granularity != "full":
            more.append("--recompute-granularity full (or selective)")
        more.append("a smaller --micro-batch-size")
        if not (tr.bf16 or tr.fp16):   # halves activations (the state grows: fp32 main weights)
            more.append("--bf16")
    elif sharding and sharding not in more:
        more.append(sharding)
    if cpu and config.parallel.dp > 1:
        more.append("fewer data-parallel ranks (each holds a copy of the model)")
    return shrink + (", " + ", ".join(more) if more else "") + ", " + split
