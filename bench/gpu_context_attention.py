"""bench/gpu.py's context-parallel attention section: the per-block attention
kernels of ptdp.parallel.block_attention on the device in use, and the ring
of ptdp.parallel.context_attention emulated on that one device.

1. Every kernel candidate of the device type (cuda: cuda_flash,
   cuda_efficient, plain; cpu: cpu_flash, plain), in each dtype it takes,
   at two head sizes, causal (a square block on the diagonal) and not (half
   the rows against all the keys, as the ring's later blocks), with grouped
   key/value heads: block_forward's output and LSE and block_backward's dq,
   dk and dv against "plain" in fp32 on the same (rounded) inputs. A case
   passes when each maximum absolute error is within BLOCK_TOLERANCE times
   the largest magnitude of that reference tensor. A kernel that raises is
   recorded as failed, with its message. (On a GPU a kernel that faults
   leaves the CUDA context broken: every later case then fails with the
   same message, and the first failure names the culprit.)
2. The kernel `block_kernel` picks per dtype and head size.
3. Forward + backward time of one causal block for each kernel that passed,
   relative to the chosen one (ratios only: a single short measurement).
4. The ring on one device: a causal sequence cut into 2c chunks
   (context_layout.split_sequence), each rank's block pairs computed and
   merged as context_attention's p2p ring does (its own helpers, no process
   group), forward and backward, the pieces joined and compared with
   torch.nn.functional.scaled_dot_product_attention over the whole sequence
   (fp32 reference on the same rounded inputs; RING_TOLERANCE).

5. Sliding windows (issue 43): the window kernel ptdp.parallel.window_kernel
   finds on the device (CUDA's flash attention with a window, per 16-bit
   dtype), and local_attention with a window of WINDOW_LEFT keys and
   learnable sinks, forward + backward at the timing sizes: the window
   kernel (where there is one) against the block plan on block_kernel's
   choice (output and gradients within BLOCK_TOLERANCE of the block plan's
   largest value), and the time of each relative to full causal attention.

bench/gpu.py runs this file as a child process (`run_isolated`): a CUDA
kernel that faults leaves the CUDA context unusable, and must not take the
training measurements with it. Alone:

    python bench/gpu_context_attention.py --device cuda --json attention.json
    python bench/gpu_context_attention.py --tiny --device cpu
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from child_section import run_in_child, section_main  # bench/child_section.py, beside this file
from ptdp import device as devices
from ptdp.parallel import context_attention as ring
from ptdp.parallel.block_attention import block_backward, block_forward, block_kernel
from ptdp.parallel.context_layout import join_sequence, split_sequence
from ptdp.parallel.local_attention import local_attention
from ptdp.parallel.window_kernel import windowed_kernel

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CANDIDATES = {"cuda": ("cuda_flash", "cuda_efficient", "plain"), "cpu": ("cpu_flash", "plain")}
# torch's flash kernel on CUDA takes 16-bit inputs only.
KERNEL_DTYPES = {"cuda_flash": ("bf16", "fp16")}

# Largest |error| / largest |reference| per tensor. The kernels compute in
# fp32 inside; 16-bit ones round their output and the probabilities they
# multiply by v (or dout) to the input's dtype: bf16 keeps 8 bits (2^-8 =
# 4e-3 per rounding), fp16 11 bits (5e-4). Observed on a CPU (cpu_flash,
# d 64 and 128): fp32 <= 1e-6, bf16 <= 8e-3, fp16 <= 1e-3. A wrong
# formula (a base-2 LSE, a missed scale, a mask off by one row) moves some
# tensor by tens of percent.
BLOCK_TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2, "fp16": 5e-3}
# The ring against scaled_dot_product_attention: the 1e-5 in fp32;
# bf16 as a block, the merges being fp32.
RING_TOLERANCE = {"fp32": 1e-5, "bf16": 3e-2}
RING_DTYPES = ("fp32", "bf16")
QUANTITIES = ("out", "lse", "dq", "dk", "dv")


@dataclass(frozen=True)
class Sizes:
    batch: int
    heads: int
    groups: int                     # key/value heads (grouped-query attention)
    block: int                      # rows of the causal block; the other block has half
    head_dims: tuple[int, ...]
    timing_seq: int
    timing_heads: int
    timing_head_dim: int
    timing_dtype: str
    ring_seq: int
    ring_cp: int
    ring_heads: int
    ring_groups: int
    ring_head_dim: int


# 1000 rows: not a multiple of the kernels' tiles (32, 64, 128), where
# padding mistakes show; the ring's blocks (1024 rows) are aligned.
GPU_SIZES = Sizes(batch=2, heads=8, groups=2, block=1000, head_dims=(64, 128),
                  timing_seq=4096, timing_heads=16, timing_head_dim=128, timing_dtype="bf16",
                  ring_seq=8192, ring_cp=4, ring_heads=8, ring_groups=2, ring_head_dim=128)
# Seconds on a CPU. The timing is in fp32: a CPU without bf16 instructions
# runs bf16 products a hundred times slower.
TINY_SIZES = Sizes(batch=1, heads=4, groups=2, block=40, head_dims=(64, 128),
                   timing_seq=256, timing_heads=16, timing_head_dim=128, timing_dtype="fp32",
                   ring_seq=256, ring_cp=4, ring_heads=4, ring_groups=2, ring_head_dim=64)


def _failure(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _random(generator: torch.Generator, device: torch.device, dtype: torch.dtype,
            *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)


def _error(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(largest |got − want|, largest |want|); inf when got is not finite or
    its shape differs."""
    if got.shape != want.shape or not torch.isfinite(got).all():
        return math.inf, want.abs().max().item()
    return (got.float() - want.float()).abs().max().item(), want.abs().max().item()


