"""bench/gpu.py's kernel sweep: what the planner's physics (ptdp.perf) assumes
of one device, measured on it, beside what the planner predicts.

1. GEMM time against shape, bf16 and fp16 (fp32 accumulation, as
   F.linear runs them: x [m, k] times the weight [n, k] transposed). The
   shapes are the forward GEMMs of one transformer layer of every priced
   row of bench/published_runs.py (QKV, projection, MLP up, MLP down, as
   ptdp.perf.price.pricing.OperatorModel.layer_gemms gives them for the row's
   layout: m = b·s/c tokens, n or k split by t), deduplicated, the largest
   first; then square sizes, and skinny ones (k = 128 and n = 128 as the
   unfused attention products, n = E as a router). For each: the median
   time over repetitions after a warm-up (CUDA events around each call,
   the calls back to back), TFLOP/s, the fraction of the profile's peak,
   and the planner's time for the same GEMM
   (HardwareProfile.gemm_seconds) with measured / predicted. Operands
   cycle through copies of at least ROTATION_BYTES so that a small GEMM
   does not run from the L2 cache. The part stops at its time cap and lists
   what it skipped.
2. Memory-bound operators at activation sizes (bf16; rows of `row`
   elements): copy, add, bias + GeLU (ptdp's fused one, and eager), SwiGLU,
   LayerNorm, RMSNorm, softmax, dropout, bias + dropout + add; and over fp32
   buffers the AdamW update (PyTorch's fused kernel, as ptdp calls it;
   ptdp's element-wise fallback) and ptdp's whole optimizer step (gradient
   norm, clipping, AdamW, main weights to bf16, gradients zeroed). Bytes
   are the traffic the operator cannot avoid (each input read and each
   output written once; see `memory_ops`); achieved bandwidth = bytes /
   median time, against the profile's memory_bandwidth, and the planner's
   time (HardwareProfile.memory_seconds over ptdp.perf.price.operator_bytes'
   counts of the operator's class; for the optimizer step, the bytes and
   launches ptdp/perf/price/after_flush.py prices).
3. Launch overhead: a loop of tiny kernels (x.add_(1) on one element),
   host-timed, and `ptdp calibrate`'s own measurement
   (calibrate.measure_launch_overhead), seconds per launch against the
   profile's launch_overhead.
4. A sustained GEMM: the largest published shape in bf16 back to back for
   15 s, its TFLOP/s per half second, first against last, and the SM clock
   where PyTorch can read it: the rows of 1 are bursts, a training run is
   not (`sustained_part`).
5. Fused attention: causal bf16 scaled_dot_product_attention at the
   attention calls of the published rows (b·a/t sequences of s, or of s/c
   blocks), forward and backward against HardwareProfile.attention_seconds
   (`attention_part`): the kernel PyTorch picks (ptdp's), and on CUDA also
   cuDNN's (the published rows').

Every case that raises is recorded with its message and the rest runs.
bench/gpu.py runs this file as a child process (`run_isolated`), as it runs
bench/gpu_context_attention.py: a faulting kernel must not take the
training measurements with it. Alone:

    python bench/gpu_kernels_sweep.py --device cuda --json sweep.json
    python bench/gpu_kernels_sweep.py --tiny --device cpu     # a smoke test, seconds
"""

from __future__ import annotations

import importlib
import itertools
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.nn.functional as F

from child_section import run_in_child, section_main  # bench/child_section.py, beside this file
from ptdp import device as devices
from ptdp.perf.price.profiles import HardwareProfile, load_profile

BENCH = Path(__file__).resolve().parent
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GEMMS = ("qkv", "proj", "mlp_up", "mlp_down")    # OperatorModel.layer_gemms' names
# The child's limit in bench/gpu.py (the sweep takes about two minutes on
# an H200: GEMMs capped at 60 s, memory-bound operators at 30 s with
# torch.compile's build of ptdp's fused kernels, launches a second, the
# sustained GEMM 15 s, attention capped at 20 s).
SECONDS = 180.0
MIB, GIB = 2 ** 20, 2 ** 30
# Cycle a small GEMM's operands through copies of at least this many bytes:
# an H100/H200 has 50 MiB of L2, and in training a layer's operands come
# from HBM.
ROTATION_BYTES = 256 * MIB


@dataclass(frozen=True)
class Sizes:
    published_cap: int                  # at most this many published shapes, the largest first
    published_scale: int                # published dimensions divided by this (--tiny only)
    squares: tuple[int, ...]
    skinny: tuple[tuple[str, int, int, int], ...]     # (what, m, n, k)
    gemm_dtypes: tuple[str, ...]
    gemm_cap_s: float                   # the GEMM part stops after this
    case_budget_s: float                # timed calls of one case: about this long in all
    warmup: int
    min_reps: int
    max_reps: int
    activation_bytes: tuple[int, ...]   # bf16 input sizes of the memory-bound operators
    row: int                            # last dimension (hidden size, softmax row)
    optimizer_params: tuple[int, ...]   # fp32 parameters of the optimizer cases
    memory_cap_s: float
    launches: int
    launch_budget_s: float
    rotation_bytes: int
    sustain_s: float = 0.0              # the sustained GEMM: seconds back to back (0: skipped)
    sustain_window_s: float = 0.5       # its throughput is sampled over windows this long
    attention_cap: int = 0              # at most this many published attention shapes
    attention_scale: int = 1            # their heads and lengths divided by this (--tiny)
    attention_cap_s: float = 30.0


