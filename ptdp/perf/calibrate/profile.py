"""`ptdp calibrate`'s hardware profile of this machine: `calibrate` measures it
(ptdp.perf.calibrate.measure; on a GPU ptdp.perf.calibrate.gpu) and returns
the HardwareProfile that ptdp.commands.calibrate writes.

`cores` is os.cpu_count() (what configure_threads divides);
`available_cores` how much of them two processes computing at once really
get (each times the same work alone and together: on a machine others
load too, less than the cores). Every local
process is on one "server" (`devices_per_server` = LOCAL_DEVICES), and
`memory_bytes` is the machine's RAM, which its processes share. Every
measured number is also kept under `measurements`. On a machine others are
using too, all of these move with their load: calibrate right before the
runs you want to predict.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

from ptdp.perf.calibrate.gpu import calibrate_gpu
from ptdp.perf.calibrate.measure import (COLD_BYTES, GEMM_SHAPES, GEMM_SHAPES_QUICK, LOCAL_DEVICES,
                                         fit_line, latency_bandwidth, measure_gemm_speedup,
                                         measure_gemms, measure_gloo, measure_launch_overhead,
                                         measure_memory_ops)


def calibrate(*, quick: bool = False, name: str = "local", log: Callable[[str], None] = print):
    """Measure this machine; returns a HardwareProfile (a GPU's where CUDA is available)."""
    import torch

    from ptdp.device import cuda_device_count
    from ptdp.perf.price.profiles import HardwareProfile

    if cuda_device_count() > 0:
        return calibrate_gpu(quick=quick, name=name, log=log)

    cores = os.cpu_count() or 1
    # --quick: shorter timings, a smaller cold working set, fewer messages.
    budget = 0.1 if quick else 0.4
    cold_bytes = COLD_BYTES // 4 if quick else COLD_BYTES
    started = time.perf_counter()

    shapes = GEMM_SHAPES_QUICK if quick else GEMM_SHAPES
    gemms = measure_gemms(shapes, 1, budget, cold_bytes)
    slope, ramp = fit_line([2.0 * g["m"] * g["n"] * g["k"] for g in gemms],
                            [g["seconds"] for g in gemms])
    peak = 1.0 / slope
    rates = ", ".join("{m}x{n}x{k} {gflops:.1f}".format(**g) for g in gemms)
    log(f"GEMM, 1 thread: {rates} GFLOP/s -> peak {peak / 1e9:.1f} GFLOP/s, "
        f"{ramp * 1e6:.1f} us per GEMM")
    gemm_profile = HardwareProfile(name="gemm", kind="cpu", peak_tflops=peak / 1e12,
                                   peak_tflops_fp32=peak / 1e12, gemm_efficiency=1.0,
                                   gemm_ramp_seconds=ramp, memory_bandwidth=float("inf"))

    threads = measure_gemm_speedup(cores, budget, cold_bytes) if cores > 1 else None
    speedup = max(1.0, min(float(cores), threads["speedup"])) if threads else 1.0
    log(f"GEMM {threads['m']}x{threads['n']}x{threads['k']} on {cores} threads: {speedup:.2f}x "
        f"one thread" if threads else "one core: no thread speed-up")

    memory_ops = measure_memory_ops(budget, lambda *shape, **kw: gemm_profile.gemm_seconds(
        *shape, precision="fp32", bytes_per_element=4, **kw), threads=cores,
        rounds=1 if quick else 3, cold_bytes=cold_bytes,
        optimizer_elements=1 << (20 if quick else 22))
    op_bandwidth = {row["op"]: row["gbytes_per_s"] * 1e9 for row in memory_ops}
    for row in memory_ops:      # each direction's own rate (HardwareProfile.memory_seconds)
        if "forward_gbytes_per_s" in row:
            op_bandwidth[f"{row['op']}:forward"] = row["forward_gbytes_per_s"] * 1e9
            op_bandwidth[f"{row['op']}:backward"] = row["backward_gbytes_per_s"] * 1e9
    op_speedup = {row["op"]: max(1.0, min(float(cores), row["speedup"]))
                  for row in memory_ops if "speedup" in row}
    rates = ", ".join("{op} {gbytes_per_s:.1f}".format(**r) for r in memory_ops)
    log(f"memory-bound operators (forward + backward, 1 thread): {rates} GB/s")
    if op_speedup:
        log(f"... on {cores} threads: " + ", ".join(f"{op} {x:.2f}x" for op, x in op_speedup.items()))

    launch = measure_launch_overhead(budget)
    log(f"eager operator overhead: {launch['per_op'] * 1e6:.1f} us")

    sizes = [1, 1 << 16, 1 << 18] if quick else [1, 1 << 14, 1 << 16, 1 << 18, 1 << 20]
    comm = measure_gloo(sizes, 10 if quick else 40)
    capacity = comm.pop("cores")
    # Two processes measure two cores; cores they did not get count as taken on a bigger machine.
    available = min(float(cores), max(1.0, cores - (min(2, cores) - capacity["two_processes"])))
    log(f"two computing processes get {capacity['two_processes']:.2f} cores' worth -> "
        f"{available:.2f} of {cores} cores available")
    ar_latency, ar_bandwidth = latency_bandwidth(comm["allreduce"])
    p2p_latency, p2p_bandwidth = latency_bandwidth(comm["exchange"])
    # A 2-rank all-reduce in the ring formula is bytes / bandwidth + 2 latency steps.
    latency, link_bandwidth = ar_latency / 2, ar_bandwidth
    log(f"gloo, 2 processes: all-reduce {ar_latency * 1e6:.0f} us + bytes / {ar_bandwidth / 1e9:.2f} "
        f"GB/s; batched send+receive {p2p_latency * 1e6:.0f} us + bytes / "
        f"{p2p_bandwidth / 1e9:.2f} GB/s")

    try:
        memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory_bytes = 0
    profile = HardwareProfile(
        name=name, kind="cpu", devices_per_server=LOCAL_DEVICES,
        peak_tflops=peak / 1e12, peak_tflops_fp32=peak / 1e12,
        gemm_efficiency=1.0, gemm_ramp_seconds=ramp,
        memory_bandwidth=op_bandwidth["elementwise"], op_bandwidth=op_bandwidth,
        intra_bandwidth=link_bandwidth, intra_latency=latency,
        inter_bandwidth=link_bandwidth, inter_latency=latency,
        memory_bytes=float(memory_bytes), launch_overhead=launch["per_op"],
        collective_seconds={"allreduce": comm["allreduce"], "exchange": comm["exchange"]},
        cores=cores, available_cores=available, thread_speedup=speedup,
        op_thread_speedup=op_speedup,
        notes=f"measured by ptdp calibrate{' --quick' if quick else ''} on {_cpu_name()} with "
              f"torch {torch.__version__}; fp32, per process at 1 thread; 16-bit peak not measured "
              f"(= fp32)",
        measurements={"gemm": gemms, "threads": threads, "memory_ops": memory_ops,
                      "parallel": capacity,
                      "launch": launch, "exchange_latency": p2p_latency,
                      "exchange_bandwidth": p2p_bandwidth,
                      "seconds": time.perf_counter() - started})
    log(f"calibrated in {time.perf_counter() - started:.1f} s")
    return profile


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "this CPU"