def _verdict(errors: dict[str, float], scales: dict[str, float], tolerance: float) -> bool:
    return all(errors[name] <= tolerance * scales[name] for name in errors)


def worst_relative(case: dict[str, Any]) -> tuple[str, float]:
    """The case's tensor with the largest error relative to its reference's
    largest value, and that ratio."""
    ratios = {name: (case["errors"][name] / case["scales"][name] if case["scales"][name]
                     else math.inf if case["errors"][name] else 0.0) for name in case["errors"]}
    name = max(ratios, key=ratios.get)
    return name, ratios[name]


# ------------------------------------------------------------------ 1. kernels against plain fp32

def check_block(kernel: str, dtype_name: str, head_dim: int, causal: bool, sizes: Sizes,
                device: torch.device) -> dict[str, Any]:
    """One case: `kernel` on rounded inputs against plain fp32 on the same values."""
    rows = sizes.block if causal else sizes.block // 2
    keys = sizes.block
    case: dict[str, Any] = {"kernel": kernel, "dtype": dtype_name, "head_dim": head_dim,
                            "causal": causal, "q_rows": rows, "k_rows": keys,
                            "heads": sizes.heads, "groups": sizes.groups,
                            "tolerance": BLOCK_TOLERANCE[dtype_name], "passed": False,
                            "errors": {}, "scales": {}, "error": None}
    dtype = DTYPES[dtype_name]
    generator = torch.Generator().manual_seed(head_dim + 2 * causal)
    b, h, g = sizes.batch, sizes.heads, sizes.groups
    q = _random(generator, device, dtype, b, h, rows, head_dim)
    k = _random(generator, device, dtype, b, g, keys, head_dim)
    v = _random(generator, device, dtype, b, g, keys, head_dim)
    dout = _random(generator, device, dtype, b, h, rows, head_dim)
    scale = head_dim ** -0.5
    wide = [t.float() for t in (q, k, v, dout)]
    out, lse = block_forward(*wide[:3], causal, scale, "plain")
    want = dict(zip(QUANTITIES, (out, lse, *block_backward(wide[3], *wide[:3], out, lse, causal,
                                                           scale, "plain"))))
    try:
        got_out, got_lse = block_forward(q, k, v, causal, scale, kernel)
        # The backward is given the reference's final output and LSE, as the
        # ring gives every block the merged ones.
        grads = block_backward(dout, q, k, v, out.to(dtype), lse, causal, scale, kernel)
        devices.synchronize(device)   # a fault of the kernel surfaces here, in this case
    except Exception as error:  # noqa: BLE001 - a failing kernel is a finding, not the end
        case["error"] = _failure(error)
        return case
    for name, tensor in zip(QUANTITIES, (got_out, got_lse, *grads)):
        case["errors"][name], case["scales"][name] = _error(tensor, want[name])
    case["passed"] = _verdict(case["errors"], case["scales"], case["tolerance"])
    return case


