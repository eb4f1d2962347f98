"""`ptdp calibrate`: measure this machine and write a `local` hardware profile.

What is measured (fp32, CPU, each rate per process with the thread counts
`ptdp train` uses, see ptdp.device.configure_threads):

- GEMM time for a few shapes like the ones a small GPT runs, with 1 thread,
  fitted (least squares on relative error) by time = W / peak + ramp: the
  profile's `peak_tflops_fp32` (gemm_efficiency 1) and `gemm_ramp_seconds`;
- `thread_speedup`: a mid-sized GEMM on all cores over 1 thread, measured
  alternately, the fastest of each (and `op_thread_speedup`, the same for
  each memory-bound class below); at least 1;
- memory-bound operator throughput by class, forward + backward of ptdp's own
  operators at a small GPT's sizes (REFERENCE), inputs cycled through 64 MB
  so they come from memory: LayerNorm, bias+GeLU, bias+dropout+add
  (residual), a permute copy (elementwise), the attention core (SDPA with
  dropout, less its GEMMs as the fitted GEMM model prices them), the
  vocabulary-parallel cross entropy, and ptdp's AdamW passes (optimizer);
  bytes as operator_bytes.py counts them over the time -> `op_bandwidth`
  (`memory_bandwidth` = the elementwise rate), and each class's forward
  alone and the rest of the pair, its backward, likewise -> `op_bandwidth`
  under "class:forward" and "class:backward" (dropout's mask is drawn in the
  forward only, and on a CPU drawing it costs far more than its bytes);
- the fixed cost of one eager operator with autograd (forward and backward
  of a chain of tiny operators) -> `launch_overhead`;
- gloo between two local processes started by `ptdp.launch.launch_local`
  (1 thread each): all-reduce time for message sizes from 4 B to 4 MB, each
  call right after the forward and backward of a small MLP block, as in
  training (so it includes waking the waiting process, caches the
  computation filled and waiting for the later rank; the mean over many
  calls, as training pays the sum of a heavy-tailed distribution), and the
  pipeline executor's batched send + receive likewise ->
  `collective_seconds` (the simulator interpolates these tables), and
  their fit as latency + bytes / bandwidth -> `intra_*` (and `inter_*`, the
  same: one machine).

`cores` is os.cpu_count() (what configure_threads divides);
`available_cores` how much of them two processes computing at once really
get (each times the same work alone and together: on a machine others
load too, less than the cores). Every local
process is on one "server" (`devices_per_server` = LOCAL_DEVICES), and
`memory_bytes` is the machine's RAM, which its processes share. Every
measured number is also kept under `measurements`. On a machine others are
using too, all of these move with their load: calibrate right before the
runs you want to predict.

On a GPU (CUDA available) it measures what the GPU profiles' model needs
instead (`calibrate_gpu`), starting from the built-in profile of that chip
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

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from ptdp.perf.price.profiles import default_profile_path

LOCAL_DEVICES = 256     # local processes all share one machine: every link is loopback

GEMM_SHAPES = [(64, 64, 64), (128, 128, 128), (256, 256, 256), (256, 768, 256),
               (256, 1024, 256), (256, 256, 1024), (512, 512, 512), (1024, 1024, 256)]
GEMM_SHAPES_QUICK = [(128, 128, 128), (256, 768, 256), (512, 512, 512)]
# Operator sizes measured: a small GPT's microbatch (b, s, h, heads, MLP, vocabulary).
REFERENCE = {"b": 2, "s": 128, "h": 256, "a": 8, "f": 1024, "V": 1024}
COLD_BYTES = 64 << 20    # cycle through this much input so operators run from memory


def _median_seconds(fn: Callable[[], Any], *, budget: float, min_runs: int = 3,
                    max_runs: int = 200) -> float:
    fn()  # warm up
    times: list[float] = []
    deadline = time.perf_counter() + budget
    while len(times) < min_runs or (time.perf_counter() < deadline and len(times) < max_runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(slope, intercept) of y = slope·x + intercept, minimising relative
    error (weights 1/y²); the intercept is kept non-negative."""
    w = [1.0 / (y * y) for y in ys]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, xs))
    sy = sum(wi * y for wi, y in zip(w, ys))
    sxx = sum(wi * x * x for wi, x in zip(w, xs))
    sxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    det = sw * sxx - sx * sx
    slope = (sw * sxy - sx * sy) / det if det else sy / sx
    intercept = (sy - slope * sx) / sw
    if intercept < 0 or slope <= 0:
        slope, intercept = sxy / sxx, 0.0
    return slope, intercept


