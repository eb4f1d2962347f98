"""What `ptdp calibrate` measures on a GPU.

On a GPU (CUDA available) it measures what the GPU profiles' model needs
instead of a CPU's rates (`calibrate_gpu`), starting from the built-in profile of that chip
(data sheet; the a100 one with this device's SM count and memory for
others): 16-bit GEMMs over a grid of shapes, to which the tile model of
ptdp.perf.price.gemm is fitted (least squares on relative error over the
compute-bound shapes: `tile_overhead_seconds` and e_max, see
`fit_tile_model`), the memory bandwidth (a large copy), the eager operator
overhead, and with two or more GPUs NCCL between two processes: all-reduce,
all-gather and the pipeline's batched send + receive (`collective_seconds`).
With one GPU the links keep the data sheet's numbers.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from ptdp.device import (accelerator_shape, cuda_device_count, device_for, device_name,
                         synchronize)
from ptdp.distributed import init_process_group
from ptdp.perf.calibrate.measure import measure_launch_overhead, timed_by_two_processes
from ptdp.perf.price import gemm
from ptdp.perf.price.profiles import BUILTIN, builtin_profile

# [m, n, k] of the GEMMs timed on a GPU: small to large, square and skinny
# (k = 64..128 like the attention products), all compute-bound in 16 bits.
GPU_GEMM_SHAPES = [(m, n, k) for m in (1024, 4096, 16384) for n in (1024, 4096, 12288)
                   for k in (128, 1024, 8192)]
GPU_GEMM_SHAPES_QUICK = [(m, m, k) for m in (1024, 4096, 16384) for k in (128, 4096)]
NCCL_SIZES = [1 << 10, 1 << 16, 1 << 20, 1 << 24, 1 << 27]       # bytes


def fit_tile_model(rows: list[dict], peak_flops: float, sm_count: int,
                   tile: tuple[int, int], memory_bandwidth: float) -> tuple[float, float]:
    """(tile_overhead_seconds, achievable_fraction) of the tile model
    (ptdp.perf.price.gemm) fitted to measured GEMMs {m, n, k, batch?, seconds}:

        seconds = waves · overhead + waves · 2·tile_m·tile_n·k · sm_count / peak / fraction

    linear in (overhead, 1 / fraction); least squares on relative error
    (weights 1/seconds²) over the rows that are not memory-bound (their
    bytes take under half their time at `memory_bandwidth`). The overhead is
    kept non-negative."""

    points = []
    for row in rows:
        m, n, k, batch = row["m"], row["n"], row["k"], row.get("batch", 1)
        nbytes = gemm.gemm_bytes(m, n, k, batch, row.get("bytes_per_element", 2))
        if nbytes / memory_bandwidth > 0.5 * row["seconds"]:
            continue
        tiles = math.ceil(m / tile[0]) * math.ceil(n / tile[1]) * batch
        w = gemm.waves(tiles, sm_count)
        points.append((w, w * 2.0 * tile[0] * tile[1] * k * sm_count / peak_flops, row["seconds"]))
    if len(points) < 2:
        raise ValueError(f"need at least 2 compute-bound GEMM timings, got {len(points)}")
    # Normal equations of y = a·x1 + c·x2 with weights 1/y².
    s11 = sum(x1 * x1 / y ** 2 for x1, _, y in points)
    s12 = sum(x1 * x2 / y ** 2 for x1, x2, y in points)
    s22 = sum(x2 * x2 / y ** 2 for _, x2, y in points)
    s1y = sum(x1 / y for x1, _, y in points)
    s2y = sum(x2 / y for _, x2, y in points)
    det = s11 * s22 - s12 * s12
    overhead = (s1y * s22 - s2y * s12) / det if det else 0.0
    inverse_fraction = (s11 * s2y - s12 * s1y) / det if det else 0.0
    if overhead < 0 or inverse_fraction <= 0:      # no fixed cost visible: fit the slope alone
        overhead, inverse_fraction = 0.0, s2y / s22
    return overhead, 1.0 / inverse_fraction


def _gpu_seconds(fn: Callable[[], Any], device, budget: float) -> float:
    """Seconds per call of `fn` on the GPU: batches of calls between two
    synchronisations (so the launch overlaps the previous kernel, as in
    training), the fastest batch's mean."""

    fn()
    synchronize(device)
    best, deadline, calls = float("inf"), time.perf_counter() + budget, 10
    while True:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        synchronize(device)
        best = min(best, (time.perf_counter() - start) / calls)
        if time.perf_counter() > deadline:
            return best