def kernel_dtypes(kernel: str) -> tuple[str, ...]:
    return KERNEL_DTYPES.get(kernel, tuple(DTYPES))


def check_blocks(device: torch.device, sizes: Sizes) -> list[dict[str, Any]]:
    return [check_block(kernel, dtype_name, head_dim, causal, sizes, device)
            for kernel in CANDIDATES[device.type] for dtype_name in kernel_dtypes(kernel)
            for head_dim in sizes.head_dims for causal in (True, False)]


# ------------------------------------------------------------------ 2. the kernel auto picks

def chosen_kernels(device: torch.device, sizes: Sizes) -> dict[str, str]:
    """"bf16 d128" -> the kernel block_kernel picks (or "error: ..." when
    the probe itself raised)."""
    chosen = {}
    for dtype_name, dtype in DTYPES.items():
        for head_dim in sizes.head_dims:
            try:
                chosen[f"{dtype_name} d{head_dim}"] = block_kernel(device, dtype, head_dim)
            except Exception as error:  # noqa: BLE001
                chosen[f"{dtype_name} d{head_dim}"] = f"error: {_failure(error)}"
    return chosen


# ------------------------------------------------------------------ 3. relative speed

def _fwd_bwd_seconds(kernel: str, q, k, v, dout, device: torch.device, repeats: int) -> float:
    scale = q.shape[-1] ** -0.5
    seconds = []
    for _ in range(repeats + 1):           # the first is a warm-up
        devices.synchronize(device)
        began = time.perf_counter()
        out, lse = block_forward(q, k, v, True, scale, kernel)
        block_backward(dout, q, k, v, out.to(q.dtype), lse, True, scale, kernel)
        devices.synchronize(device)
        seconds.append(time.perf_counter() - began)
    return statistics.median(seconds[1:])


def time_kernels(device: torch.device, sizes: Sizes, cases: list[dict[str, Any]],
                 repeats: int = 3) -> dict[str, Any]:
    """Forward + backward of a causal block, each kernel whose cases at this
    dtype and head size all passed, as a ratio to the chosen kernel's time."""
    dtype_name, head_dim = sizes.timing_dtype, sizes.timing_head_dim
    dtype = DTYPES[dtype_name]
    result: dict[str, Any] = {"seq": sizes.timing_seq, "heads": sizes.timing_heads,
                              "head_dim": head_dim, "dtype": dtype_name, "causal": True,
                              "chosen": None, "ratios": {}, "errors": {}}
    try:
        chosen = block_kernel(device, dtype, head_dim)
    except Exception as error:  # noqa: BLE001
        result["errors"]["block_kernel"] = _failure(error)
        return result
    result["chosen"] = chosen
    working = [kernel for kernel in CANDIDATES[device.type]
               if any(c["kernel"] == kernel for c in cases)
               and all(c["passed"] for c in cases if c["kernel"] == kernel
                       and c["dtype"] == dtype_name and c["head_dim"] == head_dim)]
    kernels = [chosen] + [kernel for kernel in working if kernel != chosen]
    generator = torch.Generator().manual_seed(7)
    shape = (1, sizes.timing_heads, sizes.timing_seq, head_dim)
    q, k, v, dout = (_random(generator, device, dtype, *shape) for _ in range(4))
    seconds = {}
    for kernel in kernels:
        try:
            seconds[kernel] = _fwd_bwd_seconds(kernel, q, k, v, dout, device, repeats)
        except Exception as error:  # noqa: BLE001
            result["errors"][kernel] = _failure(error)
    if chosen in seconds:
        result["ratios"] = {kernel: s / seconds[chosen] for kernel, s in seconds.items()}
    return result


# ------------------------------------------------------------------ 5. sliding windows

WINDOW_LEFT = 127   # gpt-oss's window (its sliding_window 128)