def _rotation(make: Callable[[], Any], set_bytes: int, cold_bytes: int = COLD_BYTES) -> list[Any]:
    """Enough independent copies of an operator's inputs that cycling through
    them streams `cold_bytes` through the caches (training's working set
    does not fit them either)."""
    return [make() for _ in range(max(2, min(64, -(-cold_bytes // max(1, set_bytes)))))]


def _cycle(sets: list[Any], fn: Callable[[Any], Any]) -> Callable[[], Any]:
    state = {"i": 0}

    def run():
        state["i"] = (state["i"] + 1) % len(sets)
        return fn(sets[state["i"]])
    return run


def measure_gemms(shapes: list[tuple[int, int, int]], threads: int, budget: float,
                  cold_bytes: int = COLD_BYTES) -> list[dict]:
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rows = []
        for m, n, k in shapes:
            sets = _rotation(lambda: (torch.randn(m, k), torch.randn(k, n)), 4 * (m * k + k * n),
                             cold_bytes)
            seconds = _median_seconds(_cycle(sets, lambda ab: torch.mm(*ab)), budget=budget)
            rows.append({"m": m, "n": n, "k": k, "threads": threads, "seconds": seconds,
                         "gflops": 2 * m * n * k / seconds / 1e9})
        return rows
    finally:
        torch.set_num_threads(previous)


def _operators(gemm_seconds: Callable[..., float], cold_bytes: int = COLD_BYTES,
               optimizer_elements: int = 1 << 22) -> dict[str, dict[str, Any]]:
    """class -> {"run": forward + backward of ptdp's operator on
    REFERENCE-sized inputs, "bytes": what operator_bytes.py counts for both,
    "gemms": seconds of GEMMs inside them, "forward": (its forward alone,
    the forward's bytes, the forward's GEMM seconds) or None (the optimizer,
    which has one direction)}."""
    import torch
    import torch.nn.functional as F

    from ptdp.model.fused import bias_dropout_add, bias_gelu
    from ptdp.parallel.tensor import vocab_parallel_cross_entropy
    from ptdp.perf.price import operator_bytes

    b, s, h, a, f, V = (REFERENCE[k] for k in ("b", "s", "h", "a", "f", "V"))
    n, ffn, scores = b * s * h, b * s * f, b * a * s * s
    E = 4

    def leaf(*shape):
        return torch.randn(*shape, requires_grad=True)

    weight, bias_h, bias_f = torch.ones(h), torch.zeros(h), torch.zeros(f)
    g_n, g_f = torch.randn(s, b, h), torch.randn(s, b, f)
    ops: dict[str, dict[str, Any]] = {}

    def add(name: str, sets: list[Any], forward: Callable[[Any], Any], grad: Any,
            nbytes: tuple[float, float], gemms: tuple[float, float] = (0.0, 0.0)) -> None:
        """The class measured as training runs it: `forward` with autograd
        recording, then the backward of its output against `grad`."""
        ops[name] = {"run": _cycle(sets, lambda x: forward(x).backward(grad)),
                     "bytes": sum(nbytes), "gemms": sum(gemms),
                     "forward": (_cycle(sets, forward), nbytes[0], gemms[0])}

    add("layer_norm", _rotation(lambda: leaf(s, b, h), 3 * n * E),
        lambda x: F.layer_norm(x, (h,), weight, bias_h), g_n, operator_bytes.layer_norm_bytes(n, E))
    add("gelu", _rotation(lambda: leaf(s, b, f), 3 * ffn * E),
        lambda x: bias_gelu(x, bias_f, True), g_f, operator_bytes.gelu_bytes(ffn, E))
    add("residual", _rotation(lambda: (leaf(s, b, h), leaf(s, b, h)), 5 * n * E),
        lambda xr: bias_dropout_add(xr[0], bias_h, xr[1], 0.1, True, True), g_n,
        operator_bytes.residual_bytes(n, E, True))
    add("elementwise", _rotation(lambda: leaf(b, a, s, h // a), 3 * n * E),
        lambda x: x.permute(2, 0, 1, 3).reshape(s, b, h), g_n, operator_bytes.copy_bytes(n, E))
    g_ctx = torch.randn(b, a, s, h // a)
    # QKᵀ and PV forward; four more backward (the fitted GEMM model's prices).
    products = (gemm_seconds(s, s, h // a, batch=b * a) + gemm_seconds(s, h // a, s, batch=b * a))
    add("attention_core",
        _rotation(lambda: (leaf(b, a, s, h // a), leaf(b, a, s, h // a), leaf(b, a, s, h // a)),
                  (3 * n + 3 * scores) * E),
        lambda qkv: F.scaled_dot_product_attention(*qkv, dropout_p=0.1, is_causal=True), g_ctx,
        operator_bytes.attention_core_bytes(scores, E, True), (products, 2 * products))
    labels = torch.randint(0, V, (s, b))
    add("cross_entropy", _rotation(lambda: leaf(s, b, V), 3 * b * s * V * E),
        lambda x: vocab_parallel_cross_entropy(x, labels, 0, None), torch.ones(s, b),
        operator_bytes.cross_entropy_bytes(b * s * V, E))

    elements = optimizer_elements
    main, grad = torch.randn(elements), torch.randn(elements)
    exp_avg, exp_avg_sq = torch.zeros(elements), torch.zeros(elements)

    def adamw():  # ptdp.train.optimizer: inf check, norm, clip, AdamW
        (~torch.isfinite(grad)).any()
        grad.pow(2).sum()
        grad.mul_(1.0)
        main.mul_(0.999)
        exp_avg.lerp_(grad, 0.1)
        exp_avg_sq.mul_(0.999).addcmul_(grad, grad, value=0.001)
        denom = (exp_avg_sq.sqrt() / 0.9).add_(1e-8)
        main.addcdiv_(exp_avg, denom, value=-1e-3)

    ops["optimizer"] = {"run": adamw, "bytes": operator_bytes.OPTIMIZER_BYTES_PER_PARAMETER * elements,
                        "gemms": 0.0, "forward": None}
    return ops


def _rate(nbytes: float, seconds: float, gemms: float) -> float:
    """Bytes per second of `seconds` less the GEMMs inside (at least a tenth
    of them left: the fitted GEMM price can exceed a noisy measurement)."""
    return nbytes / max(seconds - gemms, 0.1 * seconds)


def measure_memory_ops(budget: float, gemm_seconds: Callable[..., float], threads: int = 1, *,
                       rounds: int = 3, cold_bytes: int = COLD_BYTES,
                       optimizer_elements: int = 1 << 22) -> list[dict]:
    """Bytes per second of each class of memory-bound operator (1 thread):
    the bytes operator_bytes.py counts for it over the time its forward + backward
    takes (less the time of the GEMMs inside, for the attention core), and the
    same of its forward alone and of the rest, its backward: the two
    directions can differ far more than their bytes do (on a CPU, drawing a
    dropout mask costs more than the pass that applies it, and only the
    forward, or a recomputation, draws one). With `threads` > 1 also its
    speed-up on that many threads ("speedup"), the two measured in
    alternation so that both see the same background load."""
    import torch

    previous = torch.get_num_threads()
    try:
        rows = []
        operators = _operators(gemm_seconds, cold_bytes, optimizer_elements)
        for name, op in operators.items():
            single, multi, forward = [], [], []
            for _ in range(rounds if threads > 1 else 1):
                torch.set_num_threads(1)
                single.append(_median_seconds(op["run"], budget=budget / rounds))
                if op["forward"]:
                    forward.append(_median_seconds(op["forward"][0], budget=budget / rounds))
                if threads > 1:
                    torch.set_num_threads(threads)
                    multi.append(_median_seconds(op["run"], budget=budget / rounds))
            seconds, nbytes, gemms = statistics.median(single), op["bytes"], op["gemms"]
            row = {"op": name, "seconds": seconds, "gemm_seconds": gemms, "bytes": nbytes,
                   "gbytes_per_s": _rate(nbytes, seconds, gemms) / 1e9}
            if forward:
                _, forward_bytes, forward_gemms = op["forward"]
                # The backward: the rest of the pair (at least a tenth of it).
                forward_seconds = min(statistics.median(forward), 0.9 * seconds)
                row.update(forward_seconds=forward_seconds,
                           forward_gbytes_per_s=_rate(forward_bytes, forward_seconds,
                                                      forward_gemms) / 1e9,
                           backward_gbytes_per_s=_rate(nbytes - forward_bytes,
                                                       seconds - forward_seconds,
                                                       gemms - forward_gemms) / 1e9)
            if multi:   # the least disturbed runs: others' load is available_cores' business
                row["speedup"] = min(single) / min(multi)
            rows.append(row)
        return rows
    finally:
        torch.set_num_threads(previous)


def measure_gemm_speedup(threads: int, budget: float, cold_bytes: int = COLD_BYTES) -> dict:
    """A mid-sized GEMM ([b·s, h]×[h, 4h] of REFERENCE) on `threads` threads
    over 1 thread, measured alternately."""
    import torch

    m, k, n = REFERENCE["b"] * REFERENCE["s"], REFERENCE["h"], REFERENCE["f"]
    sets = _rotation(lambda: (torch.randn(m, k), torch.randn(k, n)), 4 * (m * k + k * n), cold_bytes)
    fn = _cycle(sets, lambda ab: torch.mm(*ab))
    previous = torch.get_num_threads()
    single, multi = [], []
    try:
        for _ in range(3):
            torch.set_num_threads(1)
            single.append(_median_seconds(fn, budget=budget / 6))
            torch.set_num_threads(threads)
            multi.append(_median_seconds(fn, budget=budget / 6))
    finally:
        torch.set_num_threads(previous)
    one, many = min(single), min(multi)
    return {"m": m, "n": n, "k": k, "threads": threads, "one_thread_seconds": one,
            "seconds": many, "speedup": one / many}


def measure_launch_overhead(budget: float, ops: int = 100, device=None) -> dict:
    """Seconds per tiny eager operator: forward and backward of `ops`
    multiplications on a 16-element tensor, over 3·ops (one forward and
    about two backward operators each); on `device` (default: the CPU)."""
    import torch

    from ptdp.device import synchronize

    x = torch.randn(16, requires_grad=True, device=device)

    def chain():
        y = x
        for _ in range(ops):
            y = y * 1.0001
        y.sum().backward()
        synchronize(x.device)

    seconds = _median_seconds(chain, budget=budget)
    return {"ops": ops, "seconds": seconds, "per_op": seconds / (3 * ops)}


# ---- gloo between two local processes ------------------------------------------------------

def _mlp_block() -> Callable[[], None]:
    """Forward + backward of a small MLP block (REFERENCE's activations, an
    h -> h MLP: a few ms), as a closure."""
    import torch
    import torch.nn.functional as F

    from ptdp.model.fused import bias_gelu

    b, s, h = (REFERENCE[k] for k in ("b", "s", "h"))
    f = h
    x = torch.randn(s, b, h, requires_grad=True)
    w1 = (torch.randn(f, h) * 0.02).requires_grad_()
    w2 = (torch.randn(h, f) * 0.02).requires_grad_()
    bias, ln_w, ln_b = torch.zeros(f), torch.ones(h), torch.zeros(h)

    def block() -> None:
        y = bias_gelu(F.linear(F.layer_norm(x, (h,), ln_w, ln_b), w1), bias, True)
        F.dropout(F.linear(y, w2), 0.1).sum().backward()
    return block


def _parallel_capacity(block: Callable[[], None], rank: int, rounds: int = 3,
                       blocks: int = 8) -> dict[str, float]:
    """How much of two cores two computing processes get: each rank times
    `blocks` runs of `block` alone (the other waiting in a barrier) and with
    the other computing too; the sum over the ranks of alone / together is
    2 on two free cores and 1 when they share one (other load)."""
    import torch
    import torch.distributed as dist

    def timed() -> float:
        start = time.perf_counter()
        for _ in range(blocks):
            block()
        return time.perf_counter() - start

    alone, together = [], []
    for _ in range(rounds):
        for turn in (0, 1):
            dist.barrier()
            if rank == turn:
                alone.append(timed())
            dist.barrier()
        dist.barrier()
        together.append(timed())
    share = torch.tensor([min(alone) / statistics.median(together)])
    dist.all_reduce(share)
    return {"alone_seconds": min(alone), "together_seconds": statistics.median(together),
            "two_processes": float(share.item())}


def _comm_worker(env, payload) -> None:
    import torch
    import torch.distributed as dist
    from datetime import timedelta

    from ptdp.distributed import init_process_group

    out, sizes, repeats = payload
    torch.set_num_threads(1)
    init_process_group(env, "gloo", timedelta(minutes=2))
    try:
        rank, peer = env.rank, 1 - env.rank
        # Training computes between its collectives; so does this loop: the
        # forward and backward of a small MLP block (LayerNorm, Linear,
        # bias+GeLU, Linear, dropout), a few ms. The times then include
        # what a collective costs there: waking the waiting process, caches the
        # computation has filled, waiting for the later of the two ranks.
        between = _mlp_block()
        results: dict[str, dict[str, float]] = {"allreduce": {}, "exchange": {},
                                                "cores": _parallel_capacity(between, rank)}
        for numel in sizes:
            source = torch.randn(numel)
            receive = torch.empty(numel)

            def allreduce():
                tensor = source.clone()
                begin = time.perf_counter()
                dist.all_reduce(tensor)
                return time.perf_counter() - begin

            def exchange():  # the pipeline executor's batched send + receive
                tensor = source.clone()
                begin = time.perf_counter()
                ops = [dist.P2POp(dist.isend, tensor, peer, tag=1),
                       dist.P2POp(dist.irecv, receive, peer, tag=1)]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
                return time.perf_counter() - begin

            for name, fn in (("allreduce", allreduce), ("exchange", exchange)):
                dist.barrier()
                times = []
                for _ in range(repeats):
                    between()
                    times.append(fn())
                # The mean: training pays the sum of many calls, and these
                # times are heavy-tailed (a woken process may wait for a core).
                results[name][str(numel * 4)] = statistics.fmean(times)
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def measure_gloo(sizes: list[int], repeats: int) -> dict:
    return _timed_by_two_processes(_comm_worker, sizes, repeats)


def _timed_by_two_processes(worker, *settings) -> dict:
    """Run `worker` on two local processes; the timings its rank 0 writes."""
    from ptdp.launch import launch_local

    with tempfile.TemporaryDirectory(prefix="ptdp-calibrate-") as folder:
        out = Path(folder) / "timings.json"
        launch_local(2, worker, (str(out), *settings))
        return json.loads(out.read_text())


def _latency_bandwidth(timings: dict[str, float]) -> tuple[float, float]:
    """(latency, bytes/s) of seconds = latency + bytes / bandwidth fitted to {bytes: seconds}."""
    sizes = sorted(timings, key=int)
    slope, intercept = _fit_line([float(size) for size in sizes], [timings[size] for size in sizes])
    return intercept, 1.0 / slope


# ---- GPU: the tile model and NCCL ------------------------------------------------------------

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
    from ptdp.perf.price import gemm

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
    from ptdp.device import synchronize

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
    import torch

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
    import torch

    source = torch.empty(nbytes // 2, device=device, dtype=torch.bfloat16)
    target = torch.empty_like(source)
    return 2 * nbytes / _gpu_seconds(lambda: target.copy_(source), device, budget)


def _nccl_worker(env, payload) -> None:
    import torch
    import torch.distributed as dist
    from datetime import timedelta

    from ptdp.device import device_for
    from ptdp.distributed import init_process_group

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
    return _timed_by_two_processes(_nccl_worker, sizes, budget)


def calibrate_gpu(*, quick: bool = False, name: str = "local",
                  log: Callable[[str], None] = print):
    """Measure GPU 0 (and NCCL with GPU 1); returns a HardwareProfile."""
    import torch
    from dataclasses import replace

    from ptdp.device import accelerator_shape, cuda_device_count, device_for, device_name
    from ptdp.perf.price.profiles import BUILTIN, builtin_profile

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


# ---- the profile ---------------------------------------------------------------------------

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
    slope, ramp = _fit_line([2.0 * g["m"] * g["n"] * g["k"] for g in gemms],
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
    ar_latency, ar_bandwidth = _latency_bandwidth(comm["allreduce"])
    p2p_latency, p2p_bandwidth = _latency_bandwidth(comm["exchange"])
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


# ---- `ptdp calibrate` ----------------------------------------------------------------------

def add_calibrate_parser(commands) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "calibrate", help="measure this machine and write a hardware profile for the simulator",
        description="Measure matrix-multiply rates, memory-bound operator throughput, eager "
                    "operator overhead and gloo communication between two local processes, and "
                    "write them as a hardware profile (JSON) that `ptdp plan --gpu` and "
                    "ptdp.perf.simulate.predict.simulate read. Takes under a minute (--quick: under 20 s).")
    parser.add_argument("--out", metavar="FILE.json", default=None,
                        help=f"where to write the profile (default: {default_profile_path()}, "
                             f"which the profile name 'local' loads)")
    parser.add_argument("--quick", action="store_true", help="fewer, shorter measurements")
    parser.add_argument("--name", default="local", help="the profile's name (default: local)")
    return parser


def run_calibrate_command(args: argparse.Namespace) -> int:
    from ptdp.perf.price.profiles import save_profile

    out = Path(args.out) if args.out else default_profile_path()
    if out.is_dir():
        print(f"ptdp: error: --out {out} is a directory; give a file name", file=sys.stderr)
        return 2
    if args.out and not out.resolve().parent.is_dir():
        print(f"ptdp: error: --out {out}: directory {out.resolve().parent} does not exist",
              file=sys.stderr)
        return 2
    profile = calibrate(quick=args.quick, name=args.name,
                        log=lambda line: print(f"ptdp: {line}", flush=True))
    out.parent.mkdir(parents=True, exist_ok=True)
    save_profile(profile, out)
    print(f"ptdp: wrote the {profile.name} profile to {out}", flush=True)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="ptdp")
    run_command = add_calibrate_parser(parser.add_subparsers(dest="command", required=True))
    sys.exit(run_calibrate_command(parser.parse_args()))