GPU_SIZES = Sizes(
    # 81 distinct shapes today: all of them (about 5 s), so that the small
    # layers (t = 8 projections), where the tile model matters most, are in.
    published_cap=96, published_scale=1,
    squares=(1024, 2048, 4096, 8192, 16384),
    skinny=(("attention QKᵀ (k = d)", 4096, 4096, 128), ("attention QKᵀ (k = d)", 8192, 8192, 128),
            ("attention PV (n = d)", 4096, 128, 4096), ("attention PV (n = d)", 8192, 128, 8192),
            ("router (n = E)", 8192, 8, 4096), ("router (n = E)", 32768, 8, 4096),
            ("router (n = E)", 8192, 128, 2048)),
    gemm_dtypes=("bf16", "fp16"), gemm_cap_s=60.0, case_budget_s=0.05, warmup=3, min_reps=5,
    max_reps=50, activation_bytes=(64 * MIB, 256 * MIB, GIB), row=4096,
    optimizer_params=(16 * 2 ** 20, 64 * 2 ** 20, 256 * 2 ** 20), memory_cap_s=30.0,
    launches=1000, launch_budget_s=1.0, rotation_bytes=ROTATION_BYTES, sustain_s=15.0,
    attention_cap=16, attention_cap_s=20.0)

# Seconds on a CPU: the same steps on small shapes (published ones scaled
# down); its figures are a check of the script, not results.
TINY_SIZES = Sizes(
    published_cap=8, published_scale=64, squares=(64, 128, 256),
    skinny=(("attention QKᵀ (k = d)", 128, 128, 16), ("router (n = E)", 256, 8, 64)),
    gemm_dtypes=("bf16", "fp16"), gemm_cap_s=20.0, case_budget_s=0.002, warmup=1, min_reps=2,
    max_reps=3, activation_bytes=(256 * 2 ** 10, MIB), row=256,
    optimizer_params=(2 ** 16,), memory_cap_s=10.0, launches=200, launch_budget_s=0.02,
    rotation_bytes=0, sustain_s=0.2, sustain_window_s=0.05, attention_cap=3, attention_scale=16,
    attention_cap_s=10.0)


def _failure(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def profile_for(device: torch.device, name: str) -> tuple[str, HardwareProfile]:
    """The built-in profile of the card (a100, h100, h200 by its name); h200
    elsewhere (on a CPU its predictions only give the smoke test numbers)."""
    lowered = name.lower()
    chosen = next((p for p in ("h200", "h100", "a100") if p in lowered), "h200")
    return chosen, load_profile(chosen)


# ------------------------------------------------------------------ timing

def median_seconds(fn: Callable[[], Any], device: torch.device, sizes: Sizes) -> tuple[float, int]:
    """(median seconds of one call, calls timed): warm-up, one synchronised
    probe to size the repetitions, then the calls back to back, each between
    two CUDA events (host clock on a CPU)."""
    for _ in range(sizes.warmup):
        fn()
    devices.synchronize(device)
    start = time.perf_counter()
    fn()
    devices.synchronize(device)
    probe = time.perf_counter() - start
    reps = max(sizes.min_reps, min(sizes.max_reps, int(sizes.case_budget_s / max(probe, 1e-9))))
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(reps)]
        for begin, end in events:
            begin.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        times = [begin.elapsed_time(end) / 1e3 for begin, end in events]
    else:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(times), reps


def _rotation(make: Callable[[], Any], nbytes: int, rotation_bytes: int) -> Callable[[], Any]:
    """A function handing out copies of `make()` in turn: enough copies of
    `nbytes` each to pass `rotation_bytes` (at most 8)."""
    copies = max(1, min(8, math.ceil(rotation_bytes / max(nbytes, 1))))
    return itertools.cycle([make() for _ in range(copies)]).__next__


# ------------------------------------------------------------------ 1. GEMMs

def _bench_module(name: str):
    """A module of bench/ (published_runs imports bench/results.py by name)."""
    if name in sys.modules:
        return sys.modules[name]
    added = str(BENCH) not in sys.path
    if added:
        sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        if added:
            sys.path.remove(str(BENCH))


def published_shapes(profile: HardwareProfile | None = None) -> list[dict[str, Any]]:
    """The distinct forward GEMMs (m, n, k) of one layer of every priced row
    of bench/published_runs.py, as the planner prices them
    (OperatorModel.layer_gemms on the row's layout), the most FLOPs first;
    each with the rows and GEMM names it stands for."""
    from ptdp.perf.layout import Workload
    from ptdp.perf.price.machine import Machine
    from ptdp.perf.price.pricing import OperatorModel

    runs = _bench_module("published_runs").RUNS
    profile = profile or load_profile("h200")
    shapes: dict[tuple[int, int, int], list[str]] = {}
    for run in runs:
        if not run.priced or isinstance(run.shape, str):
            continue
        layout = run.layout()
        model = OperatorModel(Workload(run.shape.config(), run.global_batch, "bf16"), layout,
                              profile, Machine(layout, profile))
        gemms = model.layer_gemms()
        for name in GEMMS:
            if name in gemms:
                m, n, k, _batch = gemms[name]
                shapes.setdefault((m, n, k), []).append(f"{run.name} {name}")
    ordered = sorted(shapes.items(), key=lambda item: (-item[0][0] * item[0][1] * item[0][2],
                                                       item[0]))
    return [{"m": m, "n": n, "k": k, "sources": sources} for (m, n, k), sources in ordered]