def _attention_seconds(run: Callable[[], torch.Tensor], dout: torch.Tensor,
                       device: torch.device, repeats: int = 3) -> float:
    seconds = []
    for _ in range(repeats + 1):           # the first is a warm-up
        devices.synchronize(device)
        began = time.perf_counter()
        run().backward(dout)
        devices.synchronize(device)
        seconds.append(time.perf_counter() - began)
    return statistics.median(seconds[1:])


def check_windows(device: torch.device, sizes: Sizes) -> list[dict[str, Any]]:
    """Per dtype: the window kernel found, its errors against the block
    plan, and the seconds of the window kernel, the block plan and full
    causal attention (forward + backward, with sinks)."""
    cases = []
    dtype_names = ("bf16", "fp16") if device.type == "cuda" else (sizes.timing_dtype,)
    for dtype_name in dtype_names:
        dtype, head_dim = DTYPES[dtype_name], sizes.timing_head_dim
        generator = torch.Generator().manual_seed(11)
        q = _random(generator, device, dtype, 1, sizes.timing_heads, sizes.timing_seq, head_dim)
        k, v = (_random(generator, device, dtype, 1, sizes.timing_heads // 4, sizes.timing_seq,
                        head_dim) for _ in range(2))
        dout = _random(generator, device, dtype, *q.shape)
        sinks = _random(generator, device, torch.float32, sizes.timing_heads)
        plan_kernel = block_kernel(device, dtype, head_dim)
        case: dict[str, Any] = {"dtype": dtype_name, "seq": sizes.timing_seq,
                                "left": WINDOW_LEFT, "head_dim": head_dim,
                                "window_kernel": windowed_kernel(device, dtype, head_dim),
                                "block_kernel": plan_kernel, "errors": {}, "seconds": {}}

        def run(kernel: str, window) -> Callable[[], torch.Tensor]:
            inputs = [x.detach().requires_grad_() for x in (q, k, v, sinks)]

            def once() -> torch.Tensor:
                for x in inputs:
                    x.grad = None
                return local_attention(*inputs[:3], window=window, sinks=inputs[3],
                                       kernel=kernel)
            once.inputs = inputs
            return once

        window = (WINDOW_LEFT, 0)
        runs = {"block plan": run(plan_kernel, window), "full causal": run(plan_kernel, None)}
        if case["window_kernel"]:
            runs["window kernel"] = run("auto", window)
        for name, once in runs.items():
            case["seconds"][name] = _attention_seconds(once, dout, device)
        if case["window_kernel"]:
            got, want = runs["window kernel"], runs["block plan"]
            outputs = (got(), want())
            for output in outputs:
                output.backward(dout)
            for name, a, b in [("out", *outputs)] + [
                    (n, x.grad, y.grad) for n, x, y in zip(("dq", "dk", "dv", "dsinks"),
                                                           got.inputs, want.inputs)]:
                error, scale = _error(a, b)
                case["errors"][name] = error / max(scale, 1e-30)
        case["passed"] = all(e <= BLOCK_TOLERANCE[dtype_name] for e in case["errors"].values())
        cases.append(case)
        devices.release_cached_memory(device)
    return cases


def window_lines(cases: list[dict[str, Any]]) -> list[str]:
    lines = []
    for c in cases:
        full = c["seconds"].get("full causal")
        times = ", ".join(f"{name} {t / full:.2f}" for name, t in c["seconds"].items()
                          if full) if full else "not timed"
        kernel = c["window_kernel"] or f"none (block plan on {c['block_kernel']})"
        text = (f"sliding window {c['left']},0 with sinks, s {c['seq']}, d {c['head_dim']}, "
                f"{c['dtype']}: window kernel {kernel}; forward + backward time relative to "
                f"full causal: {times}")
        if c["errors"]:
            text += (f"; window kernel vs block plan {'ok' if c['passed'] else 'FAILED'}: "
                     + ", ".join(f"{n} {e:.1e}" for n, e in c["errors"].items()))
        lines.append(text)
    return lines


# ------------------------------------------------------------------ 4. the ring, emulated