def measure_gpu_gemms(shapes: list[tuple[int, int, int]], device, budget: float) -> list[dict]:

    rows = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
        seconds = _gpu_seconds(lambda: torch.mm(a, b), device, budget)
        rows.append({"m": m, "n": n, "k": k, "seconds": seconds,
                     "tflops": 2 * m * n * k / seconds / 1e12})
    return rows


def measure_gpu_bandwidth(device, budget: float, nbytes: int = 1 << 30) -> float:
    """Bytes/s of a large device-to-device copy (read + write)."""

    source = torch.empty(nbytes // 2, device=device, dtype=torch.bfloat16)
    target = torch.empty_like(source)
    return 2 * nbytes / _gpu_seconds(lambda: target.copy_(source), device, budget)


def _nccl_worker(env, payload) -> None:


    out, sizes, budget = payload
    device = device_for("cuda", env.local_rank)
    init_process_group(env, "nccl", timedelta(minutes=2))
    try:
        peer = 1 - env.rank
        results: dict[str, dict[str, float]] = {"allreduce": {}, "allgather": {}, "exchange": {}}
        for nbytes in sizes:
            tensor = torch.ones(nbytes // 2, device=device, dtype=torch.bfloat16)
            gathered = torch.empty(2 * tensor.numel(), device=device, dtype=tensor.dtype)
            receive = torch.empty_like(tensor)

            def exchange():
                for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, peer),
                                                    dist.P2POp(dist.irecv, receive, peer)]):
                    work.wait()

            for name, fn in (("allreduce", lambda: dist.all_reduce(tensor)),
                             ("allgather", lambda: dist.all_gather_into_tensor(gathered, tensor)),
                             ("exchange", exchange)):
                dist.barrier()
                results[name][str(nbytes)] = _gpu_seconds(fn, device, budget)
        if env.rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def measure_nccl(sizes: list[int], budget: float) -> dict:
    return timed_by_two_processes(_nccl_worker, sizes, budget)


def calibrate_gpu(*, quick: bool = False, name: str = "local",
                  log: Callable[[str], None] = print):
    """Measure GPU 0 (and NCCL with GPU 1); returns a HardwareProfile."""


    started = time.perf_counter()
    budget = 0.05 if quick else 0.2
    device = device_for("cuda", 0)
    chip = device_name(device)
    known = [key for key in BUILTIN if key in chip.lower()]
    base = builtin_profile(known[0] if known else "a100")
    if not known:   # unknown chip: its own SMs and memory; the peak from the fastest GEMM below
        sm_count, memory_bytes = accelerator_shape(device)
        base = replace(base, sm_count=sm_count, memory_bytes=float(memory_bytes))
    bandwidth = measure_gpu_bandwidth(device, budget)
    gemms = measure_gpu_gemms(GPU_GEMM_SHAPES_QUICK if quick else GPU_GEMM_SHAPES, device, budget)
    peak = base.peak_flops("bf16") if known else max(g["tflops"] for g in gemms) * 1e12
    overhead, fraction = fit_tile_model(gemms, peak, base.sm_count, base.gemm_tile, bandwidth)
    log(f"{chip}: {base.sm_count} SMs, copy {bandwidth / 1e9:.0f} GB/s; GEMMs "
        + ", ".join("{m}x{n}x{k} {tflops:.0f}".format(**g) for g in gemms)
        + f" TFLOP/s -> e_max {fraction:.3f} of {peak / 1e12:.0f} TFLOP/s, "
          f"{overhead * 1e6:.2f} us per tile")
    launch = measure_launch_overhead(budget, device=device)
    comm: dict[str, dict[str, float]] = {}
    if cuda_device_count() >= 2:
        comm = measure_nccl(NCCL_SIZES, budget)
        log("NCCL, 2 GPUs: " + "; ".join(
            f"{kind} " + ", ".join(f"{int(size) >> 10} KiB {t * 1e6:.0f} us"
                                   for size, t in table.items()) for kind, table in comm.items()))
    else:
        log("one GPU: no collectives measured (the data sheet's link numbers stay)")
    profile = replace(
        base, name=name, peak_tflops=peak / 1e12, gemm_efficiency=fraction,
        tile_overhead_seconds=overhead, memory_bandwidth=bandwidth,
        launch_overhead=launch["per_op"], collective_seconds=comm,
        notes=f"measured by ptdp calibrate{' --quick' if quick else ''} on {chip} with torch "
              f"{torch.__version__}; the rest from the {base.name} data sheet",
        measurements={"gemm": gemms, "launch": launch, "collectives": comm,
                      "seconds": time.perf_counter() - started})
    log(f"calibrated in {time.perf_counter() - started:.1f} s")
    return profile