def gemm_cases(sizes: Sizes, profile: HardwareProfile
               ) -> tuple[list[dict[str, Any]], int, str | None]:
    """(the shapes to measure, how many distinct published shapes there are,
    why there are none: the squares and skinny shapes run without them)."""
    try:
        published, problem = published_shapes(profile), None
    except Exception as error:  # noqa: BLE001
        published, problem = [], f"published shapes: {_failure(error)}"
    cases = []
    for shape in published[:sizes.published_cap]:
        scale = sizes.published_scale
        case = {"kind": "published", "what": shape["sources"][0], "sources": shape["sources"],
                "m": max(8, shape["m"] // scale), "n": max(8, shape["n"] // scale),
                "k": max(8, shape["k"] // scale)}
        if scale != 1:
            case["scaled_from"] = [shape["m"], shape["n"], shape["k"]]
        cases.append(case)
    cases += [{"kind": "square", "what": f"square {n}", "m": n, "n": n, "k": n} for n in sizes.squares]
    cases += [{"kind": "skinny", "what": what, "m": m, "n": n, "k": k}
              for what, m, n, k in sizes.skinny]
    return cases, len(published), problem


def measure_gemm(m: int, n: int, k: int, dtype_name: str, device: torch.device, sizes: Sizes,
                 profile: HardwareProfile) -> dict[str, Any]:
    dtype = DTYPES[dtype_name]
    operands = _rotation(lambda: (torch.randn(m, k, device=device, dtype=dtype),
                                  torch.randn(n, k, device=device, dtype=dtype)),
                         (m * k + n * k + m * n) * dtype.itemsize, sizes.rotation_bytes)
    seconds, reps = median_seconds(lambda: F.linear(*operands()), device, sizes)
    predicted = profile.gemm_seconds(m, n, k, precision=dtype_name,
                                     bytes_per_element=dtype.itemsize)
    tflops = 2.0 * m * n * k / seconds / 1e12
    return {"seconds": seconds, "reps": reps, "tflops": tflops,
            "peak_fraction": tflops * 1e12 / profile.peak_flops(dtype_name),
            "predicted_s": predicted, "ratio": seconds / predicted if predicted else None}


def gemm_part(device: torch.device, sizes: Sizes, profile: HardwareProfile) -> dict[str, Any]:
    cases, distinct, problem = gemm_cases(sizes, profile)
    started = time.monotonic()
    skipped = 0
    for case in cases:
        for dtype_name in sizes.gemm_dtypes:
            if time.monotonic() - started > sizes.gemm_cap_s:
                case[dtype_name] = {"skipped": f"over the part's {sizes.gemm_cap_s:g} s cap"}
                skipped += 1
                continue
            try:
                case[dtype_name] = measure_gemm(case["m"], case["n"], case["k"], dtype_name, device,
                                           sizes, profile)
            except Exception as error:  # noqa: BLE001 - one shape's failure must not lose the rest
                case[dtype_name] = {"error": _failure(error)}
            devices.release_cached_memory(device)
    return {"rows": cases, "dtypes": list(sizes.gemm_dtypes), "published_distinct": distinct,
            "published_measured": sum(c["kind"] == "published" for c in cases),
            "seconds": time.monotonic() - started, "cap_s": sizes.gemm_cap_s,
            "skipped_cases": skipped, "error": problem}


def published_attention(profile: HardwareProfile | None = None) -> list[dict[str, Any]]:
    """The distinct fused-attention calls (sequences, length, head size) of
    one layer of every priced flash-kernel row of bench/published_runs.py,
    as the planner prices them (OperatorModel.attention_shape: b·a/t
    sequences, split further by context parallelism), the most work first."""
    from ptdp.perf.layout import Workload
    from ptdp.perf.price.machine import Machine
    from ptdp.perf.price.pricing import OperatorModel

    runs = _bench_module("published_runs").RUNS
    profile = profile or load_profile("h200")
    shapes: dict[tuple[int, int, int], list[str]] = {}
    for run in runs:
        if not run.priced or run.kernels != "flash" or isinstance(run.shape, str):
            continue
        layout = run.layout()
        model = OperatorModel(Workload(run.shape.config(), run.global_batch, "bf16"), layout,
                              profile, Machine(layout, profile))
        heads, length = model.attention_shape()
        shapes.setdefault((heads, length, model.d), []).append(run.name)
    ordered = sorted(shapes.items(), key=lambda item: (-item[0][0] * item[0][1] ** 2 * item[0][2],
                                                       item[0]))
    return [{"heads": h, "seq": s, "head_dim": d, "sources": sources}
            for (h, s, d), sources in ordered]


def measure_attention(heads: int, seq: int, head_dim: int, device: torch.device, sizes: Sizes,
                      profile: HardwareProfile) -> dict[str, Any]:
    """Causal bf16 scaled_dot_product_attention over `heads` sequences
    (the fused kernel PyTorch picks): forward, and forward + backward, each
    the median after warm-up; the backward is their difference. Beside
    them the profile's attention_seconds."""
    dtype = DTYPES["bf16"]
    q, k, v = (torch.randn(1, heads, seq, head_dim, device=device, dtype=dtype,
                           requires_grad=True) for _ in range(3))
    grad = torch.randn(1, heads, seq, head_dim, device=device, dtype=dtype)

    def forward():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def both():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    forward_s, reps = median_seconds(forward, device, sizes)
    both_s, _ = median_seconds(both, device, sizes)
    predicted_f, predicted_b = profile.attention_seconds(heads, seq, head_dim, causal=True)
    backward_s = max(both_s - forward_s, 0.0)
    flops = 4.0 * heads * seq * seq * head_dim / 2          # causal: half the block pairs
    row = {"forward_s": forward_s, "backward_s": backward_s, "reps": reps,
           "forward_tflops": flops / forward_s / 1e12,
           "backward_tflops": 2.5 * flops / backward_s / 1e12 if backward_s else None,
           "predicted_forward_s": predicted_f, "predicted_backward_s": predicted_b,
           "forward_ratio": forward_s / predicted_f if predicted_f else None,
           "backward_ratio": backward_s / predicted_b if predicted_b and backward_s else None}
    cudnn = _cudnn_backend() if device.type == "cuda" else None
    if cudnn is not None:
        # The kernel Transformer Engine picks on Hopper, which the published
        # rows ran (bench/published_runs.py prices them at its rate).
        try:
            with cudnn():
                cudnn_forward, _ = median_seconds(forward, device, sizes)
                cudnn_both, _ = median_seconds(both, device, sizes)
            row.update(cudnn_forward_s=cudnn_forward,
                       cudnn_backward_s=max(cudnn_both - cudnn_forward, 0.0))
        except Exception as error:  # noqa: BLE001 - a shape cuDNN refuses keeps PyTorch's figures
            row["cudnn_error"] = _failure(error)
    return row


def _cudnn_backend() -> Callable[[], Any] | None:
    """A context that makes scaled_dot_product_attention use cuDNN's fused
    kernel, where this PyTorch has it (2.5 and newer); None elsewhere."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = SDPBackend.CUDNN_ATTENTION
    except (ImportError, AttributeError):
        return None
    return lambda: sdpa_kernel(backend)


def attention_part(device: torch.device, sizes: Sizes, profile: HardwareProfile
                   ) -> dict[str, Any]:
    """The published rows' attention calls (`published_attention`), scaled
    down by `attention_scale` on a CPU, each measured against the profile."""
    if sizes.attention_cap <= 0:
        return {"rows": [], "skipped": "no attention shapes at these sizes"}
    started = time.monotonic()
    rows = []
    for case in published_attention(profile)[:sizes.attention_cap]:
        heads = max(1, case["heads"] // sizes.attention_scale)
        seq = max(16, case["seq"] // sizes.attention_scale)
        row: dict[str, Any] = {"heads": heads, "seq": seq, "head_dim": case["head_dim"],
                               "sources": case["sources"]}
        if time.monotonic() - started > sizes.attention_cap_s:
            row["skipped"] = f"over the part's {sizes.attention_cap_s:g} s cap"
        else:
            try:
                row.update(measure_attention(heads, seq, case["head_dim"], device, sizes, profile))
            except Exception as error:  # noqa: BLE001 - one shape's failure must not lose the rest
                row["error"] = _failure(error)
        rows.append(row)
        devices.release_cached_memory(device)
    return {"rows": rows, "seconds": time.monotonic() - started}


def attention_lines(part: dict[str, Any], report: dict[str, Any]) -> list[str]:
    measured = [r for r in part["rows"] if r.get("forward_ratio")]
    if not measured:
        return [f"kernel sweep, attention: {part.get('skipped', 'nothing measured')}"]
    forward = statistics.median(r["forward_ratio"] for r in measured)
    backward = [r["backward_ratio"] for r in measured if r.get("backward_ratio")]
    text = (f"kernel sweep, attention (causal bf16 SDPA, {len(measured)} published shapes): "
            f"measured / predicted forward {forward:.2f}")
    if backward:
        text += f", backward {statistics.median(backward):.2f}"
    lines = [text + " (medians)"]
    cudnn = [r for r in measured if r.get("cudnn_forward_s") and r.get("cudnn_backward_s")]
    if cudnn:
        speedup = [(r["forward_s"] + r["backward_s"]) / (r["cudnn_forward_s"] + r["cudnn_backward_s"])
                   for r in cudnn]
        lines.append(f"kernel sweep, attention: cuDNN's kernel on {len(cudnn)} shapes, forward + "
                     f"backward {statistics.median(speedup):.2f}x PyTorch's default's speed (median)")
    refused = [r for r in measured if r.get("cudnn_error")]
    if refused:
        lines.append(f"kernel sweep, attention: cuDNN refused {len(refused)} shapes "
                     f"({refused[0]['cudnn_error']})")
    return lines


def attention_table(part: dict[str, Any]) -> list[str]:
    lines = ["| sequences × length × head size | forward ms | TFLOP/s | predicted ms | "
             "backward ms | TFLOP/s | predicted ms |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in part["rows"]:
        label = f"{r['heads']} × {r['seq']} × {r['head_dim']}"
        if "forward_s" not in r:
            lines.append(f"| {label} | {r.get('error') or r.get('skipped')} | | | | | |")
            continue
        back = (f"{r['backward_s'] * 1e3:.3f} | {r['backward_tflops']:.0f}"
                if r.get("backward_tflops") else "– | –")
        lines.append(f"| {label} | {r['forward_s'] * 1e3:.3f} | {r['forward_tflops']:.0f} | "
                     f"{r['predicted_forward_s'] * 1e3:.3f} | {back} | "
                     f"{r['predicted_backward_s'] * 1e3:.3f} |")
    return lines


def _clock_mhz(device: torch.device) -> float | None:
    """The device's SM clock now (MHz), where this PyTorch can read it (it
    needs pynvml); None elsewhere."""
    try:
        return float(torch.cuda.clock_rate(device)) if device.type == "cuda" else None
    except Exception:  # noqa: BLE001 - a missing pynvml or an old torch: no clock figure
        return None


def sustained_part(device: torch.device, sizes: Sizes, profile: HardwareProfile
                   ) -> dict[str, Any]:
    """The largest bf16 published GEMM back to back for `sizes.sustain_s`
    seconds: its TFLOP/s in each window of `sustain_window_s`, first against
    last. The GEMM rows above are short bursts, like the published best-case
    matmul measurements; a training run keeps the chip busy for hours, and
    its clock and power limits decide what GEMMs reach then."""
    if sizes.sustain_s <= 0:
        return {"skipped": "no sustained run at these sizes"}
    shapes = published_shapes(profile)
    m, n, k = (max(shapes, key=lambda c: c["m"] * c["n"] * c["k"])[key] for key in "mnk")
    if sizes.published_scale > 1:
        m, n, k = (max(1, x // sizes.published_scale) for x in (m, n, k))
    dtype = DTYPES["bf16"]
    x = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(n, k, device=device, dtype=dtype)
    flops = 2.0 * m * n * k
    windows: list[float] = []
    clocks: list[float] = []
    started = time.perf_counter()
    while time.perf_counter() - started < sizes.sustain_s:
        devices.synchronize(device)
        begin, calls = time.perf_counter(), 0
        while time.perf_counter() - begin < sizes.sustain_window_s:
            F.linear(x, w)
            calls += 1
            if calls % 8 == 0:   # keep the host from queueing far ahead of the window
                devices.synchronize(device)
        devices.synchronize(device)
        windows.append(flops * calls / (time.perf_counter() - begin) / 1e12)
        clock = _clock_mhz(device)
        if clock is not None:
            clocks.append(clock)
    peak = profile.peak_flops("bf16") / 1e12
    return {"m": m, "n": n, "k": k, "seconds": time.perf_counter() - started,
            "window_s": sizes.sustain_window_s, "tflops": windows,
            "first": windows[0], "last": windows[-1], "lowest": min(windows),
            "last_over_first": windows[-1] / windows[0], "last_peak_fraction": windows[-1] / peak,
            "clock_mhz": {"first": clocks[0], "last": clocks[-1]} if clocks else None}


def sustained_lines(part: dict[str, Any], report: dict[str, Any]) -> list[str]:
    return [f"kernel sweep, sustained GEMM: {sustained_summary(part)}"]


def sustained_summary(part: dict[str, Any]) -> str:
    if "skipped" in part:
        return part["skipped"]
    clock = part.get("clock_mhz")
    clocks = (f"; SM clock {clock['first']:.0f} -> {clock['last']:.0f} MHz" if clock
              else "; SM clock not readable here")
    return (f"[{part['m']}, {part['k']}]·[{part['k']}, {part['n']}] bf16 for {part['seconds']:.0f} s: "
            f"{part['first']:.0f} TFLOP/s in the first {part['window_s']:g} s, {part['last']:.0f} in "
            f"the last ({part['last_over_first']:.3f}×, {_percent(part['last_peak_fraction'])} of "
            f"peak), lowest {part['lowest']:.0f}{clocks}")


# ------------------------------------------------------------------ 2. memory-bound operators

def _adam_config() -> SimpleNamespace:
    """What ptdp.train.optimizer._adam reads of a TrainConfig (Megatron's defaults)."""
    return SimpleNamespace(adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8)


def _optimizer_buffers(count: int, device: torch.device) -> dict[str, torch.Tensor]:
    return {name: torch.rand(count, device=device) * 1e-3 for name in ("main", "grads", "m", "v")}


def _adam_elementwise(b: dict[str, torch.Tensor], config: SimpleNamespace) -> None:
    """ptdp.train.optimizer._adam's arithmetic op by op (its fallback)."""
    b["m"].lerp_(b["grads"], 1.0 - config.adam_beta1)
    b["v"].mul_(config.adam_beta2).addcmul_(b["grads"], b["grads"], value=1.0 - config.adam_beta2)
    denom = (b["v"].sqrt() / math.sqrt(1.0 - config.adam_beta2)).add_(config.adam_eps)
    b["main"].addcdiv_(b["m"], denom, value=-1e-4 / (1.0 - config.adam_beta1))


def memory_ops(count: int, row: int, device: torch.device
               ) -> dict[str, tuple[str, Callable[[], Callable[[], Any]], float, float, int]]:
    """name -> (planner class, builder of the timed call, bytes moved, bytes
    the planner prices, launches the planner adds). `count` elements of a
    bf16 activation (E = 2) of rows of `row`, or fp32 parameters for the
    optimizer cases. Bytes moved: each input read, each output written once
    (the dropout mask one byte an element); the planner's: the forward
    counts of ptdp.perf.price.operator_bytes (the same), and for the optimizer
    step after_flush.py's (gradients zeroed, OPTIMIZER_BYTES_PER_PARAMETER,
    the main weights copied to bf16) with its 30 launches."""
    from ptdp.model.fused import bias_dropout_add, bias_gelu, swiglu
    from ptdp.perf.price.operator_bytes import OPTIMIZER_BYTES_PER_PARAMETER
    from ptdp.perf.price.pricing import GRAD_BYTES
    from ptdp.train.optimizer import PIECE, _adam, _fused_adamw, sum_of_squares

    E, n, rows = 2, count, max(1, count // row)

    def act(width: int = row) -> torch.Tensor:
        return torch.randn(rows, width, device=device, dtype=torch.bfloat16)

    def vector() -> torch.Tensor:
        return torch.randn(row, device=device, dtype=torch.bfloat16)

    def copy():
        x, out = act(), act()
        return lambda: out.copy_(x)

    def add():
        x, y = act(), act()
        return lambda: x + y

    def gelu_fused():
        x, bias = act(), vector()
        return lambda: bias_gelu(x, bias, True)

    def gelu_eager():
        x, bias = act(), vector()
        return lambda: F.gelu(x + bias, approximate="tanh")

    def swiglu_op():
        y = act(2 * row)
        return lambda: swiglu(y)

    def layer_norm():
        x, weight, bias = act(), vector(), vector()
        return lambda: F.layer_norm(x, (row,), weight, bias)

    def rms_norm():
        x, weight = act(), vector()
        return lambda: F.rms_norm(x, (row,), weight, 1e-5)

    def softmax():
        x = act()
        return lambda: F.softmax(x, dim=-1)

    def dropout():
        x = act()
        return lambda: F.dropout(x, 0.1, training=True)

    def residual():
        x, residual_in, bias = act(), act(), vector()
        return lambda: bias_dropout_add(x, bias, residual_in, 0.1, True, True)

    config = _adam_config()

    def adam_fused():
        b = _optimizer_buffers(count, device)
        if not _fused_adamw(b["main"], b["grads"], b["m"], b["v"], 1, 1e-4, config):
            raise RuntimeError("this PyTorch has no torch._fused_adamw_ for the device")
        return lambda: _fused_adamw(b["main"], b["grads"], b["m"], b["v"], 2, 1e-4, config)

    def adam_elementwise():
        b = _optimizer_buffers(count, device)
        return lambda: _adam_elementwise(b, config)

    def optimizer_step():
        b = _optimizer_buffers(count, device)
        model = torch.empty(count, device=device, dtype=torch.bfloat16)

        def step():   # ptdp.train.optimizer.Optimizer.step, one data-parallel rank
            total = torch.zeros((), dtype=torch.float64, device=device)
            for piece in range(0, count, PIECE):
                total += sum_of_squares(b["grads"][piece:piece + PIECE])
            norm = math.sqrt(total.item())
            b["grads"].mul_(min(1.0, 1.0 / (norm + 1e-6)))
            _adam(b["main"], b["grads"], b["m"], b["v"], 2, 1e-4, config)
            model.copy_(b["main"])
            b["grads"].zero_()
        return step

    activation = rows * row
    planner_step = (GRAD_BYTES + OPTIMIZER_BYTES_PER_PARAMETER + 4 + E) * count
    return {
        "copy": ("elementwise", copy, 2 * activation * E, 2 * activation * E, 0),
        "add (x + y)": ("elementwise", add, 3 * activation * E, 3 * activation * E, 0),
        "bias + GeLU, ptdp fused": ("gelu", gelu_fused, 2 * activation * E, 2 * activation * E, 0),
        "bias + GeLU, eager": ("gelu", gelu_eager, 2 * activation * E, 2 * activation * E, 0),
        "SwiGLU, ptdp fused": ("gelu", swiglu_op, 3 * activation * E, 3 * activation * E, 0),
        "LayerNorm": ("layer_norm", layer_norm, 2 * activation * E, 2 * activation * E, 0),
        "RMSNorm": ("layer_norm", rms_norm, 2 * activation * E, 2 * activation * E, 0),
        f"softmax (rows of {row})": ("attention_core", softmax, 2 * activation * E,
                                     2 * activation * E, 0),
        "dropout": ("residual", dropout, (2 * E + 1) * activation, (2 * E + 1) * activation, 0),
        "bias + dropout + add, ptdp fused": ("residual", residual, (3 * E + 1) * activation,
                                             (3 * E + 1) * activation, 0),
        "AdamW, fused kernel (fp32)": ("optimizer", adam_fused, 28 * n, 28 * n, 0),
        "AdamW, element-wise (fp32)": ("optimizer", adam_elementwise, 28 * n, 28 * n, 0),
        "optimizer step, ptdp (fp32 state, bf16 model)": ("optimizer", optimizer_step,
                                                          (4 + 8 + 28 + 4 + E + 4) * n,
                                                          planner_step, 30),
    }


OPTIMIZER_OPS = ("AdamW, fused kernel (fp32)", "AdamW, element-wise (fp32)",
                 "optimizer step, ptdp (fp32 state, bf16 model)")


def memory_cases(sizes: Sizes) -> list[tuple[str, int, str]]:
    """(operator, element count, size text): the optimizer first (the issue's
    suspect, measured before torch.compile builds ptdp's fused kernels),
    then the activations, smallest first."""
    names = list(memory_ops(1, sizes.row, torch.device("cpu")))   # builders only, nothing built
    cases = [(name, count, f"{count / 2 ** 20:g} M params") for count in sizes.optimizer_params
             for name in OPTIMIZER_OPS]
    return cases + [(name, nbytes // 2, _bytes(nbytes)) for nbytes in sizes.activation_bytes
                    for name in names if name not in OPTIMIZER_OPS]


def measure_memory_op(name: str, count: int, device: torch.device, sizes: Sizes,
                      profile: HardwareProfile) -> dict[str, Any]:
    op_class, build, nbytes, planner_bytes, launches = memory_ops(count, sizes.row, device)[name]
    with torch.no_grad():
        seconds, reps = median_seconds(build(), device, sizes)
    predicted = profile.memory_seconds(planner_bytes, op_class) + launches * profile.launch_overhead
    return {"class": op_class, "bytes": nbytes, "planner_bytes": planner_bytes,
            "seconds": seconds, "reps": reps, "gbytes_per_s": nbytes / seconds / 1e9,
            "bandwidth_fraction": nbytes / seconds / profile.memory_bandwidth,
            "predicted_s": predicted, "ratio": seconds / predicted if predicted else None}


def memory_part(device: torch.device, sizes: Sizes, profile: HardwareProfile) -> dict[str, Any]:
    started = time.monotonic()
    rows, skipped = [], 0
    for name, count, size in memory_cases(sizes):
        row: dict[str, Any] = {"op": name, "size": size, "elements": count}
        if time.monotonic() - started > sizes.memory_cap_s:
            row["skipped"] = f"over the part's {sizes.memory_cap_s:g} s cap"
            skipped += 1
        else:
            try:
                row.update(measure_memory_op(name, count, device, sizes, profile))
            except Exception as error:  # noqa: BLE001
                row["error"] = _failure(error)
        rows.append(row)
        devices.release_cached_memory(device)
    return {"rows": rows, "seconds": time.monotonic() - started, "cap_s": sizes.memory_cap_s,
            "skipped_cases": skipped}


# ------------------------------------------------------------------ 3. launches

def launch_part(device: torch.device, sizes: Sizes, profile: HardwareProfile) -> dict[str, Any]:
    from ptdp.perf.calibrate.measure import measure_launch_overhead

    rows = []
    x = torch.zeros(1, device=device)

    def loop() -> float:
        devices.synchronize(device)
        start = time.perf_counter()
        for _ in range(sizes.launches):
            x.add_(1)
        devices.synchronize(device)
        return (time.perf_counter() - start) / sizes.launches

    for what, measure in (
            (f"{sizes.launches} × x.add_(1), one element, host clock",
             lambda: statistics.median(loop() for _ in range(5))),
            ("ptdp calibrate's chain (forward + backward of 100 products, per operator)",
             lambda: measure_launch_overhead(sizes.launch_budget_s, device=device)["per_op"])):
        row: dict[str, Any] = {"what": what}
        try:
            seconds = measure()
            row.update(seconds=seconds, predicted_s=profile.launch_overhead,
                       ratio=seconds / profile.launch_overhead)
        except Exception as error:  # noqa: BLE001
            row["error"] = _failure(error)
        rows.append(row)
    return {"rows": rows}


# ------------------------------------------------------------------ the section

def section(device: torch.device, tiny: bool, say: Callable[[str], None],
            sizes: Sizes | None = None) -> dict[str, Any]:
    """The five parts on `device`; a part or a case that fails is recorded, never raised."""
    sizes = sizes or (TINY_SIZES if tiny else GPU_SIZES)
    name = devices.device_name(device) if device.type == "cuda" else "cpu"
    profile_name, profile = profile_for(device, name)
    matmul = torch.backends.cuda.matmul
    report: dict[str, Any] = {
        "device": device.type, "device_name": name, "tiny": tiny, "torch": torch.__version__,
        "profile": profile_name,
        "profile_figures": {"peak_tflops": profile.peak_tflops, "sm_count": profile.sm_count,
                            "gemm_tile": list(profile.gemm_tile),
                            "gemm_efficiency": profile.gemm_efficiency,
                            "tile_overhead_seconds": profile.tile_overhead_seconds,
                            "memory_bandwidth": profile.memory_bandwidth,
                            "launch_overhead": profile.launch_overhead},
        "reduced_precision_reduction": {   # None where this PyTorch has no such switch
            "bf16": getattr(matmul, "allow_bf16_reduced_precision_reduction", None),
            "fp16": getattr(matmul, "allow_fp16_reduced_precision_reduction", None)},
        "gemm": None, "memory": None, "launch": None, "sustained": None, "attention": None,
        "errors": []}

    for part, run, lines in (("gemm", gemm_part, gemm_lines), ("memory", memory_part, memory_lines),
                             ("launch", launch_part, launch_lines),
                             ("sustained", sustained_part, sustained_lines),
                             ("attention", attention_part, attention_lines)):
        try:
            report[part] = run(device, sizes, profile)
        except Exception as error:  # noqa: BLE001 - the other parts still run
            report["errors"].append(f"{part}: {_failure(error)}")
            say(f"kernel sweep, {part}: FAILED, {_failure(error)}")
            continue
        for line in lines(report[part], report):
            say(line)
        devices.release_cached_memory(device)
    return report


# ------------------------------------------------------------------ text

def _bytes(nbytes: float) -> str:
    return f"{nbytes / GIB:.3g} GiB" if nbytes >= GIB else f"{nbytes / MIB:.3g} MiB"


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.3g} %"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}"


def _outcome(entry: dict[str, Any] | None) -> str | None:
    """The failure or skip text of a case, or None when it was measured."""
    if not entry:
        return "not run"
    if "error" in entry:
        return "FAILED: " + entry["error"].replace("|", "/")
    if "skipped" in entry:
        return "skipped: " + entry["skipped"]
    return None


def _gemm_label(case: dict[str, Any]) -> str:
    label = case["what"] + (f" (+{len(case['sources']) - 1} rows)" if len(case.get("sources", [])) > 1
                            else "")
    if "scaled_from" in case:
        label += " scaled from " + "×".join(str(d) for d in case["scaled_from"])
    return label


def gemm_table(part: dict[str, Any]) -> list[str]:
    dtypes = part["dtypes"]
    head = "| GEMM | m | n | k | " + " | ".join(
        f"{d} ms | {d} TFLOP/s | {d} of peak | {d} predicted ms | {d} measured / predicted"
        for d in dtypes) + " |"
    lines = [head, "|" + "---|" * (4 + 5 * len(dtypes))]
    for case in part["rows"]:
        cells = [_gemm_label(case).replace("|", "/"), str(case["m"]), str(case["n"]), str(case["k"])]
        for d in dtypes:
            entry = case.get(d)
            failed = _outcome(entry)
            if failed:
                cells += [failed, "", "", "", ""]
            else:
                cells += [_ms(entry["seconds"]), f"{entry['tflops']:.3g}",
                          _percent(entry["peak_fraction"]), _ms(entry["predicted_s"]),
                          f"{entry['ratio']:.2f}"]
        lines.append("|" + "|".join(f" {cell} " if cell else " " for cell in cells) + "|")
    return lines


def _ratios(part: dict[str, Any] | None, dtype: str = "bf16", kind: str = "published") -> list[float]:
    if not part:
        return []
    return [c[dtype]["ratio"] for c in part["rows"] if c["kind"] == kind
            and _outcome(c.get(dtype)) is None and c[dtype].get("ratio")]


def gemm_summary(part: dict[str, Any]) -> str:
    ratios = _ratios(part)
    text = (f"{part['published_measured']} of {part['published_distinct']} distinct published "
            f"layer GEMMs, {len(part['rows'])} shapes, {part['seconds']:.1f} s")
    if part["skipped_cases"]:
        text += f", {part['skipped_cases']} cases skipped (over the {part['cap_s']:g} s cap)"
    if part.get("error"):
        text += f"; FAILED: {part['error']}"
    if ratios:
        text += (f"; published shapes, bf16 measured / predicted: median "
                 f"{statistics.median(ratios):.2f}, from {min(ratios):.2f} to {max(ratios):.2f}")
    return text


def gemm_lines(part: dict[str, Any], report: dict[str, Any]) -> list[str]:
    return [f"kernel sweep, GEMMs (F.linear; profile {report['profile']}, "
            f"{report['profile_figures']['peak_tflops']:g} TFLOP/s peak): {gemm_summary(part)}"
            ] + gemm_table(part)


def memory_table(part: dict[str, Any]) -> list[str]:
    lines = ["| operator | size | planner class | bytes | ms | GB/s | of profile bandwidth "
             "| predicted ms | measured / predicted |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in part["rows"]:
        failed = _outcome(row if ("error" in row or "skipped" in row) else {"ok": 1})
        head = f"| {row['op']} | {row['size']} "
        if failed:
            lines.append(head + f"| {failed} | | | | | | |")
            continue
        planner = (f" (planner {_bytes(row['planner_bytes'])})"
                   if row["planner_bytes"] != row["bytes"] else "")
        lines.append(head + f"| {row['class']} | {_bytes(row['bytes'])}{planner} "
                     f"| {_ms(row['seconds'])} | {row['gbytes_per_s']:.0f} "
                     f"| {_percent(row['bandwidth_fraction'])} | {_ms(row['predicted_s'])} "
                     f"| {row['ratio']:.2f} |")
    return lines


def memory_lines(part: dict[str, Any], report: dict[str, Any]) -> list[str]:
    bandwidth = report["profile_figures"]["memory_bandwidth"]
    text = (f"kernel sweep, memory-bound operators (profile {report['profile']}, "
            f"{bandwidth / 1e12:.3g} TB/s): {len(part['rows'])} cases, {part['seconds']:.1f} s")
    if part["skipped_cases"]:
        text += f", {part['skipped_cases']} skipped (over the {part['cap_s']:g} s cap)"
    return [text] + memory_table(part)


def launch_table(part: dict[str, Any]) -> list[str]:
    lines = ["| launches | µs per launch | profile launch_overhead µs | measured / profile |",
             "|---|---:|---:|---:|"]
    for row in part["rows"]:
        if "error" in row:
            lines.append(f"| {row['what']} | FAILED: {row['error'].replace('|', '/')} | | |")
        else:
            lines.append(f"| {row['what']} | {row['seconds'] * 1e6:.2f} "
                         f"| {row['predicted_s'] * 1e6:.2f} | {row['ratio']:.2f} |")
    return lines


def launch_lines(part: dict[str, Any], report: dict[str, Any]) -> list[str]:
    return ["kernel sweep, launch overhead:"] + launch_table(part)


def markdown(report: dict[str, Any] | None) -> str:
    """bench/RESULTS.md's paragraph and tables for the section."""
    if not report:
        return ""
    if report.get("crashed"):
        return f"Kernel sweep: did not finish ({report['crashed']}).\n"
    figures = report["profile_figures"]
    text = (f"Kernel sweep (bench/gpu_kernels_sweep.py) against the planner's `{report['profile']}` "
            f"profile ({figures['peak_tflops']:g} TFLOP/s, {figures['sm_count']} SMs, tile "
            f"{figures['gemm_tile'][0]}×{figures['gemm_tile'][1]}, e_max "
            f"{figures['gemm_efficiency']:.3f}, {figures['memory_bandwidth'] / 1e12:.3g} TB/s, "
            f"launch {figures['launch_overhead'] * 1e6:g} µs); torch {report['torch']}. GEMMs: "
            "F.linear (x [m, k] · w [n, k]ᵀ, fp32 accumulation; reduced-precision reductions "
            f"allowed: bf16 {report['reduced_precision_reduction']['bf16']}, fp16 "
            f"{report['reduced_precision_reduction']['fp16']}), median time after warm-up "
            f"({'CUDA events' if report['device'] == 'cuda' else 'host clock'}), operands "
            "rotated past the L2; the published shapes are one layer's forward "
            "GEMMs of every priced row of bench/published_runs.py at its layout (m = b·s/c, n or "
            "k split by t). Memory-bound operators: bytes every kernel must move over the median "
            "time. Measured / predicted > 1: the planner is optimistic.")
    if report["errors"]:
        text += " Parts that failed: " + "; ".join(report["errors"]) + "."
    lines = [text]
    if report.get("gemm"):
        lines += ["", "GEMMs: " + gemm_summary(report["gemm"]) + ".", ""] + gemm_table(report["gemm"])
    if report.get("memory"):
        lines += ["", "Memory-bound operators:", ""] + memory_table(report["memory"])
    if report.get("launch"):
        lines += ["", "Launch overhead:", ""] + launch_table(report["launch"])
    if report.get("sustained"):
        lines += ["", "Sustained GEMM: " + sustained_summary(report["sustained"]) + "."]
    if report.get("attention") and report["attention"]["rows"]:
        lines += ["", "Fused attention (causal bf16 scaled_dot_product_attention, the published "
                  "rows' calls; TFLOP/s count the causal half, the backward 2.5× the forward):",
                  ""] + attention_table(report["attention"])
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ as a child of bench/gpu.py

def run_isolated(device_type: str, tiny: bool, timeout: float, say: Callable[[str], None],
                 command: list[str] | None = None) -> dict[str, Any]:
    """The section in a child process (its lines passed on through `say`);
    when the child dies or runs out of time, {"crashed": why} instead.
    `command` replaces this file's command line (tests)."""
    report, why = run_in_child(Path(__file__), device_type, tiny, timeout, say, command)
    if report is not None:
        return report
    say(f"kernel sweep: FAILED, {why}")
    return {"crashed": why}


def main(argv: list[str] | None = None) -> int:
    return section_main(__doc__.splitlines()[0], section, argv)


if __name__ == "__main__":
    sys.exit(main())