def emulate_ring(device: torch.device, sizes: Sizes, dtype_name: str,
                 kernels: list[str]) -> list[dict[str, Any]]:
    """Causal attention over `ring_seq` positions as `ring_cp` context ranks
    compute it with --cp-comm-type p2p, each rank's steps run one after the
    other here, for each kernel; against scaled_dot_product_attention."""
    dtype = DTYPES[dtype_name]
    c, s, d = sizes.ring_cp, sizes.ring_seq, sizes.ring_head_dim
    generator = torch.Generator().manual_seed(11)
    q = _random(generator, device, dtype, 1, sizes.ring_heads, s, d)
    k = _random(generator, device, dtype, 1, sizes.ring_groups, s, d)
    v = _random(generator, device, dtype, 1, sizes.ring_groups, s, d)
    dout = _random(generator, device, dtype, 1, sizes.ring_heads, s, d)
    wide = [t.float().requires_grad_() for t in (q, k, v)]
    reference = F.scaled_dot_product_attention(*wide, is_causal=True,
                                               enable_gqa=sizes.ring_heads != sizes.ring_groups)
    reference.backward(dout.float())
    want = {"out": reference.detach(), "dq": wide[0].grad, "dk": wide[1].grad,
            "dv": wide[2].grad}
    del reference, wide

    def pieces(x):
        return [split_sequence(x, c, rank, seq_dim=2) for rank in range(c)]

    qs, ks, vs, douts = pieces(q), pieces(k), pieces(v), pieces(dout)
    half, scale = s // (2 * c), d ** -0.5
    results = []
    for kernel in kernels:
        case: dict[str, Any] = {"kernel": kernel, "dtype": dtype_name, "seq": s, "cp": c,
                                "heads": sizes.ring_heads, "groups": sizes.ring_groups,
                                "head_dim": d, "tolerance": RING_TOLERANCE[dtype_name],
                                "passed": False, "errors": {}, "scales": {}, "error": None}
        try:
            outs, lses = [], []
            for rank in range(c):
                out, lse = ring._empty_result(qs[rank])
                for step in range(c):
                    source = (rank - step) % c
                    ring._forward_blocks(qs[rank], ks[source], vs[source],
                                         ring._ring_blocks(rank, source, c, half, None), scale,
                                         kernel, out, lse)
                outs.append(out.to(dtype))
                lses.append(lse)
            grads = {name: [torch.zeros(t.shape, dtype=lses[0].dtype, device=device)
                            for t in pieces_of]
                     for name, pieces_of in (("dq", qs), ("dk", ks), ("dv", vs))}
            for rank in range(c):
                for source in range(c):
                    ring._backward_blocks(douts[rank], qs[rank], ks[source], vs[source],
                                          outs[rank], lses[rank],
                                          ring._ring_blocks(rank, source, c, half, None), scale,
                                          kernel, grads["dq"][rank], grads["dk"][source],
                                          grads["dv"][source])
            got = {"out": join_sequence(outs, seq_dim=2)}
            got.update({name: join_sequence([g.to(dtype) for g in parts], seq_dim=2)
                        for name, parts in grads.items()})
            devices.synchronize(device)
        except Exception as error:  # noqa: BLE001
            case["error"] = _failure(error)
            results.append(case)
            continue
        for name in want:
            case["errors"][name], case["scales"][name] = _error(got[name], want[name])
        case["passed"] = _verdict(case["errors"], case["scales"], case["tolerance"])
        results.append(case)
        del got, outs, lses, grads
    return results


# ------------------------------------------------------------------ the section

def section(device: torch.device, tiny: bool, say: Callable[[str], None]) -> dict[str, Any]:
    """Everything above on `device`; each part's failure is recorded, never raised."""
    sizes = TINY_SIZES if tiny else GPU_SIZES
    report: dict[str, Any] = {"device": device.type, "tiny": tiny, "blocks": [], "chosen": {},
                              "timing": None, "ring": [], "errors": [],
                              # TF32 fp32 products would need a looser fp32 tolerance
                              "float32_matmul_precision": torch.get_float32_matmul_precision()}

    def part(name: str, action: Callable[[], Any]) -> Any:
        try:
            return action()
        except Exception as error:  # noqa: BLE001 - the other parts still run
            report["errors"].append(f"{name}: {_failure(error)}")
            say(f"context-parallel attention, {name}: FAILED, {_failure(error)}")
            return None

    report["blocks"] = part("kernels", lambda: check_blocks(device, sizes)) or []
    for line in block_lines(report["blocks"]):
        say(line)
    report["chosen"] = part("block_kernel", lambda: chosen_kernels(device, sizes)) or {}
    say(chosen_line(report["chosen"]))
    report["timing"] = part("timing", lambda: time_kernels(device, sizes, report["blocks"]))
    if report["timing"]:
        say(timing_line(report["timing"]))
    for dtype_name in RING_DTYPES:
        kernels = [k for k in CANDIDATES[device.type] if dtype_name in kernel_dtypes(k)]
        cases = part(f"ring {dtype_name}", lambda: emulate_ring(device, sizes, dtype_name, kernels))
        report["ring"] += cases or []
        devices.release_cached_memory(device)
    for line in ring_lines(report["ring"]):
        say(line)
    report["windows"] = part("windows", lambda: check_windows(device, sizes)) or []
    for line in window_lines(report["windows"]):
        say(line)
    report["passed"] = passed(report)
    return report


def passed(report: dict[str, Any]) -> bool:
    """Did the kernels that run (those block_kernel picks) pass, and the ring
    with each of them? A fused kernel that fails where the probe passes it
    over is reported, but is no fault."""
    chosen = set(report["chosen"].values())
    blocks_ok = all(c["passed"] for c in report["blocks"] if c["kernel"] in chosen)
    ring_ok = all(c["passed"] for c in report["ring"]
                  if report["chosen"].get(f"{c['dtype']} d{c['head_dim']}", c["kernel"])
                  == c["kernel"])
    probes_ok = not any(kernel.startswith("error") for kernel in chosen)
    windows_ok = all(c["passed"] for c in report.get("windows", []))
    return (not report["errors"] and bool(report["blocks"]) and bool(report["ring"])
            and probes_ok and blocks_ok and ring_ok and windows_ok)


# ------------------------------------------------------------------ text

def _errors_text(case: dict[str, Any]) -> str:
    return ", ".join(f"{name} {case['errors'][name]:.1e}" for name in case["errors"])


def block_lines(cases: list[dict[str, Any]]) -> list[str]:
    """One line per kernel and dtype, then one per failed case."""
    lines = []
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for case in cases:
        groups.setdefault((case["kernel"], case["dtype"]), []).append(case)
    for (kernel, dtype_name), group in groups.items():
        ok = sum(c["passed"] for c in group)
        measured = [c for c in group if c["error"] is None]
        worst = max((worst_relative(c) + (c,) for c in measured), key=lambda w: w[1],
                    default=None)
        text = (f"context-parallel attention, {kernel} {dtype_name}: "
                f"{'ok' if ok == len(group) else 'FAILED'}, {ok}/{len(group)} cases")
        if worst is not None:
            text += (f", worst error {worst[1]:.1e} of the reference ({worst[0]}, "
                     f"d {worst[2]['head_dim']}, {'causal' if worst[2]['causal'] else 'no mask'})"
                     f" <= {BLOCK_TOLERANCE[dtype_name]:g}")
        lines.append(text)
        for c in group:
            if not c["passed"]:
                what = c["error"] or f"max |error| {_errors_text(c)}"
                lines.append(f"    d {c['head_dim']}, {'causal' if c['causal'] else 'no mask'}: "
                             f"{what}")
    return lines


def chosen_line(chosen: dict[str, str]) -> str:
    return "context-parallel attention, `block_kernel` picks: " + ", ".join(
        f"{key} {kernel}" for key, kernel in chosen.items())


def timing_line(timing: dict[str, Any]) -> str:
    text = (f"context-parallel attention, forward + backward of a causal block (s {timing['seq']}, "
            f"{timing['heads']} heads, d {timing['head_dim']}, {timing['dtype']}), time relative "
            f"to {timing['chosen']}: ")
    text += ", ".join(f"{kernel} {ratio:.2f}" for kernel, ratio in timing["ratios"].items())
    if timing["errors"]:
        text += "; failed: " + ", ".join(f"{k} ({e})" for k, e in timing["errors"].items())
    return text


def ring_lines(cases: list[dict[str, Any]]) -> list[str]:
    if not cases:
        return ["context-parallel attention, ring emulated: nothing ran"]
    first = cases[0]
    lines = [f"context-parallel attention, p2p ring emulated on one device (c {first['cp']}, "
             f"s {first['seq']}, {first['heads']} heads, {first['groups']} key/value groups, "
             f"d {first['head_dim']}) vs scaled_dot_product_attention:"]
    for c in cases:
        if c["error"]:
            lines.append(f"    {c['dtype']} {c['kernel']}: FAILED, {c['error']}")
            continue
        name, ratio = worst_relative(c)
        lines.append(f"    {c['dtype']} {c['kernel']}: {'ok' if c['passed'] else 'FAILED'}, "
                     f"worst error {ratio:.1e} of the reference ({name}) <= {c['tolerance']:g}; "
                     f"max |error| {_errors_text(c)}")
    return lines


def markdown(report: dict[str, Any] | None) -> str:
    """bench/RESULTS.md's paragraph and table for the section."""
    if not report:
        return ""
    if report.get("crashed"):
        return f"Context-parallel attention: the check did not finish ({report['crashed']}).\n"
    rows = ["| kernel | dtype | block cases passed | worst block error | ring c = 4 vs SDPA |",
            "|---|---|---|---|---|"]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for case in report["blocks"]:
        groups.setdefault((case["kernel"], case["dtype"]), []).append(case)
    for (kernel, dtype_name), group in groups.items():
        ok = sum(c["passed"] for c in group)
        measured = [worst_relative(c)[1] for c in group if c["error"] is None]
        worst = f"{max(measured):.1e}" if measured else "n/a"
        errors = sorted({c["error"] for c in group if c["error"]})
        if errors:
            worst += " (" + "; ".join(e.replace("|", "/") for e in errors) + ")"
        ring_cases = [c for c in report["ring"] if c["kernel"] == kernel
                      and c["dtype"] == dtype_name]
        ring_text = "; ".join(
            ("FAILED: " + c["error"].replace("|", "/")) if c["error"] else
            f"{'ok' if c['passed'] else 'FAILED'} ({worst_relative(c)[1]:.1e})"
            for c in ring_cases) or "not run"
        rows.append(f"| {kernel} | {dtype_name} | {ok}/{len(group)} | {worst} | {ring_text} |")
    timing = report.get("timing") or {}
    ratios = ", ".join(f"{k} {r:.2f}" for k, r in timing.get("ratios", {}).items())
    text = [f"Context-parallel attention kernels (bench/gpu_context_attention.py): "
            f"{'ok' if report['passed'] else 'FAILED'}. Errors are the largest |error| over the "
            "reference's largest |value|, against plain fp32 attention (blocks) or "
            "scaled_dot_product_attention over the whole sequence (the ring, emulated on one "
            "device). " + chosen_line(report["chosen"]).split(", ", 1)[1] + "."]
    if ratios:
        text[0] += (f" Forward + backward of a causal block (s {timing['seq']}, "
                    f"{timing['heads']} heads, d {timing['head_dim']}, {timing['dtype']}), "
                    f"time relative to {timing['chosen']}: {ratios}.")
    if report["errors"]:
        text[0] += " Parts that failed: " + "; ".join(report["errors"]) + "."
    windows = [f"- {line}" for line in window_lines(report.get("windows", []))]
    return "\n".join(text + [""] + rows + ([""] + windows if windows else [])) + "\n"


# ------------------------------------------------------------------ as a child of bench/gpu.py

def run_isolated(device_type: str, tiny: bool, timeout: float, say: Callable[[str], None],
                 command: list[str] | None = None) -> dict[str, Any]:
    """The section in a child process (its lines passed on through `say`);
    when the child dies or runs out of time, {"crashed": why, "passed":
    False} instead. `command` replaces this file's command line (tests)."""
    report, why = run_in_child(Path(__file__), device_type, tiny, timeout, say, command)
    if report is not None:
        return report
    say(f"context-parallel attention: FAILED, the check {why}")
    return {"crashed": why, "passed": False}


def main(argv: list[str] | None = None) -> int:
    return section_main(__doc__.splitlines()[0], section, argv)


if __name__ == "__main__":
    sys.exit(main())
